"""Numbers that the plugin's Python code and its kernels must agree on, each defined once.

The draft tree: every node carries one int64 ancestor word (bit ``j`` set iff node ``j`` is an ancestor-or-self),
so a tree holds at most 64 tokens, the root included, and the config caps the node budget at 63. The MLA geometry:
the tree-verify kernels are built for DeepSeek-V3 / Kimi-K2's latent cache rows (512 latent + 64 rope dims). The
MLA kernel ids and shared-memory needs: the dispatch (``kernels/mla_dispatch.py``) picks a kernel by what a GPU can
hold and passes its id to the CUDA op.

The CUDA sources mirror these in ``kernels/csrc/params.h`` (with ``static_assert``s on how they relate);
``tests/unit/test_constants.py`` parses that header and checks every mirror against this module.
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

MLA_KERNEL_PORTABLE = 0
"""``ddtree::mla_tree_verify``'s ``kernel`` id of the portable 64-row kernel (<= 99 KB of shared memory a block)."""
MLA_KERNEL_RESIDENT_V = 1
"""Kernel id of the resident-V 64-row kernel (sm_90's ~226 KB a block)."""
MLA_KERNEL_DECODE = 2
"""Kernel id of the 16-row decode kernel (launches of few rows a request; every GPU)."""
MLA_RESIDENT_V_SMEM = 231424
"""Dynamic shared memory of a resident-V CTA, bytes (bf16 and fp8 caches alike)."""
MLA_DECODE_DEEP_SMEM_BF16 = 90112
"""Dynamic shared memory of a decode CTA in its deep configuration (32-key tiles), bf16 cache."""
MLA_DECODE_DEEP_SMEM_FP8 = 108544
"""The same over an fp8 cache (3 ring stages)."""
