"""Helpers for in-process vLLM engines in the GPU end-to-end tests: prompts, generation, graph-replay counting (the
CPU end-to-end tests share the prompt sets)."""

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


def shared_prefix_prompts(n: int = 16) -> list[dict]:
    """Prompts of 160-300 tokens whose first 160 are shared: with small step budgets each is prefilled in chunks
    beside other requests' decodes, and every request after the first finds its prefix cached."""
    rng = random.Random(1)
    shared = [rng.choice(range(2, 1000)) for _ in range(160)]
    return [
        {"prompt_token_ids": shared + [rng.choice(range(2, 1000)) for _ in range(rng.randint(0, 140))]}
        for _ in range(n)
    ]


def generate(llm, batch_prompts: list[dict], batch: int, **params) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **params})
    out: list[list[int]] = []
    for i in range(0, len(batch_prompts), batch):
        chunk = batch_prompts[i : i + batch]
        out += [list(o.outputs[0].token_ids) for o in llm.generate(chunk, sp, use_tqdm=False)]
    return out


def generate_with_margins(llm, batch_prompts: list[dict], batch: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and, per position, the log-prob gap between the chosen token and the runner-up."""
    from vllm import SamplingParams

    from kit.greedy_equality import greedy_with_gaps

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    return greedy_with_gaps(llm, batch_prompts, sp, batch)


def assert_equal_up_to_near_ties(
    label: str, got: list[list[int]], want: list[list[int]], gaps: list[list[float]]
) -> None:
    """bf16 losslessness (``tests/kit/greedy_equality.py``); prints what it saw."""
    from kit.greedy_equality import compare_greedy

    seen = compare_greedy(got, want, gaps)
    print(
        f"{label}: {seen.identical}/{len(want)} identical; {len(seen.near_tie_gaps)} diverge at reference near-ties "
        f"(gaps {sorted(seen.near_tie_gaps)}); {len(seen.clear_divergences)} elsewhere {seen.clear_divergences}"
    )
    assert seen.lossless, f"{label}: diverged where the reference had a clear winner: {seen.clear_divergences}"


def assert_no_more_divergent_than_the_chain(
    label: str, tree: list[list[int]], chain: list[list[int]], want: list[list[int]]
) -> None:
    """bf16 fidelity against vLLM's own chain (issue 36): ddtree's greedy output may leave the target's (``want``,
    no speculation) on at most one sequence more than vLLM's DFlash chain of the same width does; prints both."""
    from kit.greedy_equality import divergent_sequences

    by_tree, by_chain = divergent_sequences(tree, want), divergent_sequences(chain, want)
    print(f"{label}: ddtree leaves the target on {by_tree}, vLLM's chain on {by_chain} (of {len(want)})")
    assert len(by_tree) <= len(by_chain) + 1, f"{label}: ddtree {by_tree} vs the chain {by_chain}"


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


def free() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()
