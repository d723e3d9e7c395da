"""The one MLA dispatch table: which kernel attends the decode rows of an MLA verify launch.

Two choices, both made here from the launch's shapes, the GPU and the knobs (``vllm_ddtree/envs.py``), and handed
down as parameters: the backend asks ``flashmla_context`` / ``split_this_launch`` (per builder, per launch), and
``ops.mla_tree_verify`` asks ``mla_launch`` and passes its answer to the CUDA op, which decides nothing itself.
Every input is host-known and fixed per CUDA graph (a FULL graph's batch has one query width), so a graph replays
the choice its capture made.

The context keys (every key before a request's tree), ``VLLM_DDTREE_MLA_CONTEXT``; rows a request = the launch's
query width x heads; FlashMLA is usable with vLLM's FlashMLA build (Hopper), a bf16 model and cache, 64-token pages:

    context knob   FlashMLA usable   rows a request   decode rows run on
    auto           yes               > 32             FlashMLA over the context + our Triton tree tail
    auto           yes               <= 32            our CUDA kernel (OWN_KERNEL_MAX_ROWS)
    flashmla       yes               any              FlashMLA over the context + our Triton tree tail
    auto/flashmla  no                any              our CUDA kernel
    ddtree         -                 any              our CUDA kernel

Our CUDA kernel, ``VLLM_DDTREE_MLA_VARIANT``; rows = max query length x heads, B requests:

    variant knob    rows, B                              GPU                              kernel
    auto            rows <= 32, or rows <= 64 and B = 1  any                              decode
    auto            more                                 a resident-V CTA fits (sm_90)    resident-V
    auto            more                                 less shared memory (sm_80/120)   portable
    portable        any                                  any                              portable
    decode          any                                  any                              decode
    decode-shallow  any                                  any                              decode, shallow ring

The decode kernel takes its deep configuration (32-key tiles) where two of its CTAs fit an SM (sm_90), else the
shallow one (16-key tiles: sm_80 / sm_120), and programmatic dependent launch on sm_90+ unless
``VLLM_DDTREE_MLA_PDL=0``; ``VLLM_DDTREE_MLA_DECODE_CTAS_PER_SM`` overrides the CTAs per SM that size its split.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vllm_ddtree import envs
from vllm_ddtree.constants import (
    MLA_DECODE_DEEP_SMEM_BF16,
    MLA_DECODE_DEEP_SMEM_FP8,
    MLA_KERNEL_DECODE,
    MLA_KERNEL_PORTABLE,
    MLA_KERNEL_RESIDENT_V,
    MLA_RESIDENT_V_SMEM,
)

# Launches of at most this many packed rows a request (query width x heads) keep our decode kernel in auto mode; above
# it the FlashMLA split wins (measured: docs/results.md, section 6.3).
OWN_KERNEL_MAX_ROWS = 32
# FlashMLA's page size: the split needs the cache in pages of this many tokens.
FLASHMLA_PAGE = 64
# The decode kernel where a request has few rows; with 64 rows and several requests its four 16-row blocks re-read
# every KV tile and the 64-row kernels win (measured: docs/results.md, section 6.3).
DECODE_MAX_ROWS, DECODE_MAX_ROWS_ONE_REQUEST = 32, 64
# Shared memory the GPU reserves per resident CTA (sm_80 and later), on top of its dynamic shared memory.
CTA_RESERVED_SMEM = 1024


def flashmla_context(
    context: str, flashmla_supported: bool, block_size: int, model_dtype: torch.dtype, cache_dtype: str
) -> bool:
    """Whether FlashMLA may attend decode rows' context keys (first table): vLLM's FlashMLA is usable
    (``flashmla_supported``), a bf16 model and cache in FlashMLA's pages, unless ``context`` is ``ddtree``."""
    return (
        context != "ddtree"
        and flashmla_supported
        and block_size == FLASHMLA_PAGE
        and model_dtype == torch.bfloat16
        and cache_dtype in ("auto", "bfloat16")
    )


