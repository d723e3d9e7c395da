"""Tree acceptance: walk each verified draft tree along the target's own token choices.

Every node of a draft tree got its own target distribution in the verify pass.  The target picks one token at
each node (argmax when greedy, one independent draw when sampling); the accepted path starts at the root and
moves to the child whose draft token equals the target's pick at the current node, until no child matches.
The output is the path's tokens followed by the target's pick at the last path node (the bonus token).  Every
emitted token is therefore the target's own choice under its exact context, which makes the walk lossless.

The walk is written without loops or host synchronisation so that it can run inside a CUDA graph: node ``j`` is
on the path iff every non-root ancestor-or-self ``k`` of ``j`` matched (``node_tokens[k-1] ==
target_tokens[parent[k]]``).  Matches are packed into one bit word and compared with the ancestor bitmask.

All functions take the tree fields of ``vllm_ddtree.tree.DraftTrees`` as separate tensors, so callers can pass
persistent buffers directly (``walk_trees(t.node_tokens, t.parents, t.anc_bits, t.num_nodes, ...)``):

- ``node_tokens`` ``[B, budget]`` int64: draft token of node ``i+1`` (node 0 is the root);
- ``parents`` ``[B, W]`` int64, ``W = budget+1``: parent index, topological (``parent < child``), -1 for the root
  and for padding;
- ``anc_bits`` ``[B, W]`` int64, ``W <= 64``: bit ``j`` of node ``i``'s word is set iff ``j`` is an ancestor-or-self
  of ``i`` (a tree is at most 64 tokens: the config caps the budget at 63);
- ``num_nodes`` ``[B]`` int64: real nodes are ``1..num_nodes``; nodes after them are padding and never accepted.

Siblings must carry distinct tokens (so at most one child can match), as the tree builder guarantees.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from vllm_ddtree import envs
from vllm_ddtree.constants import MAX_TREE_BUDGET, MAX_TREE_WIDTH


@dataclass(frozen=True)
class AcceptedPaths:
    """Result of the walk, laid out for vLLM's ``SamplerOutput`` and the KV-compaction step."""

    accepted_nodes: Tensor  # [B, max_depth+1] int64: node index at path depth d (column 0 = root); -1 past the path
    num_accepted: Tensor  # [B] int64: number of accepted draft nodes a
    output_tokens: Tensor  # [B, budget+1] int64: path tokens, then the bonus token, then -1


def _check_masks(anc_bits: Tensor) -> None:
    """Refuse ancestor masks that are not one int64 word per node: wider trees cannot be verified (the config caps
    the budget so that they never occur)."""
    if anc_bits.dim() != 2 or anc_bits.shape[1] > MAX_TREE_WIDTH:
        raise ValueError(
            f"ancestor masks must be [B, W] int64 with W <= {MAX_TREE_WIDTH} (one word per node, root "
            f"included: budget <= {MAX_TREE_BUDGET}), got shape {tuple(anc_bits.shape)}"
        )


def _pack_bits(flags: Tensor) -> Tensor:
    """Pack bool flags ``[B, W]`` (W <= 64) into one int64 word ``[B]``, node ``j`` at bit ``j``.

    The bits are disjoint, so an integer sum is their OR (bit 63 wraps to the sign bit, as in the ancestor masks).
    """
    width = flags.shape[1]
    weights = torch.ones(width, dtype=torch.int64, device=flags.device) << torch.arange(
        width, dtype=torch.int64, device=flags.device
    )
    return (flags.to(torch.int64) * weights).sum(-1)


