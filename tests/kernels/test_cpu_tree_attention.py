"""DDTree CPU tree attention against a pure-torch fp32 reference over the paged cache, and against CPU_ATTN itself.

The backend's impl is driven directly (metadata from its builder, a hand-made config), not through an engine.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.config.vllm import set_current_vllm_config
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_ddtree.backends.cpu import (
    DDTreeCPUAttentionBackend,
    DDTreeCPUAttentionImpl,
    DDTreeCPUAttentionMetadataBuilder,
    cache_layout,
)
from vllm_ddtree.config import DDTreeConfig
from vllm_ddtree.tree_mask import TreeMaskBuffers, causal_bits, install_tree_masks

NUM_HEADS, NUM_KV_HEADS, BLOCK_SIZE = 4, 2, 16
LAYER = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)


@pytest.fixture(autouse=True)
def _no_masks_left_behind() -> Iterator[None]:
    install_tree_masks(None)
    yield
    install_tree_masks(None)


def _signed(word: int) -> int:
    return word - (1 << 64) if word >= 1 << 63 else word


def random_tree_bits(n: int, rng: random.Random) -> list[int]:
    """Ancestor words of a random tree on n nodes in topological order (parent < child), root = node 0."""
    bits = [1]
    for i in range(1, n):
        bits.append(bits[rng.randrange(i)] | (1 << i))
    return [_signed(b) for b in bits]


def _config(dtype: torch.dtype, width: int | None) -> SimpleNamespace:
    ddtree = None if width is None else DDTreeConfig(budget=width - 1, topk=1, max_depth=1)
    return SimpleNamespace(
        model_config=SimpleNamespace(dtype=dtype, get_num_attention_heads=lambda parallel_config: NUM_HEADS),
        cache_config=SimpleNamespace(block_size=BLOCK_SIZE, cache_dtype="auto"),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        speculative_config=SimpleNamespace(ddtree=ddtree),
    )


def _impls(
    head_size: int, dtype: torch.dtype, width: int | None, soft_cap: float | None = None, sinks: bool = False, **extra
) -> tuple[DDTreeCPUAttentionImpl, CPUAttentionBackendImpl]:
    sink_logits = torch.randn(NUM_HEADS).to(torch.bfloat16) if sinks else None  # CPU_ATTN's kernel takes bf16 sinks
    args = dict(
        num_heads=NUM_HEADS,
        head_size=head_size,
        scale=head_size**-0.5,
        num_kv_heads=NUM_KV_HEADS,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
        logits_soft_cap=soft_cap,
        sinks=sink_logits,
    )
    args.update(extra)
    with set_current_vllm_config(_config(dtype, width)):
        return DDTreeCPUAttentionImpl(**args), CPUAttentionBackendImpl(**args)


@dataclass
class Row:
    """One request of the batch: `ctx` cached tokens, `q_len` new ones, and (tree rows) its ancestor words."""

    ctx: int
    q_len: int
    bits: list[int] | None = None


@dataclass
class Batch:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    cache: torch.Tensor
    common: CommonAttentionMetadata


def make_batch(rows: list[Row], head_size: int, dtype: torch.dtype, isa: str, causal: bool = True) -> Batch:
    """Random K/V per request; the context goes into a paged cache with shuffled block tables, the new tokens stay
    as key/value inputs (the impl writes them, as in the engine)."""
    seq_lens = [r.ctx + r.q_len for r in rows]
    blocks_per_row = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_row) + 3
    pool = torch.randperm(num_blocks).tolist()
    table = torch.zeros(len(rows), max(blocks_per_row), dtype=torch.int32)
    for b, n in enumerate(blocks_per_row):
        table[b, :n] = torch.tensor([pool.pop() for _ in range(n)])
    cache = torch.zeros(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(num_blocks, NUM_KV_HEADS, 2 * BLOCK_SIZE, head_size).chunk(2, dim=2)

    def slots(b: int, positions: range) -> torch.Tensor:
        pos = torch.tensor(list(positions), dtype=torch.int64)
        return table[b, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE

    keys = [torch.randn(s, NUM_KV_HEADS, head_size).to(dtype) for s in seq_lens]
    values = [torch.randn(s, NUM_KV_HEADS, head_size).to(dtype) for s in seq_lens]
    for b, r in enumerate(rows):
        if r.ctx:
            ctx_slots = slots(b, range(r.ctx))
            k, v = keys[b][: r.ctx], values[b][: r.ctx]
            ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, ctx_slots, isa)
    starts = [0]
    for r in rows:
        starts.append(starts[-1] + r.q_len)
    query = torch.randn(starts[-1], NUM_HEADS, head_size).to(dtype)
    new = [slice(r.ctx, r.ctx + r.q_len) for r in rows]
    qsl = torch.tensor(starts, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(rows),
        num_actual_tokens=starts[-1],
        max_query_len=max(r.q_len for r in rows),
        max_seq_len=max(seq_lens),
        block_table_tensor=table,
        slot_mapping=torch.cat([slots(b, range(r.ctx, r.ctx + r.q_len)) for b, r in enumerate(rows)]),
        causal=causal,
    )
    return Batch(
        query=query,
        key=torch.cat([k[s] for k, s in zip(keys, new, strict=True)]),
        value=torch.cat([v[s] for v, s in zip(values, new, strict=True)]),
        keys=keys,
        values=values,
        cache=cache,
        common=common,
    )


def reference(
    batch: Batch, rows: list[Row], impl: CPUAttentionBackendImpl, tree: bool, causal: bool = True
) -> torch.Tensor:
    """fp32 attention from the logical K/V: prefix visible, tail by ancestor bits (tree rows) or causal."""
    out = []
    group = NUM_HEADS // NUM_KV_HEADS
    start = 0
    for b, r in enumerate(rows):
        seq_len = r.ctx + r.q_len
        q = batch.query[start : start + r.q_len].float()
        start += r.q_len
        k = batch.keys[b].float().repeat_interleave(group, dim=1)
        v = batch.values[b].float().repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,lhd->hql", q, k) * impl.scale
        if impl.logits_soft_cap:
            logits = impl.logits_soft_cap * torch.tanh(logits / impl.logits_soft_cap)
        visible = torch.ones(r.q_len, seq_len, dtype=torch.bool)
        if causal:
            for i in range(r.q_len):
                for j in range(r.q_len):
                    see = (r.bits[i] >> j) & 1 if tree and r.bits is not None else j <= i
                    visible[i, r.ctx + j] = bool(see)
        logits = logits.masked_fill(~visible, float("-inf"))
        if impl.sinks is not None:
            sink = impl.sinks.float().view(NUM_HEADS, 1, 1).expand(-1, r.q_len, 1)
            probs = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
        else:
            probs = torch.softmax(logits, -1)
        out.append(torch.einsum("hql,lhd->qhd", probs, v))
    return torch.cat(out)


def run(
    impl: CPUAttentionBackendImpl,
    batch: Batch,
    dtype: torch.dtype,
    head_size: int,
    width: int | None,
    drafting: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Build metadata with the DDTree builder and run the impl on a private copy of the cache."""
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=head_size, dtype=dtype)
    builder = DDTreeCPUAttentionMetadataBuilder(spec, ["layer.0"], _config(dtype, width), torch.device("cpu"))
    if drafting:
        metadata = builder.build_for_drafting(batch.common, draft_index=0)
    else:
        metadata = builder.build(0, batch.common)
    cache = batch.cache.clone()
    output = torch.full_like(batch.query, float("nan"))
    impl.forward(LAYER, batch.query, batch.key, batch.value, cache, metadata, output)
    return output, cache


