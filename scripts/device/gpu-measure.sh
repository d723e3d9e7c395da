#!/usr/bin/env bash
# The H200 measurements of docs/results.md as a queue of stages. Each stage has two halves; with two GPUs the halves
# run side by side, one lane per GPU, otherwise one after the other. Every bench and test is cut off after
# $JOB_TIMEOUT seconds (560; bench JSON is written row by row, so a cut-off keeps what finished). Results and logs go
# to $RESULTS (/tmp/ddtree-gpu).
#   bash scripts/device/gpu-measure.sh STAGE...                 # run the stages now and wait
#   bash scripts/device/gpu-measure.sh --background STAGE...    # start them in their own session and return at once
#   bash scripts/device/gpu-measure.sh poll SECONDS             # wait, then print progress and pack $RESULTS
# Stages:
#   step-a       budgets 8 16: Qwen3-4B geometry | Kimi-K2-attention MLA (+ V1 chain; --paired)
#   step-b       budgets 32 63, the same two targets
#   acceptance   embedded pairs, budgets 8 16 32 63: GQA | MLA
#   ops          tree ops incl. the drafter top-k | the MLA kernel (auto, portable, decode; all shapes) vs baselines
#   tests        the gpu-marked tests: end to end + top-k | kernels and backends
#   load-faults  bench/load_faults.py: both embedded pairs under 200 streams with aborts, then forced preemption
#   adaptive     the GPU tests of the adaptive budget (forced width switches, the chosen budget; GQA and MLA)
#   serve-sweep  bench/serve_sweep.py --interleave, vLLM's default serving config: both pairs' servers (no spec, V2
#                chain k=7, ddtree adaptive 15) started at once and measured in alternating passes at concurrency
#                1 4 16 64 128, passes of >= 6 s (JOB_TIMEOUT=1100: 815 s on an H100 at a288f4a)
#   serve-budgets  the same for ddtree at fixed budgets 8 16 32 63 (both pairs: 8 servers)
#   serve-adaptive  the same for no spec, V2 chain k=7, ddtree adaptive 15 and adaptive 63 (both pairs: 8 servers;
#                the widths-with-FULL-graphs rule at c64/c128, bigger trees at c1; JOB_TIMEOUT=1300)
#   serve-high   the serve-sweep servers at concurrency 16 64 128 only, where the verify's width meets the FULL
#                graphs' limit (one short session)
#   serve-profile  the MLA pair under vLLM's default serving config at concurrency 1 4 16, with one profiled pass at
#                16 (bench/trace_summary.py): ddtree 15 fixed, V2 chain k=7 (with and without this plugin loaded),
#                ddtree adaptive 15, no spec
#   serve-load   the MLA pair under vLLM's default serving config at concurrency 16 64 128 (where load lives): no
#                spec, V2 chain k=7, ddtree adaptive 15, one job a config (~7 min each: JOB_TIMEOUT=700)
#   recheck      the GPU tests of the V2 host trims (context K/V + combine graphs, e2e GQA, MLA matches-target) and
#                of the MLA query pack, then its bench (one lane)
#   profile      Kimi-K2-attention MLA, budgets 8 16, 32k, batch 1: a torch.profiler table per config (V2 chain, ddtree)
#   profile-b16  the same at budget 63, 4k, batch 16 (GPU-bound steps: where the verify's GPU time goes)
#   profile-4k   the same at budgets 32 63, 4k, batch 1 (the batch-1 cells that miss 0.25x of the V1 chain)
#   offsets      MLA budgets 16 8, batch 1: V2 chain + ddtree paired and pinned, 15 alternating repeats (one lane)
#   offsets-wide the same at budgets 32 63
#   v1-plain     MLA budgets 16 32 63, batch 1: vLLM's chain on V1 + TRITON_MLA as shipped (plugins off) and ddtree,
#                paired and pinned, 9 alternating repeats
#   divergence   bench/divergence.py: greedy divergence from the target and teacher-forced log-prob deviation of
#                the dflash chain and ddtree, on generated GQA and MLA (8-128 heads, dense and MoE) targets; one job
#                a config (6 bf16 V2 engines without torch.compile, 30-80 s each to start on the H200: ~5 min a
#                config), lanes alternating; divergence-a (3 configs) and divergence-b (the other 4) fit a session each
#   numerics-tests the GPU tests of the verify-numerics changes: MLA tail + GQA tree kernels with the context pass
#                attending the root, the layout, the MLA backend and the end-to-end tests (one lane)
#   divergence-ab  the divergence bench on one MLA and one GQA config with VLLM_DDTREE_PREFILL=ddtree (prefill
#                chunks on the tree backends, as before backends/row_split.py): the A/B of that change
#   jobs:FILE    the jobs listed in FILE, one per line: LANE NAME [K=V ...] ARGS... (runs python3 ARGS with those
#                environment variables, e.g. VLLM_DDTREE_CSRC=DIR for a kernel A/B; $RESULTS expands; words split
#                on blanks, so no quoted arguments)
# The background form outlives the command that started it (a new process session), so a remote command of limited
# length can start a long queue and later ones can poll it; poll packs everything into $OUT/results.tgz when $OUT is
# set (one file: remote runners may return only a few).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RESULTS="${RESULTS:-/tmp/ddtree-gpu}"
JOB_TIMEOUT="${JOB_TIMEOUT:-560}"
export VLLM_USE_FLASHINFER_SAMPLER="${VLLM_USE_FLASHINFER_SAMPLER:-0}" HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" RESULTS
cd "$ROOT"

