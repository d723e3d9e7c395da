#!/usr/bin/env bash
# Re-splits the vLLM bundle for the lent GPU machine so that each part fits one device command beside this
# repository: a command carries the tracked files too (29 MB, the embedded models), and 64 MiB in all, so the shared
# bundle's 50 MB parts are refused there. The bundle (.device/install-vllm.sh and .device/vllm/dp*/p*, ignored by
# git) comes from the lent machine's own tooling, outside this repository: when it is missing, set
# VLLM_BUNDLE_SCRIPT to the script that builds it and this one runs it first.
#   bash scripts/device/device-vllm-parts.sh     # then, back to back, one `run` a part (printed below)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
if ! { [ -f .device/install-vllm.sh ] && ls .device/vllm/dp0/p0 > /dev/null 2>&1; }; then
  [ -n "${VLLM_BUNDLE_SCRIPT:-}" ] || { echo "no vLLM bundle under .device/: set VLLM_BUNDLE_SCRIPT to the script" \
    "that builds it (the lent machine's tooling)" >&2; exit 1; }
  bash "$VLLM_BUNDLE_SCRIPT"
fi
tree=$(git ls-files -z | xargs -0 du -cb | tail -n 1 | cut -f1)
part=$(( (60 * 1024 * 1024 - tree) / 1024 / 1024 ))  # MiB a part, with ~4 MiB to spare
[ "$part" -ge 8 ] || { echo "tracked files take $((tree / 1024 / 1024)) MiB: no room left for vLLM parts" >&2; exit 1; }
tmp=$(mktemp -d)
cat $(ls .device/vllm/dp*/p* | sort -V) > "$tmp/bundle.tar"
rm -rf .device/vllm && mkdir -p .device/vllm
split -b "${part}M" -d -a 2 "$tmp/bundle.tar" "$tmp/p"
count=$(ls "$tmp"/p[0-9]* | wc -l)
i=0
for f in $(ls "$tmp"/p[0-9]* | sort -V); do
  mkdir -p ".device/vllm/dp$i" && mv "$f" ".device/vllm/dp$i/p$i" && echo "$count" > ".device/vllm/dp$i/COUNT"
  i=$((i + 1))
done
rm -rf "$tmp"
echo "$count parts of <= $part MiB (tracked files $((tree / 1024 / 1024)) MiB); one run each, back to back:"
for ((k = 0; k < count; k++)); do
  echo "  run  command: bash .device/install-vllm.sh   carry: [\".device/vllm/dp$k\", \".device/install-vllm.sh\"]"
done
