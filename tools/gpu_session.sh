#!/usr/bin/env bash
# One GPU slot of at most 9 minutes, spent on what only a GPU can show (docs/gpu.md).
#
#   bash tools/gpu_session.sh [--wheels DIR] [--out DIR] [--dry]
#
# Every step runs under its own `timeout` and the next one runs whatever the last did; the
# timeouts sum to at most 540 s. Each step's output goes to OUT/<step>.txt, its exit status and
# seconds to OUT/steps.tsv, and at the end OUT/report.md and OUT/report.json gather the figures
# (tools/gpu_session_report.py). Without CUDA it refuses with exit 2 before any work;
# --dry lists the steps and their timeouts and runs nothing (on any machine).
# Wheels megarl needs and the machine lacks come from --wheels DIR (an ignored folder that
# travels with the checkout; tools/gpu_common.sh installs them with --no-deps).

# D's fast-kernel keys: run-config keys relative to actor_rollout_ref.actor.megatron (or full
# dotted paths), space-separated. Every kernel key that issue 46 adds, each off by default
# until measured here (attention_backend's default, auto, already takes FlexAttention for
# packed rows and SDPA's own kernel choice on CUDA): Megatron's fused SwiGLU and
# bias-dropout-add, the token-chunked log-prob + entropy path, fused AdamW + foreach grad norm.
KERNEL_OVERRIDES="${KERNEL_OVERRIDES:-override_transformer_config.bias_activation_fusion=true \
override_transformer_config.bias_dropout_fusion=true \
actor_rollout_ref.actor.entropy_from_logits_with_chunking=true \
actor_rollout_ref.actor.optim.fused=true}"

set -uo pipefail  # no -e: a failed step is recorded and the session goes on
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
OUT="gpu_session"
WHEELS=""
DRY=0
NAME=tools/gpu_session.sh
usage() { echo "usage: bash $NAME [--wheels DIR] [--out DIR] [--dry]" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) [[ $# -ge 2 ]] || usage; WHEELS="$2"; shift 2 ;;
    --out) [[ $# -ge 2 ]] || usage; OUT="$2"; shift 2 ;;
    --dry) DRY=1; shift ;;
    -h|--help) usage ;;
    *) echo "$NAME: unknown argument $1" >&2; usage ;;
  esac
done
[[ -z "$WHEELS" || -d "$WHEELS" ]] || { echo "$NAME: --wheels $WHEELS is not a directory" >&2; exit 2; }

# bench_train at the real Qwen2.5-1.5B shape (configs/models/qwen2_5_1_5b.json), bf16, Megatron
# side only, lengths 2048-4096; $PEAK (the GPU's bf16 peak) turns on the MFU figures
BT='"$PY" tools/bench_train.py --dtype bfloat16 --seq 4096 --steps 4 --warmup 2 ${PEAK:+--peak-tflops $PEAK}'
KO='$(for o in $KERNEL_OVERRIDES; do printf -- "--override %s " "$o"; done)'
# name | timeout s | what | command (run by bash -c in the checkout, OUT PY PEAK exported)
STEPS=(
  "env|20|nvidia-smi, torch and CUDA versions|nvidia-smi > \"\$OUT/nvidia-smi.txt\" 2>&1; gpu_env_json \"\$OUT/env.json\" && cat \"\$OUT/env.json\""
  "A|55|as before: the 1.5B shape at vocab 2308 (the earlier figures), padded|$BT --config-json \"\$OUT/qwen2_5_1_5b_v2308.json\" --batch 4 --micro-batch 1 --json \"\$OUT/A.json\""
  "B|55|real vocab 151936, padded, micro-batch 1|$BT --shape qwen2.5-1.5b --batch 4 --micro-batch 1 --json \"\$OUT/B.json\""
  "C|55|real vocab, packed (token budget 8192)|$BT --shape qwen2.5-1.5b --batch 4 --token-budget 8192 --packed-only --json \"\$OUT/C.json\""
  "D|75|C with every kernel key on (KERNEL_OVERRIDES), profiled|$BT --shape qwen2.5-1.5b --batch 4 --token-budget 8192 --packed-only $KO --profile \"\$OUT/profile_D\" --json \"\$OUT/D.json\""
  "E|75|D's keys at batch 16 (the optimizer amortised over 4x the tokens)|$BT --shape qwen2.5-1.5b --batch 16 --token-budget 8192 --packed-only $KO --json \"\$OUT/E.json\""
  "engine|50|the CUDA engine's tokens/s against transformers generate|\"\$PY\" tools/bench_rollout.py --device cuda --dtype bfloat16 --repeats 3"
  "weight_sync|60|bench_weight_sync into CUDA engines (gloo update group)|\"\$PY\" tools/bench_weight_sync.py --device cuda --repeat 2 --json \"\$OUT/weight_sync.json\""
  "quickstart|70|the quickstart on one GPU (torchrun): steps/s, peak memory|MEGARL_GPU_REPORT_DIR=\"\$OUT\" \"\$PY\" -m pytest -m gpu -p no:cacheprovider -q -rs tests/integration/test_gpu_path.py -k test_quickstart_on_one_gpu_under_torchrun --junitxml=\"\$OUT/pytest.xml\""
)
INSTALL_S=25  # the wheel install, before the steps (nothing to do where all is installed)

if [[ $DRY == 1 ]]; then
  total=$INSTALL_S
  printf "%-12s %5s  %s\n" install $INSTALL_S "missing wheels from --wheels (tools/gpu_common.sh)"
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name limit what cmd <<< "$s"
    printf "%-12s %5s  %s\n%18s%s\n" "$name" "$limit" "$what" "" "$cmd"
    total=$((total + limit))
  done
  echo "total timeouts: $total s (a 9-minute slot: 540 s)"
  echo "KERNEL_OVERRIDES: ${KERNEL_OVERRIDES:-(none)}"
  exit 0
fi

source "$HERE/tools/gpu_common.sh"
gpu_require_cuda "$NAME"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$HERE"
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
export OUT PY KERNEL_OVERRIDES
export -f gpu_env_json
printf "step\trc\tseconds\n" > "$OUT/steps.tsv"
SECONDS=0
timeout -k 5 "$INSTALL_S" bash -c "source tools/gpu_common.sh; gpu_install_missing $NAME '$WHEELS'" \
  > "$OUT/install.txt" 2>&1
printf "install\t%s\t%s\n" "$?" "$SECONDS" >> "$OUT/steps.tsv"
PEAK=$(gpu_peak_tflops 2>/dev/null)
export PEAK
# A: the 1.5B shape at the vocabulary the earlier figures had (the tiny tokenizer's 2308)
"$PY" -c 'import json, sys; c = json.load(open(sys.argv[1])); c["vocab_size"] = 2308
json.dump(c, open(sys.argv[2], "w"), indent=1)' configs/models/qwen2_5_1_5b.json \
  "$OUT/qwen2_5_1_5b_v2308.json"

for s in "${STEPS[@]}"; do
  IFS='|' read -r name limit what cmd <<< "$s"
  echo "== $name ($what), at most $limit s"
  SECONDS=0
  # timeout signals the step's whole process group (torchrun ranks, engine servers)
  timeout -k 10 "$limit" bash -c "$cmd" > "$OUT/$name.txt" 2>&1
  rc=$?
  printf "%s\t%s\t%s\n" "$name" "$rc" "$SECONDS" >> "$OUT/steps.tsv"
  [[ $rc == 0 ]] || echo "   $name failed (exit $rc$([[ $rc == 124 ]] && echo ': timed out')): see $OUT/$name.txt"
done
"$PY" tools/gpu_session_report.py "$OUT"
