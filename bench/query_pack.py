"""Time the MLA context pass's query packing on the GPU under CUDA-graph replay: ``torch.cat`` of the query as vLLM
hands it over (the absorbed ``q_nope`` a head-major GEMM output seen transposed, ``q_pe`` a slice of a wider row)
against ``pack_context_query``'s one Triton launch, at the verify shapes of the MLA step bench (64 heads; batch x
tree width tokens). Checks both give the same bytes, prints a table with the copy rate, writes JSON.

    python bench/query_pack.py --out bench/results/query_pack_h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/meta.py

from meta import run_meta  # noqa: E402

from bench.tree_ops import gpu_median_us  # noqa: E402
from vllm_ddtree.kernels import pack_context_query  # noqa: E402

HEADS = 64
# (batch, tree width): batch 1 and 16 at budgets 15 / 63, and the 32-request batch of the kernel bench.
SHAPES = [(1, 16), (1, 64), (16, 16), (16, 64), (32, 16)]


def vllm_query(tokens: int, heads: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_nope`` ``[T, H, 512]`` as ``bmm(...).transpose(0, 1)`` and ``q_pe`` as a 64-wide slice of ``[T, H, 192]``."""
    q_nope = torch.randn(heads, tokens, 512, device=device, dtype=torch.bfloat16).transpose(0, 1)
    q_pe = torch.randn(tokens, heads, 192, device=device, dtype=torch.bfloat16)[..., 128:]
    return q_nope, q_pe


def bench_shape(batch: int, width: int) -> dict:
    tokens = batch * width
    q_nope, q_pe = vllm_query(tokens, HEADS, "cuda")
    if not torch.equal(pack_context_query(q_nope, q_pe), torch.cat([q_nope, q_pe], -1)):
        raise AssertionError(f"pack_context_query differs from torch.cat at {tokens} tokens")
    cat_us = gpu_median_us(lambda: torch.cat([q_nope, q_pe], -1))
    pack_us = gpu_median_us(lambda: pack_context_query(q_nope, q_pe))
    moved = 2 * tokens * HEADS * 576 * 2  # bytes read + written
    return dict(
        batch=batch,
        width=width,
        tokens=tokens,
        heads=HEADS,
        cat_us=round(cat_us, 2),
        pack_us=round(pack_us, 2),
        speedup=round(cat_us / pack_us, 2),
        pack_tb_s=round(moved / pack_us / 1e6, 2),
        cat_tb_s=round(moved / cat_us / 1e6, 2),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/query_pack.json"))
    args = parser.parse_args()
    rows = [bench_shape(batch, width) for batch, width in SHAPES]
    print(
        f"{'batch':>5} {'width':>5} {'tokens':>6} {'cat us':>8} {'pack us':>8} {'speedup':>7} {'cat TB/s':>8} "
        f"{'pack TB/s':>9}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['width']:>5} {r['tokens']:>6} {r['cat_us']:>8} {r['pack_us']:>8} "
            f"{r['speedup']:>7} {r['cat_tb_s']:>8} {r['pack_tb_s']:>9}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = dict(gpu=torch.cuda.get_device_name(), host=platform.node(), torch=torch.__version__)
    args.out.write_text(
        json.dumps(
            dict(meta=run_meta(), machine=machine, timing="CUDA-graph replay, median us a call", rows=rows), indent=1
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
