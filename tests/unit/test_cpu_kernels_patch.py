"""The vLLM-CPU expand kernel seam: DDTree's replacement keeps the Triton kernel's contract for every dtype."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.patches.cpu_kernels import expand_per_request


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64, torch.bool])
def test_expand_per_request_repeats_each_value_over_its_tokens(dtype: torch.dtype) -> None:
    values = torch.tensor([3, 0, 7, 5]).to(dtype)
    cu = torch.tensor([2, 5, 5, 6], dtype=torch.int32)  # request 2 has no tokens
    out = torch.full((8,), 9).to(dtype)
    expand_per_request(out, values, cu, 0, 1)
    expected = torch.tensor([3, 3, 1, 1, 1, 5]).to(dtype) if dtype != torch.bool else torch.tensor([1, 1, 1, 1, 1, 1])
    assert torch.equal(out[:6], expected.to(dtype))
    assert torch.equal(out[6:], torch.full((2,), 9).to(dtype)), "rows past the last request stay untouched"


def test_expand_per_request_writes_float_temperatures() -> None:
    """The case vLLM-CPU's own wrapper gets wrong (it writes a float32 output into an int64 copy)."""
    out = torch.empty(3)
    expand_per_request(out, torch.tensor([0.8, 0.01]), torch.tensor([1, 3]), 0, 1.0)
    assert out.tolist() == pytest.approx([0.8, 0.01, 0.01])


def test_cpu_runner_installs_the_replacement() -> None:
    """Where the installed vLLM-CPU takes its stand-in from: 0.26 a ``kernel[grid]`` wrapper, 0.32 the function."""
    import importlib

    from vllm_ddtree.patches import cpu_kernels, versions

    cpu_kernels.apply()
    cpu_kernels.apply()
    module_name, name = versions.cpu_expand_kernel_seam()
    module = importlib.import_module(module_name)
    installed = getattr(module, name)
    assert (installed[(4,)] if name == "expand_kernel" else installed) is expand_per_request
    assert hasattr(module, f"_orig_{name}")


def test_top_k_over_no_rows_returns_them() -> None:
    """A chain verify of requests that all have zero drafts has no target rows: top-k must not read ``k.max()``."""
    from vllm.v1.sample.ops import topk_topp_sampler

    from vllm_ddtree.patches import cpu_kernels

    cpu_kernels.apply()
    empty = torch.empty(0, 32)
    assert topk_topp_sampler.apply_top_k_top_p(empty, torch.empty(0, dtype=torch.int64), None) is empty
    logits = torch.arange(8.0).repeat(2, 1)
    masked = topk_topp_sampler.apply_top_k_only(logits.clone(), torch.tensor([2, 8]))
    assert torch.isinf(masked[0, :6]).all() and masked[0, 6:].tolist() == [6.0, 7.0]
    assert masked[1].tolist() == logits[1].tolist()


def test_tree_summary_reads_vllm_positions_as_path_depths() -> None:
    from vllm_ddtree.config import DDTreeConfig
    from vllm_ddtree.patches.metrics import tree_summary

    line = tree_summary(4, 6, [[2, 1, 0], [2, 1, 0]], DDTreeConfig(budget=15, topk=8, max_depth=3))
    assert line.startswith("DDTree: 2.50 tokens per verify step over 4 trees of 15 nodes")
    assert "depth 1..3: 1.000, 0.500, 0.000" in line
