"""Measured compute rates of one GPU, the compute floor's denominators in ``bench/kernel_mla.py``.

    python bench/compute_rates.py --out bench/results/compute_rates_h200.json

- dense bf16 GEMM through torch (cuBLAS; wgmma on sm_90): the rate FlashMLA-class kernels can approach;
- ``mma.sync`` m16n8k16 bf16 -> fp32 (``bench/mma_sync_rate.cu``, built with nvcc into a shared library): the
  instruction the portable MLA kernel and the decode kernel run, with 1 or 2 warps on each SM sub-partition and 1, 2
  or 4 independent accumulator chains a warp, so both the peak and one chain's dependent-issue time are measured.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/meta.py

from meta import run_meta  # noqa: E402

from vllm_ddtree import envs  # noqa: E402
from vllm_ddtree.kernels.ops import cache_root, csrc_dir  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "mma_sync_rate.cu"


def gemm_tflops(n: int = 8192, reps: int = 10) -> float:
    """Median dense bf16 GEMM rate (n x n x n) in TFLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    return 2 * n**3 / statistics.median(times) / 1e12


def nvcc_path() -> str | None:
    cand = Path(envs.CUDA_HOME) / "bin" / "nvcc"
    return str(cand) if cand.is_file() else shutil.which("nvcc")


def build_rate_library(arch: str, cache: Path | None = None) -> Path:
    """Compiles ``mma_sync_rate.cu`` for ``arch`` (e.g. "90") into a cached shared library and returns its path."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found: set CUDA_HOME to a CUDA toolkit to measure the mma.sync rate")
    include = csrc_dir()
    key = hashlib.sha256(SOURCE.read_bytes() + (include / "device_utils.cuh").read_bytes() + arch.encode())
    key = key.hexdigest()[:16]
    cache = cache or cache_root() / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"mma_sync_rate_{arch}_{key}.so"
    if not lib.is_file():
        tmp = lib.with_suffix(".tmp.so")
        subprocess.run(
            [
                nvcc,
                "-O3",
                "-shared",
                "-Xcompiler",
                "-fPIC",
                f"-gencode=arch=compute_{arch},code=sm_{arch}",
                f"-I{include}",
                str(SOURCE),
                "-o",
                str(tmp),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        tmp.replace(lib)
    return lib


def mma_sync_rates(device: int = 0) -> list[dict]:
    """One row per (warps a sub-partition, chains a warp): whole-GPU TFLOP/s and one warp's ns per mma."""
    major, minor = torch.cuda.get_device_capability(device)
    lib = ctypes.CDLL(str(build_rate_library(f"{major}{minor}")))
    fn = lib.mma_sync_rate
    fn.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_double),
        ctypes.POINTER(ctypes.c_double),
    ]
    clock_mhz = lib.max_clock_khz(device) / 1e3
    rows = []
    for warps in (1, 2):
        for chains in (1, 2, 4):
            tf, ns = ctypes.c_double(), ctypes.c_double()
            err = fn(device, warps, chains, ctypes.byref(tf), ctypes.byref(ns))
            if err:
                raise RuntimeError(f"mma_sync_rate(warps={warps}, chains={chains}) failed with CUDA error {err}")
            rows.append(
                dict(
                    warps_per_smsp=warps,
                    chains=chains,
                    tflops=round(tf.value, 1),
                    ns_per_mma=round(ns.value, 2),
                    clk_per_mma_at_max_clock=round(ns.value * clock_mhz / 1e3, 1),
                )
            )
    return rows


def floor_us(flops: float, kv_bytes: float, copy_gbs: float, tflops: float) -> float:
    """Microseconds of the slower of: reading ``kv_bytes`` at the measured copy rate (the denominator of the bench's
    "% of copy rate"), and doing ``flops`` at ``tflops``."""
    return max(kv_bytes / (copy_gbs * 1e3), flops / (tflops * 1e6))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    gemm = gemm_tflops()
    rows = mma_sync_rates()
    print(f"{torch.cuda.get_device_name()}: dense bf16 GEMM (torch) {gemm:.0f} TFLOP/s")
    print(
        f"{'warps/SMSP':>10} {'chains':>6} {'TFLOP/s':>8} {'ns/mma':>7} {'clk/mma':>7}   (mma.sync m16n8k16 bf16->fp32)"
    )
    for r in rows:
        print(
            f"{r['warps_per_smsp']:>10} {r['chains']:>6} {r['tflops']:>8.1f} {r['ns_per_mma']:>7.2f} "
            f"{r['clk_per_mma_at_max_clock']:>7.1f}"
        )
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(
                dict(meta=run_meta(), device=torch.cuda.get_device_name(), gemm_tflops=round(gemm, 1), mma_sync=rows),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
