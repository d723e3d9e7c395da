"""``bench/trace_summary.py`` on a synthetic trace: step kinds and periods, GPU time inside steps, busy share,
kernel ranking and host calls."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from trace_summary import load_trace, summarize  # noqa: E402


def _trace() -> list[dict]:
    events = []
    decode, mixed = "execute_context_0(0)_generation_4(64)", "execute_context_1(100)_generation_3(48)"
    for i, name in enumerate([decode, mixed, decode, decode]):
        start = i * 10_000.0  # a step every 10 ms
        events.append({"ph": "X", "cat": "user_annotation", "name": name, "ts": start, "dur": 500.0})
        events.append({"ph": "X", "cat": "gpu_user_annotation", "name": name, "ts": start + 100, "dur": 2_000.0})
        events.append({"ph": "X", "cat": "kernel", "name": "gemm", "ts": start + 200, "dur": 1_000.0})
        events.append({"ph": "X", "cat": "kernel", "name": "attn", "ts": start + 1_300, "dur": 500.0})
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": start + 50, "dur": 10.0})
    events.append({"ph": "i", "cat": "kernel", "name": "marker", "ts": 0.0})  # not a complete event: ignored
    return events


def test_summary_of_a_synthetic_trace(tmp_path: Path) -> None:
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    summary = summarize(load_trace(path), top=1)
    decode, mixed = summary["steps"]["decode"], summary["steps"]["mixed"]
    assert decode["steps"] == 2 and mixed["steps"] == 1  # the last step has no successor: no period
    assert decode["median_period_ms"] == mixed["median_period_ms"] == 10.0
    assert mixed["median_tokens"] == 148 and decode["median_gpu_kernel_ms"] == 1.5
    assert summary["span_ms"] == 30.0 and summary["gpu_busy_share"] == 0.15  # 1.5 ms of kernels per 10 ms
    assert summary["top_kernels"] == [{"name": "gemm", "count": 4, "total_ms": 4.0, "mean_us": 1000.0}]
    assert summary["host_calls"] == {"cudaGraphLaunch": {"count": 4, "total_ms": 0.04}}
