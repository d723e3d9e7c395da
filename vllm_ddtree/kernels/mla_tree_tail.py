"""The tree tail of MLA verify attention (Triton), run beside a context pass that another kernel does.

On Hopper, vLLM ships FlashMLA, which reads the latent cache at close to the GPU's limits but knows only causal
masks. DDTree's MLA backend therefore splits each verify row's keys in two: FlashMLA attends every key before the
request's last ``q_len`` and the first of those, the tree's root (the keys every row sees, ``causal=False``) and
returns its normalised output and log-sum-exp; ``mla_tree_tail`` attends the other tree keys (at most 63) under
the ancestor words; and ``merge_context`` joins the two by log-sum-exp. A root row then sees no tail key and keeps
FlashMLA's output bit for bit: the target's own kernel over the keys its own decode of that token attends. The
context is read once, by FlashMLA, for all tree rows and heads.
``split_verify`` runs the tail on a second stream while FlashMLA runs (fork and join are captured in CUDA graphs):
the tail needs nothing from FlashMLA, so only the merge follows it (measured: docs/results.md, section 6.4).
``pack_context_query`` builds FlashMLA's packed ``[T, H, 576]`` query from the two parts vLLM hands over, in one
launch.

One tail program owns one request, ``BLOCK_M`` (query, head) rows of it (row ``r``: query ``r // H``, head
``r % H``) and one ``512 / V_SPLIT``-wide part of the output, so the request's tree keys are read once per row tile
and part. With at most 64 keys per request the softmax is exact in two passes: scores over the 576 latent dims, then
the output part in 64-wide slices. Small batches split the output over up to 8 programs (the scores are recomputed
in each, ~1/8 of a program's work): at batch 1 a 16-node tree of 64 heads is otherwise only 16 programs on 132 SMs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from vllm_ddtree import envs
from vllm_ddtree.constants import LOG2E, MAX_TREE_WIDTH, MLA_HEAD_DIM, MLA_KV_LORA_RANK, MLA_ROPE_DIM

# The same numbers as the kernels' compile-time constants.
_KV_LORA, _ROPE, _LOG2E = tl.constexpr(MLA_KV_LORA_RANK), tl.constexpr(MLA_ROPE_DIM), tl.constexpr(LOG2E)
# Launch shape: 64 (query, head) rows per program, latent dims in 64-wide slices, 8 warps. Chosen so that no
# target spills registers (checked ahead of time for sm_80/90/120 by tests/kernels/test_triton_aot.py).
BLOCK_M, CHUNK, NUM_WARPS = 64, 64, 8
V_SPLITS = (
    1,
    4,
    8,
)  # output parts per row tile; 2 would spill registers on sm_80/90/120 (tests/kernels/test_triton_aot.py)
# Output parts by grid size (row tiles of all requests): more parts spread small grids, and from large grids on the
# recomputed scores cost more than the spread saves (measured: docs/results.md, section 6.4).
SPLIT_8_BELOW, SPLIT_4_UP_TO = 16, 64


@triton.jit
def _mla_tree_tail_kernel(
    q_nope_ptr,
    q_pe_ptr,
    kv_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    bits_ptr,
    out_ptr,
    lse_ptr,
    qk_scale,
    s_qn_t,
    s_qn_h,
    s_qp_t,
    s_qp_h,
    s_blk,
    s_tok,
    s_bt,
    s_o_t,
    s_o_h,
    s_l_t,
    NUM_HEADS: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    KEYS: tl.constexpr,
    CHUNK: tl.constexpr,
    V_SPLIT: tl.constexpr,
    F32_DOT: tl.constexpr,
    ROOT_IN_CONTEXT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    v_part = tl.program_id(2) if V_SPLIT > 1 else 0  # a constant 0 unsplit: same code as without parts
    q0 = tl.load(qsl_ptr + b).to(tl.int64)
    q_len = tl.load(qsl_ptr + b + 1).to(tl.int64) - q0
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = (r // NUM_HEADS).to(tl.int64)
    head = (r % NUM_HEADS).to(tl.int64)
    row_ok = qi < q_len
    if tile * BLOCK_M >= q_len * NUM_HEADS:  # past this request's rows (q_len-0 graph padding stops here)
        return
    token = q0 + qi
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    tail = seq_len - q_len

    # The request's tail keys: key j sits at position tail + j (KEYS >= the launch's longest query).
    j = tl.arange(0, KEYS)
    k_ok = j < q_len
    k_pos = tail + j
    page = tl.load(bt_ptr + b * s_bt + k_pos // PAGE, mask=k_ok, other=0).to(tl.int64)
    k_row = kv_ptr + page * s_blk + (k_pos % PAGE) * s_tok

    # Scores over the 512 latent dims (in CHUNK-wide slices) plus the 64 rope dims, in log2 units.
    c = tl.arange(0, CHUNK)
    s = tl.zeros([BLOCK_M, KEYS], tl.float32)
    for c0 in range(0, _KV_LORA, CHUNK):
        q = tl.load(
            q_nope_ptr + token[:, None] * s_qn_t + head[:, None] * s_qn_h + c0 + c[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        k = tl.load(k_row[:, None] + c0 + c[None, :], mask=k_ok[:, None], other=0.0)
        if F32_DOT:
            q, k = q.to(tl.float32), k.to(tl.float32)
        s += tl.dot(q, tl.trans(k))
    e = tl.arange(0, _ROPE)
    q_pe = tl.load(
        q_pe_ptr + token[:, None] * s_qp_t + head[:, None] * s_qp_h + e[None, :], mask=row_ok[:, None], other=0.0
    )
    k_pe = tl.load(k_row[:, None] + _KV_LORA + e[None, :], mask=k_ok[:, None], other=0.0)
    p_dtype = k_pe.dtype
    if F32_DOT:
        q_pe, k_pe = q_pe.to(tl.float32), k_pe.to(tl.float32)
    s = (s + tl.dot(q_pe, tl.trans(k_pe))) * qk_scale
    bits = tl.load(bits_ptr + token, mask=row_ok, other=0)
    low, high = bits.to(tl.int32), (bits >> 32).to(tl.int32)  # 32-bit halves keep the [rows, keys] test narrow
    word = tl.where(j[None, :] < 32, low[:, None], high[:, None])
    visible = (((word >> (j[None, :] % 32)) & 1) != 0) & k_ok[None, :]
    if ROOT_IN_CONTEXT:  # the context pass attended the root key (tree_mask.context_key_counts)
        visible = visible & (j[None, :] >= 1)
    s = tl.where(visible, s, float("-inf"))

    m = tl.max(s, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.math.exp2(s - m_safe[:, None])
    denom = tl.sum(p, axis=1)
    denom_safe = tl.where(denom == 0.0, 1.0, denom)
    lse = tl.where(denom == 0.0, float("-inf"), (m_safe + tl.math.log2(denom_safe)) / _LOG2E)
    tl.store(lse_ptr + token * s_l_t + head, lse, mask=row_ok & (v_part == 0))

    p = p.to(p_dtype)  # round P like the cache dtype, as tensor-core attention does
    if F32_DOT:
        p = p.to(tl.float32)
    for step in range(_KV_LORA // V_SPLIT // CHUNK):  # a constant trip count, like the unsplit loop
        d0 = v_part * (_KV_LORA // V_SPLIT) + step * CHUNK
        v = tl.load(k_row[:, None] + d0 + c[None, :], mask=k_ok[:, None], other=0.0)
        if F32_DOT:
            v = v.to(tl.float32)
        acc = tl.dot(p, v)
        tl.store(
            out_ptr + token[:, None] * s_o_t + head[:, None] * s_o_h + d0 + c[None, :],
            (acc / denom_safe[:, None]).to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )


def tree_keys(max_query_len: int) -> int:
    """Key columns a program scores: the launch's longest query rounded up to a power of two, at least 16 (the
    smallest tensor-core dot). A 16-token tree then costs a quarter of the score and P V work of 64 columns."""
    return max(16, triton.next_power_of_2(max_query_len))


def output_parts(programs: int) -> int:
    """How many parts to split each row tile's 512 output dims into, for a grid of ``programs`` row tiles: every
    part recomputes the tile's scores, which only pays while the grid leaves most SMs idle."""
    return 8 if programs < SPLIT_8_BELOW else 4 if programs <= SPLIT_4_UP_TO else 1


