"""Decode step time on Model Runner V2: no speculation vs vLLM's DFlash chain vs DDTree, side by side in one run.

Targets have dummy weights and the drafter is a dummy DFlash model, so proposals are (almost) never accepted and
the time per decode step is what is compared: verify + sample + draft, at the same verify width W = 1 + budget.
Each configuration runs in its own process and its engine core in another, as under ``vllm serve``; ``--inline``
keeps the engine core in the bench's process, as every committed step-time JSON so far was measured, which adds each
step's output handling to its host time. For every (context, batch) it prefills once (prefix-cached, warming
every graph), then runs ``generate`` with 1 + N output tokens ``--repeats`` times while a wrapper on the model
runner's ``execute_model`` records when each step starts; the step time is the median interval between steady
decode steps (pipelined like serving: async scheduling on V2). Decode steps replay FULL CUDA graphs; each row
reports how many timed steps ran and how many verify and drafter graph replays they made (V2), so a row whose steps
fell out of the graphs shows it. Batch-1 steps of small targets are host-bound and shift by up to ~1.5 ms between
processes and over time; ``--rounds R`` runs every configuration R times, interleaved, and reports the median over
rounds; ``--paired`` keeps the engines of one budget alive at once (``bench/paired_children.py``, an equal share of
the GPU memory each) and alternates their timed repeats, so a ratio compares steps timed seconds apart (ddtree
with the V2 chain, or with the chains named by ``--pair-chains``). Beside the
ratio of medians each row gets two that stretches of slow repeats cannot move (``robust_ratios``). Every engine
checks that its KV cache holds the largest batch at the longest context (else it would time preemptions).
The plugin is installed in every configuration's process, so vLLM's own chains run with its FlashAttention geometry
fix too (``vllm_ddtree/patches/fa_geometry.py``): chain and ddtree drafters get the same FA3 plan. The one exception,
``dflash-v1-plain``, runs vLLM 0.26 as shipped (``VLLM_PLUGINS=none``): the V1 chain a user has without this plugin,
whose drafter FA3 is planned with the MLA target's geometry.

Targets:
  qwen3-4b  Qwen3-4B geometry (36 layers, GQA 32/8 heads); configs none, dflash, ddtree (all V2).
  kimi-mla  DeepSeek-V3 architecture with Kimi-K2 attention (64 heads, kv_lora_rank 512, q_lora_rank 1536),
            4 dense layers, hidden 2048; configs none and dflash on V2 + FLASHMLA, dflash-v1 on V1 + TRITON_MLA
            (the only MLA path without FlashMLA; dflash-v1-plain the same without the plugin), dflash-v2-triton
            on V2 + TRITON_MLA (no FULL graphs: TRITON_MLA supports single-token decode only; plain vLLM 0.26
            stopped it inside FA3, see fa_geometry), ddtree on V2 + DDTree's MLA backend (FlashMLA context + our
            tree tail), ddtree-own with our CUDA kernel for the whole verify (the portable path).

    python bench/step_time.py --target qwen3-4b --budgets 8 16 --contexts 4096 32768 --batches 1 16 --out x.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

from child_rows import result_rows
from engine_probes import (
    engine_process_env,
    full_graph_sizes,
    install_probes,
    kv_capacity,
    read_probes,
    run_on_worker,
    shut_down,
    start_profiler,
    stop_profiler,
)
from meta import run_meta
from paired_children import Child, core_sets, interleaved_rows

DRAFT_LAYERS = 2
DRAFT_BLOCK = 16
COMMON = dict(
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    hidden_act="silu",
    attention_bias=False,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    bos_token_id=0,
    eos_token_id=1,
)
QWEN3_4B = dict(
    model_type="qwen3",
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
)
KIMI_MLA = dict(
    model_type="deepseek_v3",
    hidden_size=2048,
    intermediate_size=8192,
    moe_intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=64,
    num_key_value_heads=64,
    vocab_size=163840,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=4,
    moe_layer_freq=1,
    routed_scaling_factor=1.0,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    rope_scaling=None,
)
# Per target: architecture, config, and each configuration's (spec method, target attention backend, V2 runner?,
# extra environment).
TARGETS = {
    "qwen3-4b": (
        "Qwen3ForCausalLM",
        QWEN3_4B,
        {"none": (None, None, True, {}), "dflash": ("dflash", None, True, {}), "ddtree": ("ddtree", None, True, {})},
    ),
    "kimi-mla": (
        "DeepseekV3ForCausalLM",
        KIMI_MLA,
        {
            "none": (None, "FLASHMLA", True, {}),
            "dflash": ("dflash", "FLASHMLA", True, {}),
            "dflash-v1": ("dflash", "TRITON_MLA", False, {}),
            "dflash-v1-plain": ("dflash", "TRITON_MLA", False, {"VLLM_PLUGINS": "none"}),
            "dflash-v2-triton": ("dflash", "TRITON_MLA", True, {}),
            "ddtree": ("ddtree", None, True, {}),
            "ddtree-own": ("ddtree", None, True, {"DDTREE_MLA_CONTEXT": "ddtree"}),
        },
    ),
}


def write_models(root: Path, target_name: str) -> tuple[Path, Path]:
    """Config-only target and a 2-layer Qwen3-style DFlash drafter for it (weights are vLLM's dummy init)."""
    arch, geometry, _ = TARGETS[target_name]
    target, drafter = root / target_name, root / f"{target_name}-dflash"
    target.mkdir(parents=True, exist_ok=True)
    drafter.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps({"architectures": [arch], **COMMON, **geometry}))
    hidden, layers = geometry["hidden_size"], geometry["num_hidden_layers"]
    (drafter / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DFlashDraftModel"],
                **COMMON,
                **QWEN3_4B,
                "hidden_size": hidden,
                "vocab_size": geometry["vocab_size"],
                "num_hidden_layers": DRAFT_LAYERS,
                "block_size": DRAFT_BLOCK,
                "num_target_layers": layers,
                "target_hidden_size": hidden,
                "dflash_config": {
                    "mask_token_id": geometry["vocab_size"] - 1,
                    "target_layer_ids": sorted({1, layers // 2, layers - 1 - (layers > 4) * 2}),
                },
            }
        )
    )
    return target, drafter


