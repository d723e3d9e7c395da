"""Where a served step's time goes: a short summary of a vLLM worker's torch-profiler trace (Chrome trace JSON).

``vllm serve --profiler-config '{"profiler": "torch", ...}'`` writes one trace per profiled range; vLLM annotates
each engine step ``execute_context_N(T)_generation_M(G)`` (N prefilling requests with T tokens, M decoding requests
with G tokens). The summary splits steps into decode-only and mixed (prefill + decode) and gives, per kind, how many
there were, the median step period (one annotation's start to the next) and the GPU kernel time inside; then the
GPU's busy share of the whole range, the kernels that took the most GPU time, and the host API calls that launch
work or wait for it (graph replays vs single kernel launches, synchronisations).

    python bench/trace_summary.py TRACE.json.gz [--top 15]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
LAUNCH_CALLS = ("cudaGraphLaunch", "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
WAIT_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def load_trace(path: Path) -> list[dict[str, Any]]:
    """The trace's complete events (``ph == "X"``) of a ``.json`` or ``.json.gz`` file."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarize(events: list[dict[str, Any]], top: int = 15) -> dict[str, Any]:
    """The summary described in the module docstring; times in milliseconds."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    steps = sorted((e for e in events if e.get("cat") == "user_annotation" and STEP.fullmatch(e["name"])),
                   key=lambda e: e["ts"])  # fmt: skip
    gpu_steps = sorted((e for e in events if e.get("cat") == "gpu_user_annotation" and STEP.fullmatch(e["name"])),
                       key=lambda e: e["ts"])  # fmt: skip
    kernel_starts = sorted(k["ts"] for k in kernels)
    kernel_by_start = sorted(kernels, key=lambda k: k["ts"])
    prefix = [0.0]
    for k in kernel_by_start:
        prefix.append(prefix[-1] + k["dur"])

    def kernel_time(start: float, end: float) -> float:
        i, j = bisect.bisect_left(kernel_starts, start), bisect.bisect_left(kernel_starts, end)
        return prefix[j] - prefix[i]

    kinds: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for step, nxt in zip(steps, steps[1:], strict=False):
        ctx_reqs, ctx_tokens, gen_reqs, gen_tokens = map(int, STEP.fullmatch(step["name"]).groups())
        kind = "mixed" if ctx_reqs else "decode"
        kinds[kind]["period_ms"].append((nxt["ts"] - step["ts"]) / 1e3)
        kinds[kind]["tokens"].append(ctx_tokens + gen_tokens)
        kinds[kind]["requests"].append(ctx_reqs + gen_reqs)
    for step in gpu_steps:  # the GPU's own span of each step, where the profiler records it
        ctx_reqs = int(STEP.fullmatch(step["name"]).group(1))
        kind = "mixed" if ctx_reqs else "decode"
        kinds[kind]["gpu_span_ms"].append(step["dur"] / 1e3)
        kinds[kind]["gpu_kernel_ms"].append(kernel_time(step["ts"], step["ts"] + step["dur"]) / 1e3)

    def med(values: list[float]) -> float | None:
        return round(statistics.median(values), 3) if values else None

    total_period = max(sum(sum(v["period_ms"]) for v in kinds.values()), 1e-9)
    step_kinds = {
        kind: {
            "steps": len(v["period_ms"]),
            "median_period_ms": med(v["period_ms"]),
            "median_tokens": med(v["tokens"]),
            "median_requests": med(v["requests"]),
            "median_gpu_span_ms": med(v["gpu_span_ms"]),
            "median_gpu_kernel_ms": med(v["gpu_kernel_ms"]),
            "share_of_time": round(sum(v["period_ms"]) / total_period, 3),
        }
        for kind, v in sorted(kinds.items())
    }
    span = (steps[-1]["ts"] - steps[0]["ts"]) if len(steps) > 1 else 0.0
    first, last = (steps[0]["ts"], steps[-1]["ts"]) if steps else (float("-inf"), float("inf"))
    in_span = [(k["ts"], k["ts"] + k["dur"]) for k in kernels if first <= k["ts"] < last]
    by_name: dict[str, list[float]] = defaultdict(list)
    for k in kernels:
        by_name[k["name"]].append(k["dur"])
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    calls: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver":
            name = e["name"]
            if name.startswith(LAUNCH_CALLS) or name.startswith(WAIT_CALLS):
                calls[name].append(e["dur"])
    return {
        "steps": step_kinds,
        "span_ms": round(span / 1e3, 1),
        "gpu_busy_share": round(_busy(in_span) / span, 3) if span else None,
        "top_kernels": [
            {
                "name": name[:120],
                "count": len(d),
                "total_ms": round(sum(d) / 1e3, 2),
                "mean_us": round(sum(d) / len(d), 1),
            }
            for name, d in ranked  # fmt: skip
        ],
        "host_calls": {
            name: {"count": len(d), "total_ms": round(sum(d) / 1e3, 2)} for name, d in sorted(calls.items())
        },
    }


def render(summary: dict[str, Any]) -> str:
    """The summary as a few text lines."""
    lines = [f"span {summary['span_ms']} ms, GPU busy {summary['gpu_busy_share']}"]
    for kind, s in summary["steps"].items():
        lines.append(
            f"  {kind}: {s['steps']} steps ({s['share_of_time']:.0%} of time), period {s['median_period_ms']} ms, "
            f"{s['median_tokens']} tokens / {s['median_requests']} requests, GPU span {s['median_gpu_span_ms']} ms, "
            f"kernels {s['median_gpu_kernel_ms']} ms"
        )
    lines.append("  host calls: " + ", ".join(f"{n} {c['count']} ({c['total_ms']} ms)" for n, c in
                                             summary["host_calls"].items()))  # fmt: skip
    for k in summary["top_kernels"]:
        lines.append(f"  {k['total_ms']:9.2f} ms {k['count']:7d}x {k['mean_us']:8.1f} us  {k['name']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    print(render(summarize(load_trace(args.trace), args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
