"""DDTree's tree-verify attention for GQA targets (Qwen3 / Llama architectures) on GPUs, vLLM's ``CUSTOM`` backend.

It is vLLM's Triton attention backend (same paged cache layout, logical ``(blocks, kv_heads, page, 2*head)``, and
the same cache writes) with the attention itself replaced: query ``t`` sees its request's context (every key
before its last ``q_len``) and the tail keys allowed by ``token_bits[t]``, which the runner's ``prepare_attn``
hook writes every step (causal words for ordinary rows, ancestor words for tree rows). The context and the root,
which every row sees and where the time goes at long lengths, run on vLLM's FlashAttention (one read of the cache
for all tree rows and heads of a KV head, no mask), so a root row keeps the output of the target's own kernel;
``gqa_tree_attention`` then attends the rest of the masked tail and merges it into FlashAttention's output by
log-sum-exp. Where FlashAttention cannot run (float32, no build for the GPU) the Triton kernel does both.
Every tensor lives in persistent buffers, so the verify step and the drafter stay in FULL CUDA graphs; the builder
reports ``UNIFORM_BATCH``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from vllm_ddtree.backends.row_split import first_prefill_request, tree_row_limit
from vllm_ddtree.kernels import gqa_tree_attention
from vllm_ddtree.tree_mask import context_key_counts, current_tree_masks


def flash_attention_version() -> int | None:
    """vLLM's FlashAttention version for this GPU, or None where its varlen kernel is unavailable."""
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version, is_flash_attn_varlen_func_available

    if not is_flash_attn_varlen_func_available():
        return None
    return get_flash_attn_version()


