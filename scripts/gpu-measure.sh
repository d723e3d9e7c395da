#!/usr/bin/env bash
# The README's H200 measurements in stages that each fit one device call (< 10 min): with two GPUs visible the two
# halves of a stage run side by side, one per GPU, otherwise one after the other. Each bench is cut off at 560 s
# (its JSON is written row by row, so a cut-off keeps what finished). JSON and logs go to ${OUT:-/tmp/ddtree-gpu}.
#   bash scripts/gpu-measure.sh step-a       # budgets 8 16: Qwen3-4B geometry | Kimi-K2-attention MLA (+ V1 chain)
#   bash scripts/gpu-measure.sh step-b       # budgets 32 63, the same two targets
#   bash scripts/gpu-measure.sh acceptance   # embedded pairs, budgets 8 16 32 63: MLA | GQA
#   bash scripts/gpu-measure.sh ops          # tree ops incl. the drafter top-k, and the MLA kernel vs baselines
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-/tmp/ddtree-gpu}"
mkdir -p "$OUT"
bash "$ROOT/scripts/gpu-check.sh" --install-only || exit 1
export VLLM_USE_FLASHINFER_SAMPLER="${VLLM_USE_FLASHINFER_SAMPLER:-0}" HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
cd "$ROOT"
GPUS=$(nvidia-smi -L | wc -l)

# run NAME ARGS...: python3 ARGS with a 560 s cut-off, output in $OUT/NAME.log
run() { local name=$1; shift; timeout 560 python3 "$@" > "$OUT/$name.log" 2>&1; echo "$name: rc $?"; }

# halves "A" "B": two run-commands, on GPU 0 and GPU 1 at once when there are two GPUs
halves() {
  if [ "$GPUS" -ge 2 ]; then
    (export CUDA_VISIBLE_DEVICES=0; eval "$1") & (export CUDA_VISIBLE_DEVICES=1; eval "$2") & wait
  else
    eval "$1"; eval "$2"
  fi
}

case "${1:-}" in
  step-a|step-b)
    budgets="8 16"; [ "$1" = step-b ] && budgets="32 63"
    tag=${1#step-}
    halves "run step_qwen3_$tag bench/step_time.py --target qwen3-4b --budgets $budgets --out $OUT/step_qwen3_$tag.json" \
           "run step_kimi_$tag bench/step_time.py --target kimi-mla --configs none dflash dflash-v1 ddtree --budgets $budgets --out $OUT/step_kimi_$tag.json"
    tail -n 20 "$OUT"/step_*_"$tag".log ;;
  acceptance)
    halves "run acc_mla bench/acceptance.py --pairs mla --out $OUT/acc_mla.json" \
           "run acc_gqa bench/acceptance.py --pairs gqa --out $OUT/acc_gqa.json"
    tail -n 14 "$OUT"/acc_*.log ;;
  ops)
    run tree_ops bench/tree_ops.py --out "$OUT/tree_ops.json"
    run kernel_mla bench/kernel_mla.py --baselines --variants auto --out "$OUT/kernel_mla.json"
    tail -n 9 "$OUT/tree_ops.log" "$OUT/kernel_mla.log" ;;
  *) echo "usage: bash scripts/gpu-measure.sh step-a|step-b|acceptance|ops" >&2; exit 2 ;;
esac
