# shellcheck shell=bash
# Shared by the launch/slurm_*.sh batch scripts (sourced, never run): the job's Python
# environment, a Ray cluster over the Slurm allocation, and its teardown.
#
# Environment variables honoured (all optional):
#   MEGARL_VENV         virtualenv to activate on every node (default: $SLURM_SUBMIT_DIR/.venv
#                       when it exists, else whatever python/ray are on PATH)
#   RAY_PORT            GCS port of the head (default 6379)
#   RAY_HEAD_IP         address the workers and the driver use to reach the head (default: the
#                       first address `hostname -I` gives on the head node)
#   RAY_NUM_CPUS        logical CPUs each node offers Ray (default: trainer.n_gpus_per_node on
#                       CPU runs, one per worker process; Ray's own count on GPU runs)
#   RAY_NUM_GPUS        GPUs each node offers Ray (default: Ray's own count)
#   RAY_TMPDIR          Ray's temp/session dir on the head (default /tmp/ray-slurm-<jobid>);
#                       per job so no other Ray on the machine finds (or is found by) this one
#   RAY_START_TIMEOUT   seconds to wait for every node to join (default 300)
#   RAY_STOP_ON_NODES   1 (default): at teardown also run `ray stop` on every node, which stops
#                       every Ray process of the node, this job's or not; 0: only stop the
#                       processes this job started (for nodes shared with other Ray users)
#   RAY_AUTH_TOKEN      Ray auth token of the job's cluster (default: a fresh random one)
#   RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S  Ray's drain on SIGTERM (default here 0: none)

_megarl_log() { echo "[$(date +%H:%M:%S) ${MEGARL_LAUNCHER:-megarl-slurm}] $*" >&2; }
# _megarl_die [STATUS] MESSAGE...: log and exit (status 1 unless given).
_megarl_die() {
    local code=1
    if [[ $1 =~ ^[0-9]+$ ]]; then code=$1; shift; fi
    _megarl_log "error: $*"
    exit "$code"
}

# Fail early outside Slurm: every function below reads the allocation from SLURM_* variables.
megarl_require_slurm() {
    [ -n "${SLURM_JOB_ID:-}" ] || _megarl_die 2 "not inside a Slurm job: submit with sbatch $0 ..."
}

# Activate the virtualenv (if any) and make the repository importable, as `ray.init` does for a
# local run (megarl.cluster.placement.init_ray); the Ray daemons started afterwards hand this
# environment to every worker process they spawn.
megarl_setup_env() {
    local venv="${MEGARL_VENV:-}"
    if [ -z "$venv" ] && [ -d "${SLURM_SUBMIT_DIR:-.}/.venv" ]; then
        venv="${SLURM_SUBMIT_DIR:-.}/.venv"
    fi
    if [ -n "$venv" ]; then
        [ -f "$venv/bin/activate" ] || _megarl_die 2 "MEGARL_VENV=$venv has no bin/activate"
        # shellcheck disable=SC1091
        . "$venv/bin/activate"
    fi
    command -v python >/dev/null || _megarl_die 2 "no python on PATH (set MEGARL_VENV)"
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false
    export PYTHONPATH="${MEGARL_HOME}${PYTHONPATH:+:$PYTHONPATH}"
    _megarl_log "python $(command -v python), megarl from $MEGARL_HOME"
}

# Resolve CONFIG + overrides once, before any daemon starts, so a bad config fails in seconds
# with megarl's own message. Sets MEGARL_DEVICE and MEGARL_DEVICES_PER_NODE.
megarl_read_config() {
    local out
    out=$(python - "$@" <<'EOF'
import sys
from megarl.config import ConfigError, load_config
try:
    cfg = load_config(sys.argv[1], sys.argv[2:])
except ConfigError as err:
    print(f"config {sys.argv[1]}: {err}", file=sys.stderr)
    sys.exit(2)
print(cfg.trainer.device, cfg.trainer.n_gpus_per_node, cfg.trainer.max_restarts)
EOF
    ) || _megarl_die 2 "the config or its overrides are invalid (see above)"
    read -r MEGARL_DEVICE MEGARL_DEVICES_PER_NODE MEGARL_MAX_RESTARTS <<<"$out"
    if [ "$MEGARL_DEVICE" = cuda ] && [ -n "${SLURM_GPUS_ON_NODE:-}" ] \
        && [ "$SLURM_GPUS_ON_NODE" -lt "$MEGARL_DEVICES_PER_NODE" ]; then
        _megarl_die 2 "trainer.n_gpus_per_node=$MEGARL_DEVICES_PER_NODE but the job has" \
            "$SLURM_GPUS_ON_NODE GPU(s) per node: submit with --gpus-per-node=$MEGARL_DEVICES_PER_NODE"
    fi
}

