"""Acceptance and speed of the embedded trained pairs: no speculation vs vLLM's DFlash chain vs DDTree.

For each pair (``gqa``: stdlib-qwen3-tiny + its drafter; ``mla``: stdlib-mla-tiny + its drafter) and batch size,
every configuration greedily continues the same held-out prompts (``models/heldout_prompts.json``: windows of the
held-out stdlib stream, never trained on). Reported per configuration: mean acceptance length (1 + accepted /
drafts, vLLM's own counters), output tokens per second, how many sequences equal the no-speculation output, and
where the others first leave it: at a near-tie of the reference (its top two tokens within 1 nat, a bf16 rounding
flip) or elsewhere (a real difference; ``tests/kit/greedy_equality.py``).
Each batch size runs the prompts once untimed, so one-off costs (Triton compiles of first-seen shapes, lazy
allocations) stay out of the numbers, then ``--passes`` timed passes whose median is reported (a batch-16 pass lasts
well under a second, so one host hiccup would otherwise move it by 3x); prefix caching is off, so every pass prefills.

On a GPU the engines run Model Runner V2 in bf16 with FULL decode CUDA graphs (no torch.compile); on vLLM-CPU
(V1, GQA pair only) in float32, where greedy equality is exact. One process per engine, and its engine core in
another, as when serving (graph replays are counted there: ``engine_probes.py``).

    python bench/acceptance.py --pairs gqa mla --batches 1 16 --out bench/results/acceptance_h200.json
    VLLM_CPU_KVCACHE_SPACE=1 python bench/acceptance.py --pairs gqa --budgets 15 --batches 8 --prompts 20 \
        --max-tokens 64 --out models/acceptance.json
    python bench/acceptance.py --write-prompts   # from train/tokenizer.py's held-out split
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from child_rows import result_rows
from engine_probes import (
    engine_process_env,
    full_graph_sizes,
    install_probes,
    read_probes,
    run_on_worker,
    shut_down,
    spec_decode_counters,
)
from meta import run_meta

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the greedy-equality checks of the test kit (tests/kit)
PAIRS = {"gqa": ("stdlib-qwen3-tiny", "stdlib-qwen3-tiny-dflash"), "mla": ("stdlib-mla-tiny", "stdlib-mla-tiny-dflash")}
PROMPTS = ROOT / "models" / "heldout_prompts.json"
HELDOUT_STREAM = Path.home() / ".cache" / "vllm-ddtree" / "stdlib-data" / "heldout.u16"
CHAIN_TOKENS = 7  # the drafters' block size - 1: vLLM's DFlash chain drafts one block


def write_prompts(n: int = 64, length: int = 64) -> None:
    """n evenly spaced windows of the held-out token stream (json/, email/, six modules) as token-id prompts."""
    import numpy as np

    data = np.fromfile(HELDOUT_STREAM, dtype=np.uint16).astype(int)
    starts = np.linspace(0, data.size - length - 1, n).astype(int)
    PROMPTS.write_text(json.dumps([data[s : s + length].tolist() for s in starts]) + "\n")
    print(f"{n} prompts of {length} tokens -> {PROMPTS}")


def engine_kwargs(gpu: bool, max_batch: int, sizes: list[int]) -> dict:
    """Every decode batch of 1..max_batch requests gets a FULL graph for its verify and its drafter step (``sizes``:
    ``full_graph_sizes``). vLLM's default capture sizes stop at 512 tokens, so budget 63 at batch 16 would verify
    eagerly."""
    common = dict(
        max_model_len=512, max_num_seqs=max_batch, seed=0, disable_log_stats=False, enable_prefix_caching=False
    )  # the timed pass prefills like the warm-up pass did
    if not gpu:
        return dict(common, dtype="float32", max_num_batched_tokens=512)
    return dict(
        common,
        dtype="bfloat16",
        gpu_memory_utilization=0.1,
        compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": sizes},
    )


def _drafter_block(drafter: str) -> int:
    return json.loads((Path(drafter) / "config.json").read_text())["block_size"]


def _decode(llm: object, prompts: list[dict], params: object, batch: int) -> list[list[int]]:
    tokens: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        tokens += [list(o.outputs[0].token_ids) for o in llm.generate(prompts[i : i + batch], params, use_tqdm=False)]
    return tokens


def _warm_up(llm: object, prompts: list[dict], params: object, batch: int, reference: bool) -> list[list[float]]:
    """One untimed pass; for the reference (no speculation) with ``logprobs=2``, returning each position's gap
    between the best and the runner-up token (``tests/kit/greedy_equality.py``)."""
    from kit.greedy_equality import greedy_with_gaps

    if not reference:
        _decode(llm, prompts, params, batch)
        return []
    params = params.clone()
    params.logprobs = 2
    return greedy_with_gaps(llm, prompts, params, batch)[1]


def run_one(args: argparse.Namespace) -> None:
    """Child process: one engine; every batch size; prints one RESULT line per batch size."""
    import torch

    gpu = torch.cuda.is_available()
    if gpu:  # every config on Model Runner V2: vLLM defaults MoE-configured DeepSeek targets (the MLA pair) to V1
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    from vllm import LLM, SamplingParams

    target, drafter = (str(ROOT / "models" / name) for name in PAIRS[args.pair])
    spec = None
    if args.method != "none":
        spec = {
            "method": args.method,
            "model": drafter,
            "num_speculative_tokens": args.budget,
            "adaptive_budget": False,  # acceptance of the whole budget, every step
            "draft_load_config": {"load_format": "safetensors"},
        }
    method = None if args.method == "none" else args.method
    sizes = full_graph_sizes(range(1, max(args.batches) + 1), method, args.budget, _drafter_block(drafter))
    llm = LLM(model=target, speculative_config=spec, **engine_kwargs(gpu, max(args.batches), sizes))
    run_on_worker(llm, install_probes, inline=False)
    prompts = [{"prompt_token_ids": p} for p in json.loads(PROMPTS.read_text())[: args.prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for batch in args.batches:
        # Warm-up pass (graphs, first-shape Triton compiles); the reference run also records its top-2 gaps.
        gaps = _warm_up(llm, prompts, params, batch, reference=spec is None)
        before = spec_decode_counters(llm)
        run_on_worker(llm, read_probes, inline=False)
        walls = []
        for _ in range(args.passes):
            start = time.perf_counter()
            tokens = _decode(llm, prompts, params, batch)
            walls.append(time.perf_counter() - start)
        wall = statistics.median(walls)
        after = spec_decode_counters(llm)
        probes = run_on_worker(llm, read_probes, inline=False)
        drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get("vllm:spec_decode_num_drafts", 0)
        accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
            "vllm:spec_decode_num_accepted_tokens", 0
        )
        row = {
            "pair": args.pair,
            "method": args.method,
            "budget": args.budget,
            "batch": batch,
            "device": torch.cuda.get_device_name() if gpu else "cpu",
            "dtype": "bfloat16" if gpu else "float32",
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
            "tok_per_s": round(len(tokens) * args.max_tokens / wall, 1),
            "wall_s": [round(w, 3) for w in walls],
            "verify_graph_replays": probes.verify,
            "draft_graph_replays": probes.draft,
            "tokens": tokens,
            "gaps": gaps,
        }
        print("RESULT " + json.dumps(row), flush=True)
    shut_down(llm)


def summarize(rows: list[dict]) -> list[dict]:
    """Rows without token lists, with equality to and speed-up over no speculation (same pair and batch): how many
    sequences are identical, and how many first diverge at a near-tie of the reference vs elsewhere (a real
    difference; see ``tests/kit/greedy_equality.py``)."""
    from kit.greedy_equality import compare_greedy

    ref = {(r["pair"], r["batch"]): r for r in rows if r["method"] == "none"}
    chain = {(r["pair"], r["batch"]): r for r in rows if r["method"] == "dflash"}
    out = []
    for r in rows:
        base, ch = ref.get((r["pair"], r["batch"])), chain.get((r["pair"], r["batch"]))
        s = {k: v for k, v in r.items() if k not in ("tokens", "gaps")}
        if base:
            seen = compare_greedy(r["tokens"], base["tokens"], base["gaps"])
            s["equal_to_target"] = f"{seen.identical}/{len(base['tokens'])}"
            s["diverge_at_near_ties"] = len(seen.near_tie_gaps)
            s["diverge_elsewhere"] = len(seen.clear_divergences)
            s["vs_no_spec"] = round(r["tok_per_s"] / base["tok_per_s"], 2)
        if ch:
            s["vs_chain"] = round(r["tok_per_s"] / ch["tok_per_s"], 2)
        out.append(s)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="+", choices=sorted(PAIRS), default=["gqa", "mla"])
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 63], help="ddtree node budgets")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--passes", type=int, default=3, help="timed passes per batch size (median reported)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "acceptance.json")
    parser.add_argument("--write-prompts", action="store_true", help="regenerate models/heldout_prompts.json")
    parser.add_argument("--one", nargs=3, metavar=("PAIR", "METHOD", "BUDGET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_prompts:
        write_prompts()
        return
    if args.one:
        args.pair, args.method, args.budget = args.one[0], args.one[1], int(args.one[2])
        run_one(args)
        return
    configs = [("none", 0), ("dflash", CHAIN_TOKENS)] + [("ddtree", b) for b in args.budgets]
    rows: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for pair in args.pairs:
        for method, budget in configs:
            cmd = [
                sys.executable,
                __file__,
                "--one",
                pair,
                method,
                str(budget),
                "--prompts",
                str(args.prompts),
                "--max-tokens",
                str(args.max_tokens),
                "--passes",
                str(args.passes),
                "--batches",
                *map(str, args.batches),
            ]
            env = dict(os.environ, **engine_process_env(inline=False), HF_HUB_OFFLINE="1")
            for row in result_rows(cmd, f"{pair} {method} {budget}", env):
                rows.append(row)
                _write(args, rows)
    table = _write(args, rows)
    print(
        f"{'pair':4} {'config':7} {'budget':>6} {'batch':>5} {'accept len':>10} {'tok/s':>9} {'vs chain':>8} "
        f"{'vs none':>7} {'== target':>9} {'near-tie':>8} {'elsewhere':>9}"
    )
    for r in table:
        print(
            f"{r['pair']:4} {r['method']:7} {r['budget']:>6} {r['batch']:>5} {r['mean_acceptance_length']:>10.3f} "
            f"{r['tok_per_s']:>9.1f} {r.get('vs_chain', ''):>8} {r.get('vs_no_spec', ''):>7} "
            f"{r.get('equal_to_target', ''):>9} {r.get('diverge_at_near_ties', ''):>8} "
            f"{r.get('diverge_elsewhere', ''):>9}"
        )


def _write(args: argparse.Namespace, rows: list[dict]) -> list[dict]:
    table = summarize(rows)
    args.out.write_text(
        json.dumps(
            {
                "meta": run_meta(),
                "prompts": args.prompts,
                "prompt_len": 64,
                "max_tokens": args.max_tokens,
                "graphs": "FULL_DECODE_ONLY on GPUs, no torch.compile",
                "rows": table,
            },
            indent=1,
        )
        + "\n"
    )
    return table


if __name__ == "__main__":
    main()
