"""Per-row top-k log-probs of the drafter's logits, for the tree build: two Triton launches on CUDA.

The DDTree drafter needs, at every depth, the k most likely tokens and their log-probs. ``logits.topk`` plus a
``logsumexp`` is a radix select and several more full passes over the vocabulary: in an H200 profile (batch 16 x 15
depths, 163,840 tokens) the topk alone took 0.41 ms per drafter step and the logsumexp passes ~0.2 ms, about what a
ddtree step then cost over a chain step of the same width. Here one pass reads the logits once: every program takes
a vocabulary slice and writes the slice's top-k and its (max, sum of exp); a second launch merges the slices of each
row. Static grid, no host reads, so it runs inside the drafter's FULL CUDA
graph. Ties go to the lower token id (``topk_logprobs_reference`` is the same rule in torch: a stable sort).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_SLICE = 4096  # vocabulary entries per first-pass program (more for huge vocabularies: at most 128 slices a row)
MAX_SLICES = 128
MAX_FUSED_K = 16  # larger k (a config with topk > 16) takes the torch path


@triton.jit
def _slice_topk_kernel(logits, row_stride, vocab, part_vals, part_ids, part_stats, num_slices,
                       K: tl.constexpr, KP: tl.constexpr, SLICE: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    piece = tl.program_id(1)
    cols = piece * SLICE + tl.arange(0, SLICE)
    x = tl.load(logits + row * row_stride + cols, mask=cols < vocab, other=-float("inf")).to(tl.float32)
    top = tl.max(x, 0)
    shift = tl.where(top == -float("inf"), 0.0, top)  # an all -inf slice adds 0, not NaN
    total = tl.sum(tl.exp(x - shift), 0)
    slot = tl.arange(0, KP)
    vals = tl.full([KP], -float("inf"), tl.float32)
    ids = tl.full([KP], 2147483647, tl.int32)  # a slice with fewer than K tokens leaves id "none" (max int)
    free = cols < vocab
    for j in tl.static_range(K):
        best = tl.max(tl.where(free, x, -float("inf")), 0)
        pick = tl.min(tl.where(free & (x == best), cols, 2147483647), 0)
        vals = tl.where(slot == j, best, vals)
        ids = tl.where(slot == j, pick, ids)
        free = free & (cols != pick)
    out = (row * num_slices + piece) * KP + slot
    tl.store(part_vals + out, vals)
    tl.store(part_ids + out, ids)
    tl.store(part_stats + (row * num_slices + piece) * 2, top)
    tl.store(part_stats + (row * num_slices + piece) * 2 + 1, total)


@triton.jit
def _merge_topk_kernel(part_vals, part_ids, part_stats, num_slices, vocab, out_logprobs, out_ids,
                       K: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr):  # fmt: skip
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
    if not logits.is_cuda or k > MAX_FUSED_K or rows == 0:
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
        logits, logits.stride(0), vocab, part_vals, part_ids, part_stats, num_slices, K=k, KP=kp, SLICE=slice_len,
        num_warps=8,
    )  # fmt: skip
    out_logprobs = torch.empty(rows, k, dtype=torch.float32, device=device)
    out_ids = torch.empty(rows, k, dtype=torch.int64, device=device)
    _merge_topk_kernel[(rows,)](
        part_vals, part_ids, part_stats, num_slices, vocab, out_logprobs, out_ids, K=k, KP=kp,
        SP=triton.next_power_of_2(num_slices), num_warps=4,
    )  # fmt: skip
    return out_logprobs, out_ids
