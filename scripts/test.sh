#!/usr/bin/env bash
# The test command: installs what is missing, checks style (ruff check, ruff format --check), runs every non-GPU test
# (unit, kernels, vLLM-CPU engine tests, the csrc build for sm_80/90/120). pytest's "no tests collected" (exit 5) is
# a failure like any other.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(bash "$ROOT/scripts/install-cpu.sh")"
cd "$ROOT"
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
exec "$VENV/bin/python" -m pytest -m "not gpu" -p no:cacheprovider "$@"