class EngineBench:
    """One configuration's engine (in this process; its engine core in another unless ``--inline``), measured one
    (context, batch) cell at a time: ``cell`` prefills and warms every graph, each ``repeat`` times one generate."""

    def __init__(self, args: argparse.Namespace) -> None:
        spec_method, backend, self.v2, env = TARGETS[args.target][2][args.method]
        os.environ.update(env)
        os.environ.update(engine_process_env(args.inline))
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if self.v2 else "0"
        from vllm import LLM

        self.args, self.spec = args, spec_method
        target, drafter = write_models(Path(args.workdir), args.target)
        spec = None
        if spec_method:
            spec = {"method": spec_method, "model": str(drafter), "num_speculative_tokens": args.budget}
            if spec_method == "ddtree":
                spec["adaptive_budget"] = False  # the step of a fixed width is what this bench times
        self.llm = LLM(
            model=str(target),
            load_format="dummy",
            dtype="bfloat16",
            skip_tokenizer_init=True,
            seed=0,
            max_model_len=max(args.contexts) + 512,
            max_num_seqs=max(args.batches),
            gpu_memory_utilization=args.gpu_memory,
            speculative_config=spec,
            enable_prefix_caching=True,
            attention_backend=backend,
            compilation_config={
                "mode": 0,
                "cudagraph_mode": "FULL_DECODE_ONLY",
                "cudagraph_capture_sizes": full_graph_sizes(args.batches, spec_method, args.budget, DRAFT_BLOCK),
            },
        )
        capacity = self.on_worker(kv_capacity)
        if capacity < max(args.batches):
            raise SystemExit(
                f"{args.method}: the KV cache holds {capacity:.1f} requests of {max(args.contexts) + 512} "
                f"tokens, the batch is {max(args.batches)}; give each engine more memory (fewer "
                f"configurations per --paired group, or no --paired)"
            )
        self.on_worker(install_probes)

    def on_worker(self, fn: Any) -> Any:
        return run_on_worker(self.llm, fn, self.args.inline)

    def cell(self, context: int, batch: int) -> None:
        from vllm import SamplingParams

        self.context, self.batch = context, batch
        self.prompts = [
            {"prompt_token_ids": [(7 * i + 13 * r) % 150000 + 2 for i in range(context)]} for r in range(batch)
        ]
        self.params = SamplingParams(temperature=0.0, max_tokens=1 + self.args.steps, ignore_eos=True)
        self.llm.generate(self.prompts, self.params, use_tqdm=False)  # prefill into the prefix cache, warm the graphs
        self.on_worker(read_probes)
        self.samples: list[float] = []
        self.busy: list[float] = []
        self.counts = [0, 0, 0, 0, 0]  # steps, verify, drafter, context K/V write and combine replays

    def repeat(self) -> None:
        self.llm.generate(self.prompts, self.params, use_tqdm=False)
        probes = self.on_worker(read_probes)
        steady = slice(3, None)  # skip the prefill step and the ramp-up
        self.samples.append(statistics.median([b - a for a, b in pairwise(probes.starts)][steady]))
        self.busy.append(statistics.median(probes.busy[steady]))
        self.counts = [
            self.counts[0] + len(probes.starts),
            self.counts[1] + probes.verify,
            self.counts[2] + probes.draft,
            self.counts[3] + probes.context_kv,
            self.counts[4] + probes.combine,
        ]

    def profile(self, directory: str) -> None:
        args = self.args
        out = Path(directory) / f"{args.target}-{args.method}-{args.budget}-{self.context}-b{self.batch}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        self.on_worker(start_profiler)
        self.llm.generate(self.prompts, self.params, use_tqdm=False)
        out.write_text(
            f"{args.method} budget {args.budget}: one generate of {1 + args.steps} tokens (first "
            f"is prefill), engine process\n" + self.on_worker(stop_profiler)
        )
        self.on_worker(partial(start_profiler, with_stack=True))
        self.llm.generate(self.prompts, self.params, use_tqdm=False)
        by_function = self.on_worker(partial(stop_profiler, trace=str(out.with_suffix(".trace.json"))))
        out.with_suffix(".python.txt").write_text(by_function)

    def row(self) -> dict:
        return {
            "method": self.args.method,
            "budget": self.args.budget if self.spec else 0,
            "width": 1 + self.args.budget if self.spec else 1,
            "context": self.context,
            "batch": self.batch,
            "step_ms": round(1e3 * statistics.median(self.samples), 4),
            "samples_ms": [round(1e3 * s, 4) for s in self.samples],
            "worker_ms": round(1e3 * statistics.median(self.busy), 4),
            "steps": self.counts[0],
            "verify_graph_replays": self.counts[1] if self.v2 else None,
            "draft_graph_replays": self.counts[2] if self.v2 and self.spec else None,
            "context_kv_graph_replays": self.counts[3] if self.v2 and self.spec == "ddtree" else None,
            "combine_graph_replays": self.counts[4] if self.v2 and self.spec == "ddtree" else None,
        }

    def close(self) -> None:
        shut_down(self.llm)


