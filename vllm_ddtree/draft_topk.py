"""Per-row top-k log-probs of the drafter's logits, for the tree build: two Triton launches on CUDA.

The DDTree drafter needs, at every depth, the k most likely tokens and their log-probs. ``logits.topk`` plus a
``logsumexp`` is a radix select and several more full passes over the vocabulary, about what a ddtree step cost over
a chain step of the same width (measured: docs/results.md, section 4). Here one pass reads the logits once: every
program takes a vocabulary slice and writes the slice's top-k and its (max, sum of exp); a second launch merges the
slices of each row. Within a slice every token carries one distinct integer key (logit bits, then the lower id), so
a pick is one max and a retire (k block-wide arg-max rounds made a first version compute-bound). Static
grid, no host reads, so it runs inside the drafter's FULL CUDA graph. Ties go to the lower token id
(``topk_logprobs_reference`` is the same rule in torch: a stable sort).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_SLICE = 4096  # vocabulary entries per first-pass program (more for huge vocabularies: at most 128 slices a row)
MAX_SLICES = 128
MAX_SLICE = 65536  # the keys' 16-bit index field: larger vocabularies (over 8M tokens) take the torch path
MAX_FUSED_K = 16  # larger k (a config with topk > 16) takes the torch path


@triton.jit
def _token_keys(raw, local, WIDE: tl.constexpr):
    """Integer keys ordered as the reference ranks a slice's tokens (larger logit first, then the lower id), all
    distinct: the logit's bits made monotone as a signed integer in the high part, 65535 - the slice-local index in
    the low 16 bits. 16-bit logits give int32 keys, float32 logits int64 keys. -0.0 counts as 0.0."""
    if WIDE:
        bits = raw.to(tl.int32, bitcast=True)
        bits = tl.where(bits == -2147483648, 0, bits)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = (ordered.to(tl.int64) << 32) | (65535 - local).to(tl.int64)
    else:
        bits = raw.to(tl.int16, bitcast=True).to(tl.int32)
        bits = tl.where(bits == -32768, 0, bits)
        ordered = bits ^ ((bits >> 31) & 0x7FFF)
        key = (ordered << 16) | (65535 - local)
    return key


@triton.jit
def _key_logit(key, dtype, WIDE: tl.constexpr):
    """The float32 logit a key was made from."""
    if WIDE:
        ordered = (key >> 32).to(tl.int32)
        logit = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    else:
        ordered = key >> 16
        logit = (ordered ^ ((ordered >> 31) & 0x7FFF)).to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
    return logit


@triton.jit
def _slice_topk_kernel(
    logits,
    row_stride,
    vocab,
    part_vals,
    part_ids,
    part_stats,
    num_slices,
    K: tl.constexpr,
    KP: tl.constexpr,
    SLICE: tl.constexpr,
    WIDE: tl.constexpr,
):
    row = tl.program_id(0)
    piece = tl.program_id(1)
    local = tl.arange(0, SLICE)
    live = piece * SLICE + local < vocab
    raw = tl.load(logits + row * row_stride + piece * SLICE + local, mask=live, other=-float("inf"))
    x = raw.to(tl.float32)
    top = tl.max(x, 0)
    shift = tl.where(top == -float("inf"), 0.0, top)  # an all -inf slice adds 0, not NaN
    total = tl.sum(tl.exp(x - shift), 0)
    # One max per pick over distinct keys: no tie-breaking pass, no mask of picked tokens (a pick's key is retired).
    none = -9223372036854775807 if WIDE else -2147483647
    keys = tl.where(live, _token_keys(raw, local, WIDE), none)
    slot = tl.arange(0, KP)
    vals = tl.full([KP], -float("inf"), tl.float32)
    ids = tl.full([KP], 2147483647, tl.int32)  # a slice with fewer than K tokens leaves id "none" (max int)
    for j in tl.static_range(K):
        best = tl.max(keys, 0)
        found = (slot == j) & (best != none)
        vals = tl.where(found, _key_logit(best, raw.dtype, WIDE), vals)
        ids = tl.where(found, piece * SLICE + 65535 - (best & 0xFFFF).to(tl.int32), ids)
        keys = tl.where(keys == best, none, keys)
    out = (row * num_slices + piece) * KP + slot
    tl.store(part_vals + out, vals)
    tl.store(part_ids + out, ids)
    tl.store(part_stats + (row * num_slices + piece) * 2, top)
    tl.store(part_stats + (row * num_slices + piece) * 2 + 1, total)


@triton.jit
def _merge_topk_kernel(
    part_vals,
    part_ids,
    part_stats,
    num_slices,
    vocab,
    out_logprobs,
    out_ids,
    K: tl.constexpr,
    KP: tl.constexpr,
    SP: tl.constexpr,
):
    row = tl.program_id(0)
    pieces = tl.arange(0, SP)
    live = pieces < num_slices
    tops = tl.load(part_stats + (row * num_slices + pieces) * 2, mask=live, other=-float("inf"))
    totals = tl.load(part_stats + (row * num_slices + pieces) * 2 + 1, mask=live, other=0.0)
    top = tl.max(tops, 0)
    shift = tl.where(top == -float("inf"), 0.0, top)
    lse = shift + tl.log(tl.sum(totals * tl.exp(tops - shift), 0))
    cand = tl.arange(0, SP * KP)
    ok = (cand // KP < num_slices) & (cand % KP < K)
    vals = tl.load(part_vals + row * num_slices * KP + cand, mask=ok, other=-float("inf"))
    ids = tl.load(part_ids + row * num_slices * KP + cand, mask=ok, other=2147483647)
    for j in tl.static_range(K):
        best = tl.max(vals, 0)
        pick = tl.min(tl.where(vals == best, ids, 2147483647), 0)
        at = tl.min(tl.where((vals == best) & (ids == pick), cand, 2147483647), 0)
        tl.store(out_logprobs + row * K + j, best - lse)
        tl.store(out_ids + row * K + j, tl.minimum(pick, vocab - 1).to(tl.int64))
        vals = tl.where(cand == at, -float("inf"), vals)
        ids = tl.where(cand == at, 2147483647, ids)


def topk_logprobs_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, k]`` float32 log-probs and int64 ids of each row's k largest logits, ties to the lower id."""
    values, ids = torch.sort(logits.float(), dim=-1, descending=True, stable=True)
    return values[:, :k] - torch.logsumexp(logits.float(), dim=-1, keepdim=True), ids[:, :k]


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, k]`` float32 log-probs and int64 ids of each row's k most likely tokens. CUDA (k <= 16): the two-pass
    Triton kernel; otherwise torch's ``topk`` and ``logsumexp`` (CPU ties are torch's, which the tree never needs
    to match: every drafted token is verified)."""
    rows, vocab = logits.shape
    fused = logits.dtype in (torch.bfloat16, torch.float16, torch.float32) and vocab <= MAX_SLICES * MAX_SLICE
    if not logits.is_cuda or k > MAX_FUSED_K or rows == 0 or not fused:
        values, ids = logits.topk(k, dim=-1)
        return values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True), ids
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _fused(logits, k, rows, vocab)


def _fused(logits: torch.Tensor, k: int, rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    slice_len = max(MIN_SLICE, triton.next_power_of_2(triton.cdiv(vocab, MAX_SLICES)))
    num_slices = triton.cdiv(vocab, slice_len)
    kp = triton.next_power_of_2(k)
    device = logits.device
    part_vals = torch.empty(rows, num_slices, kp, dtype=torch.float32, device=device)
    part_ids = torch.empty(rows, num_slices, kp, dtype=torch.int32, device=device)
    part_stats = torch.empty(rows, num_slices, 2, dtype=torch.float32, device=device)
    _slice_topk_kernel[(rows, num_slices)](
        logits,
        logits.stride(0),
        vocab,
        part_vals,
        part_ids,
        part_stats,
        num_slices,
        K=k,
        KP=kp,
        SLICE=slice_len,
        WIDE=logits.element_size() == 4,
        num_warps=8,
    )
    out_logprobs = torch.empty(rows, k, dtype=torch.float32, device=device)
    out_ids = torch.empty(rows, k, dtype=torch.int64, device=device)
    _merge_topk_kernel[(rows,)](
        part_vals,
        part_ids,
        part_stats,
        num_slices,
        vocab,
        out_logprobs,
        out_ids,
        K=k,
        KP=kp,
        SP=triton.next_power_of_2(num_slices),
        num_warps=4,
    )
    return out_logprobs, out_ids