def mla_tree_tail(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_bits: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    max_query_len: int,
    v_split: int | None = None,
    root_in_context: bool = False,
) -> None:
    """Attend each verify row's tree keys only (the request's last ``q_len`` <= 64 keys, bit ``j`` of
    ``tree_bits[t]`` lets row ``t`` see key ``j``; with ``root_in_context`` keys 1.. only, the context pass having
    attended the root); writes the normalised ``out`` ``[T, H, 512]`` (in its dtype) and ``lse`` ``[T, H]`` (natural
    log; -inf for a row that sees no key). bf16/fp16 cache ``[blocks, page, 576]``; no host reads (CUDA graphs).
    ``v_split`` (output parts per row tile, one of ``V_SPLITS``) defaults to ``output_parts`` of the grid."""
    num_reqs, num_heads = seq_lens.shape[0], q_nope.shape[1]
    if not 1 <= max_query_len <= MAX_TREE_WIDTH:
        raise ValueError(f"mla_tree_tail handles rows of 1..{MAX_TREE_WIDTH} tokens, got max_query_len {max_query_len}")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != MLA_HEAD_DIM or kv_cache.stride(-1) != 1:
        raise ValueError(
            f"kv_cache must be [blocks, page, {MLA_HEAD_DIM}], last dim contiguous; got {tuple(kv_cache.shape)}"
        )
    if num_reqs == 0 or q_nope.shape[0] == 0:
        return
    tiles = triton.cdiv(max_query_len * num_heads, BLOCK_M)
    keys = tree_keys(max_query_len)
    v_split = output_parts(num_reqs * tiles) if v_split is None else v_split
    if v_split not in V_SPLITS:
        raise ValueError(f"v_split must be one of {V_SPLITS}, got {v_split}")
    _mla_tree_tail_kernel[(num_reqs, tiles, v_split)](
        q_nope,
        q_pe,
        kv_cache,
        block_table,
        seq_lens,
        query_start_loc,
        tree_bits,
        out,
        lse,
        softmax_scale * LOG2E,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        NUM_HEADS=num_heads,
        PAGE=kv_cache.shape[1],
        BLOCK_M=BLOCK_M,
        KEYS=keys,
        CHUNK=CHUNK,
        V_SPLIT=v_split,
        F32_DOT=envs.TRITON_INTERPRET,
        ROOT_IN_CONTEXT=root_in_context,
        num_warps=NUM_WARPS,
    )