# jobs STAGE: one line per job, "LANE NAME [K=V ...] ARGS..." (python3 ARGS; LANE 0 or 1)
jobs_of() {
  local r=$RESULTS tag budgets
  case "$1" in
    step-a|step-b)
      tag=${1#step-}; budgets="8 16"; [ "$1" = step-b ] && budgets="32 63"
      echo "0 step_qwen3_$tag bench/step_time.py --target qwen3-4b --budgets $budgets --out $r/step_qwen3_$tag.json"
      echo "1 step_kimi_$tag bench/step_time.py --target kimi-mla --configs none dflash dflash-v1" \
           "dflash-v1-plain ddtree --budgets $budgets --paired --pin --repeats 9 --out $r/step_kimi_$tag.json" ;;
    acceptance)
      echo "0 acc_gqa bench/acceptance.py --pairs gqa --out $r/acc_gqa.json"
      echo "1 acc_mla bench/acceptance.py --pairs mla --out $r/acc_mla.json" ;;
    ops)
      echo "0 tree_ops bench/tree_ops.py --out $r/tree_ops.json"
      echo "1 kernel_mla bench/kernel_mla.py --baselines --variants auto,portable,decode --shapes all" \
           "--out $r/kernel_mla.json" ;;
    tests)
      echo "0 tests_e2e -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_ddtree_gpu_e2e.py tests/unit/test_draft_topk.py"
      echo "1 tests_kernels -m pytest -q -s -m gpu -p no:cacheprovider --ignore tests/gpu/test_ddtree_gpu_e2e.py" \
           "--ignore tests/unit/test_draft_topk.py tests" ;;
    load-faults)
      echo "0 load_faults bench/load_faults.py --deadline 540 --out $r/load_faults_h200.json" ;;
    adaptive)
      echo "0 tests_adaptive -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu -k adaptive" ;;
    serve-sweep)
      echo "0 sweep bench/serve_sweep.py --interleave --pairs mla gqa --configs nospec chain-7 adaptive-15" \
           "--min-seconds 6 --logs $r/serve_logs --out $r/serve_sweep.json" ;;
    serve-high)
      echo "0 sweep_high bench/serve_sweep.py --interleave --pairs mla gqa --configs nospec chain-7 adaptive-15" \
           "--concurrency 16 64 128 --min-seconds 6 --logs $r/serve_logs --out $r/serve_sweep_high.json" ;;
    serve-budgets)
      echo "0 sweep_budgets bench/serve_sweep.py --interleave --pairs mla gqa --configs ddtree-8 ddtree-16 ddtree-32" \
           "ddtree-63 --min-seconds 6 --logs $r/serve_logs --out $r/serve_sweep_budgets.json" ;;
    serve-adaptive)
      echo "0 sweep_adaptive bench/serve_sweep.py --interleave --pairs mla gqa --configs nospec chain-7" \
           "adaptive-15 adaptive-63 --min-seconds 6 --logs $r/serve_logs --out $r/serve_sweep_adaptive.json" ;;
    serve-profile)
      local c
      for c in ddtree-15 chain-7 vllmchain-7 adaptive-15 nospec; do
        echo "0 profile_mla_$c bench/serve_sweep.py --pairs mla --configs $c --concurrency 1 4 16 --profile-at 16" \
             "--logs $r/serve_logs --out $r/sweep_mla_$c.json"
      done ;;
    serve-load)
      local c
      for c in nospec chain-7 adaptive-15; do
        echo "0 load_mla_$c bench/serve_sweep.py --pairs mla --configs $c --concurrency 16 64 128" \
             "--logs $r/serve_logs --out $r/load_mla_$c.json"
      done ;;
    recheck)
      echo "0 tests_e2e -m pytest -q -s -m gpu -p no:cacheprovider tests/unit/test_context_kv_graphs.py" \
           "tests/gpu/test_ddtree_gpu_e2e.py"
      echo "0 tests_mla -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_mla_backend_gpu.py" \
           "-k matches_target_and_replays"
      echo "0 tests_pack -m pytest -q -s -m gpu -p no:cacheprovider tests/kernels/test_mla_tree_tail.py -k pack"
      echo "0 query_pack bench/query_pack.py --out $r/query_pack.json" ;;
    profile)
      echo "0 profile_kimi bench/step_time.py --target kimi-mla --configs dflash ddtree --budgets 8 16 --contexts 32768" \
           "--batches 1 --profile $r/profile --out $r/profile_kimi.json" ;;
    profile-b16)
      echo "0 profile_kimi_b16 bench/step_time.py --target kimi-mla --configs dflash ddtree --budgets 63 --contexts 4096" \
           "--batches 16 --profile $r/profile_b16 --out $r/profile_kimi_b16.json" ;;
    profile-4k)
      echo "0 profile_kimi_4k bench/step_time.py --target kimi-mla --configs dflash ddtree --budgets 32 63 --contexts 4096" \
           "--batches 1 --profile $r/profile_4k --out $r/profile_kimi_4k.json" ;;
    offsets)
      echo "0 offsets bench/step_time.py --target kimi-mla --configs dflash ddtree --budgets 16 8 --batches 1" \
           "--paired --pin --repeats 15 --out $r/offsets.json" ;;
    offsets-wide)
      echo "0 offsets_wide bench/step_time.py --target kimi-mla --configs dflash ddtree --budgets 32 63 --batches 1" \
           "--paired --pin --repeats 15 --out $r/offsets_wide.json" ;;
    v1-plain)
      echo "0 step_v1_plain bench/step_time.py --target kimi-mla --configs dflash-v1-plain ddtree --budgets 16 32 63" \
           "--batches 1 --paired --pin --pair-chains dflash-v1-plain --repeats 9 --out $r/step_v1_plain_b1.json" ;;
    divergence|divergence-a|divergence-b)
      local c n=0 configs="mla-h16-moe-l3 gqa-h8kv2-l3 mla-h64-moe-l4"
      [ "$1" = divergence-b ] && configs="gqa-h16kv8-l2 mla-h8-dense-l2 mla-h32-dense-l4 mla-h128-moe-l2"
      [ "$1" = divergence ] && configs="$configs gqa-h16kv8-l2 mla-h8-dense-l2 mla-h32-dense-l4 mla-h128-moe-l2"
      for c in $configs; do
        echo "$((n++ % 2)) div_$c bench/divergence.py --configs $c --out $r/divergence_$c.json"
      done ;;
    numerics-tests)  # the GPU tests of what the verify numerics work changed (kernels, backends, end to end)
      echo "0 tests_numerics_kernels -m pytest -q -s -m gpu -p no:cacheprovider tests/kernels/test_mla_tree_tail.py" \
           "tests/kernels/test_gqa_tree_attention.py tests/unit/test_verify_layout.py"
      echo "0 tests_numerics_e2e -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_mla_backend_gpu.py" \
           "tests/gpu/test_ddtree_gpu_e2e.py" ;;
    divergence-ab)  # the same bench with the tree backends attending prefill chunks too (the plugin before)
      echo "0 div_prefill_ddtree_mla-h16-moe-l3 VLLM_DDTREE_PREFILL=ddtree bench/divergence.py --configs mla-h16-moe-l3" \
           "--out $r/divergence_prefill_ddtree_mla-h16-moe-l3.json"
      echo "1 div_prefill_ddtree_gqa-h8kv2-l3 VLLM_DDTREE_PREFILL=ddtree bench/divergence.py --configs gqa-h8kv2-l3" \
           "--out $r/divergence_prefill_ddtree_gqa-h8kv2-l3.json" ;;
    jobs:*)
      [ -f "${1#jobs:}" ] || { echo "no job file '${1#jobs:}'" >&2; return 2; }
      grep -v '^\s*\(#\|$\)' "${1#jobs:}" | sed "s|\$RESULTS|$r|g" ;;
    *) echo "unknown stage '$1': step-a, step-b, acceptance, ops, tests, recheck, profile, profile-b16, profile-4k, offsets, offsets-wide," \
            "v1-plain, divergence, divergence-a, divergence-b, divergence-ab, numerics-tests, serve-sweep, serve-budgets," \
            "serve-adaptive, serve-high, serve-profile, serve-load, adaptive, load-faults" \
            "or jobs:FILE" >&2; return 2 ;;
  esac
}

