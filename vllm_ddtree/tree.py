"""Best-first DDTree draft-tree construction.

The DFlash drafter gives, for each depth 1..D, the top-K log-probs and token ids. A draft node is a rank tuple
(r1..rd) whose score is the float32 sum of the chosen log-probs, accumulated in depth order. The tree is the
``budget`` highest-scoring nodes (ties: lexicographically smaller rank tuple first). Because log-probs are <= 0 the
score never rises along a path, so the selected set is prefix-closed and the selection order is topological.

Three implementations that produce bit-identical ``DraftTrees``:

* ``build_trees_reference``: the lazy best-first heap of the DDTree paper, in plain Python. It is the spec, and
  the CPU's fast path (vLLM-CPU).
* ``build_trees_torch``: the same search, vectorised over the batch with static shapes (CPU and CUDA).
* ``build_trees_triton``: one Triton program per request, the search held in registers (CUDA).

The torch and Triton paths never read tensor values on the host, so they can be captured in a CUDA graph.

Both fast paths keep a *frontier* of at most ``budget + 1`` candidates. Popping a candidate replaces it with its
first child and adds its next sibling. Instead of comparing rank tuples, every frontier entry carries its position
``lex`` in the lexicographic order of the frontier: entries are never ancestors of one another, so the popped
entry's first child takes its position, the next sibling the position right after it, and every later entry moves
up by one.
"""

import heapq
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from vllm_ddtree.constants import MAX_TREE_BUDGET

# Largest depth D and top-k K the Triton kernel's packed (depth, rank, parent) int32 can hold.
_MAX_PACKED = 255


@dataclass(frozen=True)
class DraftTrees:
    """A batch of draft trees; node 0 of each tree is the root (the last accepted token).

    node_tokens: [B, budget] int64, token of node i+1; 0 for padding nodes.
    parents:     [B, W] int64, W = budget+1; parents[:, 0] = -1; -1 for padding nodes.
    depth:       [B, W] int64; depth[:, 0] = 0; 0 for padding nodes.
    anc_bits:    [B, W] int64, one word per node (W <= 64): bit j of anc_bits[b, i] is set iff node j is an
                 ancestor-or-self of node i (bit 63 is the sign bit). Padding nodes: own bit.
    num_nodes:   [B] int64, number of real non-root nodes (<= budget).
    """

    node_tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    anc_bits: torch.Tensor
    num_nodes: torch.Tensor


def _check_inputs(topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, budget: int) -> None:
    if topk_logprobs.dim() != 3 or topk_ids.shape != topk_logprobs.shape:
        raise ValueError(f"expected [B, D, K] inputs, got {tuple(topk_logprobs.shape)} and {tuple(topk_ids.shape)}")
    if topk_logprobs.dtype != torch.float32 or topk_ids.dtype != torch.int64:
        raise ValueError(f"expected float32 log-probs and int64 ids, got {topk_logprobs.dtype} and {topk_ids.dtype}")
    if topk_logprobs.shape[1] < 1 or topk_logprobs.shape[2] < 1 or budget < 1:
        raise ValueError(f"need D >= 1, K >= 1 and budget >= 1, got {tuple(topk_logprobs.shape)}, budget={budget}")
    if budget > MAX_TREE_BUDGET:
        raise ValueError(
            f"a draft tree holds at most {MAX_TREE_BUDGET} nodes (one int64 ancestor word per node, "
            f"root included), got budget={budget}"
        )


def _own_bits(width: int, device: torch.device) -> torch.Tensor:
    """[W] int64: node i's own bit (bit 63 is the sign bit)."""
    return torch.ones((), dtype=torch.int64, device=device) << torch.arange(width, device=device)


