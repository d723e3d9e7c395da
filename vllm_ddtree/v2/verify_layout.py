"""Lay out one target verify step of Model Runner V2: depth RoPE positions and per-token tree bits.

V2 computes every token's slot from its *linear* position (``base + i``), then builds attention metadata from the
same persistent ``positions`` buffer that the FULL CUDA graph reads. Between the two, DDTree rewrites the positions
of each tree row in place to ``base + depth(node)`` (the RoPE position the node has on its own path) and writes the
per-token ancestor words the tree-attention backend reads: bit ``j`` of ``token_bits[t]`` lets query ``t`` see the
``j``-th of its request's last ``q_len`` keys. Rows that are not trees get causal words. After the sampler, the
drafter needs the linear positions back (DFlash reads them for its context) and the target hidden states of the
accepted path's nodes in path order: ``restore_path_context`` does both in one launch (host time per step counts
where batch-1 steps are host-bound).

A batch row verifies a tree when it has drafts (``num_logits > 1``): its last ``num_logits`` tokens are the tree's
root and first ``num_logits - 1`` nodes, and the tree lives in ``tree_depth``/``tree_anc`` at the row's request
state index. One program per batch row; nothing is read on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.accept import AcceptedPaths
from vllm_ddtree.tree_mask import MAX_TREE_WIDTH, causal_bits


@triton.jit
def _verify_layout_kernel(
    positions,
    token_bits,
    query_start_loc,
    cu_num_logits,
    idx_mapping,
    tree_depth,
    tree_anc,
    tree_stride,
    MAX_W: tl.constexpr,
):
    b = tl.program_id(0)
    rsi = tl.load(idx_mapping + b).to(tl.int64)
    q_start = tl.load(query_start_loc + b).to(tl.int64)
    q_end = tl.load(query_start_loc + b + 1).to(tl.int64)
    num_logits = (tl.load(cu_num_logits + b + 1) - tl.load(cu_num_logits + b)).to(tl.int64)
    is_tree = (num_logits > 1) & (rsi >= 0)
    i = tl.arange(0, MAX_W)
    root = q_end - num_logits
    on_tree = is_tree & (i < num_logits)
    # Causal words for the first min(q_len, 64) rows (longer rows are causal in the kernel), then the tree's.
    row = i.to(tl.int64)
    causal = tl.where(row >= 63, -1, (tl.full([MAX_W], 1, tl.int64) << (row + 1)) - 1)
    anc = tl.load(tree_anc + rsi * tree_stride + i, mask=on_tree, other=0)
    in_req = i < q_end - q_start
    tl.store(token_bits + q_start + i, tl.where(on_tree, anc, causal), mask=in_req)
    base = tl.load(positions + root, mask=is_tree, other=0)
    new_pos = base + tl.load(tree_depth + rsi * tree_stride + i, mask=on_tree, other=0)
    tl.store(positions + root + i, new_pos, mask=on_tree)


def write_verify_layout(
    positions: torch.Tensor,
    token_bits: torch.Tensor,
    query_start_loc: torch.Tensor,
    cu_num_logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    tree_depth: torch.Tensor,
    tree_anc: torch.Tensor,
    num_reqs: int,
) -> None:
    """Depth positions of every tree row in place, and the per-token ancestor words of the whole batch."""
    if num_reqs == 0:
        return
    if tree_depth.stride() != tree_anc.stride() or tree_anc.stride(-1) != 1:
        raise ValueError("tree_depth and tree_anc must be row-major buffers of one shape")
    _verify_layout_kernel[(num_reqs,)](
        positions,
        token_bits,
        query_start_loc,
        cu_num_logits,
        idx_mapping,
        tree_depth,
        tree_anc,
        tree_anc.stride(0),
        MAX_W=MAX_TREE_WIDTH,
        num_warps=1,
    )


def verify_layout_reference(
    positions: torch.Tensor,
    token_bits: torch.Tensor,
    query_start_loc: torch.Tensor,
    cu_num_logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    tree_depth: torch.Tensor,
    tree_anc: torch.Tensor,
    num_reqs: int,
) -> None:
    """Plain-Python reference of ``write_verify_layout`` (same in-place effect)."""
    causal = causal_bits(MAX_TREE_WIDTH, positions.device)
    for b in range(num_reqs):
        rsi = int(idx_mapping[b])
        q_start, q_end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        num_logits = int(cu_num_logits[b + 1] - cu_num_logits[b])
        rows = min(q_end - q_start, MAX_TREE_WIDTH)
        token_bits[q_start : q_start + rows] = causal[:rows]
        if num_logits > 1 and rsi >= 0:
            root = q_end - num_logits
            token_bits[root : root + num_logits] = tree_anc[rsi, :num_logits]
            positions[root : root + num_logits] = positions[root] + tree_depth[rsi, :num_logits]


MAX_HIDDENS = 4  # hidden tensors per launch of the path-context kernel (DFlash reads 3-5 target layers)


@triton.jit
def _path_context_kernel(
    positions,
    h0,
    h1,
    h2,
    h3,
    row_stride,
    dim,
    query_start_loc,
    cu_num_logits,
    idx_mapping,
    accepted_nodes,
    acc_stride,
    num_accepted,
    NUM_H: tl.constexpr,
    RESTORE: tl.constexpr,
    MAX_W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (request, column chunk): with RESTORE, chunk 0 gives the request's tree rows their linear positions
    back; then in each of the NUM_H hidden tensors, rows root+1..root+a take the rows of the path's nodes in depth
    order. In place without a copy: the node at depth ``k`` has index ``>= k`` (parents precede children), so a row
    that is read later was never written before."""
    b = tl.program_id(0).to(tl.int64)
    num_logits = (tl.load(cu_num_logits + b + 1) - tl.load(cu_num_logits + b)).to(tl.int64)
    root = tl.load(query_start_loc + b + 1).to(tl.int64) - num_logits
    if RESTORE:
        if tl.program_id(1) == 0:
            is_tree = (num_logits > 1) & (tl.load(idx_mapping + b) >= 0)
            i = tl.arange(0, MAX_W)
            base = tl.load(positions + root, mask=is_tree, other=0)
            tl.store(positions + root + i, base + i, mask=is_tree & (i < num_logits))
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < dim
    for k in range(1, tl.load(num_accepted + b) + 1):
        node = tl.load(accepted_nodes + b * acc_stride + k)
        src = (root + node) * row_stride + cols
        dst = (root + k) * row_stride + cols
        for t in tl.static_range(NUM_H):
            h = h0
            if t == 1:
                h = h1
            if t == 2:
                h = h2
            if t == 3:
                h = h3
            tl.store(h + dst, tl.load(h + src, mask=mask), mask=mask)


