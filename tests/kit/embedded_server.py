"""The vLLM-CPU server set-up the client-facing engine tests share: the embedded GQA pair, float32, budget 15, and the
scheduler limits of issue 39's reproductions."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "models" / "stdlib-qwen3-tiny"
DRAFTER = ROOT / "models" / "stdlib-qwen3-tiny-dflash"
MAX_MODEL_LEN = 512
BUDGET = 15
# vLLM-CPU checks that this fraction of the NUMA node's memory is free at startup (the KV cache itself is
# VLLM_CPU_KVCACHE_SPACE); a low one lets the server start beside the reference engine and other tests.
MEMORY_FRACTION = 0.3
ENGINE = [
    "--dtype",
    "float32",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "512",
    "--seed",
    "0",
    "--gpu-memory-utilization",
    str(MEMORY_FRACTION),
]
# Every step verifies the whole tree: on vLLM-CPU the adaptive budget would mostly verify none, and these tests are
# about what clients can do to tree steps (tests/engine/test_adaptive_cpu.py covers the adaptive budget).
SPEC = {"method": "ddtree", "model": str(DRAFTER), "num_speculative_tokens": BUDGET, "adaptive_budget": False}