def run_one(args: argparse.Namespace) -> None:
    """Child process: one engine, every (context, batch); prints one JSON line per measurement."""
    bench = EngineBench(args)
    for context in args.contexts:
        for batch in args.batches:
            bench.cell(context, batch)
            for _ in range(args.repeats):
                bench.repeat()
            if args.profile:
                bench.profile(args.profile)
            print("RESULT " + json.dumps(bench.row()), flush=True)
    bench.close()


def serve_one(args: argparse.Namespace) -> None:
    """Child process driven by ``paired_children``: ``READY``, then one answer per command line on stdin."""
    bench = EngineBench(args)
    print("READY", flush=True)
    for line in sys.stdin:
        command, *values = line.split()
        if command == "cell":
            bench.cell(*map(int, values))
            print("OK", flush=True)
        elif command == "repeat":
            bench.repeat()
            print("OK", flush=True)
        elif command == "row":
            print("RESULT " + json.dumps(bench.row()), flush=True)
        else:
            raise SystemExit(f"unknown command '{line.strip()}'")
    bench.close()


def _child_cmd(args: argparse.Namespace, workdir: str, method: str, budget: int, gpu_memory: float) -> list[str]:
    return [
        sys.executable,
        __file__,
        "--target",
        args.target,
        "--one",
        method,
        str(budget),
        "--workdir",
        workdir,
        "--steps",
        str(args.steps),
        "--repeats",
        str(args.repeats),
        "--gpu-memory",
        str(gpu_memory),
        "--contexts",
        *map(str, args.contexts),
        "--batches",
        *map(str, args.batches),
        *(["--inline"] if args.inline else []),
    ]


def _paired_rows(args: argparse.Namespace, workdir: str, group: list[tuple[str, int]]) -> list[dict]:
    """One group's engines, started one after the other (each finds the memory its predecessors took gone), then
    measured with their repeats interleaved."""
    children: list[Child] = []
    cpu_sets = core_sets(len(group)) if args.pin else [None] * len(group)
    try:
        for (method, budget), cpus in zip(group, cpu_sets, strict=True):
            cmd = _child_cmd(args, workdir, method, budget, args.gpu_memory / len(group)) + ["--serve"]
            log = args.out.with_name(f"{args.out.stem}.{method}-{budget}.log")
            children.append(Child(cmd, f"{method} budget {budget}", log, cpus))
        cells = [(context, batch) for context in args.contexts for batch in args.batches]
        return interleaved_rows(children, cells, args.repeats)
    finally:
        for child in children:
            child.close()