def restore_path_context(
    positions: torch.Tensor,
    hiddens: list[torch.Tensor],
    query_start_loc: torch.Tensor,
    cu_num_logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    paths: AcceptedPaths,
    num_reqs: int,
) -> None:
    """The drafter's context after a tree verify, in place: every tree row's linear position back (``base + i``,
    undoing ``write_verify_layout``), and in each hidden tensor ``[tokens, dim]`` the accepted path's rows in path
    order (the torch reference is a gather through ``path_permutation``). One launch per ``MAX_HIDDENS`` hidden
    tensors, no host reads."""
    if num_reqs == 0:
        return
    groups = [hiddens[i : i + MAX_HIDDENS] for i in range(0, len(hiddens), MAX_HIDDENS)] or [[]]
    for n, group in enumerate(groups):
        first = group[0] if group else positions
        if any(
            h.stride(-1) != 1
            or h.stride(0) != first.stride(0)
            or h.shape[-1] != first.shape[-1]
            or h.dtype != first.dtype
            for h in group
        ):
            raise ValueError(
                "restore_path_context needs hidden tensors of one dtype, width and row stride, with a "
                "contiguous last dim"
            )
        dim = first.shape[-1] if group else 0
        block = min(triton.next_power_of_2(max(dim, 1)), 1024)
        slots = [*group, *[first] * (MAX_HIDDENS - len(group))]
        _path_context_kernel[(num_reqs, max(triton.cdiv(dim, block), 1))](
            positions,
            *slots,
            first.stride(0),
            dim,
            query_start_loc,
            cu_num_logits,
            idx_mapping,
            paths.accepted_nodes,
            paths.accepted_nodes.stride(0),
            paths.num_accepted,
            NUM_H=len(group),
            RESTORE=n == 0,
            MAX_W=MAX_TREE_WIDTH,
            BLOCK=block,
            num_warps=4,
        )
