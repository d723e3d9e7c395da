"""Serving throughput as users get it: ``vllm serve`` with vLLM's defaults, driven by vLLM's own ``vllm bench serve``.

For each embedded pair and each config (no speculation, vLLM's DFlash chain on Model Runner V2, ddtree at fixed
budgets, ddtree with its adaptive budget) the sweep starts the OpenAI server with vLLM's default serving config
(torch.compile, default CUDA graphs; ``--tuned`` adds the repo's tuned settings as a second series), waits for
health, and at each concurrency runs one warm-up pass and then ``--passes`` timed passes of ``vllm bench serve``
(custom dataset of the held-out prompts, ``--output-len`` tokens each, temperature 0, ignore EOS), each pass long
enough to last ``--min-seconds``. It reads ``/metrics`` around the timed passes for acceptance, then stops the
server. ``--interleave`` instead starts every pair's and config's server at once, keeps them up side by side and
alternates their timed passes: a machine whose speed drifts (a shared 2-core VM) slows every config alike, and a
lent GPU pays one start-up instead of one per config (each server then takes a share of the GPU's memory and a
fixed KV cache, the one departure from vLLM's defaults). Output: JSON (``meta``: commit, vLLM, torch, GPU),
a table on stdout, and a PNG (tok/s vs concurrency, one line per config) with ``--plot``.

    python bench/serve_sweep.py --out bench/results/serve_sweep_h200.json            # the GPU sweep
    python bench/serve_sweep.py --pairs gqa --configs nospec ddtree-15 adaptive-15 \\
        --concurrency 1 4 8 --out bench/results/serve_sweep_cpu.json                  # vLLM-CPU
    python bench/serve_sweep.py --plot bench/results/serve_sweep_h200.json           # the PNG beside the JSON
    python bench/serve_sweep.py --merge a.json b.json --out all.json                 # one sweep from several runs
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MODELS = ROOT / "models"
PROMPTS = MODELS / "heldout_prompts.json"
PAIRS = {"mla": ("stdlib-mla-tiny", "stdlib-mla-tiny-dflash"), "gqa": ("stdlib-qwen3-tiny", "stdlib-qwen3-tiny-dflash")}
SERVED = "tiny"
DEFAULT_CONFIGS = ["nospec", "chain-7", "vllmchain-7", "ddtree-8", "ddtree-16", "ddtree-32", "ddtree-63", "adaptive-63"]
TUNED = ["-cc", json.dumps({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})]
"""The repo's tuned settings (its step benches'): no torch.compile, FULL graphs for uniform decode steps only."""
SHARED_GPU_KV_CACHE_BYTES = 4 << 30
"""Each server's KV cache when several share one GPU (``--interleave``), fixed: servers starting side by side would
otherwise count each other's allocations as their own in vLLM's memory profile. The tiny pairs fill a fraction of
it at concurrency 128."""
DATASET_REPEATS = 64
"""The held-out prompts repeat this many times in the dataset file (passes take as many requests as they need)."""
PROFILED_STEPS = 400
"""Engine steps a profiled pass records (``--profile-at``): enough for steady state, a trace of tens of MB."""


def speculative_config(config: str, drafter: Path) -> dict[str, Any] | None:
    """``nospec``, ``chain-K`` (vLLM's dflash, K drafts), ``vllmchain-K`` (the same with no vLLM plugin loaded:
    vLLM as its users have it without this one), ``ddtree-B`` (fixed budget B), ``adaptive-B``, ``plain-B``
    (adaptive B with every step forced to verify no drafts: what speculation's machinery costs by itself)."""
    if config == "nospec":
        return None
    name, _, number = config.partition("-")
    if name not in ("chain", "vllmchain", "ddtree", "adaptive", "plain") or not number.isdigit():
        raise SystemExit(
            f"unknown config {config!r}: use nospec, chain-K, vllmchain-K, ddtree-B, adaptive-B or plain-B"
        )
    spec: dict[str, Any] = {
        "method": "dflash" if name in ("chain", "vllmchain") else "ddtree",
        "model": str(drafter),
        "num_speculative_tokens": int(number),
    }
    if name == "ddtree":
        spec["adaptive_budget"] = False
    return spec


def profiler_config(trace_dir: Path) -> dict[str, Any]:
    """vLLM's torch profiler for one profiled pass: worker traces only, no Python stacks, at most 400 steps."""
    return {
        "profiler": "torch",
        "torch_profiler_dir": str(trace_dir.resolve()),
        "torch_profiler_with_stack": False,
        "torch_profiler_dump_cuda_time_total": False,
        "ignore_frontend": True,
        "max_iterations": PROFILED_STEPS,
    }


def server_args(pair: str, config: str, gpu: bool, tuned: bool, trace_dir: Path | None = None,
                sharing: int = 1) -> list[str]:  # fmt: skip
    """vLLM's defaults except the dtype (bf16 on a GPU, as the models are; float32 on vLLM-CPU); ``trace_dir`` adds
    vLLM's profiler (its ``/start_profile`` endpoint) writing there; ``sharing`` servers on one GPU each take
    1/``sharing`` of vLLM's default memory share and a fixed KV cache."""
    target, drafter = (MODELS / name for name in PAIRS[pair])
    args = ["--model", str(target), "--served-model-name", SERVED, "--dtype", "bfloat16" if gpu else "float32"]
    spec = speculative_config(config, drafter)
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec)]
    if not gpu:
        args += ["--max-num-seqs", "8", "--gpu-memory-utilization", "0.3"]
    elif sharing > 1:
        args += ["--gpu-memory-utilization", f"{0.9 / sharing:.3f}", "--kv-cache-memory-bytes",
                 str(SHARED_GPU_KV_CACHE_BYTES)]  # fmt: skip
    if trace_dir is not None:
        args += ["--profiler-config", json.dumps(profiler_config(trace_dir))]
    return args + (TUNED if tuned else [])