def build_trees_reference(topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, budget: int) -> DraftTrees:
    """Lazy best-first heap in plain Python: the specification the fast paths are tested against."""
    _check_inputs(topk_logprobs, topk_ids, budget)
    lp = topk_logprobs.detach().cpu().numpy()
    ids = topk_ids.detach().cpu().numpy()
    batch, max_depth, k = lp.shape
    width = budget + 1
    node_tokens = np.zeros((batch, budget), dtype=np.int64)
    parents = np.full((batch, width), -1, dtype=np.int64)
    depth = np.zeros((batch, width), dtype=np.int64)
    anc = np.zeros((batch, width), dtype=np.uint64)
    for i in range(width):
        anc[:, i] = np.uint64(1) << np.uint64(i)
    num_nodes = np.zeros(batch, dtype=np.int64)
    zero = np.float32(0.0)
    for b in range(batch):
        # Entry: (-score, ranks, score, parent_score, parent_node). Ranks make ties go to the lex-smaller tuple.
        score = zero + lp[b, 0, 0]
        heap = [(-float(score), (0,), score, zero, 0)]
        node = 0
        while heap and node < budget:
            _, ranks, score, parent_score, parent = heapq.heappop(heap)
            node += 1
            d, r = len(ranks), ranks[-1]
            node_tokens[b, node - 1] = ids[b, d - 1, r]
            parents[b, node] = parent
            depth[b, node] = d
            anc[b, node] |= anc[b, parent]
            if r + 1 < k:
                sib = parent_score + lp[b, d - 1, r + 1]
                heapq.heappush(heap, (-float(sib), ranks[:-1] + (r + 1,), sib, parent_score, parent))
            if d < max_depth:
                child = score + lp[b, d, 0]
                heapq.heappush(heap, (-float(child), ranks + (0,), child, score, node))
        num_nodes[b] = node
    return DraftTrees(
        node_tokens=torch.from_numpy(node_tokens),
        parents=torch.from_numpy(parents),
        depth=torch.from_numpy(depth),
        anc_bits=torch.from_numpy(anc.view(np.int64)),
        num_nodes=torch.from_numpy(num_nodes),
    )


# Columns of the torch path's integer frontier state.
_DEPTH, _RANK, _PARENT, _LEX = range(4)
# Columns of its float frontier state.
_SCORE, _PSCORE = range(2)


def build_trees_torch(topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, budget: int) -> DraftTrees:
    """Best-first search vectorised over the batch: ``budget`` steps over a static frontier of ``budget + 1``."""
    _check_inputs(topk_logprobs, topk_ids, budget)
    batch, max_depth, k = topk_logprobs.shape
    dev = topk_logprobs.device
    width = budget + 1
    last = max_depth * k - 1
    lp = topk_logprobs.reshape(batch, max_depth * k)
    ids = topk_ids.reshape(batch, max_depth * k)
    rows = torch.arange(batch, device=dev)
    neg_inf = torch.full((), float("-inf"), device=dev)
    no_lex = torch.full((), width, dtype=torch.int64, device=dev)

    # Frontier: slot 0 holds the first node (0,) under the root; the popped slot takes the first child and slot
    # t+1 the next sibling, so budget+1 slots are enough.
    f_int = torch.zeros(batch, width, 4, dtype=torch.int64, device=dev)
    f_int[:, 0, _DEPTH] = 1
    f_flt = torch.zeros(batch, width, 2, dtype=torch.float32, device=dev)
    f_flt[:, 0, _SCORE] = f_flt[:, 0, _PSCORE] + lp[:, 0]
    f_valid = torch.zeros(batch, width, dtype=torch.bool, device=dev)
    f_valid[:, 0] = True

    node_tokens = torch.zeros(batch, budget, dtype=torch.int64, device=dev)
    parents = torch.full((batch, width), -1, dtype=torch.int64, device=dev)
    depth = torch.zeros(batch, width, dtype=torch.int64, device=dev)
    own = _own_bits(width, dev)
    anc = own.expand(batch, -1).clone()
    num_nodes = torch.zeros(batch, dtype=torch.int64, device=dev)

    for t in range(budget):
        score = f_flt[..., _SCORE]
        best = torch.where(f_valid, score, neg_inf).amax(dim=1, keepdim=True)
        cand = f_valid & (score == best)
        j = torch.where(cand, f_int[..., _LEX], no_lex).argmin(dim=1, keepdim=True)
        has = f_valid.any(dim=1)
        sel_int = f_int.gather(1, j[..., None].expand(-1, -1, 4)).squeeze(1)
        sel_flt = f_flt.gather(1, j[..., None].expand(-1, -1, 2)).squeeze(1)
        d, r, par, lex = sel_int.unbind(1)
        s, ps = sel_flt.unbind(1)

        node = t + 1
        tok = ids.gather(1, ((d - 1) * k + r).clamp(0, last)[:, None]).squeeze(1)
        node_tokens[:, t] = torch.where(has, tok, 0)
        parents[:, node] = torch.where(has, par, -1)
        depth[:, node] = torch.where(has, d, 0)
        anc[:, node] = torch.where(has, anc[rows, par] | own[node], own[node])
        num_nodes += has

        # Every entry after the popped one in lex order moves up one to make room for the next sibling.
        f_int[..., _LEX] += (f_int[..., _LEX] > lex[:, None]).long()
        child_lp = lp.gather(1, (d * k).clamp(max=last)[:, None]).squeeze(1)
        child_int = torch.stack([d + 1, torch.zeros_like(d), torch.full_like(d, node), lex], dim=1)
        child_flt = torch.stack([s + child_lp, s], dim=1)
        f_int.scatter_(1, j[..., None].expand(-1, -1, 4), child_int[:, None])
        f_flt.scatter_(1, j[..., None].expand(-1, -1, 2), child_flt[:, None])
        f_valid.scatter_(1, j, (has & (d < max_depth))[:, None])
        sib_lp = lp.gather(1, ((d - 1) * k + r + 1).clamp(max=last)[:, None]).squeeze(1)
        f_int[:, node] = torch.stack([d, r + 1, par, lex + 1], dim=1)
        f_flt[:, node] = torch.stack([ps + sib_lp, ps], dim=1)
        f_valid[:, node] = has & (r + 1 < k)

    return DraftTrees(node_tokens, parents, depth, anc, num_nodes)


