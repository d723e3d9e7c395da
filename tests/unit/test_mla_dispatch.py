"""The MLA dispatch table (kernels/mla_dispatch.py) on CPU: which decode launches take the FlashMLA split, and which
of our CUDA kernels (and configuration) a launch gets on each GPU; the kernels themselves run in the GPU tests."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree import envs
from vllm_ddtree.constants import MLA_KERNEL_DECODE, MLA_KERNEL_PORTABLE, MLA_KERNEL_RESIDENT_V
from vllm_ddtree.kernels import mla_dispatch
from vllm_ddtree.kernels.mla_dispatch import (
    OWN_KERNEL_MAX_ROWS,
    DeviceCaps,
    decode_deep,
    flashmla_context,
    mla_launch,
    pick_kernel,
    split_this_launch,
)

# cudaDevAttrMaxSharedMemoryPerBlockOptin / PerMultiprocessor and the compute major of the GPUs the kernels target
H200 = DeviceCaps(232448, 233472, 9)
A100 = DeviceCaps(166912, 167936, 8)
RTX_PRO_6000 = DeviceCaps(101376, 102400, 12)  # sm_120
GPUS = {"H200": H200, "A100": A100, "sm_120": RTX_PRO_6000}


def test_auto_keeps_launches_of_few_rows_on_our_kernel() -> None:
    # plain decode at 8 or 16 heads (TP 8 / 4 of Kimi-K2), trees of up to 4 tokens at 8 heads or 2 at 16: our kernel
    assert not split_this_launch("auto", 1, 8)
    assert not split_this_launch("auto", 1, 16)
    assert not split_this_launch("auto", 4, 8)
    assert not split_this_launch("auto", 2, 16)
    assert OWN_KERNEL_MAX_ROWS == 32
    # more rows a request: the split
    assert split_this_launch("auto", 5, 8)
    assert split_this_launch("auto", 3, 16)
    assert split_this_launch("auto", 1, 64)
    assert split_this_launch("auto", 17, 64)


def test_forced_choices() -> None:
    assert split_this_launch("flashmla", 1, 8)  # VLLM_DDTREE_MLA_CONTEXT=flashmla splits every launch
    assert split_this_launch("flashmla", 64, 128)


def test_flashmla_context_needs_flashmla_bf16_and_its_pages() -> None:
    ok = dict(flashmla_supported=True, block_size=64, model_dtype=torch.bfloat16, cache_dtype="auto")
    for context in ("auto", "flashmla"):
        assert flashmla_context(context, **ok)
        assert flashmla_context(context, **dict(ok, cache_dtype="bfloat16"))
        for bad in (
            dict(flashmla_supported=False),
            dict(block_size=16),
            dict(model_dtype=torch.float16),
            dict(cache_dtype="fp8"),
            dict(cache_dtype="fp8_e4m3"),
        ):
            assert not flashmla_context(context, **dict(ok, **bad)), bad
    assert not flashmla_context("ddtree", **ok)  # our kernel for everything


def test_context_knob_default_and_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_DDTREE_MLA_CONTEXT", raising=False)
    assert envs.VLLM_DDTREE_MLA_CONTEXT == "auto"
    for value in ("flashmla", "ddtree", "auto"):
        monkeypatch.setenv("VLLM_DDTREE_MLA_CONTEXT", value)
        assert envs.VLLM_DDTREE_MLA_CONTEXT == value
    monkeypatch.setenv("VLLM_DDTREE_MLA_CONTEXT", "flash")
    with pytest.raises(ValueError, match="VLLM_DDTREE_MLA_CONTEXT must be one of auto, flashmla, ddtree"):
        envs.VLLM_DDTREE_MLA_CONTEXT  # noqa: B018


@pytest.mark.parametrize("gpu", GPUS)
def test_auto_kernel_by_rows_batch_and_gpu(gpu: str) -> None:
    caps = GPUS[gpu]
    many_rows = MLA_KERNEL_RESIDENT_V if gpu == "H200" else MLA_KERNEL_PORTABLE  # ~226 KB a block: sm_90 only
    for rows, batch, want in [
        (8, 64, MLA_KERNEL_DECODE),
        (32, 8, MLA_KERNEL_DECODE),
        (33, 2, many_rows),
        (48, 1, MLA_KERNEL_DECODE),
        (64, 1, MLA_KERNEL_DECODE),
        (64, 8, many_rows),
        (65, 1, many_rows),
        (4096, 16, many_rows),
    ]:
        assert pick_kernel("auto", rows, batch, caps) == want, (rows, batch)


@pytest.mark.parametrize("gpu", GPUS)
def test_forced_kernels(gpu: str) -> None:
    caps = GPUS[gpu]
    for rows, batch in [(8, 1), (64, 8), (4096, 16)]:
        assert pick_kernel("portable", rows, batch, caps) == MLA_KERNEL_PORTABLE
        assert pick_kernel("decode", rows, batch, caps) == MLA_KERNEL_DECODE
        assert pick_kernel("decode-shallow", rows, batch, caps) == MLA_KERNEL_DECODE


def test_decode_configuration_by_gpu() -> None:
    for fp8 in (False, True):
        assert decode_deep("auto", H200, fp8) and decode_deep("decode", H200, fp8)
        assert not decode_deep("decode-shallow", H200, fp8)  # sm_120's ring on the H200
        assert not decode_deep("auto", A100, fp8)  # 164 KB an SM: two deep CTAs do not fit
        assert not decode_deep("auto", RTX_PRO_6000, fp8)


def test_launch_parameters_from_the_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mla_dispatch, "device_caps", lambda device: H200)
    for name in ("VLLM_DDTREE_MLA_VARIANT", "VLLM_DDTREE_MLA_PDL", "VLLM_DDTREE_MLA_DECODE_CTAS_PER_SM"):
        monkeypatch.delenv(name, raising=False)
    dev = torch.device("cuda", 0)
    assert mla_launch(dev, 16, 4, False) == mla_dispatch.MlaLaunch(MLA_KERNEL_DECODE, True, 0, True)
    assert mla_launch(dev, 128, 4, True) == mla_dispatch.MlaLaunch(MLA_KERNEL_RESIDENT_V, False, 0, True)
    monkeypatch.setenv("VLLM_DDTREE_MLA_VARIANT", "decode-shallow")
    monkeypatch.setenv("VLLM_DDTREE_MLA_PDL", "0")
    monkeypatch.setenv("VLLM_DDTREE_MLA_DECODE_CTAS_PER_SM", "7")
    assert mla_launch(dev, 128, 4, True) == mla_dispatch.MlaLaunch(MLA_KERNEL_DECODE, False, 7, False)
    monkeypatch.setattr(mla_dispatch, "device_caps", lambda device: A100)
    monkeypatch.setenv("VLLM_DDTREE_MLA_PDL", "1")
    assert not mla_launch(dev, 16, 4, False).pdl  # programmatic dependent launch needs sm_90+


def test_off_cuda_caps_hold_nothing() -> None:
    """Meta tensors (a compile trace, never launched) get the kernel every GPU can run."""
    caps = mla_dispatch.device_caps(torch.device("meta"))
    assert pick_kernel("auto", 4096, 16, caps) == MLA_KERNEL_PORTABLE and not decode_deep("auto", caps, False)