def install(rows: list[Row], width: int, active: bool = True) -> TreeMaskBuffers:
    buffers = TreeMaskBuffers(max_num_reqs=len(rows) + 2, width=width, device=torch.device("cpu"))
    buffers.anc_bits.fill_(-1)  # rows the hook does not use hold garbage
    for b, r in enumerate(rows):
        if r.bits is not None:
            buffers.anc_bits[b, : len(r.bits)] = torch.tensor(r.bits, dtype=torch.int64)
    buffers.active = active
    install_tree_masks(buffers)
    return buffers


def mixed_rows(width: int, rng: random.Random) -> list[Row]:
    """Tree rows of several shapes between prefill chunks (q_len > W) and single-token decodes."""
    return [
        Row(37, width, random_tree_bits(width, rng)),
        Row(20, 1, [1]),  # decode / root-only tree: plain causal
        Row(0, width + 9),  # prefill chunk, longer than the tree
        Row(0, width, random_tree_bits(width, rng)),  # tree with no cached prefix
        Row(50, 5, random_tree_bits(5, rng)),  # narrower tree than the budget
        Row(16, width, causal_bits(width).tolist()),  # chain
        Row(33, width, [_signed(1 | (1 << i)) for i in range(width)]),  # star: every node a child of the root
        Row(5, 2, random_tree_bits(2, rng)),
    ]


