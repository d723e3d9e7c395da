"""DDTree's tree-verify attention for GQA targets (Qwen3 / Llama architectures) on GPUs, vLLM's ``CUSTOM`` backend.

It is vLLM's Triton attention backend (same paged cache layout, logical ``(blocks, kv_heads, page, 2*head)``, and
the same cache writes) with the attention itself replaced by ``gqa_tree_attention``: query ``t`` sees its request's
prefix and the tail keys allowed by ``token_bits[t]``, which the runner's ``prepare_attn`` hook writes every step
(causal words for ordinary rows, ancestor words for tree rows). The bits live in one persistent buffer, so the
verify step and the drafter stay in FULL CUDA graphs; the builder reports ``UNIFORM_BATCH``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from vllm_ddtree.backends.tree_mask import current_tree_masks
from vllm_ddtree.gqa_tree_attention import gqa_tree_attention


class DDTreeGQAMetadataBuilder(TritonAttentionMetadataBuilder):
    """Triton attention metadata; every tensor the tree kernel reads is persistent (runner buffers, token bits)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH


class DDTreeGQAImpl(TritonAttentionImpl):
    """Tree-masked paged attention; the cache update is Triton attention's own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        unsupported = [
            name
            for name, used in (
                ("ALiBi", self.alibi_slopes is not None),
                ("sliding window", self.sliding_window != (-1, -1)),
                ("logit soft-capping", bool(self.logits_soft_cap)),
                ("attention sinks", self.sinks is not None),
                (f"kv_cache_dtype={self.kv_cache_dtype}", self.kv_cache_dtype not in ("auto", "float16", "bfloat16")),
            )
            if used
        ]
        if unsupported:
            raise ValueError(
                f"the ddtree GQA tree-attention backend does not support {', '.join(unsupported)}; "
                f"serve this target without ddtree or with a plain bf16/fp16 KV cache."
            )
        self.supports_quant_query_input = False

    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: TritonAttentionMetadata, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        masks = current_tree_masks()
        if attn_metadata is None or masks is None or masks.token_bits.numel() == 0:
            # Profiling runs, and processes without a DDTree runner: plain causal Triton attention.
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("the ddtree GQA backend does not fuse output quantization")
        num_tokens = attn_metadata.num_actual_tokens
        gqa_tree_attention(
            query[:num_tokens], kv_cache, attn_metadata.block_table, attn_metadata.seq_lens,
            attn_metadata.query_start_loc, masks.token_bits[:num_tokens], self.scale,
            output[:num_tokens].view(num_tokens, self.num_heads, self.head_size),
        )  # fmt: skip
        return output


class DDTreeGQABackend(TritonAttentionBackend):
    """vLLM attention backend for the target of a ddtree config (registered as ``CUSTOM``)."""

    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16"]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[DDTreeGQAImpl]:
        return DDTreeGQAImpl

    @staticmethod
    def get_builder_cls() -> type[DDTreeGQAMetadataBuilder]:
        return DDTreeGQAMetadataBuilder

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size >= 16 and head_size & (head_size - 1) == 0