@triton.jit(do_not_specialize=["s_co_b", "s_cl_b", "s_cl_h"])  # move with the step's query length: no recompiles
def _merge_context_kernel(
    context_out_ptr,
    context_lse_ptr,
    tree_out_ptr,
    tree_lse_ptr,
    qsl_ptr,
    out_ptr,
    lse_ptr,
    s_co_b,
    s_co_q,
    s_co_h,
    s_cl_b,
    s_cl_h,
    s_cl_q,
    s_to_t,
    s_to_h,
    s_tl_t,
    s_o_t,
    s_o_h,
    s_l_t,
    NUM_HEADS: tl.constexpr,
    ROWS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    q0 = tl.load(qsl_ptr + b).to(tl.int64)
    q_len = tl.load(qsl_ptr + b + 1).to(tl.int64) - q0
    if tl.program_id(1) * ROWS >= q_len * NUM_HEADS:  # past this request's rows (q_len-0 graph padding stops here)
        return
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    qi = (r // NUM_HEADS).to(tl.int64)
    head = (r % NUM_HEADS).to(tl.int64)
    row_ok = qi < q_len
    token = q0 + qi
    # FlashMLA's context pass: out [B, s_q, H, 512], lse [B, H, s_q] (natural log; +-inf or NaN when empty).
    c_lse = tl.load(context_lse_ptr + b * s_cl_b + head * s_cl_h + qi * s_cl_q, mask=row_ok, other=float("-inf"))
    seen = (c_lse == c_lse) & (c_lse != float("inf")) & (c_lse != float("-inf"))
    c_lse = tl.where(seen, c_lse, float("-inf"))
    t_lse = tl.load(tree_lse_ptr + token * s_tl_t + head, mask=row_ok, other=float("-inf"))
    m = tl.maximum(c_lse, t_lse)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_context = tl.where(seen, tl.exp(c_lse - m_safe), 0.0)
    w_tree = tl.where(t_lse == float("-inf"), 0.0, tl.exp(t_lse - m_safe))
    total = w_context + w_tree
    total_safe = tl.where(total == 0.0, 1.0, total)
    tl.store(
        lse_ptr + token * s_l_t + head, tl.where(total == 0.0, float("-inf"), m_safe + tl.log(total_safe)), mask=row_ok
    )
    d = tl.arange(0, _KV_LORA)
    c_out = tl.load(
        context_out_ptr + b * s_co_b + qi[:, None] * s_co_q + head[:, None] * s_co_h + d[None, :],
        mask=row_ok[:, None] & seen[:, None],
        other=0.0,
    )
    t_out = tl.load(
        tree_out_ptr + token[:, None] * s_to_t + head[:, None] * s_to_h + d[None, :],
        mask=row_ok[:, None] & (w_tree[:, None] > 0.0),
        other=0.0,
    )
    merged = (c_out.to(tl.float32) * w_context[:, None] + t_out.to(tl.float32) * w_tree[:, None]) / total_safe[:, None]
    tl.store(
        out_ptr + token[:, None] * s_o_t + head[:, None] * s_o_h + d[None, :],
        merged.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


MERGE_ROWS, MERGE_WARPS = 8, 4  # (query, head) rows x 512 dims a merge program


def merge_context(
    context_out: torch.Tensor,
    context_lse: torch.Tensor,
    tree_out: torch.Tensor,
    tree_lse: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    max_query_len: int,
) -> None:
    """``out`` / ``lse`` ``[T, H, 512]`` / ``[T, H]`` = the log-sum-exp merge of the context pass (FlashMLA's
    ``[B, s_q, H, 512]`` / ``[B, H, s_q]``; +-inf or NaN lse where a row has no context) and the tree part
    (``mla_tree_tail``'s ``[T, H, 512]`` / ``[T, H]``)."""
    num_reqs, num_heads = query_start_loc.shape[0] - 1, out.shape[1]
    if num_reqs == 0 or out.shape[0] == 0:
        return
    grid = (num_reqs, triton.cdiv(max_query_len * num_heads, MERGE_ROWS))
    _merge_context_kernel[grid](
        context_out,
        context_lse,
        tree_out,
        tree_lse,
        query_start_loc,
        out,
        lse,
        context_out.stride(0),
        context_out.stride(1),
        context_out.stride(2),
        context_lse.stride(0),
        context_lse.stride(1),
        context_lse.stride(2),
        tree_out.stride(0),
        tree_out.stride(1),
        tree_lse.stride(0),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        NUM_HEADS=num_heads,
        ROWS=MERGE_ROWS,
        num_warps=MERGE_WARPS,
    )


PACK_HEADS, PACK_WARPS = 4, 4  # (token, 4 heads) a program: 2,304 elements, 18 a thread


@triton.jit
def _pack_query_kernel(
    q_nope_ptr,
    q_pe_ptr,
    rows_ptr,
    out_ptr,
    s_qn_t,
    s_qn_h,
    s_qp_t,
    s_qp_h,
    s_o_t,
    s_o_h,
    num_heads,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    HEADS: tl.constexpr,
    GATHER: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    src = tl.load(rows_ptr + t).to(tl.int64) if GATHER else t
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    ok = (head < num_heads)[:, None]
    head = head.to(tl.int64)[:, None]
    n = tl.arange(0, NOPE)[None, :]
    nope = tl.load(q_nope_ptr + src * s_qn_t + head * s_qn_h + n, mask=ok)
    tl.store(out_ptr + t * s_o_t + head * s_o_h + n, nope, mask=ok)
    r = tl.arange(0, ROPE)[None, :]
    pe = tl.load(q_pe_ptr + src * s_qp_t + head * s_qp_h + r, mask=ok)
    tl.store(out_ptr + t * s_o_t + head * s_o_h + NOPE + r, pe, mask=ok)


def pack_context_query(q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """FlashMLA's query ``[T, H, 576]``: ``cat(q_nope, q_pe)`` along the last dim, row ``i`` taken from row
    ``rows[i]`` when ``rows`` is given (the gather into FlashMLA's uniform layout), in one launch. vLLM hands the
    absorbed ``q_nope`` as a head-major view transposed to ``[T, H, 512]``, which ``torch.cat`` copies at a fraction
    of the copy rate (measured: docs/results.md, section 5)."""
    if q_nope.shape[:2] != q_pe.shape[:2] or q_nope.shape[2] != MLA_KV_LORA_RANK or q_pe.shape[2] != MLA_ROPE_DIM:
        raise ValueError(
            f"q_nope [T, H, {MLA_KV_LORA_RANK}] and q_pe [T, H, {MLA_ROPE_DIM}] expected, got "
            f"{tuple(q_nope.shape)} and {tuple(q_pe.shape)}"
        )
    q_nope = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    num_rows, num_heads = (q_nope.shape[0] if rows is None else rows.shape[0]), q_nope.shape[1]
    out = q_nope.new_empty(num_rows, num_heads, MLA_HEAD_DIM)
    if num_rows == 0 or num_heads == 0:
        return out
    _pack_query_kernel[(num_rows, triton.cdiv(num_heads, PACK_HEADS))](
        q_nope,
        q_pe,
        q_nope if rows is None else rows,
        out,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        out.stride(0),
        out.stride(1),
        num_heads,
        NOPE=MLA_KV_LORA_RANK,
        ROPE=MLA_ROPE_DIM,
        HEADS=PACK_HEADS,
        GATHER=rows is not None,
        num_warps=PACK_WARPS,
    )
    return out


def compile_pack_context_query(num_heads: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compile both specialisations of the query pack (as laid out and gathered) for a model's heads and dtype at
    start-up: captured decode graphs are uniform and only ever compile the first, so the gather would otherwise
    compile at the first mixed batch served. One row each; every stride the kernel sees is a multiple of 16 here as
    in serving, so the specialisations are the same."""
    q_nope = torch.zeros(1, num_heads, MLA_KV_LORA_RANK, dtype=dtype, device=device)
    q_pe = torch.zeros(1, num_heads, MLA_ROPE_DIM, dtype=dtype, device=device)
    pack_context_query(q_nope, q_pe)
    pack_context_query(q_nope, q_pe, torch.zeros(1, dtype=torch.int64, device=device))


def split_verify(
    context_pass: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_bits: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    max_query_len: int,
    side_stream: torch.cuda.Stream | None,
) -> None:
    """The whole verify of every row: ``context_pass()`` (FlashMLA over the context keys and the root,
    ``tree_mask.context_key_counts``, returning its out and lse) on the current stream while ``mla_tree_tail``
    attends the other tree keys on ``side_stream``, then ``merge_context``
    on the current stream once both are done. ``side_stream`` None runs the two one after the other (CPU). The tree
    part is kept in ``out``'s dtype: in fp32 its extra bytes cost more than the overlap saves at many rows
    (measured: docs/results.md, section 6.4)."""
    tree_out = torch.empty_like(out)
    tree_lse = torch.empty(lse.shape, dtype=torch.float32, device=lse.device)
    if side_stream is None:
        mla_tree_tail(
            q_nope,
            q_pe,
            kv_cache,
            block_table,
            seq_lens,
            query_start_loc,
            tree_bits,
            softmax_scale,
            tree_out,
            tree_lse,
            max_query_len,
            root_in_context=True,
        )
        context_out, context_lse = context_pass()
    else:
        main_stream = torch.cuda.current_stream()
        side_stream.wait_stream(main_stream)  # the step's queries and cache writes are in
        with torch.cuda.stream(side_stream):
            mla_tree_tail(
                q_nope,
                q_pe,
                kv_cache,
                block_table,
                seq_lens,
                query_start_loc,
                tree_bits,
                softmax_scale,
                tree_out,
                tree_lse,
                max_query_len,
                root_in_context=True,
            )
        context_out, context_lse = context_pass()
        main_stream.wait_stream(side_stream)
    merge_context(context_out, context_lse, tree_out, tree_lse, query_start_loc, out, lse, max_query_len)


def mla_context_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    softmax_scale: float,
    max_query_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 stand-in for FlashMLA's context pass (tests): every row of request ``b`` attends its first
    ``context_lens[b]`` keys; returns out ``[B, s_q, H, 512]`` and lse ``[B, H, s_q]`` (+inf where empty, as FlashMLA
    reports it; padded query slots stay 0 / +inf)."""
    num_reqs, num_heads = context_lens.shape[0], q_nope.shape[1]
    page = kv_cache.shape[1]
    out = torch.zeros(num_reqs, max_query_len, num_heads, MLA_KV_LORA_RANK, dtype=torch.float32)
    lse = torch.full((num_reqs, num_heads, max_query_len), float("inf"))
    qsl = query_start_loc.tolist()
    for b in range(num_reqs):
        n, ctx = qsl[b + 1] - qsl[b], int(context_lens[b])
        if n == 0 or ctx == 0:
            continue
        pages = block_table[b, : -(-ctx // page)].long()
        kv = kv_cache[pages].reshape(-1, MLA_HEAD_DIM)[:ctx].float()
        q = torch.cat([q_nope[qsl[b] : qsl[b + 1]], q_pe[qsl[b] : qsl[b + 1]]], -1).float()  # [n, H, 576]
        s = torch.einsum("nhd,kd->nhk", q, kv) * softmax_scale
        row_lse = torch.logsumexp(s, -1)
        out[b, :n] = torch.einsum("nhk,kd->nhd", torch.exp(s - row_lse[..., None]), kv[:, :MLA_KV_LORA_RANK])
        lse[b, :, :n] = row_lse.T
    return out, lse