def walk_trees_torch(
    node_tokens: Tensor,
    parents: Tensor,
    anc_bits: Tensor,
    num_nodes: Tensor,
    target_tokens: Tensor,
    max_depth: int,
) -> AcceptedPaths:
    """Accept, per tree, the longest root path whose draft tokens equal the target's picks at their parents.

    ``target_tokens`` ``[B, W]`` int64 is the target's chosen token at each node.  ``max_depth`` fixes the width of
    ``accepted_nodes`` (static shapes for CUDA graphs); paths are cut at that depth, so pass the trees' maximum
    depth.  Pure tensor ops with static shapes: no host synchronisation, the same code on CPU and CUDA.
    """
    _check_masks(anc_bits)
    batch, budget = node_tokens.shape
    width = budget + 1
    device = node_tokens.device
    node_idx = torch.arange(width, dtype=torch.int64, device=device)

    # matched[k]: node k's draft token is the target's pick at its parent (the root always "matches").
    parent_pick = target_tokens.gather(1, parents.clamp(min=0))
    real = (node_idx >= 1) & (node_idx <= num_nodes.unsqueeze(1))
    matched = real.clone()
    matched[:, 1:] &= node_tokens == parent_pick[:, 1:]
    matched[:, 0] = True

    # on_path[j]: every ancestor-or-self of j matched, i.e. j's mask has no bit outside the matched set.  The mask
    # holds j's own bit, so unmatched and padding nodes drop out.
    on_path = (anc_bits & ~_pack_bits(matched).unsqueeze(1)) == 0

    # The path is a chain in index order (topological), so a running count gives each path node's depth.
    path_depth = on_path.cumsum(1) - 1
    on_path &= path_depth <= max_depth
    num_accepted = on_path.sum(1) - 1

    # Scatter path nodes to their depth; everything else goes to a spill column that is dropped.
    spill = max_depth + 1
    nodes = torch.full((batch, spill + 1), -1, dtype=torch.int64, device=device)
    nodes.scatter_(1, torch.where(on_path, path_depth, spill), node_idx.expand(batch, width))
    accepted_nodes = nodes[:, :spill]

    # Output row: token of the path node at depth d in column d-1, then the bonus at column a (spill: column W).
    out = torch.full((batch, width + 1), -1, dtype=torch.int64, device=device)
    out.scatter_(1, torch.where(on_path[:, 1:], path_depth[:, 1:] - 1, width), node_tokens)
    last = accepted_nodes.gather(1, num_accepted.unsqueeze(1))
    out.scatter_(1, num_accepted.unsqueeze(1), target_tokens.gather(1, last))
    return AcceptedPaths(accepted_nodes=accepted_nodes, num_accepted=num_accepted, output_tokens=out[:, :width])


def walk_verify_batch_torch(
    picks: Tensor,
    inputs: Tensor,
    cu_num_logits: Tensor,
    tree_rows: Tensor,
    parents: Tensor,
    anc_bits: Tensor,
    num_nodes: Tensor,
    max_depth: int,
) -> AcceptedPaths:
    """``walk_verify_batch`` in torch ops (the reference): gather each request's verify rows into ``[B, W]``."""
    budget = parents.shape[1] - 1
    starts = cu_num_logits[:-1].to(torch.int64)
    counts = cu_num_logits[1:].to(torch.int64) - starts
    col = torch.arange(budget + 1, device=picks.device)
    index = (starts[:, None] + col[None, :]).clamp(0, max(picks.shape[0] - 1, 0))
    target = torch.where(col[None, :] < counts[:, None], picks.to(torch.int64)[index], -1)
    tokens = torch.where(col[None, 1:] < counts[:, None], inputs.to(torch.int64)[index[:, 1:]], 0)
    rows = tree_rows.to(torch.int64)
    rows = torch.where(rows >= 0, rows, parents.shape[0] - 1)
    return walk_trees_torch(
        tokens, parents[rows], anc_bits[rows], torch.minimum(counts - 1, num_nodes[rows]), target, max_depth
    )


