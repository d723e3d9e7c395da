"""DDTree tree attention for vLLM-CPU: CPU_ATTN plus an ancestor-only mask on tree-verify rows.

The CPU platform only ever selects ``CPU_ATTN``, so the plugin swaps this backend into that slot with
``register_backend(AttentionBackendEnum.CPU_ATTN, "vllm_ddtree.backends.cpu.DDTreeCPUAttentionBackend")``.

Every row first goes through CPU_ATTN unchanged (KV-cache write and causal attention). Then, for causal metadata
while the runner's :class:`~vllm_ddtree.tree_mask.TreeMaskBuffers` are installed and active, rows with
``2 <= q_len <= width`` are recomputed in torch (fp32) with the tree mask: query ``i`` sees every key before the
last ``q_len`` keys, and tail key ``j`` iff bit ``j`` of ``anc_bits[b, i]`` is set. Non-causal metadata, metadata
built for the drafter (``build_for_drafting``), prefill chunks, single-token decodes and inactive steps are exactly
CPU_ATTN's output. Tree rows are thus computed twice (kernel, then torch): this backend is for correctness on CPU.

Tree rows honour GQA/MQA, logits soft-capping and attention sinks like CPU_ATTN. Sliding windows and ALiBi are
defined over token positions, which a tree's slots do not have (siblings share a depth), and an fp8 KV cache would
need CPU_ATTN's dequantisation; with DDTree on, those raise NotImplementedError when the layer is built.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm.config import get_current_vllm_config
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionLayer, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.patches import versions
from vllm_ddtree.tree_mask import current_tree_masks

_DIGIT = 16
"""Probe digit base: 1..16 are exact in every float dtype CPU_ATTN caches (fp32, bf16, fp16)."""


@functools.cache
def cache_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where CPU_ATTN stores K[t, d] and V[t, d] inside one (block, kv-head) slab of ``2 * block_size * head_size``.

    CPU_ATTN packs each block for its ISA (VEC/VEC16 keep K as ``[head_size, block_size]``, AMX uses tile packing),
    so the layout is learned rather than hard-coded: index-coded K/V (base-16 digits, K positive, V negative) go
    through the real ``cpu_attn_reshape_and_cache`` into a one-block scratch cache, and each slot is decoded back.
    Returns two ``[block_size, head_size]`` int64 maps of flat slab offsets (K, V).
    """
    numel = block_size * head_size
    ids = torch.arange(numel)
    k_ids = torch.zeros(2 * numel, dtype=torch.int64)
    v_ids = torch.zeros(2 * numel, dtype=torch.int64)
    scale = 1
    while scale < numel:
        digit = ((ids // scale) % _DIGIT + 1).to(dtype).view(block_size, 1, head_size)
        slab = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
        key_cache, value_cache = slab.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(digit, -digit, key_cache, value_cache, torch.arange(block_size), isa)
        stored = slab.view(-1).to(torch.int64)
        k_ids += torch.where(stored > 0, stored - 1, 0) * scale
        v_ids += torch.where(stored < 0, -stored - 1, 0) * scale
        scale *= _DIGIT
    k_pos, v_pos = (stored > 0).nonzero().squeeze(1), (stored < 0).nonzero().squeeze(1)
    k_map = torch.empty(numel, dtype=torch.int64)
    v_map = torch.empty(numel, dtype=torch.int64)
    k_map[k_ids[k_pos]] = k_pos
    v_map[v_ids[v_pos]] = v_pos
    bijective = (
        k_pos.numel() == numel
        and v_pos.numel() == numel
        and torch.equal(k_ids[k_map], ids)
        and torch.equal(v_ids[v_map], ids)
    )
    if not bijective:
        raise NotImplementedError(
            f"CPU_ATTN's KV-cache packing for isa={isa}, dtype={dtype}, block_size={block_size}, "
            f"head_size={head_size} is not a per-block permutation; DDTree tree rows cannot read it."
        )
    return k_map.view(block_size, head_size), v_map.view(block_size, head_size)


@dataclass
class DDTreeCPUAttentionMetadata(CPUAttentionMetadata):
    """CPU_ATTN metadata plus the rows that may be tree-verify rows this step.

    ``tree_rows`` holds ``(batch_row, query_start, query_len, seq_len)`` for rows with ``2 <= q_len <= width``
    of causal metadata, computed once per step on the host; forward still checks that the masks are active.
    """

    tree_rows: tuple[tuple[int, int, int, int], ...] = ()


class DDTreeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """CPU_ATTN's builder; also lists the candidate tree rows so layers need no per-layer host syncs."""

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> DDTreeCPUAttentionMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        masks = current_tree_masks()
        rows: list[tuple[int, int, int, int]] = []
        if masks is not None and base.causal is True and base.dynamic_causal is None:
            starts = common_attn_metadata.query_start_loc_cpu[: common_attn_metadata.num_reqs + 1].tolist()
            seq_lens = common_attn_metadata.seq_lens[: common_attn_metadata.num_reqs].tolist()
            for b, seq_len in enumerate(seq_lens):
                q_len = starts[b + 1] - starts[b]
                if 2 <= q_len <= masks.width:
                    rows.append((b, starts[b], q_len, seq_len))
        return _with_tree_rows(base, tuple(rows))

    def build_for_drafting(
        self, common_attn_metadata: CommonAttentionMetadata, draft_index: int
    ) -> DDTreeCPUAttentionMetadata:
        """Drafter forwards never verify a tree, not even a causal DFlash drafter's (which runs while the target
        step's masks are still active): plain CPU_ATTN metadata without tree rows."""
        return _with_tree_rows(super().build(0, common_attn_metadata, fast_build=True), ())


def _with_tree_rows(
    base: CPUAttentionMetadata, tree_rows: tuple[tuple[int, int, int, int], ...]
) -> DDTreeCPUAttentionMetadata:
    return DDTreeCPUAttentionMetadata(**{f.name: getattr(base, f.name) for f in fields(base)}, tree_rows=tree_rows)


class DDTreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """CPU_ATTN's impl; recomputes active tree rows with the ancestor-only mask after CPU_ATTN has run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if get_ddtree_config(get_current_vllm_config()) is None or self.attn_type != AttentionType.DECODER:
            return
        unsupported = [
            name
            for name, present in (
                ("sliding window", self.sliding_window != -1),
                ("ALiBi", self.alibi_slopes is not None),
                (f"fp8 KV cache ({self.kv_cache_dtype})", is_quantized_kv_cache(self.kv_cache_dtype)),
            )
            if present
        ]
        if unsupported:
            raise NotImplementedError(
                f"DDTree tree attention on CPU does not support {', '.join(unsupported)}; "
                "use a model without it or turn DDTree off."
            )

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: DDTreeCPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """CPU_ATTN for every row, then the tree-masked recompute of this step's tree rows (if masks are active)."""
        super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        masks = current_tree_masks()
        if attn_metadata is None or not attn_metadata.tree_rows or masks is None or not masks.active:
            return output
        num_blocks, num_kv_heads, block_size, packed = kv_cache.shape
        isa = versions.cpu_attention_isa(self, layer)
        k_map, v_map = cache_layout(isa, kv_cache.dtype, block_size, self.head_size)
        slabs = kv_cache.view(num_blocks, num_kv_heads, block_size * packed)
        for b, q_start, q_len, seq_len in attn_metadata.tree_rows:
            num_seq_blocks = -(-seq_len // block_size)
            blocks = slabs[attn_metadata.block_table[b, :num_seq_blocks].long()]
            keys = blocks[:, :, k_map].transpose(0, 1).reshape(num_kv_heads, -1, self.head_size)[:, :seq_len]
            values = blocks[:, :, v_map].transpose(0, 1).reshape(num_kv_heads, -1, self.head_size)[:, :seq_len]
            rows = slice(q_start, q_start + q_len)
            output[rows] = self._tree_rows_attention(query[rows], keys, values, masks.anc_bits[b, :q_len]).to(
                output.dtype
            )
        return output

    def _tree_rows_attention(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, anc_bits: torch.Tensor
    ) -> torch.Tensor:
        """fp32 attention of one request's ``[q_len, H, D]`` queries over ``[Hkv, seq_len, D]`` keys/values."""
        q_len, seq_len = query.shape[0], keys.shape[1]
        tail = (anc_bits[:, None] >> torch.arange(q_len, device=anc_bits.device)[None, :]) & 1
        visible = torch.cat([tail.new_ones(q_len, seq_len - q_len), tail], dim=1).bool()
        q = query.float().view(q_len, self.num_kv_heads, self.num_queries_per_kv, self.head_size)
        logits = torch.einsum("qkgd,kld->kgql", q, keys.float()) * self.scale
        if self.logits_soft_cap:
            logits = self.logits_soft_cap * torch.tanh(logits / self.logits_soft_cap)
        logits = logits.masked_fill(~visible, float("-inf"))
        if self.sinks is not None:
            sink = self.sinks.float().view(self.num_kv_heads, self.num_queries_per_kv, 1, 1).expand(-1, -1, q_len, 1)
            probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(logits, dim=-1)
        out = torch.einsum("kgql,kld->qkgd", probs, values.float())
        return out.reshape(q_len, self.num_heads, self.head_size)


class DDTreeCPUAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with DDTree tree rows; keeps the name ``CPU_ATTN`` because layers look the enum up by name."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[DDTreeCPUAttentionImpl]:
        return DDTreeCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[DDTreeCPUAttentionMetadataBuilder]:
        return DDTreeCPUAttentionMetadataBuilder
