"""Which rows of a target step the tree backends attend themselves, and which go to vLLM's own prefill attention.

A verify row is at most the verify width long (the node budget + the root, <= 64 tokens); anything longer is a
prefill chunk. Attending prefill chunks on the tree backends is correct (causal words) but rounds differently from
the target's own prefill in bf16, so every prompt would start from a context slightly off the one the target
computes without speculation, and greedy outputs leave the target's more often than vLLM's chain (which prefills on
vLLM's own attention) does. So rows longer than the verify width take vLLM's prefill attention: MLA's prefill path
(``reorder_batch_threshold``), FlashAttention with a causal mask for GQA. Model Runner V2 orders a step's requests
uniform decodes first, then by query length, so the long rows are a suffix of the batch; only requests still
prefilling leave (a verify row is never longer than the width, but that is not left to chance).
``VLLM_DDTREE_PREFILL=ddtree`` keeps every row of up to 64 tokens (GQA: every row) on the tree backends instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_ddtree import envs
from vllm_ddtree.tree_mask import MAX_TREE_WIDTH


def tree_row_limit(vllm_config: Any) -> int | None:
    """The longest query a tree backend attends itself: the verify width (``num_speculative_tokens`` + 1, at most
    64), 1 without speculation; None (no limit but the backend's own) under ``VLLM_DDTREE_PREFILL=ddtree``."""
    if envs.VLLM_DDTREE_PREFILL == "ddtree":
        return None
    spec = vllm_config.speculative_config
    budget = spec.num_speculative_tokens if spec is not None and spec.num_speculative_tokens else 0
    return min(MAX_TREE_WIDTH, budget + 1)


def first_prefill_request(query_start_loc: Sequence[int], limit: int, prefilling: Sequence[bool] | None = None) -> int:
    """The index of the first request whose query is longer than ``limit`` when every request from it on is (and,
    where ``prefilling`` is known, is still prefilling: a verify row never leaves the tree backend); those requests
    take vLLM's prefill attention. Else the number of requests: every row on the tree backend, which is always
    correct, only less faithful to the target's own prefill."""
    lengths = [b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:], strict=True)]
    first = next((i for i, n in enumerate(lengths) if n > limit), len(lengths))

    def leaves(i: int) -> bool:
        return lengths[i] > limit and (prefilling is None or (i < len(prefilling) and bool(prefilling[i])))

    return first if all(leaves(i) for i in range(first, len(lengths))) else len(lengths)