@triton.jit
def _build_trees_kernel(
    lp_ptr,
    ids_ptr,
    tok_ptr,
    par_ptr,
    dep_ptr,
    anc_ptr,
    num_ptr,
    max_depth,
    k,
    BUDGET: tl.constexpr,
    BLOCK: tl.constexpr,
    TABLE: tl.constexpr,
):
    """One program per request. Frontier slots and tree nodes share the index range [0, BLOCK).

    The search is latency-bound (BUDGET dependent steps), so each step touches registers only: the [D, K]
    log-prob table is loaded once, looked up with masked reductions, and the node tokens are gathered at the end.
    Depth, rank and parent of a frontier entry travel packed in one int32 (8 + 8 + 16 bits) to save reductions.
    BUDGET is a compile-time constant: it is fixed per deployment, and a runtime loop bound breaks Triton's
    interpreter under numpy >= 2.5.
    """
    b = tl.program_id(0).to(tl.int64)
    width = BUDGET + 1
    lp_row = lp_ptr + b * max_depth * k
    ids_row = ids_ptr + b * max_depth * k
    idx = tl.arange(0, BLOCK)
    cell = tl.arange(0, TABLE)
    neg_inf = float("-inf")
    table = tl.load(lp_row + cell, mask=cell < max_depth * k, other=neg_inf)

    f_score = tl.where(idx == 0, tl.max(tl.where(cell == 0, table, neg_inf), axis=0), neg_inf)
    f_pscore = tl.zeros([BLOCK], tl.float32)
    f_packed = tl.full([BLOCK], 1, tl.int32)  # depth 1, rank 0, parent 0
    f_lex = tl.zeros([BLOCK], tl.int32)
    f_valid = idx == 0

    n_packed = tl.zeros([BLOCK], tl.int32)
    n_anc = tl.full([BLOCK], 1, tl.int64) << idx.to(tl.int64)

    for t in range(BUDGET):
        best = tl.max(tl.where(f_valid, f_score, neg_inf), axis=0)
        cand = f_valid & (f_score == best)
        lex = tl.min(tl.where(cand, f_lex, BLOCK), axis=0)
        sel = cand & (f_lex == lex)
        has = lex < BLOCK
        packed = tl.sum(tl.where(sel, f_packed, 0), axis=0)
        ps = tl.max(tl.where(sel, f_pscore, neg_inf), axis=0)
        d = packed & 0xFF
        r = (packed >> 8) & 0xFF
        par = packed >> 16

        node = t + 1
        is_node = (idx == node) & has
        n_packed = tl.where(is_node, packed, n_packed)
        par_anc = tl.sum(tl.where(idx == par, n_anc, 0), axis=0)
        n_anc = tl.where(is_node, n_anc | par_anc, n_anc)

        has_child = has & (d < max_depth)
        has_sib = has & (r + 1 < k)
        child_lp = tl.max(tl.where(cell == d * k, table, neg_inf), axis=0)
        sib_lp = tl.max(tl.where(cell == (d - 1) * k + r + 1, table, neg_inf), axis=0)
        at_new = idx == node
        f_lex = tl.where(f_lex > lex, f_lex + 1, f_lex)
        f_score = tl.where(sel, best + child_lp, tl.where(at_new, ps + sib_lp, f_score))
        f_pscore = tl.where(sel, best, tl.where(at_new, ps, f_pscore))
        f_packed = tl.where(sel, (d + 1) | (node << 16), tl.where(at_new, d | ((r + 1) << 8) | (par << 16), f_packed))
        f_lex = tl.where(at_new, lex + 1, f_lex)
        f_valid = tl.where(sel, has_child, tl.where(at_new, has_sib, f_valid))

    n_dep = n_packed & 0xFF
    n_rank = (n_packed >> 8) & 0xFF
    real = (idx >= 1) & (idx < width) & (n_dep > 0)
    n_tok = tl.load(ids_row + (n_dep - 1) * k + n_rank, mask=real, other=0)
    n_par = tl.where(real, n_packed >> 16, -1)
    in_tree = idx < width
    tl.store(tok_ptr + b * BUDGET + idx - 1, n_tok, mask=(idx >= 1) & in_tree)
    tl.store(par_ptr + b * width + idx, n_par.to(tl.int64), mask=in_tree)
    tl.store(dep_ptr + b * width + idx, n_dep.to(tl.int64), mask=in_tree)
    tl.store(anc_ptr + b * width + idx, n_anc, mask=in_tree)
    tl.store(num_ptr + b, tl.sum(real.to(tl.int64), axis=0))


