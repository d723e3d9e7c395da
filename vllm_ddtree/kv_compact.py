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

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

# Element type used to move payload bits, by element size in bytes (integer loads and stores keep NaN payloads).
_BITS_DTYPE = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
# Upper bound on the elements of one program's tile (path rows x payload chunk), to bound register use.
_TILE_ELEMS = 4096


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
    payload_len,
    BITS: tl.constexpr,
    PATH: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program per (request, layer, payload chunk): load the chunk of every path row, then store them all."""
    req = tl.program_id(0)
    layer = tl.program_id(1)
    chunk = tl.program_id(2)

    depth = 1 + tl.arange(0, PATH).to(tl.int64)
    num_acc = tl.load(num_accepted + req * num_acc_stride).to(tl.int64)
    node_ptrs = accepted_nodes + req * acc_stride_req + depth * acc_stride_col
    nodes = tl.load(node_ptrs, mask=depth < num_cols, other=-1).to(tl.int64)
    valid = (depth <= num_acc) & (nodes >= 0) & (nodes != depth)
    start = tl.load(query_start_loc + req * qsl_stride).to(tl.int64)
    src = tl.load(slot_mapping + (start + nodes) * slot_stride, mask=valid, other=-1).to(tl.int64)
    dst = tl.load(slot_mapping + (start + depth) * slot_stride, mask=valid, other=-1).to(tl.int64)
    valid = valid & (src >= 0) & (dst >= 0)
    src_base = (src // block_size) * stride_block + (src % block_size) * stride_offset
    dst_base = (dst // block_size) * stride_block + (dst % block_size) * stride_offset

    elem = chunk * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    elem_off = (elem // row_len) * stride_row + elem % row_len
    mask = valid[:, None] & (elem < payload_len)[None, :]

    cache = tl.load(layer_ptrs + layer).to(tl.pointer_type(BITS))
    rows = tl.load(cache + src_base[:, None] + elem_off[None, :], mask=mask)
    # A destination may be another row's source: every thread's reads must finish before any thread writes.
    tl.debug_barrier()
    tl.store(cache + dst_base[:, None] + elem_off[None, :], rows, mask=mask)


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
        if max_num_reqs < 1 or max_path_len < 1:
            raise ValueError(f"max_num_reqs={max_num_reqs} and max_path_len={max_path_len} must be positive")

        self._caches = caches
        self._block_dim = block_dim
        self._offset_dim = offset_dim
        self._max_num_reqs = max_num_reqs
        self._max_path_len = max_path_len
        self._use_triton = first.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
        # The caches are persistent, so their base addresses can live in a device table built once.
        self._layer_ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=first.device)
        row_dim = row_dims[0] if row_dims else None
        self._num_rows = first.shape[row_dim] if row_dim is not None else 1
        self._stride_row = first.stride(row_dim) if row_dim is not None else 0
        self._path_tile = triton.next_power_of_2(max_path_len)
        payload_len = self._num_rows * first.shape[-1]
        self._chunk = min(triton.next_power_of_2(payload_len), max(16, _TILE_ELEMS // self._path_tile))
        self._num_chunks = triton.cdiv(payload_len, self._chunk)

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
        first = self._caches[0]
        grid = (batch, len(self._caches), self._num_chunks)
        _compact_kv_kernel[grid](
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
            first.shape[self._offset_dim],
            first.stride(self._block_dim),
            first.stride(self._offset_dim),
            self._stride_row,
            first.shape[-1],
            self._num_rows * first.shape[-1],
            BITS=_BITS_DTYPE[first.element_size()],
            PATH=self._path_tile,
            CHUNK=self._chunk,
        )
