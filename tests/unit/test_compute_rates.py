"""The compute floors of bench/kernel_mla.py: the floor arithmetic, and the mma.sync rate library builds (nvcc)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from bench.compute_rates import build_rate_library, floor_us, nvcc_path


def test_floor_is_the_slower_of_memory_and_compute() -> None:
    # B1 L32k H64 N16: 73 GFLOP and 37.7 MB of KV; at 4,000 GB/s and 500 TFLOP/s the FLOPs bound it
    flops, kv = 2176.0 * 16 * 64 * 32768, 32768 * 1152
    assert floor_us(flops, kv, 4000.0, 500.0) == pytest.approx(flops / 500e6)
    # plain decode at 8 heads: the KV read bounds it
    flops, kv = 2176.0 * 1 * 8 * 131072, 131072 * 1152
    assert floor_us(flops, kv, 4000.0, 500.0) == pytest.approx(kv / 4000e3)


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not found (set CUDA_HOME)")
@pytest.mark.parametrize("arch", ["80", "90", "120"])
def test_mma_sync_rate_library_builds(arch: str, tmp_path: Path) -> None:
    lib = build_rate_library(arch, cache=tmp_path)
    assert lib.is_file() and lib.parent == tmp_path
    loaded = ctypes.CDLL(str(lib))  # loads without a GPU: the CUDA runtime is linked in and opens the driver lazily
    assert hasattr(loaded, "mma_sync_rate") and hasattr(loaded, "max_clock_khz")
    assert build_rate_library(arch, cache=tmp_path) == lib  # cached: same content, same file
