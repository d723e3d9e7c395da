"""``bench/serve_sweep.py``: its table — each ddtree cell's ratio to max(chain, no speculation), and for interleaved
runs the median of the per-round ratios (a drifting machine slows both passes of a round alike) — and the arguments
and environment of the servers (several on one GPU; vLLM's chain on Model Runner V2)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from serve_sweep import best_baseline, paired_ratio, table  # noqa: E402


def _record(config: str, passes: dict[int, list[float]], interleaved: bool = True) -> dict:
    cells = [
        {"concurrency": c, "output_tok_s": tok_s, "median_tok_s": sorted(tok_s)[len(tok_s) // 2]}
        for c, tok_s in passes.items()
    ]
    return {"pair": "gqa", "series": "default", "config": config, "interleaved": interleaved, "cells": cells}


def test_paired_ratio_cancels_drift_that_the_ratio_of_medians_keeps() -> None:
    baseline = [100.0, 50.0, 200.0]  # the machine halves, then quadruples its speed between rounds
    ddtree = [90.0, 45.0, 20.0]  # 0.9x in the first two rounds, then one pass stalls
    assert paired_ratio(ddtree, baseline) == 0.9
    assert sorted(ddtree)[1] / sorted(baseline)[1] == 0.45


def test_table_prints_both_ratios_against_the_better_baseline() -> None:
    records = [
        _record("nospec", {1: [100.0, 100.0, 100.0], 16: [400.0, 200.0, 400.0]}),
        _record("chain-7", {1: [150.0, 150.0, 150.0]}, interleaved=False),
        _record("adaptive-15", {1: [300.0, 300.0, 300.0], 16: [360.0, 180.0, 360.0]}),
    ]
    best = best_baseline(records, "gqa", "default")
    assert best[1]["median_tok_s"] == 150.0 and not best[1]["interleaved"] and best[16]["interleaved"]
    lines = table(records, [1, 16]).splitlines()
    adaptive = next(line for line in lines if "adaptive-15" in line)
    assert "300 (2.00×) |" in adaptive  # against the chain, which did not run interleaved: no paired ratio
    assert "360 (0.90×; paired 0.90×)" in adaptive


def test_servers_sharing_one_gpu_split_its_memory_and_fix_their_kv_cache() -> None:
    from serve_sweep import SHARED_GPU_KV_CACHE_BYTES, server_args

    alone = server_args("mla", "adaptive-15", gpu=True, tuned=False)
    assert "--gpu-memory-utilization" not in alone and "--kv-cache-memory-bytes" not in alone  # vLLM's defaults
    shared = server_args("mla", "adaptive-15", gpu=True, tuned=False, sharing=6)
    assert shared[shared.index("--gpu-memory-utilization") + 1] == "0.150"
    assert shared[shared.index("--kv-cache-memory-bytes") + 1] == str(SHARED_GPU_KV_CACHE_BYTES)
    cpu = server_args("gqa", "nospec", gpu=False, tuned=False, sharing=2)
    assert "--kv-cache-memory-bytes" not in cpu and "--speculative-config" not in cpu


def test_vllms_chain_runs_on_model_runner_v2_on_a_gpu() -> None:
    from serve_sweep import server_env

    assert server_env("chain-7", gpu=True) == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert server_env("vllmchain-7", gpu=True) == {"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_PLUGINS": ""}
    assert server_env("nospec", gpu=True) is None and server_env("adaptive-15", gpu=True) is None  # vLLM's / ours
    assert server_env("chain-7", gpu=False) is None and server_env("vllmchain-7", gpu=False) == {"VLLM_PLUGINS": ""}
    assert server_env("plain-15", gpu=False) == {"VLLM_DDTREE_ADAPTIVE_FORCE": "0"}