# A job Slurm requeued (SLURM_RESTART_COUNT > 0: a node failed, preemption, `scontrol
# requeue`) is a restart of the run: megarl resumes from its newest checkpoint and counts the
# requeues against trainer.max_restarts (MEGARL_RESTARTS_BEFORE, MEGARL_RESTART_REASON).
megarl_requeued() {
    local n=${SLURM_RESTART_COUNT:-0}
    [ "$n" -gt 0 ] || return 0
    if [ "$n" -gt "${MEGARL_MAX_RESTARTS:-0}" ]; then
        _megarl_die 1 "job $SLURM_JOB_ID was requeued $n time(s), past" \
            "trainer.max_restarts=${MEGARL_MAX_RESTARTS:-0}: not starting again"
    fi
    export MEGARL_RESTARTS_BEFORE=$n
    export MEGARL_RESTART_REASON="Slurm requeued job $SLURM_JOB_ID (a node failed, it was preempted or requeued by hand)"
    _megarl_log "requeued job: restart $n/${MEGARL_MAX_RESTARTS} of the run, from its newest checkpoint"
}

# One srun step on one node that overlaps the others (the Ray daemons hold the node's CPUs for
# the whole job, yet the driver and `ray stop` must still run there).
_megarl_srun_on() {
    local node=$1; shift
    srun --nodes=1 --ntasks=1 -w "$node" --overlap ${SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK} "$@"
}

MEGARL_RAY_PIDS=()
MEGARL_NODES=()

# Start the head on this (the batch) node and a worker on every other node, each as a
# `ray start --block` step in the background: ending the step ends that node's Ray.
# Returns once every node has joined, with RAY_ADDRESS exported: megarl's init_ray then joins
# this cluster instead of starting its own.
megarl_ray_start() {
    # Traps first: a failure half-way through start-up must still stop what did start.
    trap '_megarl_on_signal TERM' TERM
    trap '_megarl_on_signal INT' INT
    trap 'megarl_ray_stop' EXIT
    mapfile -t MEGARL_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    local head=${MEGARL_NODES[0]} port=${RAY_PORT:-6379}
    # `hostname -I` skips loopback, which `hostname --ip-address` often returns and which the
    # other nodes could not reach.
    local ip=${RAY_HEAD_IP:-$(hostname -I 2>/dev/null | awk '{print $1}')}
    [ -n "$ip" ] || ip=$(hostname --ip-address | awk '{print $1}')
    local res=()
    if [ -n "${RAY_NUM_CPUS:-}" ]; then
        res+=(--num-cpus="$RAY_NUM_CPUS")
    elif [ "${MEGARL_DEVICE:-cpu}" = cpu ]; then
        # A CPU "device" is one logical Ray CPU (placement bundles ask {"CPU": 1}); init_ray
        # passes no num_cpus when it joins a cluster, so the daemons must say it.
        res+=(--num-cpus="${MEGARL_DEVICES_PER_NODE:-1}")
    fi
    [ -n "${RAY_NUM_GPUS:-}" ] && res+=(--num-gpus="$RAY_NUM_GPUS")
    MEGARL_RAY_TMPDIR=${RAY_TMPDIR:-/tmp/ray-slurm-$SLURM_JOB_ID}
    # Ray's token auth: one fresh token per job, handed to every daemon, the driver and its
    # workers through the environment (srun passes it on), so no ~/.ray/auth_token is needed.
    export RAY_AUTH_MODE=token
    export RAY_AUTH_TOKEN=${RAY_AUTH_TOKEN:-$(python -c 'import secrets; print(secrets.token_hex(32))')}
    # Nothing to drain when the job ends: SIGTERM should stop a node's Ray at once, within
    # Slurm's KillWait, not after Ray's default 30 s drain.
    export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}
    _megarl_log "Ray head on $head ($ip:$port), ${#MEGARL_NODES[@]} node(s): ${MEGARL_NODES[*]}"
    _megarl_srun_on "$head" ray start --head --block --log-style=record --node-ip-address="$ip" --port="$port" \
        --temp-dir="$MEGARL_RAY_TMPDIR" --include-dashboard=false --disable-usage-stats \
        "${res[@]}" &
    MEGARL_RAY_PIDS+=($!)
    export RAY_ADDRESS="$ip:$port"
    _megarl_wait_nodes 1 "$head"
    # this job's head session (a directory of its own under the temp dir): teardown waits for
    # the daemons that name it
    MEGARL_RAY_SESSION=$(readlink -f "$MEGARL_RAY_TMPDIR/session_latest" 2>/dev/null || true)
    [ "${#MEGARL_NODES[@]}" -gt 1 ] || return 0
    local node
    for node in "${MEGARL_NODES[@]:1}"; do
        _megarl_srun_on "$node" ray start --block --log-style=record --address="$RAY_ADDRESS" \
            --disable-usage-stats "${res[@]}" &
        MEGARL_RAY_PIDS+=($!)
    done
    _megarl_wait_nodes "${#MEGARL_NODES[@]}" "all"
}

