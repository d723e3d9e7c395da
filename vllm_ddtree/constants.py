"""Numbers that the plugin's Python code and its kernels must agree on, each defined once.

The draft tree: every node carries one int64 ancestor word (bit ``j`` set iff node ``j`` is an ancestor-or-self),
so a tree holds at most 64 tokens, the root included, and the config caps the node budget at 63. The MLA geometry:
the tree-verify kernels are built for DeepSeek-V3 / Kimi-K2's latent cache rows (512 latent + 64 rope dims).

The CUDA sources mirror these in ``kernels/csrc/params.h`` (with ``static_assert``s on how they relate);
``tests/test_constants.py`` parses that header and checks every mirror against this module.
"""

from __future__ import annotations

ANCESTOR_WORD_BITS = 64
"""Bits of one ancestor-mask word (one int64 per tree node)."""
MAX_TREE_WIDTH = ANCESTOR_WORD_BITS
"""Tokens of a draft tree, root included: one word per node holds the whole tree."""
MAX_TREE_BUDGET = MAX_TREE_WIDTH - 1
"""Draft nodes of a tree, root excluded (the largest ``num_speculative_tokens``)."""

MLA_KV_LORA_RANK = 512
"""MLA latent width: the absorbed query's ``q_nope``, the value and the output dims."""
MLA_ROPE_DIM = 64
"""MLA rope dims of the query (``q_pe``) and of each cache row."""
MLA_HEAD_DIM = MLA_KV_LORA_RANK + MLA_ROPE_DIM
"""One latent cache row (and FlashMLA's packed query): latent then rope dims, 576."""

LOG2E = 1.4426950408889634
"""log2(e): the kernels run their softmax in base 2 and scale scores by this."""
