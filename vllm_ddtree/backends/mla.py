"""DDTree's tree-verify attention for MLA targets (DeepSeek-V3, Kimi-K2): vLLM's MLA backend on our CUDA kernel.

vLLM's MLA common code keeps prefill (vLLM's MLA prefill path) and absorbs the decode queries; this backend's decode
is ``ddtree::mla_tree_verify``, which reads each request's latent cache once for all its tree rows and heads and
applies the per-token ancestor words. On Hopper with a bf16 cache in 64-token pages, where vLLM ships FlashMLA, the
decode is split instead: FlashMLA attends each row's context (every key before the request's tree, and its root;
no mask) while ``mla_tree_tail`` attends the other tree keys on a second stream, merged by log-sum-exp
(``split_verify``) — except for
launches of few rows a request (plain decode and tiny trees at few heads), which our decode kernel reads faster.
``VLLM_DDTREE_MLA_CONTEXT`` overrides: ``flashmla`` splits every launch, ``ddtree`` keeps our kernel for all. Those
choices, and which of our kernels runs, are the dispatch table's (``kernels/mla_dispatch.py``).
Rows up to the verify width take the decode path (``QueryLenSupport.VARLEN``, reorder threshold = the width,
``backends/row_split.py``): tree rows get their tree words from the runner's ``prepare_attn`` hook, every other
short row is causal; longer rows (prefill chunks) take vLLM's MLA prefill path, as without speculation. Without a
DDTree runner in the process the builder writes causal words itself, so the backend is also a correct plain MLA
decode backend.
All tensors the kernels read are persistent and KV split plans are computed on the device, so the builder reports
``UNIFORM_BATCH`` and the verify step and the drafter stay in FULL graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionCGSupport, MultipleOf

from vllm_ddtree import envs
from vllm_ddtree.backends.row_split import first_prefill_request, tree_row_limit
from vllm_ddtree.constants import MAX_TREE_WIDTH, MLA_HEAD_DIM, MLA_KV_LORA_RANK, MLA_ROPE_DIM
from vllm_ddtree.kernels.mla_dispatch import FLASHMLA_PAGE, flashmla_context, split_this_launch
from vllm_ddtree.tree_mask import causal_bits, context_key_counts, current_tree_masks


@dataclass
class DDTreeMLADecodeMetadata(MLACommonDecodeMetadata):
    """Decode rows' block table and lengths (from vLLM) plus their query offsets, grid bound and causal words; with
    the FlashMLA context split also each row's context length, the row gather into FlashMLA's uniform width (None
    when the rows already have it), and FlashMLA's scheduler metadata."""

    query_start_loc: torch.Tensor
    max_query_len: int
    causal_token_bits: torch.Tensor
    context_lens: torch.Tensor | None = None
    padded_rows: torch.Tensor | None = None
    flashmla_sched: Any = None


@dataclass
class DDTreeMLAMetadata(MLACommonMetadata[DDTreeMLADecodeMetadata]):
    pass


def padded_query_rows(query_start_loc: torch.Tensor, width: int, num_tokens: int, cols: torch.Tensor) -> torch.Tensor:
    """``[B * width]`` row indices into the decode queries for FlashMLA's uniform ``[B, width]`` layout: request b's
    rows, then its last row repeated (q_len-0 padding requests point at an existing row). ``cols`` is
    ``arange(>= width)``."""
    qsl = query_start_loc.to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    rows = qsl[:-1, None] + torch.minimum(cols[None, :width], (q_lens - 1).clamp(min=0)[:, None])
    return rows.flatten().clamp(max=max(num_tokens - 1, 0))


def uniform_query_rows(query_start_loc: list[int], width: int) -> bool:
    """Whether every request has exactly ``width`` query rows: FlashMLA's uniform ``[B, width]`` layout is then the
    rows as they are, with no gather (every verify step of a ddtree batch, and plain decode)."""
    return all(b - a == width for a, b in zip(query_start_loc[:-1], query_start_loc[1:], strict=True))


def causal_token_bits(query_start_loc: list[int], num_tokens: int) -> torch.Tensor:
    """``[num_tokens]`` int64: token t of a request gets the causal word of its index in the request (<= 63)."""
    qsl = torch.tensor(query_start_loc, dtype=torch.int64)
    covered = int(qsl[-1])
    index = torch.zeros(num_tokens, dtype=torch.int64)
    starts = torch.repeat_interleave(qsl[:-1], qsl[1:] - qsl[:-1], output_size=covered)
    index[:covered] = (torch.arange(covered) - starts).clamp(max=MAX_TREE_WIDTH - 1)
    return causal_bits(MAX_TREE_WIDTH)[index]