# Poll the cluster until `want` live nodes have joined; fail with the missing count on timeout
# or as soon as one of the Ray steps has exited (its output is in the job's log above).
_megarl_wait_nodes() {
    local want=$1 what=$2 deadline=$((SECONDS + ${RAY_START_TIMEOUT:-300})) have=0 pid
    while :; do
        for pid in "${MEGARL_RAY_PIDS[@]}"; do
            kill -0 "$pid" 2>/dev/null || _megarl_die 1 "a Ray daemon step exited during start-up (see its output above)"
        done
        have=$(python - "$want" 2>/dev/null <<'EOF'
import logging, sys
import ray
try:
    ray.init(address="auto", logging_level=logging.ERROR, log_to_driver=False)
    print(sum(1 for n in ray.nodes() if n["Alive"]))
except Exception:
    print(0)
EOF
        ) || have=0
        [ "${have:-0}" -ge "$want" ] && break
        [ "$SECONDS" -ge "$deadline" ] && _megarl_die 1 "Ray: only ${have:-0} of $want node(s) joined" \
            "($what) within RAY_START_TIMEOUT=${RAY_START_TIMEOUT:-300}s at $RAY_ADDRESS"
        sleep 2
    done
    _megarl_log "Ray: $have of $want node(s) up ($what)"
}

# Idempotent teardown: end the `ray start --block` steps (Ray stops what it started on SIGTERM),
# then, unless RAY_STOP_ON_NODES=0, `ray stop` on every node as a backstop.
megarl_ray_stop() {
    [ -n "${MEGARL_RAY_STOPPED:-}" ] && return 0
    MEGARL_RAY_STOPPED=1
    local pid node deadline=$((SECONDS + 30))
    _megarl_log "stopping Ray on ${#MEGARL_NODES[@]} node(s)"
    for pid in "${MEGARL_RAY_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${MEGARL_RAY_PIDS[@]}"; do
        while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.5; done
        kill -KILL "$pid" 2>/dev/null || true
    done
    # The head's daemons (GCS, raylet, their helpers) can outlive the ended step by seconds on
    # a loaded node; a next job whose head lands here would find this GCS still on the port
    # and `ray start` would refuse ("already running"). Wait for them, then kill what is left.
    if [ -n "${MEGARL_RAY_SESSION:-}" ]; then
        deadline=$((SECONDS + 30))
        while pgrep -f -- "$MEGARL_RAY_SESSION" >/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
            sleep 0.5
        done
        pkill -KILL -f -- "$MEGARL_RAY_SESSION" 2>/dev/null || true
    fi
    if [ "${RAY_STOP_ON_NODES:-1}" = 1 ]; then
        for node in "${MEGARL_NODES[@]}"; do
            timeout 60 srun --nodes=1 --ntasks=1 -w "$node" --overlap ray stop --force \
                >/dev/null 2>&1 || _megarl_log "ray stop on $node failed"
        done
    fi
    wait 2>/dev/null || true
}

# Run megarl as a background child and wait for it, so a SIGTERM/SIGINT to the batch script
# (scancel, time limit) reaches the trap now rather than after megarl exits; forward it to
# megarl, tear Ray down, and exit with megarl's status (128+signal when killed).
MEGARL_CHILD=
megarl_run() {
    _megarl_log "running: $*"
    "$@" &
    MEGARL_CHILD=$!
    local rc=0
    wait "$MEGARL_CHILD" || rc=$?
    MEGARL_CHILD=
    _megarl_log "megarl exited with status $rc"
    return "$rc"
}

_megarl_on_signal() {
    _megarl_log "caught SIG$1: stopping megarl and Ray"
    if [ -n "$MEGARL_CHILD" ]; then
        kill -"$1" "$MEGARL_CHILD" 2>/dev/null || true
        wait "$MEGARL_CHILD" 2>/dev/null || true
    fi
    megarl_ray_stop
    local code=143; [ "$1" = INT ] && code=130
    exit "$code"
}