def split_this_launch(context: str, width: int, num_heads: int) -> bool:
    """Whether a decode launch where FlashMLA can take the context uses the split: always when forced, else unless
    its rows a request (``width`` query tokens x ``num_heads``) are few enough for our decode kernel. ``width`` is
    the uniform query length of a FULL graph's batch, so the choice is fixed per graph."""
    return context == "flashmla" or width * num_heads > OWN_KERNEL_MAX_ROWS


@dataclass(frozen=True)
class DeviceCaps:
    """What the second table asks of a GPU: opt-in shared memory a block, shared memory an SM, compute major."""

    smem_per_block_optin: int
    smem_per_sm: int
    major: int


@functools.cache
def _cuda_caps(index: int) -> DeviceCaps:
    props = torch.cuda.get_device_properties(index)
    return DeviceCaps(props.shared_memory_per_block_optin, props.shared_memory_per_multiprocessor, props.major)


def device_caps(device: torch.device) -> DeviceCaps:
    """The GPU's caps, queried once per device. Off CUDA (meta tensors of a compile trace, which never launch) a GPU
    that holds nothing: the portable kernel, the shallow ring, no PDL."""
    if device.type != "cuda":
        return DeviceCaps(0, 0, 0)
    return _cuda_caps(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class MlaLaunch:
    """The parameters of ``ddtree::mla_tree_verify`` that select and size its kernel."""

    kernel: int
    """MLA_KERNEL_PORTABLE, MLA_KERNEL_RESIDENT_V or MLA_KERNEL_DECODE."""
    decode_deep: bool
    """The decode kernel's deep configuration (32-key tiles, two CTAs an SM) instead of the shallow one."""
    decode_ctas_per_sm: int
    """CTAs per SM that size the decode kernel's split (0: the occupancy of its configuration)."""
    pdl: bool
    """Programmatic dependent launch of the decode kernel and its combine."""


def pick_kernel(variant: str, rows: int, batch: int, caps: DeviceCaps) -> int:
    """The second table's kernel for ``rows`` packed rows a request and ``batch`` requests."""
    if variant == "portable":
        return MLA_KERNEL_PORTABLE
    if variant.startswith("decode"):
        return MLA_KERNEL_DECODE
    if rows <= DECODE_MAX_ROWS or (rows <= DECODE_MAX_ROWS_ONE_REQUEST and batch == 1):
        return MLA_KERNEL_DECODE
    return MLA_KERNEL_RESIDENT_V if caps.smem_per_block_optin >= MLA_RESIDENT_V_SMEM else MLA_KERNEL_PORTABLE


def decode_deep(variant: str, caps: DeviceCaps, fp8: bool) -> bool:
    """Whether the decode kernel runs deep: two of its deep CTAs fit an SM, unless ``decode-shallow`` forces the
    shallow ring (sm_120's configuration, testable on an H200)."""
    need = MLA_DECODE_DEEP_SMEM_FP8 if fp8 else MLA_DECODE_DEEP_SMEM_BF16
    fits = caps.smem_per_block_optin >= need and caps.smem_per_sm >= 2 * (need + CTA_RESERVED_SMEM)
    return variant != "decode-shallow" and fits


def mla_launch(device: torch.device, rows: int, batch: int, fp8: bool) -> MlaLaunch:
    """The kernel parameters of one ``mla_tree_verify`` launch (second table), from the knobs read now."""
    variant = envs.VLLM_DDTREE_MLA_VARIANT
    caps = device_caps(device)
    kernel = pick_kernel(variant, rows, batch, caps)
    return MlaLaunch(
        kernel=kernel,
        decode_deep=kernel == MLA_KERNEL_DECODE and decode_deep(variant, caps, fp8),
        decode_ctas_per_sm=envs.VLLM_DDTREE_MLA_DECODE_CTAS_PER_SM,
        pdl=envs.VLLM_DDTREE_MLA_PDL and caps.major >= 9,
    )
