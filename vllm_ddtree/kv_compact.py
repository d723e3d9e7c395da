"""KV compaction: after a tree verify, move the accepted path's KV entries to the linear slots of the history.

The verify pass wrote node ``i`` of request ``b`` to slot ``slot_mapping[query_start_loc[b] + i]`` (linear
position ``base + i``), although rejected siblings sit between the accepted nodes.  Once the walk has accepted
path ``p_0 = 0 < p_1 < ... < p_a`` the cache must read like the linear history ``base, base+1, ..., base+a``, so
for every target attention layer the KV of node ``p_k`` is copied from slot ``slot_mapping[qs + p_k]`` to slot
``slot_mapping[qs + k]`` (``k = 1..a``; nothing to do where ``p_k == k``, e.g. along a chain prefix).

A destination can be another copy's source (``k == p_j`` for some ``j < k``), so all reads happen before all
writes.  Slots are ``block * block_size + offset``; slot -1 marks a padding row and is never touched.  Block 0
(slots ``0..block_size-1``) is vLLM's null block, which never holds real KV: copies that must not happen become
identity copies of slot 0, which keeps every shape static and the whole step free of host synchronisation.

Cache tensors are the per-layer logical views vLLM hands to the attention layers: MLA ``[num_blocks, block_size,
head_dim]`` (block dim 0, offset dim 1) and GQA ``[num_blocks, num_kv_heads, block_size, 2*head_size]`` (block dim
0, offset dim 2) in any physical order (NHD/HND, or carved out of a tensor with a layers dimension).  Only the
last dim is assumed to be stride-1; everything else is addressed through strides, and payload bytes are copied
verbatim whatever the dtype (fp8 caches are uint8 bytes).
"""

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from vllm_ddtree import envs

# Element type used to move payload bits, by element size in bytes (integer loads and stores keep NaN payloads).
_BITS_DTYPE = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
# Words one program moves per load/store (a 1152-byte MLA row is 144 int64 words).
_MAX_CHUNK = 1024


def _copy_slots(
    slot_mapping: Tensor, query_start_loc: Tensor, accepted_nodes: Tensor, num_accepted: Tensor
) -> tuple[Tensor, Tensor]:
    """Source and destination slots ``[B, D]`` for path depths ``1..D``; copies to skip become ``0 -> 0``."""
    batch, width = accepted_nodes.shape
    depth = torch.arange(1, width, device=accepted_nodes.device, dtype=torch.int64)
    nodes = accepted_nodes[:, 1:].to(torch.int64)
    start = query_start_loc[:batch].to(torch.int64).unsqueeze(1)
    valid = (depth <= num_accepted.to(torch.int64).unsqueeze(1)) & (nodes >= 0) & (nodes != depth)
    slots = slot_mapping.to(torch.int64)
    src = slots[torch.where(valid, start + nodes, 0)]
    dst = slots[torch.where(valid, start + depth, 0)]
    valid &= (src >= 0) & (dst >= 0)
    return torch.where(valid, src, 0), torch.where(valid, dst, 0)


def compact_kv_reference(
    kv_caches: Sequence[Tensor],
    block_dim: int,
    offset_dim: int,
    slot_mapping: Tensor,
    query_start_loc: Tensor,
    accepted_nodes: Tensor,
    num_accepted: Tensor,
) -> None:
    """Copy each accepted path node's KV to its linear slot in every cache, in place (gather, then scatter).

    ``accepted_nodes`` is ``[B, D+1]`` (column 0 = root, -1 past the path) and ``num_accepted`` ``[B]``; node ``i``
    of request ``b`` is row ``query_start_loc[b] + i`` of ``slot_mapping``.  Pure torch with static shapes and no
    host synchronisation, so it also serves as the CPU path and as the oracle for the Triton kernel.
    """
    src, dst = _copy_slots(slot_mapping, query_start_loc, accepted_nodes, num_accepted)
    src, dst = src.flatten(), dst.flatten()
    for cache in kv_caches:
        block_size = cache.shape[offset_dim]
        src_index: list = [slice(None)] * cache.dim()
        dst_index: list = [slice(None)] * cache.dim()
        src_index[block_dim], src_index[offset_dim] = src // block_size, src % block_size
        dst_index[block_dim], dst_index[offset_dim] = dst // block_size, dst % block_size
        cache[tuple(dst_index)] = cache[tuple(src_index)]


