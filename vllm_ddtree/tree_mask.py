"""Per-process tree masks shared by the runner hook (writer) and the tree-attention backends (readers).

vLLM's ``CommonAttentionMetadata`` has no field for tree data, so the runner hook fills these persistent buffers in
the batch order of the current target step and the attention backend reads them at forward time.
"""

from __future__ import annotations

import torch

MAX_TREE_WIDTH = 64
"""One int64 ancestor word per node: the root plus at most 63 nodes."""


class TreeMaskBuffers:
    """Per-process persistent tree masks in *batch order* of the current target step.

    ``anc_bits[b, i]`` bit ``j`` set means query ``i`` of batch row ``b`` may see the row's tail key ``j`` (the
    ``j``-th of its last ``q_len`` keys). ``active`` is True only while the current step's rows are filled.
    ``token_bits`` (Model Runner V2) holds the same words per token of the step, ``[max_num_tokens]``; CUDA graphs
    capture its address, so it is allocated once (all bits set until the first step writes it).
    """

    def __init__(self, max_num_reqs: int, width: int, device: torch.device, max_num_tokens: int = 0) -> None:
        if not 1 <= width <= MAX_TREE_WIDTH:
            raise ValueError(f"tree width must be 1..{MAX_TREE_WIDTH} (one int64 ancestor word), got {width}")
        self.width = width
        self.anc_bits = torch.zeros(max_num_reqs, width, dtype=torch.int64, device=device)
        self.token_bits = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        self.active = False


_installed: list[TreeMaskBuffers | None] = [None]


def install_tree_masks(buffers: TreeMaskBuffers | None) -> None:
    """Make ``buffers`` the process's tree masks (one model runner per worker process), or clear them with None."""
    _installed[0] = buffers


def current_tree_masks() -> TreeMaskBuffers | None:
    """The installed tree masks, or None when no DDTree runner lives in this process."""
    return _installed[0]


def causal_bits(width: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[width]`` int64 words where row ``i`` has bits ``0..i`` set: the mask of a chain, i.e. plain causal.

    Built from Python ints so row 63 becomes -1 (all 64 bits, sign bit included) without overflowing a shift.
    """
    if not 1 <= width <= MAX_TREE_WIDTH:
        raise ValueError(f"tree width must be 1..{MAX_TREE_WIDTH} (one int64 ancestor word), got {width}")
    words = [(1 << (i + 1)) - 1 for i in range(width)]
    signed = [w - (1 << 64) if w >= 1 << 63 else w for w in words]
    return torch.tensor(signed, dtype=torch.int64, device=device)


def context_key_counts(
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Keys a request's context pass attends for every row (vLLM's FlashAttention / FlashMLA, no mask): every key
    before its last ``q_len`` and the first of those, the tree's root, which every tree row and every causal row
    sees. A root row then needs nothing else and keeps vLLM's kernel's output bit for bit (the kernel and the keys
    of the target's own decode of that token); the tree kernels attend tail keys 1.. only. Requests with ``q_len``
    0 (graph padding) count ``seq_len``."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    return torch.sub(seq_lens, (q_lens - 1).clamp(min=0).to(seq_lens.dtype), out=out)