def flash_context_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int = 0,
    fa_version: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's rows against its first ``context_lens`` keys (``tree_mask.context_key_counts``: the context
    and the root), unmasked: FlashAttention's output [T, Hq, D] and log-sum-exp [Hq, T]. ``kv_cache`` is the logical
    Triton layout."""
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

    head = query.shape[-1]
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head, dim=-1)
    version = fa_version if fa_version is not None else flash_attention_version()
    out, lse = flash_attn_varlen_func(
        q=query,
        k=key_cache,
        v=value_cache,
        max_seqlen_q=max_query_len,
        cu_seqlens_q=query_start_loc,
        max_seqlen_k=max_seq_len,
        seqused_k=context_lens,
        softmax_scale=scale,
        causal=False,
        block_table=block_table,
        return_softmax_lse=True,
        num_splits=num_splits,
        fa_version=version,
    )
    return out, lse


def flash_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor,
    fa_version: int | None,
) -> None:
    """Prefill rows on FlashAttention, causal over each request's keys, as vLLM's FlashAttention backend attends
    them without speculation (``row_split``). ``query_start_loc`` starts at 0 for these requests."""
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

    key_cache, value_cache = kv_cache.transpose(1, 2).split(query.shape[-1], dim=-1)
    flash_attn_varlen_func(
        q=query,
        k=key_cache,
        v=value_cache,
        out=out,
        cu_seqlens_q=query_start_loc,
        max_seqlen_q=max_query_len,
        seqused_k=seq_lens,
        max_seqlen_k=max_seq_len,
        softmax_scale=scale,
        causal=True,
        block_table=block_table,
        fa_version=fa_version,
    )


@dataclass
class DDTreeGQAMetadata(TritonAttentionMetadata):
    """Triton attention metadata plus the per-request context lengths and FlashAttention's split bound, and the
    requests the tree path attends (a prefix of the batch; the rest, prefill chunks past the verify width, take
    FlashAttention from ``prefill_query_start_loc``)."""

    context_lens: torch.Tensor | None = None
    max_num_splits: int = 0
    num_tree_reqs: int = 0
    num_tree_tokens: int = 0
    prefill_query_start_loc: torch.Tensor | None = None


class DDTreeGQAMetadataBuilder(TritonAttentionMetadataBuilder):
    """Triton attention metadata; every tensor the kernels read is persistent (runner buffers, token bits, and
    the context lengths, recomputed into one buffer every step because V2 rebuilds metadata outside the graph)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.context_lens = torch.zeros(vllm_config.scheduler_config.max_num_seqs, dtype=torch.int32, device=device)
        compilation = vllm_config.compilation_config
        # Under FULL graphs FlashAttention's split count must be bounded at capture (vLLM's own FA backend rule).
        self.graph_num_splits = (
            vllm_config.attention_config.flash_attn_max_num_splits_for_cuda_graph
            if compilation.cudagraph_mode.has_full_cudagraphs()
            else 0
        )
        self.max_graph_tokens = compilation.max_cudagraph_capture_size or 0
        self.row_limit = tree_row_limit(vllm_config)

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> DDTreeGQAMetadata:
        m = common_attn_metadata
        base = super().build(common_prefix_len, m, fast_build)
        num_reqs = m.num_reqs
        qsl = m.query_start_loc
        context = context_key_counts(m.seq_lens[:num_reqs], qsl[: num_reqs + 1], out=self.context_lens[:num_reqs])
        splits = self.graph_num_splits if base.num_actual_tokens <= self.max_graph_tokens else 0
        tree_reqs, prefill_qsl = num_reqs, None
        if self.row_limit is not None and m.max_query_len > self.row_limit:  # never in a FULL graph's batch
            qsl_cpu = m.query_start_loc_cpu[: num_reqs + 1].tolist()
            prefilling = None if m.is_prefilling is None else m.is_prefilling.tolist()
            tree_reqs = first_prefill_request(qsl_cpu, self.row_limit, prefilling)
            prefill_qsl = qsl[tree_reqs : num_reqs + 1] - qsl_cpu[tree_reqs] if tree_reqs < num_reqs else None
        tree_tokens = int(m.query_start_loc_cpu[tree_reqs]) if tree_reqs < num_reqs else base.num_actual_tokens
        return DDTreeGQAMetadata(
            **vars(base),
            context_lens=context,
            max_num_splits=splits,
            num_tree_reqs=tree_reqs,
            num_tree_tokens=tree_tokens,
            prefill_query_start_loc=prefill_qsl,
        )


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
        self.fa_version = flash_attention_version()

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        masks = current_tree_masks()
        if attn_metadata is None or masks is None or masks.token_bits.numel() == 0:
            # Profiling runs, and processes without a DDTree runner: plain causal Triton attention.
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("the ddtree GQA backend does not fuse output quantization")
        m = attn_metadata
        num_tokens = m.num_actual_tokens
        out = output[:num_tokens].view(num_tokens, self.num_heads, -1)
        fa_ready = self.fa_version is not None and query.dtype in (torch.float16, torch.bfloat16)
        block_table, seq_lens, qsl, context_lens, tokens = (
            m.block_table,
            m.seq_lens,
            m.query_start_loc,
            m.context_lens,
            num_tokens,
        )
        if m.prefill_query_start_loc is not None and fa_ready:  # prefill chunks past the verify width
            reqs, tokens = m.num_tree_reqs, m.num_tree_tokens
            flash_prefill_attention(
                query[tokens:num_tokens],
                kv_cache,
                block_table[reqs:],
                seq_lens[reqs:],
                m.prefill_query_start_loc,
                self.scale,
                m.max_query_len,
                m.max_seq_len,
                out[tokens:],
                self.fa_version,
            )
            block_table, seq_lens, qsl, context_lens = (
                block_table[:reqs],
                seq_lens[:reqs],
                qsl[: reqs + 1],
                context_lens[:reqs],
            )
        query = query[:tokens]
        context = None
        if fa_ready:
            context = flash_context_attention(
                query,
                kv_cache,
                block_table,
                context_lens,
                qsl,
                self.scale,
                m.max_query_len,
                m.max_seq_len,
                m.max_num_splits,
                self.fa_version,
            )
        gqa_tree_attention(
            query,
            kv_cache,
            block_table,
            seq_lens,
            qsl,
            masks.token_bits[:tokens],
            self.scale,
            out[:tokens],
            prefix_out=context[0] if context else None,
            prefix_lse=context[1] if context else None,
        )
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