@pytest.mark.parametrize("head_size", [32, 64])
@pytest.mark.parametrize("width", [8, 64])
def test_mixed_batch_matches_reference(head_size: int, width: int) -> None:
    rng = random.Random(head_size * 1000 + width)
    torch.manual_seed(rng.randrange(1 << 30))
    rows = mixed_rows(width, rng)
    impl, _ = _impls(head_size, torch.float32, width)
    batch = make_batch(rows, head_size, torch.float32, impl.isa)
    install(rows, width)
    output, _ = run(impl, batch, torch.float32, head_size, width)
    torch.testing.assert_close(output, reference(batch, rows, impl, tree=True), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_random_trees_bf16(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    width = rng.choice([4, 16, 33, 64])
    rows = [Row(rng.randrange(0, 70), rng.randrange(2, width + 1)) for _ in range(rng.randrange(1, 5))]
    for r in rows:
        r.bits = random_tree_bits(r.q_len, rng)
    impl, _ = _impls(64, torch.bfloat16, width)
    batch = make_batch(rows, 64, torch.bfloat16, impl.isa)
    install(rows, width)
    output, _ = run(impl, batch, torch.bfloat16, 64, width)
    torch.testing.assert_close(output.float(), reference(batch, rows, impl, tree=True), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("features", [{}, {"soft_cap": 3.0}, {"sinks": True}])
@pytest.mark.parametrize("head_size", [32, 64])
def test_chains_equal_cpu_attn_causal(features: dict, head_size: int) -> None:
    """A chain's ancestor words are causal, so tree rows must reproduce CPU_ATTN's own kernel (softcap, sinks too)."""
    torch.manual_seed(head_size)
    width = 12
    rows = [Row(ctx, q, causal_bits(q).tolist()) for ctx, q in [(40, 12), (0, 7), (17, 2), (64, 12)]]
    impl, base = _impls(head_size, torch.float32, width, **features)
    batch = make_batch(rows, head_size, torch.float32, impl.isa)
    install(rows, width)
    output, cache = run(impl, batch, torch.float32, head_size, width)
    expected, expected_cache = run(base, batch, torch.float32, head_size, width)
    torch.testing.assert_close(output, expected, atol=2e-5, rtol=1e-4)
    assert torch.equal(cache, expected_cache)


@pytest.mark.parametrize("installed", [True, False])
def test_inactive_or_missing_masks_are_cpu_attn(installed: bool) -> None:
    rng = random.Random(7)
    torch.manual_seed(7)
    width = 8
    rows = mixed_rows(width, rng)
    impl, base = _impls(64, torch.float32, width)
    batch = make_batch(rows, 64, torch.float32, impl.isa)
    if installed:
        install(rows, width, active=False)
    output, cache = run(impl, batch, torch.float32, 64, width)
    expected, expected_cache = run(base, batch, torch.float32, 64, width)
    assert torch.equal(output, expected)
    assert torch.equal(cache, expected_cache)
    torch.testing.assert_close(output, reference(batch, rows, impl, tree=False), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("causal", "drafting"), [(False, False), (False, True), (True, True)])
def test_drafter_metadata_is_untouched(causal: bool, drafting: bool) -> None:
    """The DFlash drafter's layers run CPU_ATTN (non-causal, or causal for some drafters) while the target step's
    masks are still active; neither non-causal metadata nor anything built for drafting may see them."""
    rng = random.Random(3)
    torch.manual_seed(3)
    width = 8
    rows = mixed_rows(width, rng)
    impl, base = _impls(32, torch.float32, width)
    batch = make_batch(rows, 32, torch.float32, impl.isa, causal=causal)
    install(rows, width)
    output, _ = run(impl, batch, torch.float32, 32, width, drafting)
    expected, _ = run(base, batch, torch.float32, 32, width, drafting)
    assert torch.equal(output, expected)
    torch.testing.assert_close(output, reference(batch, rows, impl, tree=False, causal=causal), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"sliding_window": 32}, "sliding window"),
        ({"alibi_slopes": [0.5, 0.25, 0.125, 0.0625]}, "ALiBi"),
        ({"kv_cache_dtype": "fp8"}, "fp8 KV cache"),
    ],
)
def test_unsupported_features_raise_only_with_ddtree(extra: dict, fragment: str) -> None:
    try:
        _impls(64, torch.float32, None, **extra)  # DDTree off: plain CPU_ATTN accepts it ...
    except NotImplementedError as refusal:  # ... except fp8 on CPUs without AVX-512 / AMX, which it refuses itself
        assert "kv_cache_dtype" in extra, refusal
        with pytest.raises(NotImplementedError, match=re.escape(str(refusal))):
            _impls(64, torch.float32, 8, **extra)  # DDTree on: the same refusal, nothing of ours in between
        return
    with pytest.raises(NotImplementedError, match=fragment):
        _impls(64, torch.float32, 8, **extra)


