#!/usr/bin/env bash
# Install Slurm (controller, node daemon, client commands) and munge from Debian/Ubuntu packages,
# so the launch/ scripts and tests/integration/test_slurm_launch.py can run a real one-machine
# Slurm. Idempotent: does nothing when slurmctld, slurmd, munged and sbatch are all on PATH.
#
# Root is needed to install. Without root and without the binaries it prints the command to
# run and exits 1. The packages' own services are not started or configured here: the test
# starts private daemons with their own config, key and sockets under a temp dir.
set -euo pipefail

export PATH="$PATH:/usr/sbin:/sbin"
NEEDED=(slurmctld slurmd munged sbatch)
PACKAGES=(slurmctld slurmd slurm-client munge)

missing() {
    local b out=()
    for b in "${NEEDED[@]}"; do command -v "$b" >/dev/null 2>&1 || out+=("$b"); done
    echo "${out[@]:-}"
}

todo=$(missing)
if [ -z "$todo" ]; then
    echo "install_slurm: slurm and munge already installed ($(slurmd -V 2>/dev/null))"
    exit 0
fi
echo "install_slurm: missing: $todo"

if [ "$EUID" -ne 0 ]; then
    echo "install_slurm: not root; install them with:" >&2
    echo "  sudo apt-get install -y --no-install-recommends ${PACKAGES[*]}" >&2
    echo "  (or your distribution's slurm-wlm/slurm and munge packages), then re-run." >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_slurm: apt-get not found; install Slurm (slurmctld, slurmd, client) and munge" \
         "with your package manager, then re-run." >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# Package post-install scripts try to start services; in containers without an init system that
# fails or hangs, so forbid it for the duration of the install (policy-rc.d exit 101 = denied).
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
fi
cleanup() { [ "$made_policy" = 1 ] && rm -f "$policy"; return 0; }
trap cleanup EXIT

apt_install() { apt-get install -y --no-install-recommends "${PACKAGES[@]}"; }
# Try with the current package lists first; refresh them only if that fails (stale or absent).
if ! apt_install; then
    echo "install_slurm: install failed; running apt-get update and retrying" >&2
    apt-get update
    apt_install
fi

todo=$(missing)
if [ -n "$todo" ]; then
    echo "install_slurm: still missing after install: $todo" >&2
    exit 1
fi
echo "install_slurm: ok ($(slurmd -V))"