class DDTreeMLAMetadataBuilder(MLACommonMetadataBuilder[DDTreeMLAMetadata]):
    """vLLM's MLA metadata with every decode row (up to the verify width) on the tree kernels."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.VARLEN
    reorder_batch_threshold: int = MAX_TREE_WIDTH

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, DDTreeMLAMetadata)
        # vLLM raises the threshold to 1 + 2 x num_speculative_tokens for parallel drafters (DFlash); our decode path
        # takes rows of at most 64 tokens, and only verify rows need it. ``build`` sets it per step.
        self._row_limit = tree_row_limit(vllm_config)
        self.reorder_batch_threshold = MAX_TREE_WIDTH if self._row_limit is None else self._row_limit
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self._causal_bits = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        from vllm.v1.attention.ops.flashmla import is_flashmla_dense_supported

        self._context_choice = envs.VLLM_DDTREE_MLA_CONTEXT
        self._flashmla_context = flashmla_context(
            self._context_choice,
            is_flashmla_dense_supported()[0],
            kv_cache_spec.block_size,
            vllm_config.model_config.dtype,
            vllm_config.cache_config.cache_dtype,
        )
        self._num_heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        if self._flashmla_context:
            max_reqs = vllm_config.scheduler_config.max_num_seqs
            self._context_lens = torch.zeros(max_reqs, dtype=torch.int32, device=device)
            self._padded_rows = torch.zeros(max_reqs * MAX_TREE_WIDTH, dtype=torch.int64, device=device)
            self._cols = torch.arange(MAX_TREE_WIDTH, dtype=torch.int64, device=device)
            from vllm_ddtree.kernels import compile_pack_context_query

            compile_pack_context_query(self._num_heads, vllm_config.model_config.dtype, device)

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> DDTreeMLAMetadata:
        """vLLM's MLA build with the decode rows of ``row_split``: requests past the verify width take vLLM's prefill
        path where they are a suffix of requests still prefilling, else every row of <= 64 tokens is a decode."""
        if self._row_limit is not None:
            m = common_attn_metadata
            prefilling = None if m.is_prefilling is None else m.is_prefilling.tolist()
            qsl = m.query_start_loc_cpu[: m.num_reqs + 1].tolist()
            suffix = first_prefill_request(qsl, self._row_limit, prefilling) < m.num_reqs
            self.reorder_batch_threshold = self._row_limit if suffix else MAX_TREE_WIDTH
        return super().build(common_prefix_len, common_attn_metadata, fast_build)

    def _build_decode(
        self,
        block_table_tensor: torch.Tensor,
        seq_lens_device: torch.Tensor,
        max_seq_len: int,
        query_start_loc_cpu: torch.Tensor,
        query_start_loc_device: torch.Tensor,
        num_decode_tokens: int,
        dcp_tot_seq_lens_device: torch.Tensor | None,
    ) -> DDTreeMLADecodeMetadata:
        qsl = query_start_loc_cpu.tolist()
        max_query_len = max((b - a for a, b in zip(qsl[:-1], qsl[1:], strict=True)), default=1)
        if current_tree_masks() is None:  # no DDTree runner writes the words: plain causal decode
            words = causal_token_bits(qsl, num_decode_tokens).pin_memory()
            self._causal_bits[:num_decode_tokens].copy_(words, non_blocking=True)
        width = max(1, min(max_query_len, MAX_TREE_WIDTH))
        decode = DDTreeMLADecodeMetadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device,
            query_start_loc=query_start_loc_device,
            max_query_len=width,
            causal_token_bits=self._causal_bits,
        )
        if self._flashmla_context and split_this_launch(self._context_choice, width, self._num_heads):
            self._plan_flashmla_context(decode, num_decode_tokens, uniform_query_rows(qsl, width))
        return decode

    def _plan_flashmla_context(self, decode: DDTreeMLADecodeMetadata, num_decode_tokens: int, uniform: bool) -> None:
        """Persistent per-step inputs of the context pass (device ops only): its key counts (the context and the
        root, ``tree_mask.context_key_counts``), and unless every
        request has ``width`` rows (``uniform``), for each request ``width`` row indices into the decode queries
        (its rows, then its last row repeated) for FlashMLA's uniform ``[B, width]`` query layout. A FULL graph is
        captured on a uniform batch and replayed only on uniform batches (real requests first, q_len-0 padding
        after), where the rows are already in that layout."""
        from vllm.v1.attention.ops.flashmla import get_mla_metadata

        num_reqs, width = decode.seq_lens.shape[0], decode.max_query_len
        qsl = decode.query_start_loc
        decode.context_lens = context_key_counts(decode.seq_lens, qsl, out=self._context_lens[:num_reqs])
        if not uniform:
            self._padded_rows[: num_reqs * width] = padded_query_rows(qsl, width, num_decode_tokens, self._cols)
            decode.padded_rows = self._padded_rows[: num_reqs * width]
        decode.flashmla_sched = get_mla_metadata()[0]


class DDTreeMLAImpl(MLACommonImpl[DDTreeMLAMetadata]):
    """Absorbed-MLA decode on ``ddtree::mla_tree_verify``; everything else is vLLM's MLA common implementation."""

    can_return_lse_for_decode: bool = True
    _tail_streams: ClassVar[dict[int, torch.cuda.Stream]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.kv_lora_rank != MLA_KV_LORA_RANK or self.qk_rope_head_dim != MLA_ROPE_DIM:
            raise ValueError(
                f"the ddtree MLA kernel is built for kv_lora_rank {MLA_KV_LORA_RANK} and qk_rope_head_dim "
                f"{MLA_ROPE_DIM} (DeepSeek-V3 / Kimi-K2), got {self.kv_lora_rank} and {self.qk_rope_head_dim}; use "
                f"FLASHMLA or TRITON_MLA for this model."
            )
        self.supports_quant_query_input = False  # the kernel takes bf16/fp16 queries, fp8 only in the cache

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: DDTreeMLAMetadata,
        layer: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from vllm_ddtree.kernels import mla_tree_verify

        decode = attn_metadata.decode
        assert decode is not None
        q_nope, q_pe = q if isinstance(q, tuple) else q.split([MLA_KV_LORA_RANK, MLA_ROPE_DIM], dim=-1)
        num_tokens, num_heads = q_nope.shape[:2]
        masks = current_tree_masks()
        bits = masks.token_bits if masks is not None and masks.token_bits.numel() else decode.causal_token_bits
        out = q_nope.new_empty(num_tokens, num_heads, MLA_KV_LORA_RANK)
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q_nope.device)
        if decode.flashmla_sched is not None and q_nope.dtype == kv_c_and_k_pe_cache.dtype == torch.bfloat16:
            self._flashmla_context_and_tail(q_nope, q_pe, kv_c_and_k_pe_cache, decode, bits[:num_tokens], out, lse)
            return out, lse
        mla_tree_verify(
            q_nope,
            q_pe,
            kv_c_and_k_pe_cache,
            decode.block_table,
            decode.seq_lens,
            decode.query_start_loc,
            bits[:num_tokens],
            self.scale,
            getattr(layer, "_k_scale_float", 1.0),
            out,
            lse,
            decode.max_query_len,
        )
        return out, lse

    def _flashmla_context_and_tail(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        decode: DDTreeMLADecodeMetadata,
        bits: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """FlashMLA over each row's context keys (no mask) while the tree tail runs on a second stream, then their
        log-sum-exp merge (``split_verify``)."""
        from vllm.v1.attention.ops.flashmla import flash_mla_with_kvcache

        from vllm_ddtree.kernels import pack_context_query, split_verify

        num_reqs, width, num_heads = decode.seq_lens.shape[0], decode.max_query_len, q_nope.shape[1]

        def context_pass() -> tuple[torch.Tensor, torch.Tensor]:
            q = pack_context_query(q_nope, q_pe, decode.padded_rows).view(num_reqs, width, num_heads, -1)
            return flash_mla_with_kvcache(
                q=q,
                k_cache=kv_cache.unsqueeze(-2),
                block_table=decode.block_table,
                cache_seqlens=decode.context_lens,
                head_dim_v=MLA_KV_LORA_RANK,
                tile_scheduler_metadata=decode.flashmla_sched,
                softmax_scale=self.scale,
                causal=False,
            )

        split_verify(
            context_pass,
            q_nope,
            q_pe,
            kv_cache,
            decode.block_table,
            decode.seq_lens,
            decode.query_start_loc,
            bits,
            self.scale,
            out,
            lse,
            width,
            self._tail_stream(q_nope.device),
        )

    def _tail_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The tree tail's stream, one per device for all layers (made on first use); None off CUDA."""
        if device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._tail_streams:
            self._tail_streams[index] = torch.cuda.Stream(index)
        return self._tail_streams[index]


class DDTreeMLABackend(MLACommonBackend):
    """vLLM attention backend for MLA targets of a ddtree config (registered as ``CUSTOM``)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"]

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return [16, 32, 64]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """64-token pages where FlashMLA can take the context keys (Hopper), else vLLM's default."""
        from vllm.v1.attention.ops.flashmla import is_flashmla_dense_supported

        if is_flashmla_dense_supported()[0]:
            return FLASHMLA_PAGE
        return super().get_preferred_block_size(default_block_size)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_builder_cls() -> type[DDTreeMLAMetadataBuilder]:
        return DDTreeMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[DDTreeMLAImpl]:
        return DDTreeMLAImpl

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [MLA_HEAD_DIM]

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        return capability.major >= 8