def paired_groups(configs: list[tuple[str, int]], chains: Sequence[str] = ("dflash",)) -> list[list[tuple[str, int]]]:
    """The configurations whose engines live at once: per budget, the ``chains`` (by default the V2 chain, whose
    ratios are held to 1.1x; ``dflash-v1-plain`` for the 0.25x one) with the ddtree ones. Every other configuration
    gets a group of its own: on the H200, groups of five engines (no spec, both chains, both V1 chains, ddtree) lost
    an engine core without a trace at its first prefill, twice, while groups of two ran every cell."""
    paired = [c for c in configs if c[1] and (c[0] in chains or c[0].startswith("ddtree"))]
    groups = [[c] for c in configs if c not in paired]
    for budget in dict.fromkeys(b for _, b in paired):
        groups.append([c for c in paired if c[1] == budget])
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=sorted(TARGETS), default="qwen3-4b")
    parser.add_argument("--configs", nargs="+", help="which configurations (default: all of the target's)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 63])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every configuration this many times, interleaved, one process each (median)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/step_time_h200.json"))
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="also write a torch.profiler table per configuration, context and batch here (round 0), "
        "and the host time by Python function of a second generate (with_stack trace)",
    )
    parser.add_argument(
        "--inline",
        action="store_true",
        help="run the engine core inside the bench process (how the earlier JSON was measured)",
    )
    parser.add_argument(
        "--paired",
        action="store_true",
        help="keep a budget's V2 chain and ddtree engines alive at once and alternate their timed "
        "repeats (each engine gets an equal share of --gpu-memory); the other configurations "
        "run one engine at a time",
    )
    parser.add_argument(
        "--pair-chains",
        nargs="+",
        default=["dflash"],
        metavar="CONFIG",
        help="with --paired: the chain configurations each budget's ddtree engines alternate with "
        "(default dflash, the V2 chain; dflash-v1-plain for the V1 chain as vLLM ships it)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="with --paired: pin each engine of a group (and its engine core) to its own physical CPU cores",
    )
    parser.add_argument("--gpu-memory", type=float, default=0.85, help="vLLM's gpu_memory_utilization (all engines)")
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "BUDGET"), help=argparse.SUPPRESS)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.method, args.budget = args.one[0], int(args.one[1])
        serve_one(args) if args.serve else run_one(args)
        return
    if args.paired and args.profile:
        parser.error("--profile times one engine at a time; run it without --paired")
    if args.pin and not args.paired:
        parser.error("--pin places the engines of a --paired group; add --paired")
    names = args.configs or list(TARGETS[args.target][2])
    unknown = sorted(set(names) - set(TARGETS[args.target][2]))
    if unknown:
        parser.error(f"unknown configs {unknown} for {args.target}; choose from {sorted(TARGETS[args.target][2])}")
    not_chains = sorted(
        c
        for c in args.pair_chains
        if c not in TARGETS[args.target][2] or c.startswith("ddtree") or not TARGETS[args.target][2][c][0]
    )
    if not_chains:
        parser.error(f"--pair-chains takes chain configurations of {args.target}; {not_chains} are not")
    speculative = [n for n in names if TARGETS[args.target][2][n][0]]
    configs = [(n, 0) for n in names if n not in speculative] + [(n, b) for b in args.budgets for n in speculative]
    rows: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        for round_index in range(args.rounds):
            if args.paired:
                for group in paired_groups(configs, args.pair_chains):
                    for row in _paired_rows(args, workdir, group):
                        rows.append(dict(row, round=round_index))
                        print("RESULT " + json.dumps(row), flush=True)
                    _write(args, rows)
                continue
            for method, budget in configs:
                cmd = _child_cmd(args, workdir, method, budget, args.gpu_memory)
                if args.profile and round_index == 0:
                    cmd += ["--profile", args.profile]
                for row in result_rows(cmd, f"{method} budget {budget} round {round_index}"):
                    rows.append(dict(row, round=round_index))
                    print("RESULT " + json.dumps(row), flush=True)
                    _write(args, rows)
    table = _write(args, rows)
    keys = ("vs_chain", "vs_chain_q1", "vs_chain_pairs", "vs_chain_v1", "vs_chain_v1_plain", "vs_chain_v1_plain_pairs")
    print(
        f"{'config':15} {'budget':>6} {'ctx':>6} {'batch':>5} {'step ms':>8} {'vs chain':>8} {'(q1)':>6} "
        f"{'(pairs)':>7} {'vs V1 chain':>11} {'vs plain V1':>11} {'(pairs)':>7}"
    )
    for r in table:
        ratios = [f"{r[key]:.3f}" if r.get(key) else "" for key in keys]
        print(
            f"{r['method']:15} {r['budget']:>6} {r['context']:>6} {r['batch']:>5} {r['step_ms']:>8.3f} "
            f"{ratios[0]:>8} {ratios[1]:>6} {ratios[2]:>7} {ratios[3]:>11} {ratios[4]:>11} {ratios[5]:>7}"
        )