def server_env(config: str, gpu: bool) -> dict[str, str] | None:
    """Environment of a config's server beyond this process's: on a GPU vLLM's chain runs on Model Runner V2, as
    ddtree does (vLLM's own default for the DeepSeek-architecture MLA target is V1); ``vllmchain`` loads no
    plugin; ``plain`` forces the adaptive budget to 0 every step."""
    env = {"VLLM_USE_V2_MODEL_RUNNER": "1"} if gpu and config.startswith(("chain", "vllmchain")) else {}
    if config.startswith("vllmchain"):
        env["VLLM_PLUGINS"] = ""
    if config.startswith("plain"):
        env["VLLM_DDTREE_ADAPTIVE_FORCE"] = "0"
    return env or None


def write_dataset(pair: str, path: Path) -> int:
    """The held-out prompts as text (vLLM's custom dataset: one ``{"prompt": ...}`` per line), repeated."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODELS / PAIRS[pair][0]))
    prompts = [tokenizer.decode(ids) for ids in json.loads(PROMPTS.read_text())]
    with path.open("w") as f:
        for _ in range(DATASET_REPEATS):
            for prompt in prompts:
                f.write(json.dumps({"prompt": prompt}) + "\n")
    return len(prompts) * DATASET_REPEATS


def bench_pass(url: str, pair: str, dataset: Path, num_prompts: int, concurrency: int, output_len: int,
               profile: bool = False) -> dict[str, Any]:  # fmt: skip
    """One run of ``vllm bench serve`` (``profile``: under vLLM's profiler); its result JSON. The client is vLLM's
    own, called in this process as its subcommand calls it: a fresh client process would import vLLM again for
    every pass (~20 s on a slow host, longer than many passes). vllm-cpu's ``vllm`` CLI cannot run it anyway: it
    looks up a distribution named vllm and stops."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = [
        "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", SERVED, "--tokenizer", str(MODELS / PAIRS[pair][0]),
        "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
        "--custom-output-len", str(output_len), "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
        "--disable-tqdm",
    ] + (["--profile"] if profile else [])  # fmt: skip
    printed = io.StringIO()
    try:
        with redirect_stdout(printed), redirect_stderr(printed):
            return bench_serve(parser.parse_args(argv))
    except Exception as err:
        raise RuntimeError(f"vllm bench serve failed ({err!r}): {printed.getvalue()[-3000:]}") from err


