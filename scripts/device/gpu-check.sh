#!/usr/bin/env bash
# GPU checks on a CUDA machine where vLLM 0.26.0 is importable: install this plugin next to it, then run the
# gpu-marked tests given as arguments (default: all of them). Logs go to ${OUT:-/tmp/ddtree-gpu}.
#   bash scripts/device/gpu-check.sh tests/gpu/test_ddtree_gpu_e2e.py tests/gpu/test_mla_backend_gpu.py
#   bash scripts/device/gpu-check.sh --install-only
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
LOGS="${OUT:-/tmp/ddtree-gpu}"
mkdir -p "$LOGS"
export VLLM_USE_FLASHINFER_SAMPLER="${VLLM_USE_FLASHINFER_SAMPLER:-0}" HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
SITE="$(python3 -c 'import vllm, pathlib; print(pathlib.Path(vllm.__file__).parents[1])' 2> /dev/null)" \
  || { echo "vLLM is not importable here: install it first (every part of the bundle, then PYTHONPATH)" >&2; exit 1; }
python3 -m pip install -q --no-deps --no-build-isolation --target "$SITE" --upgrade "$ROOT" > "$LOGS/pip.log" 2>&1 \
  || { tail -5 "$LOGS/pip.log"; exit 1; }
[ "${1:-}" = "--install-only" ] && exit 0
cd "$ROOT"
python3 -m pytest -q -s -m gpu -p no:cacheprovider "${@:-tests}" > "$LOGS/gpu-tests.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR)|passed|failed|identical" "$LOGS/gpu-tests.log" | tail -20
exit $rc
