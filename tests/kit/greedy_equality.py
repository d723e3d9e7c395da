"""Greedy outputs of two runs whose kernels round differently (bf16): "lossless" means a sequence leaves the
reference only where the reference itself was at a near-tie, i.e. its top two tokens were within ``NEAR_TIE``.

Used by the bf16 GPU tests and by ``bench/acceptance.py``; float32 runs are compared for exact equality instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

NEAR_TIE = 1.0
"""Log-prob gap (nats) under which two bf16 runs may legitimately pick different tokens: logits of ~50 (the tiny
targets) are 0.25 apart in bf16, and two attention kernels accumulate in different orders."""


def top2_gaps(logprobs: Sequence[Mapping[int, Any]]) -> list[float]:
    """Per position of a vLLM completion requested with ``logprobs=2``: best log-prob minus the runner-up's."""
    gaps = []
    for position in logprobs:
        best = sorted((lp.logprob for lp in position.values()), reverse=True)
        gaps.append(best[0] - best[1] if len(best) > 1 else float("inf"))
    return gaps


def greedy_with_gaps(
    llm: Any, prompts: Sequence[Any], params: Any, batch: int
) -> tuple[list[list[int]], list[list[float]]]:
    """The reference side of ``compare_greedy``: ``llm.generate`` over ``prompts`` in batches of ``batch`` with
    ``params`` (greedy, ``logprobs=2``), each sequence's tokens and its per-position ``top2_gaps``."""
    tokens: list[list[int]] = []
    gaps: list[list[float]] = []
    for i in range(0, len(prompts), batch):
        for out in llm.generate(prompts[i : i + batch], params, use_tqdm=False):
            tokens.append(list(out.outputs[0].token_ids))
            gaps.append(top2_gaps(out.outputs[0].logprobs))
    return tokens, gaps


def first_divergence(got: Sequence[int], want: Sequence[int]) -> int | None:
    """The first position where ``got`` leaves ``want`` (the shorter one's length if one is a prefix of the other),
    None if they are equal."""
    first = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if first is None and len(got) != len(want):
        first = min(len(got), len(want))
    return first


def divergent_sequences(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]]) -> list[int]:
    """Indices of the sequences of ``got`` that leave ``want`` anywhere."""
    return [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if first_divergence(g, w) is not None]


@dataclass
class GreedyComparison:
    """How ``got`` compares with the reference ``want``, sequence by sequence."""

    identical: int = 0
    near_tie_gaps: list[float] = field(default_factory=list)  # the reference's gap where a sequence first diverged
    clear_divergences: list[tuple[int, int, float]] = field(default_factory=list)  # (sequence, position, gap)

    @property
    def lossless(self) -> bool:
        return not self.clear_divergences


def compare_greedy(
    got: Sequence[Sequence[int]],
    want: Sequence[Sequence[int]],
    gaps: Sequence[Sequence[float]],
    near_tie: float = NEAR_TIE,
) -> GreedyComparison:
    """Find each sequence's first divergence from the reference and classify it by the reference's gap there."""
    result = GreedyComparison()
    for i, (g, w, m) in enumerate(zip(got, want, gaps, strict=True)):
        first = first_divergence(g, w)
        if first is None:
            result.identical += 1
        elif first < len(m) and m[first] < near_tie:
            result.near_tie_gaps.append(round(m[first], 3))
        else:
            result.clear_divergences.append((i, first, round(m[first], 3) if first < len(m) else float("inf")))
    return result
