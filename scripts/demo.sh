#!/usr/bin/env bash
# The demo command: installs what is missing, then serves DDTree, sends a request, prints the result, stops.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(bash "$ROOT/scripts/install-cpu.sh")"
exec "$VENV/bin/python" "$ROOT/scripts/demo.py"