# lane N LANES STAGE...: this lane's jobs of every stage, in order (all jobs when there is one lane)
lane() {
  local n=$1 lanes=$2 stage l name start rc; shift 2
  for stage in "$@"; do
    while read -r l name args; do
      [ "$lanes" -ge 2 ] && [ "$l" != "$n" ] && continue
      start=$(date +%s)
      local envs=() cmd=() tok
      # shellcheck disable=SC2086
      for tok in $args; do  # leading K=V words: environment of this job (A/B of kernel sources, knobs)
        if [ ${#cmd[@]} -eq 0 ] && [[ $tok =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; then envs+=("$tok"); else cmd+=("$tok"); fi
      done
      timeout -k 20 "$JOB_TIMEOUT" env "${envs[@]}" python3 "${cmd[@]}" > "$RESULTS/$name.log" 2>&1 < /dev/null
      rc=$?
      echo "$name: rc $rc, $(( $(date +%s) - start )) s" >> "$RESULTS/done"
    done < <(jobs_of "$stage")
  done
  echo "lane $n finished" >> "$RESULTS/done"
}

pack() { [ -n "${OUT:-}" ] && [ "$OUT" != "$RESULTS" ] && tar czf "$OUT/results.tgz" -C "$RESULTS" . 2>/dev/null; true; }

case "${1:-}" in
  poll)
    sleep "${2:-60}"
    cat "$RESULTS/done" 2>/dev/null
    nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader
    for f in "$RESULTS"/*.log; do [ -f "$f" ] && { echo "== $(basename "$f")"; tail -n 3 "$f" | cut -c1-200; }; done
    pack ;;
  lane) shift; lane "$@" ;;
  "") sed -n '2,20p' "$0" >&2; exit 2 ;;
  *)
    background=0; [ "$1" = --background ] && { background=1; shift; }
    for stage in "$@"; do jobs_of "$stage" > /dev/null || exit 2; done
    mkdir -p "$RESULTS"
    echo "--- $(date +%T) $*" >> "$RESULTS/done"
    bash "$ROOT/scripts/device/gpu-check.sh" --install-only || exit 1
    lanes=1; [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && lanes=2
    for ((n = 0; n < lanes; n++)); do
      if [ $background = 1 ]; then
        CUDA_VISIBLE_DEVICES=$n setsid nohup bash "$0" lane $n $lanes "$@" > "$RESULTS/lane$n.out" 2>&1 < /dev/null &
      else
        CUDA_VISIBLE_DEVICES=$n bash "$0" lane $n $lanes "$@" > "$RESULTS/lane$n.out" 2>&1 &
      fi
    done
    if [ $background = 1 ]; then echo "started $lanes lane(s): $*; results in $RESULTS"; exit 0; fi
    wait
    cat "$RESULTS/done"
    pack ;;
esac