def combine_rounds(rows: list[dict]) -> list[dict]:
    """One row per (config, budget, context, batch): ``step_ms`` (and ``worker_ms``, the worker's time inside each
    step) is the median over rounds (one process each, so host-bound steps that shift between processes are
    outvoted), every round's step in ``round_ms``; steps and graph replays are summed over rounds."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["budget"], r["context"], r["batch"]), []).append(r)
    table = []
    for group in groups.values():
        row = {k: v for k, v in group[0].items() if k != "round"}
        row["round_ms"] = [r["step_ms"] for r in group]
        row["step_ms"] = round(statistics.median(row["round_ms"]), 4)
        row["samples_ms"] = [s for r in group for s in r["samples_ms"]]
        if all("worker_ms" in r for r in group):
            row["worker_ms"] = round(statistics.median(r["worker_ms"] for r in group), 4)
        for key in (
            "steps",
            "verify_graph_replays",
            "draft_graph_replays",
            "context_kv_graph_replays",
            "combine_graph_replays",
        ):
            if row.get(key) is not None:
                row[key] = sum(r[key] for r in group)
        table.append(row)
    return table


def robust_ratios(
    samples: list[float], chain: list[float] | None, paired: bool, key: str = "vs_chain"
) -> dict[str, float | None]:
    """Two ratios to a chain (``key`` names it: ``vs_chain`` the V2 chain) that a few slow repeats cannot move (on
    the lent H200 some stretches of seconds run ~1.3 ms slower, often in both engines of a pair at once): of the
    lower quartiles (the undisturbed steps), and, when the engines alternated their repeats, the median of the
    ratios of repeats timed one after the other."""
    if not chain or len(samples) < 2 or len(chain) < 2:
        return {f"{key}_q1": None, f"{key}_pairs": None}
    q1 = statistics.quantiles(samples, n=4)[0] / statistics.quantiles(chain, n=4)[0]
    pairs = None
    if paired and len(samples) == len(chain):
        pairs = statistics.median(s / c for s, c in zip(samples, chain, strict=True))
    return {f"{key}_q1": round(q1, 3), f"{key}_pairs": round(pairs, 3) if pairs else None}


def _write(args: argparse.Namespace, rows: list[dict]) -> list[dict]:
    """The JSON report; every speculative row gets its ratio to the V2 chain step of the same width, context and
    batch, and every ddtree row its ratios to the V1 chains (with the plugin, and as vLLM ships it); each ratio of
    medians comes with the two robust ones (``robust_ratios``: ``…_q1``, ``…_pairs``)."""
    rows = combine_rounds(rows)
    chains = {"vs_chain": "dflash", "vs_chain_v1": "dflash-v1", "vs_chain_v1_plain": "dflash-v1-plain"}
    by_cell = {(r["method"], r["budget"], r["context"], r["batch"]): r for r in rows}
    for r in rows:
        for key, chain in chains.items():
            compared = r["method"] != "dflash" if key == "vs_chain" else r["method"].startswith("ddtree")
            ref = by_cell.get((chain, r["budget"], r["context"], r["batch"])) if r["budget"] and compared else None
            r[key] = round(r["step_ms"] / ref["step_ms"], 3) if ref else None
            r.update(robust_ratios(r["samples_ms"], ref["samples_ms"] if ref else None, args.paired, key))
    arch, geometry, configs = TARGETS[args.target]
    args.out.write_text(
        json.dumps(
            {
                "meta": run_meta(),
                "machine": "H200",
                "target": {"name": args.target, "architecture": arch, **geometry},
                "configs": {
                    name: {"method": m, "target_backend": b or "auto", "runner": "V2" if v2 else "V1", "env": env}
                    for name, (m, b, v2, env) in configs.items()
                },
                "drafter": f"DFlash {DRAFT_LAYERS} layers, block {DRAFT_BLOCK}, dummy weights",
                "dtype": "bfloat16",
                "graphs": "FULL_DECODE_ONLY, no torch.compile",
                "rounds": args.rounds,
                "engines": ("paired, pinned to their own cores" if args.pin else "paired")
                if args.paired
                else "one at a time",
                "timing": "median interval between steady decode steps; median over rounds (processes)",
                "rows": rows,
            },
            indent=1,
        )
    )
    return rows


if __name__ == "__main__":
    main()
