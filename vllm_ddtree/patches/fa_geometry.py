"""FlashAttention metadata planned with its own attention group's geometry, not the target model's.

vLLM 0.26.0's ``FlashAttentionMetadataBuilder`` reads query heads, KV heads and head size from the model-wide
``ModelConfig``, i.e. the target's. A DFlash drafter whose attention differs from its target's (every drafter of an
MLA target: GQA 32 / 8 heads of 128 against MLA's 64 / 1 of 576) then gets FA3 scheduler metadata planned for the
target's shapes while the kernel runs the drafter's: 16 query rows x 64 packed heads = 1,024 rows a request are
scheduled instead of 16 x 4 = 64, several times slower than planned right (measured: docs/results.md, section 7);
the same mismatch is
the likely cause of vLLM's V2 + TRITON_MLA DFlash stopping in FA3's metadata size check (an eager drafter, where
FA3's split heuristic can differ between the planned and the run geometry). vLLM fixed this after 0.26 (the builder
takes its group's geometry); this patch applies the same rule to 0.26 in every CUDA process, so vLLM's own DFlash
chain gets it too and benchmarks compare like with like.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm_ddtree.patches import patch_attr


def group_geometry(kv_cache_spec: Any, layers: Iterable[Any]) -> tuple[int | None, int, int]:
    """(query heads, KV heads, head size) of one attention group: query heads from its layers (None unless they all
    agree), KV heads and head size from its KV-cache spec."""
    heads = {layer.num_heads for layer in layers}
    return (heads.pop() if len(heads) == 1 else None), kv_cache_spec.num_kv_heads, kv_cache_spec.head_size


def _builder_init(self: Any, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any) -> None:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

    FlashAttentionMetadataBuilder._orig___init__(self, kv_cache_spec, layer_names, vllm_config, device)
    layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names).values()
    num_heads_q, self.num_heads_kv, self.headdim = group_geometry(kv_cache_spec, layers)
    if num_heads_q is not None:
        self.num_heads_q = num_heads_q


def apply() -> None:
    """Install the group-geometry builder (idempotent)."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

    patch_attr(FlashAttentionMetadataBuilder, "__init__", _builder_init)