def build_trees_triton(topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, budget: int) -> DraftTrees:
    """Triton path: one program per request, the tree's ancestor words in registers."""
    _check_inputs(topk_logprobs, topk_ids, budget)
    width = budget + 1
    if topk_logprobs.shape[1] > _MAX_PACKED or topk_logprobs.shape[2] > _MAX_PACKED:
        raise ValueError(f"the Triton tree builder packs depth and rank in 8 bits each, got {topk_logprobs.shape}")
    batch, max_depth, k = topk_logprobs.shape
    dev = topk_logprobs.device
    node_tokens = torch.empty(batch, budget, dtype=torch.int64, device=dev)
    parents = torch.empty(batch, width, dtype=torch.int64, device=dev)
    depth = torch.empty(batch, width, dtype=torch.int64, device=dev)
    anc = torch.empty(batch, width, dtype=torch.int64, device=dev)
    num_nodes = torch.empty(batch, dtype=torch.int64, device=dev)
    if batch > 0:
        _build_trees_kernel[(batch,)](
            topk_logprobs.contiguous(),
            topk_ids.contiguous(),
            node_tokens,
            parents,
            depth,
            anc,
            num_nodes,
            max_depth,
            k,
            BUDGET=budget,
            BLOCK=triton.next_power_of_2(width),
            TABLE=triton.next_power_of_2(max_depth * k),
            num_warps=1,
        )
    return DraftTrees(node_tokens, parents, depth, anc, num_nodes)


def build_trees(topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, budget: int) -> DraftTrees:
    """Build the draft trees: on CUDA the Triton kernel where its packed state holds D and K, else the torch path;
    on the CPU the heap, whose few Python operations a node beat the torch path's thirty-odd tensor launches a node
    (each a few microseconds of dispatch on a CPU)."""
    if not topk_logprobs.is_cuda:
        return build_trees_reference(topk_logprobs, topk_ids, budget)
    d, k = topk_logprobs.shape[1:]
    if max(d, k) <= _MAX_PACKED:
        return build_trees_triton(topk_logprobs, topk_ids, budget)
    return build_trees_torch(topk_logprobs, topk_ids, budget)
