#!/usr/bin/env bash
# Creates (or reuses) the GPU environment: PyPI's torch==2.11.0 and vllm==0.26.0 (CUDA wheels), then this plugin
# (editable). A python that already imports vLLM 0.26.0 with CUDA (DDTREE_PYTHON) is used as it is. Prints the
# python to run.
set -euo pipefail
exec 3>&1 1>&2  # everything but the final path goes to stderr
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${DDTREE_PYTHON:-}" ]; then
  "$DDTREE_PYTHON" -c 'import vllm, torch; assert vllm.__version__ == "0.26.0" and torch.cuda.is_available()'
  "$DDTREE_PYTHON" -m pip install -q --no-deps --no-build-isolation --upgrade \
    --target "$("$DDTREE_PYTHON" -c 'import vllm, pathlib; print(pathlib.Path(vllm.__file__).parents[1])')" "$ROOT"
  echo "$DDTREE_PYTHON" >&3
  exit 0
fi
VENV="${DDTREE_VENV_DIR:-$HOME/.cache/vllm-ddtree}/venv-gpu"
STAMP="$VENV/.ddtree-env-v1"
if [ ! -f "$STAMP" ]; then
  echo "[install-gpu] creating $VENV (torch 2.11.0 + vllm 0.26.0 from PyPI, a few minutes)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "${PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip setuptools wheel
  "$VENV/bin/pip" install -q torch==2.11.0 vllm==0.26.0 openai
  touch "$STAMP"
fi
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT"
echo "$VENV/bin/python" >&3