def compact_kv_slabs(
    kv_caches: Sequence[Tensor],
    token_elems: Tensor,
    slot_mapping: Tensor,
    query_start_loc: Tensor,
    accepted_nodes: Tensor,
    num_accepted: Tensor,
) -> None:
    """``compact_kv_reference`` for caches that pack each block per ISA (vLLM-CPU's CPU_ATTN).

    There a token's K and V are not a row of the logical ``(num_blocks, num_kv_heads, block_size, 2*head_size)``
    view: each (block, kv-head) slab of ``block_size * 2*head_size`` elements is laid out for the CPU's matrix
    units. ``token_elems[o]`` lists the slab offsets holding token ``o``'s K and V; copying those moves the token.
    """
    src, dst = _copy_slots(slot_mapping, query_start_loc, accepted_nodes, num_accepted)
    src, dst = src.flatten(), dst.flatten()
    block_size = token_elems.shape[0]
    for cache in kv_caches:
        slabs = cache.view(cache.shape[0], cache.shape[1], -1)
        heads = torch.arange(cache.shape[1], device=cache.device)[None, :, None]
        src_elems = token_elems[src % block_size][:, None, :]
        dst_elems = token_elems[dst % block_size][:, None, :]
        slabs[(dst // block_size)[:, None, None], heads, dst_elems] = slabs[
            (src // block_size)[:, None, None], heads, src_elems
        ]


@triton.jit
def _compact_kv_kernel(
    layer_ptrs,
    slot_mapping,
    slot_stride,
    query_start_loc,
    qsl_stride,
    accepted_nodes,
    acc_stride_req,
    acc_stride_col,
    num_cols,
    num_accepted,
    num_acc_stride,
    block_size,
    stride_block,
    stride_offset,
    stride_row,
    row_len,
    WORD: tl.constexpr,
    PATH: tl.constexpr,
    PATH_TILE: tl.constexpr,
    NUM_ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program per (request, layer): copy path rows k = 1..a in ascending k, each row word by word.

    Ascending order is what makes the in-place copy safe: a destination k can only be the source of an earlier
    copy j < k (p_j = k), which has already been read.  The element-to-thread mapping is the same for every k,
    so each thread reads a word before it (later) overwrites it; the barrier keeps that true across the loop.
    Strides and lengths are in WORD units (the widest integer that divides the payload's layout).
    """
    req = tl.program_id(0)
    layer = tl.program_id(1)
    num_acc = tl.load(num_accepted + req * num_acc_stride).to(tl.int64)
    start = tl.load(query_start_loc + req * qsl_stride).to(tl.int64)
    cache = tl.load(layer_ptrs + layer).to(tl.pointer_type(WORD))
    # All index loads happen up front, as vectors over the path, so the copy loop waits on payload loads only.
    depth = 1 + tl.arange(0, PATH_TILE).to(tl.int64)
    in_path = depth <= PATH
    nodes = tl.load(
        accepted_nodes + req * acc_stride_req + depth * acc_stride_col, mask=in_path & (depth < num_cols), other=-1
    ).to(tl.int64)
    valid = (depth <= num_acc) & (nodes >= 0) & (nodes != depth)
    src = tl.load(slot_mapping + (start + nodes) * slot_stride, mask=valid, other=-1).to(tl.int64)
    dst = tl.load(slot_mapping + (start + depth) * slot_stride, mask=valid, other=-1).to(tl.int64)
    valid = valid & (src >= 0) & (dst >= 0)
    src_off = (src // block_size) * stride_block + (src % block_size) * stride_offset
    dst_off = (dst // block_size) * stride_block + (dst % block_size) * stride_offset
    word = tl.arange(0, CHUNK)
    for k in range(1, PATH + 1):
        at = (depth == k) & valid
        copy = tl.sum(at.to(tl.int32), axis=0) > 0
        src_base = cache + tl.sum(tl.where(at, src_off, 0), axis=0)
        dst_base = cache + tl.sum(tl.where(at, dst_off, 0), axis=0)
        for row in range(NUM_ROWS):
            for first in range(0, row_len, CHUNK):
                mask = copy & (first + word < row_len)
                offs = row * stride_row + first + word
                tl.store(dst_base + offs, tl.load(src_base + offs, mask=mask), mask=mask)
        tl.debug_barrier()


def _word_bytes(cache: Tensor) -> int:
    """Widest integer (8, 4, 2 or 1 bytes) that tiles the payload rows and every stride of ``cache``."""
    size = cache.element_size()
    extents = [cache.shape[-1] * size, cache.data_ptr()] + [st * size for st in cache.stride()[:-1]]
    return next(w for w in (8, 4, 2, 1) if w >= size and all(e % w == 0 for e in extents))


class KVCompactor:
    """Compaction for a fixed set of persistent caches (all target layers of one KV-cache group).

    Built once and reused every step.  With Triton available for the caches' device (CUDA, or the Triton
    interpreter) every call is ONE kernel launch over a device table of the layers' base addresses; the launch
    only reads the index tensors on the device, so it can be captured in a CUDA graph.  Otherwise it falls back to
    ``compact_kv_reference``.  ``max_path_len`` is the tree depth D (``accepted_nodes`` has at most D+1 columns).
    """

    def __init__(
        self, kv_caches: Sequence[Tensor], block_dim: int, offset_dim: int, max_num_reqs: int, max_path_len: int
    ) -> None:
        caches = list(kv_caches)
        if not caches:
            raise ValueError("KVCompactor needs at least one KV cache tensor")
        first = caches[0]
        for name, prop in (
            ("dtype", lambda c: c.dtype),
            ("shape", lambda c: tuple(c.shape)),
            ("strides", lambda c: c.stride()),
            ("device", lambda c: c.device),
        ):
            values = {str(prop(c)) for c in caches}
            if len(values) > 1:
                raise ValueError(f"all KV caches of one KVCompactor must share {name}; got {sorted(values)}")
        ndim = first.dim()
        if not (0 <= block_dim < ndim - 1 and 0 <= offset_dim < ndim - 1 and block_dim != offset_dim):
            raise ValueError(f"block_dim={block_dim} and offset_dim={offset_dim} must be distinct non-last dims")
        if first.stride(-1) != 1:
            raise ValueError(f"the last KV cache dim must be stride-1; strides are {first.stride()}")
        row_dims = [d for d in range(ndim - 1) if d not in (block_dim, offset_dim)]
        if len(row_dims) > 1:
            raise ValueError(f"at most one payload dim besides the last is supported; cache shape is {first.shape}")
        if first.element_size() not in _BITS_DTYPE:
            raise ValueError(f"unsupported KV cache element size {first.element_size()}")
        word = min(_word_bytes(c) for c in caches)
        if max_num_reqs < 1 or max_path_len < 1:
            raise ValueError(f"max_num_reqs={max_num_reqs} and max_path_len={max_path_len} must be positive")

        self._caches = caches
        self._block_dim = block_dim
        self._offset_dim = offset_dim
        self._max_num_reqs = max_num_reqs
        self._max_path_len = max_path_len
        self._use_triton = first.is_cuda or envs.TRITON_INTERPRET
        # The caches are persistent, so their base addresses can live in a device table built once.
        self._layer_ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=first.device)
        # Addresses are computed in words of `word` bytes: fewer, wider loads and stores per KV row.
        scale = word // first.element_size()
        row_dim = row_dims[0] if row_dims else None
        self._word = _BITS_DTYPE[word]
        self._num_rows = first.shape[row_dim] if row_dim is not None else 1
        self._stride_row = first.stride(row_dim) // scale if row_dim is not None else 0
        self._stride_block = first.stride(block_dim) // scale
        self._stride_offset = first.stride(offset_dim) // scale
        self._row_len = first.shape[-1] // scale
        self._chunk = min(triton.next_power_of_2(self._row_len), _MAX_CHUNK)

    def __call__(
        self, slot_mapping: Tensor, query_start_loc: Tensor, accepted_nodes: Tensor, num_accepted: Tensor
    ) -> None:
        """Compact every cache in place for this step's accepted paths (see ``compact_kv_reference``)."""
        batch, width = accepted_nodes.shape
        if batch > self._max_num_reqs or width - 1 > self._max_path_len:
            raise ValueError(
                f"accepted_nodes {tuple(accepted_nodes.shape)} exceeds max_num_reqs={self._max_num_reqs} "
                f"or max_path_len+1={self._max_path_len + 1}"
            )
        if not self._use_triton:
            compact_kv_reference(
                self._caches,
                self._block_dim,
                self._offset_dim,
                slot_mapping,
                query_start_loc,
                accepted_nodes,
                num_accepted,
            )
            return
        if batch == 0:
            return
        _compact_kv_kernel[(batch, len(self._caches))](
            self._layer_ptrs,
            slot_mapping,
            slot_mapping.stride(0),
            query_start_loc,
            query_start_loc.stride(0),
            accepted_nodes,
            accepted_nodes.stride(0),
            accepted_nodes.stride(1),
            width,
            num_accepted,
            num_accepted.stride(0),
            self._caches[0].shape[self._offset_dim],
            self._stride_block,
            self._stride_offset,
            self._stride_row,
            self._row_len,
            WORD=self._word,
            PATH=self._max_path_len,
            PATH_TILE=triton.next_power_of_2(self._max_path_len),
            NUM_ROWS=self._num_rows,
            CHUNK=self._chunk,
            num_warps=4,
        )