@pytest.mark.parametrize(("isa", "block_size"), [("vec16", 16), ("vec", 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cache_layout_reads_back_what_cpu_attn_wrote(isa: str, block_size: int, dtype: torch.dtype) -> None:
    head_size = 64
    k_map, v_map = cache_layout(isa, dtype, block_size, head_size)
    key = torch.randn(block_size, 1, head_size).to(dtype)
    value = torch.randn(block_size, 1, head_size).to(dtype)
    slab = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = slab.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(block_size), isa)
    assert torch.equal(slab.view(-1)[k_map], key[:, 0])
    assert torch.equal(slab.view(-1)[v_map], value[:, 0])


def test_causal_bits_wrap_at_bit_63() -> None:
    bits = causal_bits(64)
    assert bits[0].item() == 1 and bits[62].item() == (1 << 63) - 1 and bits[63].item() == -1
    with pytest.raises(ValueError):
        causal_bits(65)


def test_backend_takes_the_cpu_attn_slot() -> None:
    """Layers look the enum up by get_name(), and the CPU platform always resolves CPU_ATTN's (overridable) path."""
    from vllm.platforms.cpu import CpuPlatform

    assert AttentionBackendEnum[DDTreeCPUAttentionBackend.get_name()] is AttentionBackendEnum.CPU_ATTN
    path = "vllm_ddtree.backends.cpu.DDTreeCPUAttentionBackend"
    register_backend(AttentionBackendEnum.CPU_ATTN, path)
    try:
        selector = SimpleNamespace(use_mla=False, use_sparse=False)
        assert CpuPlatform.get_attn_backend_cls(None, selector) == path
        assert AttentionBackendEnum.CPU_ATTN.get_class() is DDTreeCPUAttentionBackend
    finally:
        AttentionBackendEnum.CPU_ATTN.clear_override()