@triton.jit
def _walk_kernel(
    pick_ptr,
    input_ptr,
    cu_ptr,
    row_ptr,
    par_ptr,
    anc_ptr,
    num_ptr,
    acc_ptr,
    num_acc_ptr,
    out_ptr,
    num_sampled_ptr,
    trash_row,
    max_depth,
    BUDGET: tl.constexpr,
    BLOCK: tl.constexpr,
    COLS: tl.constexpr,
):
    """One program per request, the same ancestor-bitmask test as ``walk_trees_torch`` held in registers; the
    request's verify rows are read straight from the flat batch (row i = node i) and its tree from its buffer row."""
    b = tl.program_id(0).to(tl.int64)
    width = BUDGET + 1
    idx = tl.arange(0, BLOCK)
    start = tl.load(cu_ptr + b).to(tl.int64)
    count = tl.load(cu_ptr + b + 1).to(tl.int64) - start
    row = tl.load(row_ptr + b).to(tl.int64)
    row = tl.where(row >= 0, row, trash_row)
    in_tree = idx < width
    present = idx < count
    parents = tl.load(par_ptr + row * width + idx, mask=in_tree, other=-1)
    anc = tl.load(anc_ptr + row * width + idx, mask=in_tree, other=0)
    picks = tl.load(pick_ptr + start + idx, mask=present & in_tree, other=-1).to(tl.int64)
    tokens = tl.load(input_ptr + start + idx, mask=(idx >= 1) & present & in_tree, other=-1).to(tl.int64)
    num_nodes = tl.minimum(tl.load(num_ptr + row), count - 1)
    parent_pick = tl.load(pick_ptr + start + tl.maximum(parents, 0), mask=in_tree & (parents < count), other=-1)
    matched = (idx == 0) | ((idx <= num_nodes) & (tokens == parent_pick.to(tl.int64)))
    matched_bits = tl.sum(tl.where(matched, tl.full([BLOCK], 1, tl.int64) << idx.to(tl.int64), 0), axis=0)
    on_path = in_tree & ((anc & ~matched_bits) == 0)
    depth = tl.cumsum(on_path.to(tl.int32), axis=0) - 1
    on_path = on_path & (depth <= max_depth)
    num_acc = tl.sum(on_path.to(tl.int64), axis=0) - 1

    col = tl.arange(0, COLS)
    at = on_path[None, :] & (depth[None, :] == col[:, None])  # [COLS, BLOCK]: path node at depth col
    node_at = tl.sum(tl.where(at, idx[None, :], 0), axis=1)
    found = tl.sum(at.to(tl.int32), axis=1) > 0
    tl.store(acc_ptr + b * (max_depth + 1) + col, tl.where(found, node_at, -1), mask=col <= max_depth)
    tl.store(num_acc_ptr + b, num_acc)
    tl.store(num_sampled_ptr + b, (num_acc + 1).to(tl.int32))

    # Output column c < a holds the token of the path node at depth c+1; column a the pick at the last node.
    out_col = tl.arange(0, BLOCK)
    token_at = tl.sum(tl.where(on_path[None, :] & (depth[None, :] == out_col[:, None] + 1), tokens[None, :], 0), 1)
    bonus = tl.sum(tl.where(on_path & (depth == num_acc), picks, 0), axis=0)
    out = tl.where(out_col < num_acc, token_at, tl.where(out_col == num_acc, bonus, -1))
    tl.store(out_ptr + b * width + out_col, out, mask=out_col < width)


