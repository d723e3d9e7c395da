"""Shared set-up of the vLLM-CPU engine tests: the engine environment, and the random-weight tiny pair."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module", autouse=True)
def cpu_engine_env() -> None:
    """A 1 GiB KV cache, no hub, and pickled probes through ``collective_rpc`` (the tests read worker state)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A random-weight Qwen3 target and a DFlash drafter of block 8 (no tokenizer: token-id prompts)."""
    from kit import tiny_models

    root = tmp_path_factory.mktemp("tiny_pair")
    return tiny_models.write_target(root / "target"), tiny_models.write_dflash_drafter(root / "drafter", block_size=8)