def size_passes(url: str, pair: str, dataset: Path, size: int, concurrency: int, args: argparse.Namespace) -> int:
    """One warm-up pass; the number of prompts that makes a timed pass last ``min_seconds``."""
    warm_prompts = min(size, max(2 * concurrency, 16))
    warm = bench_pass(url, pair, dataset, warm_prompts, concurrency, args.output_len)
    per_request = max(warm["duration"], 1e-3) / max(warm["completed"], 1)
    wanted = math.ceil(1.25 * args.min_seconds / per_request)
    return min(size, max(wanted, 2 * concurrency, 16))


def summarize_cell(concurrency: int, num_prompts: int, passes: list[dict[str, Any]],
                   delta: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    """Median tok/s and spread of the timed passes; acceptance from the ``/metrics`` counters around them."""
    from vllm_ddtree.launch import mean_acceptance_length

    tok_s = [p["output_throughput"] for p in passes]
    median = statistics.median(tok_s)
    return {
        "concurrency": concurrency,
        "num_prompts": num_prompts,
        "output_tok_s": [round(t, 1) for t in tok_s],
        "median_tok_s": round(median, 1),
        "spread": round((max(tok_s) - min(tok_s)) / median, 3) if median else None,
        "seconds": [round(p["duration"], 2) for p in passes],
        "median_tpot_ms": round(statistics.median(p["median_tpot_ms"] for p in passes), 3),
        "median_ttft_ms": round(statistics.median(p["median_ttft_ms"] for p in passes), 3),
        "failed": sum(p.get("failed", 0) for p in passes),
        "acceptance_length": mean_acceptance_length(delta) if delta.get("num_drafts") else None,
        "draft_tokens_per_draft": round(delta["num_draft_tokens"] / delta["num_drafts"], 2)
        if delta.get("num_drafts")
        else None,
    }


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def measure_concurrency(url: str, pair: str, dataset: Path, size: int, concurrency: int,
                        args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """Warm-up pass, then timed passes sized from it to last ``min_seconds`` each; acceptance over the timed ones."""
    from vllm_ddtree.launch import spec_decode_counters

    num_prompts = size_passes(url, pair, dataset, size, concurrency, args)
    before = spec_decode_counters(url)
    passes = [bench_pass(url, pair, dataset, num_prompts, concurrency, args.output_len) for _ in range(args.passes)]
    return summarize_cell(concurrency, num_prompts, passes, counter_delta(before, spec_decode_counters(url)))


def profile_pass(url: str, pair: str, dataset: Path, num_prompts: int, concurrency: int, args: argparse.Namespace,
                 trace_dir: Path) -> dict[str, Any]:  # fmt: skip
    """One more pass at ``concurrency`` under vLLM's profiler (not among the timed passes): the summary of the
    worker's trace (``trace_summary``), which is then deleted."""
    from trace_summary import load_trace, summarize

    bench_pass(url, pair, dataset, num_prompts, concurrency, args.output_len, profile=True)
    deadline = time.time() + 300
    while time.time() < deadline:  # the worker writes the trace after /stop_profile answers
        traces = sorted(trace_dir.glob("**/*.pt.trace.json*"), key=lambda p: p.stat().st_mtime)
        if traces and time.time() - traces[-1].stat().st_mtime > 5:
            summary = summarize(load_trace(traces[-1]))
            for t in traces:
                t.unlink()
            return summary
        time.sleep(2)
    raise RuntimeError(f"no profiler trace under {trace_dir} 300 s after the profiled pass")


def run_config(pair: str, config: str, series: str, args: argparse.Namespace, gpu: bool, workdir: Path,
               dataset: Path, size: int, records: list[dict[str, Any]], save: Callable[[], None]) -> None:  # fmt: skip
    """One server for ``config``, every concurrency in turn; its record joins ``records`` at once and ``save`` runs
    after every cell, so a run cut off by a job's timeout keeps the cells it finished."""
    from trace_summary import render

    from vllm_ddtree.launch import openai_server

    log = (args.logs or workdir) / f"server-{pair}-{config}-{series}.log"
    record: dict[str, Any] = {"pair": pair, "config": config, "series": series, "cells": []}
    records.append(record)
    trace_dir = workdir / f"traces-{pair}-{config}-{series}" if args.profile_at else None
    start = time.time()
    try:
        served = server_args(pair, config, gpu, series == "tuned", trace_dir)
        with openai_server(served, env=server_env(config, gpu), timeout_s=1200, log_path=str(log)) as url:
            record["startup_s"] = round(time.time() - start, 1)
            for c in args.concurrency:
                cell = measure_concurrency(url, pair, dataset, size, c, args)
                if c == args.profile_at:
                    cell["profile"] = profile_pass(url, pair, dataset, cell["num_prompts"], c, args, trace_dir)
                    (args.logs or workdir).joinpath(f"profile-{pair}-{config}-{series}-c{c}.txt").write_text(
                        render(cell["profile"]) + "\n"
                    )
                record["cells"].append(cell)
                save()
                print(f"  {pair} {config} {series} c{c}: {cell['median_tok_s']} tok/s (spread {cell['spread']}, "
                      f"acceptance {cell['acceptance_length']})", flush=True)  # fmt: skip
    except Exception as err:  # one config failing must not lose the others' numbers
        record["error"] = f"{type(err).__name__}: {err}"[-2000:]
        record["log_tail"] = log.read_text()[-4000:] if log.exists() else ""
        print(f"  {pair} {config} {series}: FAILED {record['error'][:300]}", flush=True)
    save()


def run_interleaved(pairs: list[str], configs: list[str], series: str, args: argparse.Namespace, gpu: bool,
                    workdir: Path, datasets: dict[str, tuple[Path, int]], out: list[dict[str, Any]],
                    save: Callable[[], None]) -> None:  # fmt: skip
    """Every pair's and config's server up side by side, all started at once (an idle server costs under 1 % of a
    core; on a GPU they share its memory, ``server_args``' ``sharing``), and at each concurrency the timed passes of
    a pair's configs alternate, the order rotating every round: a machine whose speed drifts over minutes (a shared
    2-core VM) slows every config alike instead of whichever ran then. The records join ``out`` at once; ``save``
    runs after every concurrency."""
    from contextlib import ExitStack

    from vllm_ddtree.launch import openai_server_process, spec_decode_counters, wait_healthy

    keys = [(pair, config) for pair in pairs for config in configs]
    records = {(p, c): {"pair": p, "config": c, "series": series, "interleaved": True, "cells": []} for p, c in keys}
    out.extend(records[k] for k in keys)
    urls: dict[tuple[str, str], str] = {}
    with ExitStack() as servers:
        begin = time.time()
        started = {}
        for key in keys:
            served = server_args(*key, gpu, series == "tuned", sharing=len(keys))
            log = (args.logs or workdir) / f"server-{key[0]}-{key[1]}-{series}.log"
            env = server_env(key[1], gpu)
            started[key] = (
                log,
                servers.enter_context(openai_server_process(served, env, log_path=str(log), wait=False)),
            )
        for key, (log, (url, proc)) in started.items():
            try:
                wait_healthy(url, proc, max(1200 - (time.time() - begin), 1))
                urls[key] = url
                records[key]["startup_s"] = round(time.time() - begin, 1)
            except Exception as err:  # one config failing must not lose the others' numbers
                records[key]["error"] = f"{type(err).__name__}: {err}"[-2000:]
                records[key]["log_tail"] = log.read_text()[-4000:] if log.exists() else ""
                print(f"  {key[0]} {key[1]} {series}: FAILED {records[key]['error'][:300]}", flush=True)
        for pair in pairs:
            dataset, size = datasets[pair]
            live = [c for c in configs if (pair, c) in urls]
            for c in args.concurrency:
                sizes = {k: size_passes(urls[pair, k], pair, dataset, size, c, args) for k in live}
                before = {k: spec_decode_counters(urls[pair, k]) for k in live}
                passes: dict[str, list[dict[str, Any]]] = {k: [] for k in live}
                for round_ in range(args.passes):
                    for k in live[round_ % len(live) :] + live[: round_ % len(live)]:
                        passes[k].append(bench_pass(urls[pair, k], pair, dataset, sizes[k], c, args.output_len))
                for k in live:
                    cell = summarize_cell(
                        c, sizes[k], passes[k], counter_delta(before[k], spec_decode_counters(urls[pair, k]))
                    )
                    records[pair, k]["cells"].append(cell)
                    print(f"  {pair} {k} {series} c{c}: {cell['median_tok_s']} tok/s (spread {cell['spread']}, "
                          f"acceptance {cell['acceptance_length']})", flush=True)  # fmt: skip
                save()


def is_baseline(config: str) -> bool:
    """No speculation and vLLM's chain: what ddtree is measured against."""
    return config == "nospec" or config.startswith(("chain", "vllmchain"))


def best_baseline(records: list[dict[str, Any]], pair: str, series: str) -> dict[int, dict[str, Any]]:
    """The cell of max(chain, no speculation) per concurrency (its record's ``interleaved`` flag copied in): what
    ddtree must beat."""
    best: dict[int, dict[str, Any]] = {}
    for r in records:
        if r["pair"] == pair and r["series"] == series and is_baseline(r["config"]):
            for cell in r["cells"]:
                c = cell["concurrency"]
                if c not in best or cell["median_tok_s"] > best[c]["median_tok_s"]:
                    best[c] = {**cell, "interleaved": r.get("interleaved", False)}
    return best


def paired_ratio(tok_s: list[float], baseline_tok_s: list[float]) -> float:
    """Median over rounds of one config's pass over the baseline's pass of the same round (interleaved runs: the
    two ran minutes apart at most, so a machine's drift cancels out of each ratio)."""
    return statistics.median(a / b for a, b in zip(tok_s, baseline_tok_s, strict=False) if b > 0)


def table(records: list[dict[str, Any]], concurrency: list[int]) -> str:
    """Median tok/s per config and concurrency, and each ddtree row's ratio to max(chain, no speculation) (and,
    where both were interleaved, the median of their per-round ratios)."""
    lines = [f"| pair | series | config | {' | '.join(f'c{c}' for c in concurrency)} |",
             f"|---|---|---|{'---|' * len(concurrency)}"]  # fmt: skip
    for r in records:
        cells = {cell["concurrency"]: cell for cell in r["cells"]}
        best = best_baseline(records, r["pair"], r["series"])
        out = []
        for c in concurrency:
            cell = cells.get(c)
            if cell is None:
                out.append("—")
                continue
            text = f"{cell['median_tok_s']:,.0f}"
            base = best.get(c)
            if not is_baseline(r["config"]) and base and base["median_tok_s"]:
                text += f" ({cell['median_tok_s'] / base['median_tok_s']:.2f}×"
                if r.get("interleaved") and base["interleaved"]:
                    text += f"; paired {paired_ratio(cell['output_tok_s'], base['output_tok_s']):.2f}×"
                text += ")"
            out.append(text)
        lines.append(f"| {r['pair']} | {r['series']} | {r['config']} | {' | '.join(out)} |")
    return "\n".join(lines)


def plot(path: Path) -> Path:
    """tok/s vs concurrency, one line per config, one panel per pair and series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    panels = sorted({(r["pair"], r["series"]) for r in data["records"]})
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (pair, series) in zip(axes[0], panels, strict=True):
        for r in data["records"]:
            if (r["pair"], r["series"]) != (pair, series) or not r["cells"]:
                continue
            cells = sorted(r["cells"], key=lambda c: c["concurrency"])  # a sweep may run them in any order
            ax.plot(
                [c["concurrency"] for c in cells], [c["median_tok_s"] for c in cells], marker="o", label=r["config"]
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (vllm bench serve --max-concurrency)")
        ax.set_ylabel("output tok/s (median of passes)")
        gpu = data["meta"].get("gpu")
        ax.set_title(f"{pair} pair, {series} vllm serve, {'vLLM-CPU' if gpu in (None, 'none') else gpu}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    return png


def merge(paths: list[Path], out: Path | None) -> int:
    """Runs of the same sweep split into jobs (one config each, as on a lent GPU): one report, each record keeping
    the meta of the run that measured it."""
    runs = [json.loads(p.read_text()) for p in paths]
    records = [{**r, "meta": run["meta"]} for run in runs for r in run["records"]]
    report = {"meta": runs[0]["meta"], "settings": runs[0]["settings"], "records": records}
    concurrency = sorted({c["concurrency"] for r in records for c in r["cells"]})
    if out:
        out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(records, concurrency))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="+", default=["mla", "gqa"], choices=sorted(PAIRS))
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 64, 128])
    parser.add_argument("--passes", type=int, default=3, help="timed passes per concurrency (median and spread)")
    parser.add_argument("--min-seconds", type=float, default=10.0, help="each timed pass lasts at least this long")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--profile-at",
        type=int,
        help="after this concurrency's passes, one pass under vLLM's "
        "profiler; its trace summary goes into the cell and the logs",
    )
    parser.add_argument("--tuned", action="store_true", help="add the repo's tuned settings as a second series")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="start every server at once, keep them up side by side and alternate their timed passes (a drifting "
        "machine slows all configs alike; one start-up for all; on a GPU each server takes 0.9/n of its memory and a "
        "fixed KV cache)",
    )
    parser.add_argument("--out", type=Path, help="JSON to write (and update after every config)")
    parser.add_argument("--logs", type=Path, help="keep each server's log in this folder (default: discarded)")
    parser.add_argument("--plot", type=Path, help="only draw the PNG of an existing sweep JSON")
    parser.add_argument("--merge", nargs="+", type=Path, help="only merge sweep JSONs (one run each) into --out")
    args = parser.parse_args()
    if args.plot:
        print(plot(args.plot))
        return 0
    if args.merge:
        return merge(args.merge, args.out)
    for config in args.configs:
        speculative_config(config, Path("."))
    if args.interleave and args.profile_at:
        raise SystemExit("--profile-at profiles one server at a time; run it without --interleave")

    import torch
    from meta import repo_path, run_meta

    # A job runner's timeout sends SIGTERM: leave through the server's context manager, which stops the server (its
    # own process group) instead of leaving it holding the GPU for the next config.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the client in this process reads the local tokenizer only
    gpu = torch.cuda.is_available()
    series = ["default", "tuned"] if args.tuned else ["default"]
    where = {k: repo_path(v) if v else None for k, v in (("out", args.out), ("logs", args.logs))}
    settings = {**vars(args), **where, "plot": None, "merge": None}
    report: dict[str, Any] = {"meta": run_meta(), "settings": settings}
    report["records"] = records = []
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(report, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        datasets = {}
        for pair in args.pairs:
            datasets[pair] = (workdir / f"{pair}.jsonl", write_dataset(pair, workdir / f"{pair}.jsonl"))
        for s in series:
            if args.interleave:
                run_interleaved(args.pairs, args.configs, s, args, gpu, workdir, datasets, records, save)
                continue
            for pair in args.pairs:
                for config in args.configs:
                    run_config(pair, config, s, args, gpu, workdir, *datasets[pair], records, save)
    print(table(records, sorted(args.concurrency)))
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