def walk_verify_batch(
    picks: Tensor,
    inputs: Tensor,
    cu_num_logits: Tensor,
    tree_rows: Tensor,
    parents: Tensor,
    anc_bits: Tensor,
    num_nodes: Tensor,
    max_depth: int,
) -> tuple[AcceptedPaths, Tensor]:
    """The walk of a whole verify batch in one launch, straight from the runner's flat tensors.

    Request ``b``'s verify rows are ``cu_num_logits[b] .. cu_num_logits[b+1]-1``; row ``i`` is node ``i``, so
    ``picks[row]`` is the target's choice at the node and ``inputs[row]`` (``i >= 1``) the node's draft token. Its
    tree is row ``tree_rows[b]`` of the persistent ``parents`` / ``anc_bits`` ``[R, W]`` and ``num_nodes`` ``[R]``
    (``W <= 64``; -1, a padded batch row, reads the last buffer row); nodes beyond the request's verified rows are
    not real. Returns the paths and ``num_sampled`` ``[B]`` int32 (accepted + bonus). Triton on CUDA (and under the
    Triton interpreter), else ``walk_verify_batch_torch``; static shapes, no sync.
    """
    _check_masks(anc_bits)
    batch, width = tree_rows.shape[0], parents.shape[1]
    device = picks.device
    if not (picks.is_cuda or envs.TRITON_INTERPRET):
        paths = walk_verify_batch_torch(
            picks, inputs, cu_num_logits, tree_rows, parents, anc_bits, num_nodes, max_depth
        )
        return paths, (paths.num_accepted + 1).to(torch.int32)
    accepted_nodes = torch.empty(batch, max_depth + 1, dtype=torch.int64, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    out = torch.empty(batch, width, dtype=torch.int64, device=device)
    num_sampled = torch.empty(batch, dtype=torch.int32, device=device)
    if batch > 0:
        _walk_kernel[(batch,)](
            picks,
            inputs,
            cu_num_logits,
            tree_rows,
            parents,
            anc_bits,
            num_nodes,
            accepted_nodes,
            num_accepted,
            out,
            num_sampled,
            parents.shape[0] - 1,
            max_depth,
            BUDGET=width - 1,
            BLOCK=triton.next_power_of_2(width),
            COLS=triton.next_power_of_2(max_depth + 1),
            num_warps=2,
        )
    return AcceptedPaths(accepted_nodes=accepted_nodes, num_accepted=num_accepted, output_tokens=out), num_sampled


def walk_trees_triton(
    node_tokens: Tensor, parents: Tensor, anc_bits: Tensor, num_nodes: Tensor, target_tokens: Tensor, max_depth: int
) -> AcceptedPaths:
    """``walk_trees`` through the batch kernel (CUDA): one launch instead of ~30 small kernels."""
    batch, budget = node_tokens.shape
    width = budget + 1
    device = node_tokens.device
    inputs = torch.cat([torch.zeros(batch, 1, dtype=torch.int64, device=device), node_tokens.to(torch.int64)], 1)
    cu = torch.arange(batch + 1, dtype=torch.int64, device=device) * width
    rows = torch.arange(batch, dtype=torch.int64, device=device)
    paths, _ = walk_verify_batch(
        target_tokens.to(torch.int64).contiguous().view(-1),
        inputs.view(-1),
        cu,
        rows,
        parents.contiguous(),
        anc_bits.contiguous(),
        num_nodes.contiguous(),
        max_depth,
    )
    return paths


def walk_trees(
    node_tokens: Tensor, parents: Tensor, anc_bits: Tensor, num_nodes: Tensor, target_tokens: Tensor, max_depth: int
) -> AcceptedPaths:
    """The tree walk: the fused Triton kernel on CUDA, else the pure-torch path (same result)."""
    if node_tokens.is_cuda:
        return walk_trees_triton(node_tokens, parents, anc_bits, num_nodes, target_tokens, max_depth)
    return walk_trees_torch(node_tokens, parents, anc_bits, num_nodes, target_tokens, max_depth)


def sample_per_node(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Draw one token per node from ``probs`` ``[..., V]`` (need not be normalised); returns ``[...]`` int64.

    Uses the exponential-race form ``argmax(p / E)`` with ``E ~ Exp(1)`` (as vLLM's sampler does): it is an exact
    categorical draw, needs no host synchronisation, and takes an optional generator for reproducible draws.
    """
    noise = torch.empty(probs.shape, dtype=torch.float32, device=probs.device).exponential_(generator=generator)
    return (probs.float() / noise).argmax(-1)


def greedy_walk(
    node_tokens: Tensor,
    parents: Tensor,
    anc_bits: Tensor,
    num_nodes: Tensor,
    target_logits: Tensor,
    max_depth: int,
) -> AcceptedPaths:
    """Greedy acceptance: the target's pick at each node is the argmax of its logits ``[B, W, V]``."""
    return walk_trees(node_tokens, parents, anc_bits, num_nodes, target_logits.argmax(-1), max_depth)


def sampled_walk(
    node_tokens: Tensor,
    parents: Tensor,
    anc_bits: Tensor,
    num_nodes: Tensor,
    target_probs: Tensor,
    max_depth: int,
    generator: torch.Generator | None = None,
) -> AcceptedPaths:
    """Sampling acceptance: one independent draw per node from the target's processed probabilities ``[B, W, V]``.

    Lossless because every emitted token is a draw from the target under its exact ancestor context.
    """
    return walk_trees(node_tokens, parents, anc_bits, num_nodes, sample_per_node(target_probs, generator), max_depth)


def path_permutation(logits_start: torch.Tensor, paths: AcceptedPaths, num_tokens: int) -> torch.Tensor:
    """``[num_tokens]`` gather index that puts each request's accepted path in path order: row ``root + k`` takes
    the row of the path's node at depth ``k`` (``k <= a``); every other row keeps its own. Static shapes, no sync."""
    device = logits_start.device
    depth = torch.arange(paths.accepted_nodes.shape[1], device=device)
    keep = (depth[None, :] <= paths.num_accepted[:, None]) & (paths.accepted_nodes >= 0)
    start = logits_start.to(torch.int64)[:, None]
    trash = torch.full_like(paths.accepted_nodes, num_tokens)
    dst = torch.where(keep, start + depth[None, :], trash)
    src = torch.where(keep, start + paths.accepted_nodes, trash)
    index = torch.arange(num_tokens + 1, device=device)
    index.scatter_(0, dst.flatten(), src.flatten())
    return index[:num_tokens]
