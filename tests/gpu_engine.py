"""Helpers for in-process vLLM engines in the GPU end-to-end tests: prompts, generation, graph-replay counting."""

from __future__ import annotations

import gc
import os
import random

MAX_TOKENS = 32


def in_process() -> None:
    """Run the engine core in the test's process, so tests can reach the model runner itself."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def prompts(n: int = 50) -> list[dict]:
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.choice(range(2, 1000)) for _ in range(rng.randint(3, 60))]} for _ in range(n)]


def generate(llm, batch_prompts: list[dict], batch: int, **params) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **params})
    out: list[list[int]] = []
    for i in range(0, len(batch_prompts), batch):
        chunk = batch_prompts[i : i + batch]
        out += [list(o.outputs[0].token_ids) for o in llm.generate(chunk, sp, use_tqdm=False)]
    return out


def generate_once(model: str, batch_prompts: list[dict], batch: int, engine: dict, **params) -> list[list[int]]:
    """``generate`` on a fresh engine that is freed before returning (in-process engines must not overlap)."""
    from vllm import LLM

    llm = LLM(model=model, **engine)
    out = generate(llm, batch_prompts, batch, **params)
    del llm
    free()
    return out


def runner(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


class ReplayCounter:
    """Counts FULL-graph replays of a CUDA-graph manager instance (wraps its bound ``run_fullgraph``)."""

    def __init__(self, manager) -> None:
        self.count = 0
        run = manager.run_fullgraph

        def counted(*args, **kwargs):
            self.count += 1
            return run(*args, **kwargs)

        manager.run_fullgraph = counted


def free() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()
