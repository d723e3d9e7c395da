"""GQA tree-verify attention over vLLM's paged KV cache (Triton), plus its fp32 reference.

DDTree verifies a draft tree of W <= 64 tokens per request in one target forward. Query t of a request sees every
key before the request's last q_len keys, and tail key j iff bit j of ``tree_bits[t]`` is set (the ancestor-only
mask). Requests with q_len > 64 (prefill chunks) are plain causal.

Kernel layout: one program owns one (request, KV head, query tile, KV split). Its M-tile packs the G = Hq/Hkv query
heads of that KV head times the tile's query rows (row m = query m // G, head m % G), so each K/V tile is read once
for every tree row and head that shares it. Scores and the online softmax are fp32; the mask is built only on KV
tiles that reach the tail. Splits over the key range come from a launch constant, their bounds are computed on the
device, and a small kernel merges them by log-sum-exp, so the launch never reads tensor values on the host and can
be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree import envs
from vllm_ddtree.constants import LOG2E, MAX_TREE_WIDTH

# Requests of up to MAX_TREE_WIDTH query tokens use the tree bitmask; longer ones (prefill chunks) are causal. The
# same numbers as the kernels' compile-time constants:
_TREE_W, _LOG2E = tl.constexpr(MAX_TREE_WIDTH), tl.constexpr(LOG2E)


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    tile,
    kv_base,
    bt_row,
    kv_end,
    tail,
    bits,
    qi,
    is_tree,
    s_blk,
    s_tok,
    qk_scale,
    HEAD_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr,
    F32_DOT: tl.constexpr,
    SKIP_CONTEXT: tl.constexpr = False,
):
    """One KV tile of the online softmax. Scores are kept in log2 units (qk_scale includes log2 e). With
    SKIP_CONTEXT the keys before the tail and the tail's first key (the root) are left out: another kernel already
    attended them (``tree_mask.context_key_counts``)."""
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_D)
    k_pos = tile * BLOCK_N + n
    k_ok = k_pos < kv_end
    # Keys past kv_end never touch the block table or the cache (their pages may hold garbage or not exist).
    page = tl.load(bt_row + k_pos // PAGE, mask=k_ok, other=0).to(tl.int64)
    off = kv_base + page * s_blk + (k_pos % PAGE).to(tl.int64) * s_tok
    k = tl.load(off[:, None] + d[None, :], mask=k_ok[:, None], other=0.0)
    v = tl.load(off[:, None] + HEAD_D + d[None, :], mask=k_ok[:, None], other=0.0)
    p_dtype = v.dtype
    if F32_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if MASKED:
        j = k_pos - tail  # position inside the request's tail (negative: context, always visible)
        jj = tl.minimum(tl.maximum(j, 0), _TREE_W - 1).to(tl.int64)
        tree_vis = ((bits[:, None] >> jj[None, :]) & 1) != 0
        causal_vis = j[None, :] <= qi[:, None]
        vis = tl.where(is_tree, tree_vis, causal_vis)
        if SKIP_CONTEXT:
            vis = vis & (j[None, :] >= 1)
        else:
            vis = vis | (j[None, :] < 0)
        s = tl.where(vis & k_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row that has seen nothing yet keeps m = -inf; shift by 0 then so exp2 gives 0 rather than NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(p_dtype)  # round P like the cache dtype, as the tensor-core path does
    if F32_DOT:
        p = p.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_reqs", "num_rows"])  # per-step counts: no recompile for a new value class
def _gqa_tree_attn_kernel(
    q_ptr,
    kv_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    bits_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    prefix_out_ptr,
    prefix_lse_ptr,
    num_reqs,
    num_rows,
    qk_scale,
    s_qt,
    s_qh,
    s_blk,
    s_kvh,
    s_tok,
    s_bt,
    s_ot,
    s_oh,
    s_pt,
    s_ph,
    s_lh,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    F32_DOT: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
):
    """Grid (query tiles, KV heads, splits). Query tiles are numbered as in vLLM's unified attention: request b's
    tiles start at qsl[b] // BLOCK_Q + b, so T // BLOCK_Q + B programs cover any q_len mix without host reads."""
    pid_q = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    r = tl.arange(0, BLOCK_R)
    starts = tl.load(qsl_ptr + r, mask=r < num_reqs, other=0) // BLOCK_Q + r
    b = tl.sum(((starts <= pid_q) & (r < num_reqs)).to(tl.int32), axis=0) - 1
    q0 = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q0
    q_tile = pid_q - (q0 // BLOCK_Q + b)
    if q_tile * BLOCK_Q >= q_len:  # past this request's rows; q_len-0 padding requests stop here
        return
    seq_len = tl.load(seq_lens_ptr + b)
    tail = seq_len - q_len
    is_tree = q_len <= _TREE_W

    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_D)
    qi = q_tile * BLOCK_Q + m // GROUP
    row_ok = (m < BLOCK_Q * GROUP) & (qi < q_len)
    row = (q0 + qi).to(tl.int64)
    head = kvh * GROUP + m % GROUP
    q = tl.load(q_ptr + row[:, None] * s_qt + head[:, None] * s_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    if F32_DOT:
        q = q.to(tl.float32)
    bits = tl.load(bits_ptr + row, mask=row_ok & is_tree, other=0)

    # Causal tiles stop at their last row's key; tree tiles need every key.
    q_last = tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_end = tl.where(is_tree, seq_len, tail + q_last + 1)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    t0 = split * per_split
    t1 = tl.minimum(t0 + per_split, num_tiles)
    first_masked = tail // BLOCK_N

    kv_base = kv_ptr + kvh.to(tl.int64) * s_kvh
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    if HAS_PREFIX:
        # The context keys and the root were attended by another kernel (FlashAttention): start from its normalised
        # output and log-sum-exp (natural log, [Hq, T]); an empty context reports lse = +-inf and contributes
        # nothing. A row that sees no other key keeps that output bit for bit (alpha 1, l 1).
        lse = tl.load(prefix_lse_ptr + head * s_lh + row, mask=row_ok, other=float("-inf"))
        seen = (lse == lse) & (lse != float("inf")) & (lse != float("-inf"))
        prev = tl.load(
            prefix_out_ptr + row[:, None] * s_pt + head[:, None] * s_ph + d[None, :],
            mask=row_ok[:, None] & seen[:, None],
            other=0.0,
        )
        acc = prev.to(tl.float32)
        m_i = tl.where(seen, lse * _LOG2E, float("-inf"))
        l_i = tl.where(seen, 1.0, 0.0)
        for t in range(first_masked, num_tiles):
            acc, m_i, l_i = _attend_tile(
                q,
                acc,
                m_i,
                l_i,
                t,
                kv_base,
                bt_row,
                kv_end,
                tail,
                bits,
                qi,
                is_tree,
                s_blk,
                s_tok,
                qk_scale,
                HEAD_D,
                BLOCK_N,
                PAGE,
                True,
                DOT_PREC,
                F32_DOT,
                True,
            )
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        dst = out_ptr + row[:, None] * s_ot + head[:, None] * s_oh + d[None, :]
        tl.store(dst, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        return
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for t in range(t0, tl.minimum(t1, first_masked)):
        acc, m_i, l_i = _attend_tile(
            q,
            acc,
            m_i,
            l_i,
            t,
            kv_base,
            bt_row,
            kv_end,
            tail,
            bits,
            qi,
            is_tree,
            s_blk,
            s_tok,
            qk_scale,
            HEAD_D,
            BLOCK_N,
            PAGE,
            False,
            DOT_PREC,
            F32_DOT,
        )
    for t in range(tl.maximum(t0, first_masked), t1):
        acc, m_i, l_i = _attend_tile(
            q,
            acc,
            m_i,
            l_i,
            t,
            kv_base,
            bt_row,
            kv_end,
            tail,
            bits,
            qi,
            is_tree,
            s_blk,
            s_tok,
            qk_scale,
            HEAD_D,
            BLOCK_N,
            PAGE,
            True,
            DOT_PREC,
            F32_DOT,
        )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        dst = out_ptr + row[:, None] * s_ot + head[:, None] * s_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # Workspace [splits, T, Hq, D] and [splits, T, Hq]; an empty split stores lse = -inf and weighs nothing.
        slot = (split * num_rows + row) * NUM_Q_HEADS + head
        tl.store(part_out_ptr + slot[:, None] * HEAD_D + d[None, :], o, mask=row_ok[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(part_lse_ptr + slot, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_reqs", "num_rows"])
def _combine_kernel(
    part_out_ptr,
    part_lse_ptr,
    qsl_ptr,
    out_ptr,
    num_reqs,
    num_rows,
    s_ot,
    s_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    """Grid (T, head blocks): merge the splits of one row by log-sum-exp (log2 units). Rows at or past
    qsl[B] belong to no request and are left untouched."""
    row = tl.program_id(0).to(tl.int64)
    if row >= tl.load(qsl_ptr + num_reqs):
        return
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < NUM_Q_HEADS
    d = tl.arange(0, HEAD_D)
    sp = tl.arange(0, SPLITS_P2)
    slots = (sp[:, None] * num_rows + row) * NUM_Q_HEADS + h[None, :]
    lse = tl.load(part_lse_ptr + slots, mask=(sp[:, None] < NUM_SPLITS) & h_ok[None, :], other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.math.exp2(lse - lse_max[None, :])  # [splits, heads]
    w = w / tl.maximum(tl.sum(w, axis=0), 1e-30)[None, :]
    acc = tl.zeros([BLOCK_H, HEAD_D], tl.float32)
    for s in range(NUM_SPLITS):
        w_s = tl.sum(tl.where(sp[:, None] == s, w, 0.0), axis=0)
        slot = (s * num_rows + row) * NUM_Q_HEADS + h
        part = tl.load(part_out_ptr + slot[:, None] * HEAD_D + d[None, :], mask=h_ok[:, None], other=0.0)
        acc += part * w_s[:, None]
    dst = out_ptr + row * s_ot + h[:, None] * s_oh + d[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


def tile_config(
    head_d: int, dtype: torch.dtype, group: int, avg_q: int, has_prefix: bool, hopper: bool
) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)``. M-tile: all heads of the group times as many rows as fit,
    sized from the average q_len (a static hint); smaller for D = 256 and fp32 (no tensor cores with ieee dots).
    8 warps from 64 x 128 tiles up (with 4 the row-gathered K/V addresses spill). 64-key K/V tiles only where they
    fit the registers: Hopper's tree tail. Elsewhere 32 keys, and on sm_80 / sm_120
    whole-context tiles of at most 64 rows: their builds of the larger tiles spill up to 400 bytes a thread
    (``tests/kernels/test_triton_aot.py`` compiles every choice for sm_80, sm_90 and sm_120 and checks for spills)."""
    wide = head_d > 128 or dtype == torch.float32
    cap = 64 if wide or (not hopper and not has_prefix) else 128
    block_m = max(16, min(cap, triton.next_power_of_2(group * avg_q)), triton.next_power_of_2(group))
    block_n = 64 if hopper and has_prefix and not wide else 32
    num_warps = 8 if block_m * head_d >= 64 * 128 else 4
    num_stages = 1 if dtype == torch.float32 else (2 if wide else 3)
    return block_m, block_n, num_warps, num_stages


def _default_num_splits(num_rows: int, block_q: int, num_kv_heads: int, big_tile: bool, device: torch.device) -> int:
    """Fill one wave from static shapes: an 8-warp 128x128 tile holds one CTA per SM, smaller tiles two; splitting
    past one wave loses to wave quantization (measured: docs/results.md, section 2)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    resident = sms * (1 if big_tile else 2)
    return max(1, min(32, resident // max(1, triton.cdiv(num_rows, block_q) * num_kv_heads)))


def gqa_tree_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_bits: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int | None = None,
    prefix_out: torch.Tensor | None = None,
    prefix_lse: torch.Tensor | None = None,
) -> None:
    """Tree-verify attention into ``out`` [T, Hq, D]. ``kv_cache`` is the logical (blocks, Hkv, page, 2D) view
    (K in [..., :D], V in [..., D:]) with any physical stride order; ``seq_lens`` count this step's tokens.
    ``num_splits`` (default: one wave of programs, from shapes and SM count) fixes the KV split count; it is a
    launch constant, so the call can be captured in a CUDA graph and replayed with new lengths, tables and trees.

    With ``prefix_out`` [T, Hq, D] and ``prefix_lse`` [Hq, T] (natural log; FlashAttention's ``out`` and
    ``softmax_lse`` over each request's first ``tree_mask.context_key_counts`` keys: the context and the root), only
    the other tail keys are read here and merged into that result: the long context runs on FlashAttention, the
    tree mask only where it applies."""
    num_rows, num_q_heads, head_d = query.shape
    num_blocks, num_kv_heads, page, two_d = kv_cache.shape
    if two_d != 2 * head_d or num_q_heads % num_kv_heads or kv_cache.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError(f"bad shapes/strides: query {tuple(query.shape)}, kv_cache {tuple(kv_cache.shape)}")
    if head_d & (head_d - 1) or page & (page - 1) or head_d < 16:
        raise ValueError(f"head size and page size must be powers of two (head >= 16), got {head_d}, {page}")
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError("out must match query in shape and dtype")
    num_reqs = seq_lens.shape[0]
    if num_rows == 0 or num_reqs == 0:
        return
    group = num_q_heads // num_kv_heads
    has_prefix = prefix_out is not None
    hopper = query.is_cuda and torch.cuda.get_device_capability(query.device)[0] == 9
    tiles = tile_config(head_d, query.dtype, group, triton.cdiv(num_rows, num_reqs), has_prefix, hopper)
    block_m, block_n, num_warps, num_stages = tiles
    block_q = block_m // group
    num_q_tiles = num_rows // block_q + num_reqs
    big_tile = block_m * head_d >= 128 * 128
    if has_prefix != (prefix_lse is not None):
        raise ValueError("prefix_out and prefix_lse go together")
    if has_prefix:
        if prefix_out.shape != query.shape or prefix_out.stride(-1) != 1 or prefix_lse.shape != (num_q_heads, num_rows):
            raise ValueError(f"prefix_out must be {tuple(query.shape)} and prefix_lse ({num_q_heads}, {num_rows})")
        num_splits = 1  # the tail is at most 64 keys for tree rows
    elif num_splits is None:
        num_splits = _default_num_splits(num_rows, block_q, num_kv_heads, big_tile, query.device)
    # Triton 3.6's interpreter multiplies bf16 dot operands as raw bits: there the dots run on fp32 copies.
    f32_dot = query.dtype == torch.bfloat16 and envs.TRITON_INTERPRET
    dot_prec = "ieee" if query.dtype == torch.float32 or f32_dot else "tf32"
    if num_splits > 1:
        part_out = torch.empty(num_splits, num_rows, num_q_heads, head_d, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_splits, num_rows, num_q_heads, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused by the single-pass kernel
    pre_out = prefix_out if has_prefix else out
    pre_lse = prefix_lse if has_prefix else part_lse
    _gqa_tree_attn_kernel[(num_q_tiles, num_kv_heads, num_splits)](
        query,
        kv_cache,
        block_table,
        seq_lens,
        query_start_loc,
        tree_bits,
        out,
        part_out,
        part_lse,
        pre_out,
        pre_lse,
        num_reqs,
        num_rows,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        pre_out.stride(0),
        pre_out.stride(1),
        prefix_lse.stride(0) if has_prefix else 0,
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        HEAD_D=head_d,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=triton.next_power_of_2(num_reqs),
        PAGE=page,
        NUM_SPLITS=num_splits,
        DOT_PREC=dot_prec,
        F32_DOT=f32_dot,
        HAS_PREFIX=has_prefix,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        block_h = min(16, triton.next_power_of_2(num_q_heads))
        _combine_kernel[(num_rows, triton.cdiv(num_q_heads, block_h))](
            part_out,
            part_lse,
            query_start_loc,
            out,
            num_reqs,
            num_rows,
            out.stride(0),
            out.stride(1),
            NUM_Q_HEADS=num_q_heads,
            HEAD_D=head_d,
            BLOCK_H=block_h,
            NUM_SPLITS=num_splits,
            SPLITS_P2=triton.next_power_of_2(num_splits),
            num_warps=4,
        )


def gqa_tree_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_bits: torch.Tensor,
    scale: float,
    row_chunk: int = 256,
) -> torch.Tensor:
    """fp32 reference, slow and simple: gather each request's keys through the block table, apply the tree rule
    (causal for q_len > 64) and softmax in fp32. Returns [T, Hq, D] fp32; rows of no request stay NaN."""
    num_rows, num_q_heads, head_d = query.shape
    num_kv_heads, page = kv_cache.shape[1], kv_cache.shape[2]
    group = num_q_heads // num_kv_heads
    dev = query.device
    out = torch.full((num_rows, num_q_heads, head_d), float("nan"), dtype=torch.float32, device=dev)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        q0, q1 = qsl[b], qsl[b + 1]
        n, seq_len = q1 - q0, lens[b]
        if n == 0:
            continue
        pages = block_table[b, : -(-seq_len // page)].long()
        kv = kv_cache[pages].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, 2 * head_d)[:, :seq_len].float()
        k = kv[..., :head_d].repeat_interleave(group, 0)  # [Hq, L, D]: keys past L (NaN padding) are cut first
        v = kv[..., head_d:].repeat_interleave(group, 0)
        j = torch.arange(n, device=dev)
        if n <= MAX_TREE_WIDTH:
            tail_vis = ((tree_bits[q0:q1].to(dev)[:, None] >> j[None, :]) & 1).bool()  # [n, n]
        else:
            tail_vis = j[None, :] <= j[:, None]
        q = query[q0:q1].float().transpose(0, 1)  # [Hq, n, D]
        for r0 in range(0, n, row_chunk):
            r1 = min(r0 + row_chunk, n)
            s = (q[:, r0:r1] @ k.transpose(1, 2)) * scale  # [Hq, rows, L]
            s[:, :, seq_len - n :] = s[:, :, seq_len - n :].masked_fill(~tail_vis[r0:r1], float("-inf"))
            out[q0 + r0 : q0 + r1] = (torch.softmax(s, -1) @ v).transpose(0, 1)
    return out
