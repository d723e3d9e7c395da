"""Timing of ``ddtree::mla_tree_verify`` on one GPU: CUDA-graph replay over >= 4 rotating KV caches, medians.

    python bench/kernel_mla.py --baselines --out bench/results/mla_kernel_h200_baselines.json

Each row carries its floors: the KV read at the measured copy rate and the FLOPs at the measured dense bf16 GEMM
rate (cuBLAS) — ``floor_us`` — and at the measured ``mma.sync`` peak, the instruction the portable and decode kernels
run (``floor_mma_sync_us``; rates from ``bench/compute_rates.py``). ``--baselines`` (needs vLLM 0.26 on the GPU
machine) also times, over the same rotating caches and in the same run,
vLLM's Triton MLA decode with the tree flattened to one row per node (row i sees L - N + i + 1 keys, as vLLM runs
verify) and FlashMLA with causal q_len = N (same work minus the tree mask), called as in
../shared/device/bench_mla_anchor.py. Block size 64 for those (FlashMLA requires it). ``--shapes memory-bound``
times plain decode and short trees at few heads instead, where the share of copy bandwidth is what counts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench.compute_rates import floor_us, gemm_tflops, mma_sync_rates  # noqa: E402
from vllm_ddtree import envs  # noqa: E402

SHAPES = [(1, 32768, 64, 16), (1, 32768, 64, 64), (1, 131072, 64, 16), (1, 32768, 128, 16), (8, 8192, 64, 16),
          (32, 4096, 16, 16)]
# Memory-bound shapes (B, L, H, N): ~1.89 * N * H FLOP per KV byte, far below the H200's ~206, so the floor is the
# KV read and the copy-bandwidth share is the figure of merit (plain decode and short trees at high TP).
MEMORY_BOUND_SHAPES = [(1, 131072, 8, 1), (1, 131072, 16, 2), (16, 16384, 8, 1), (64, 4096, 16, 1)]
# Between the two (32-128 packed rows a request): where `auto` switches from the decode kernel to the 64-row one.
CROSSOVER_SHAPES = [(1, 32768, 32, 1), (8, 8192, 8, 4), (1, 32768, 16, 3), (1, 32768, 64, 1), (8, 8192, 32, 2),
                    (1, 32768, 16, 8)]
SHAPE_SETS = {"issue": SHAPES, "memory-bound": MEMORY_BOUND_SHAPES, "crossover": CROSSOVER_SHAPES,
              "all": SHAPES + MEMORY_BOUND_SHAPES}


def random_tree_bits(n: int, rng: random.Random) -> list[int]:
    anc = [1]
    for i in range(1, n):
        anc.append(anc[rng.randrange(i)] | (1 << i))
    return [a - (1 << 64) if a >= 1 << 63 else a for a in anc]


def copy_bandwidth_gbs() -> float:
    """Measured device copy rate (bytes read + written), the memory floor's denominator."""
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        y.copy_(x)
    e.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 2 * 10 / (s.elapsed_time(e) * 1e-3) / 1e9


def graph_time_us(fn, reps: int, per_call: int) -> float:
    """Median microseconds per call of ``fn`` (which makes ``per_call`` calls), under CUDA-graph replay."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / per_call)
    return statistics.median(times)


def baseline_times(q: torch.Tensor, caches: list, tables: list, B: int, L: int, H: int, N: int, page: int,
                   bits: torch.Tensor, reps: int) -> dict:
    """vLLM Triton MLA (tree flattened to rows), FlashMLA causal and our Hopper split (FlashMLA context + tree
    tail), same caches; NaN where one cannot run."""
    res: dict = {}
    scale = 1 / math.sqrt(576)
    try:
        import triton
        from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

        qf = q.contiguous()
        btf = [bt.repeat_interleave(N, dim=0).contiguous() for bt in tables]
        sl = (torch.arange(N, device="cuda").repeat(B) + L - N + 1).int()
        n_sm = torch.cuda.get_device_properties(0).multi_processor_count
        nsplit = min(triton.next_power_of_2(max(1, L // 512)), n_sm * 2)
        o = torch.zeros(B * N, H, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.zeros(B * N, H, dtype=torch.bfloat16, device="cuda")  # as in bench_mla_anchor.py
        logits = torch.empty(B * N, H, nsplit, 513, dtype=torch.float32, device="cuda")
        one = torch.ones((), dtype=torch.float32, device="cuda")  # vLLM would build these on the host per call

        def tri() -> None:
            for c, bt in zip(caches, btf, strict=True):
                kv = c.view(c.shape[0], c.shape[1], 1, 576)
                decode_attention_fwd(qf, kv, kv[..., :512], o, lse, bt, sl, logits, nsplit, scale, page,
                                     k_scale=one, v_scale=one, is_mla=True)

        res["triton_mla_us"] = round(graph_time_us(tri, reps, len(caches)), 2)
    except Exception as e:  # noqa: BLE001 - report and keep going
        print("  triton baseline failed:", str(e)[:200])
        res["triton_mla_us"] = float("nan")
    try:
        from vllm.third_party.flashmla.flash_mla_interface import flash_mla_with_kvcache, get_mla_metadata

        q4 = q.view(B, N, H, 576).contiguous()
        seqlens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        sm, _ = get_mla_metadata()

        def fm() -> None:
            for c, bt in zip(caches, tables, strict=True):
                flash_mla_with_kvcache(q4, c.view(c.shape[0], c.shape[1], 1, 576), bt, seqlens, 512, sm, None,
                                       softmax_scale=scale, causal=True)

        res["flashmla_causal_us"] = round(graph_time_us(fm, reps, len(caches)), 2)
    except Exception as e:  # noqa: BLE001
        print("  flashmla baseline failed:", str(e)[:200])
        res["flashmla_causal_us"] = float("nan")
    try:
        res["ours_hopper_us"] = round(hopper_split_time(q, caches, tables, B, L, H, N, bits, reps), 2)
    except Exception as e:  # noqa: BLE001
        print("  FlashMLA context + tree tail failed:", str(e)[:200])
        res["ours_hopper_us"] = float("nan")
    return res


def hopper_split_time(q: torch.Tensor, caches: list, tables: list, B: int, L: int, H: int, N: int, bits: torch.Tensor,
                      reps: int) -> float:
    """The DDTree MLA backend's Hopper decode (``split_verify``): FlashMLA over the L-N context keys (no mask) while
    ``mla_tree_tail`` attends the N tree keys on a second stream, then the log-sum-exp merge (query padding is a
    no-op here: every request has N rows)."""
    from vllm.third_party.flashmla.flash_mla_interface import flash_mla_with_kvcache, get_mla_metadata

    from vllm_ddtree.kernels import split_verify

    scale = 1 / math.sqrt(576)
    q4 = q.view(B, N, H, 576).contiguous()
    context = torch.full((B,), L - N, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, B * N + 1, N, dtype=torch.int32, device="cuda")
    out = torch.empty(B * N, H, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(B * N, H, dtype=torch.float32, device="cuda")
    sm, _ = get_mla_metadata()
    side = torch.cuda.Stream()

    def split() -> None:
        for c, bt in zip(caches, tables, strict=True):
            def context_pass(c: torch.Tensor = c, bt: torch.Tensor = bt) -> tuple[torch.Tensor, torch.Tensor]:
                return flash_mla_with_kvcache(q4, c.view(c.shape[0], c.shape[1], 1, 576), bt, context, 512, sm, None,
                                              softmax_scale=scale, causal=False)

            split_verify(context_pass, q[..., :512], q[..., 512:], c, bt, seq_lens, qsl, bits, scale, out, lse, N,
                         side)  # fmt: skip

    return graph_time_us(split, reps, len(caches))


def kernel_breakdown_us(fn, calls: int = 20) -> dict[str, float]:
    """Device microseconds per launch of each kernel ``fn`` launches (eager, torch.profiler): where the time of one
    call goes (split planner, main kernel, combine); their sum leaves out the gaps between launches. With programmatic
    dependent launch (the decode kernel on sm_90+) a kernel's span includes its wait on the one before it: run with
    VLLM_DDTREE_MLA_PDL=0 for separate times."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.count >= calls:
            name = e.key.replace("(anonymous namespace)::", "").split("(")[0].split("<")[0].split("::")[-1]
            out[name] = round(out.get(name, 0.0) + e.device_time_total / calls, 2)
    return out


def shape_work(B: int, L: int, H: int, N: int, fp8: bool) -> tuple[float, float]:
    """A verify call's FLOPs (QK over 576 dims and PV over 512, every (node, head) row against all L keys) and its KV
    bytes (each key's 576 dims read once), the numerators of its TFLOP/s, copy-rate share and floors."""
    return 2176.0 * N * H * L * B, B * L * 576 * (1 if fp8 else 2)


def time_shape(B: int, L: int, H: int, N: int, page: int, fp8: bool, rotate: int, reps: int,
               baselines: dict | None = None, breakdown: bool = False) -> dict:
    """Our kernel on one shape; ``baselines`` (a dict, filled on the first variant of the shape and reused by the
    next) adds the baseline timings and our ratios to them; ``breakdown`` the device time per kernel."""
    from vllm_ddtree.kernels import mla_tree_verify

    rng = random.Random(0)
    T = B * N
    nblk = -(-L // page)
    q = (torch.randn(T, H, 576, device="cuda") / 10).to(torch.bfloat16)
    q_nope, q_pe = q[..., :512], q[..., 512:]
    caches, tables = [], []
    for _ in range(rotate):
        c = (torch.randn(B * nblk, page, 576, device="cuda") / 10)
        c = c.to(torch.float8_e4m3fn).view(torch.uint8) if fp8 else c.to(torch.bfloat16)
        caches.append(c)
        tables.append(torch.randperm(B * nblk, device="cuda").to(torch.int32).view(B, nblk))
    seq_lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, T + 1, N, dtype=torch.int32, device="cuda")
    bits = torch.tensor(sum((random_tree_bits(N, rng) for _ in range(B)), []), dtype=torch.int64, device="cuda")
    out = torch.empty(T, H, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(T, H, dtype=torch.float32, device="cuda")
    scale = 1 / math.sqrt(576)

    def step() -> None:
        for c, bt in zip(caches, tables, strict=True):
            mla_tree_verify(q_nope, q_pe, c, bt, seq_lens, qsl, bits, scale, 1.0, out, lse, max_query_len=N)

    us = graph_time_us(step, reps, rotate)
    flops, kv_bytes = shape_work(B, L, H, N, fp8)
    row = dict(B=B, L=L, H=H, N=N, page=page, fp8=fp8, us=round(us, 2), tflops=round(flops / us / 1e6, 1),
               kv_gbs=round(kv_bytes / us / 1e3, 1), variant=envs.VLLM_DDTREE_MLA_VARIANT)
    if breakdown:
        c, bt = caches[0], tables[0]
        row["kernels_us"] = kernel_breakdown_us(
            lambda: mla_tree_verify(q_nope, q_pe, c, bt, seq_lens, qsl, bits, scale, 1.0, out, lse, max_query_len=N))
    if baselines is not None and not fp8:
        if not baselines:
            baselines.update(baseline_times(q, caches, tables, B, L, H, N, page, bits, reps))
        row.update(baselines)
        row["x_vs_triton"] = round(row["triton_mla_us"] / us, 2)
        row["x_of_flashmla"] = round(row["flashmla_causal_us"] / us, 2)
        row["hopper_x_vs_triton"] = round(row["triton_mla_us"] / row["ours_hopper_us"], 2)
        row["hopper_x_of_flashmla"] = round(row["flashmla_causal_us"] / row["ours_hopper_us"], 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--rotate", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default="auto,portable",
                    help="comma list of VLLM_DDTREE_MLA_VARIANT values: auto (the decode kernel at few rows a request, "
                         "else resident-V where smem allows, e.g. sm_90, else portable), portable (sm_120 config), "
                         "decode (the 16-row decode kernel, at every size), decode-shallow (decode with sm_120's "
                         "2-stage ring)")
    ap.add_argument("--shapes", choices=sorted(SHAPE_SETS), default="issue",
                    help="issue: the compute-bound shapes of the README table; memory-bound: plain decode and short "
                         "trees at few heads, judged by their share of copy bandwidth; crossover: 32-128 rows a "
                         "request, where auto changes kernels")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--breakdown", action="store_true",
                    help="also the device time per kernel of one call (planner / main / combine; eager, profiler)")
    ap.add_argument("--baselines", action="store_true", help="also time vLLM Triton MLA and FlashMLA (needs vLLM)")
    ap.add_argument("--csrc", default="", help="build the kernel from this source tree instead (A/B timing of a "
                    "kernel change: run once per tree, same machine, back to back)")
    args = ap.parse_args()
    if args.csrc:
        os.environ["VLLM_DDTREE_CSRC"] = str(Path(args.csrc).resolve())
    bw = copy_bandwidth_gbs()
    gemm = gemm_tflops()
    mma_sync = max(r["tflops"] for r in mma_sync_rates())
    rows = []
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw:.0f} GB/s, bf16 GEMM {gemm:.0f} TFLOP/s, "
          f"mma.sync peak {mma_sync:.0f} TFLOP/s")
    shapes = SHAPE_SETS[args.shapes]
    shape_baselines: dict = {shape: {} for shape in shapes}
    print(f"{'variant':>8} {'B':>3} {'L':>7} {'H':>4} {'N':>3} {'us':>9} {'TFLOP/s':>8} {'KV GB/s':>8} {'%copyBW':>7} "
          f"{'floor':>8} {'floor_mma':>9}  (floors in us: at the GEMM rate / at the mma.sync peak)")
    for var in args.variants.split(","):
        if var not in envs.MLA_VARIANTS:
            raise SystemExit(f"unknown variant {var!r}: one of {', '.join(envs.MLA_VARIANTS)}")
        os.environ["VLLM_DDTREE_MLA_VARIANT"] = var
        for B, L, H, N in shapes:
            r = time_shape(B, L, H, N, args.page, args.fp8, args.rotate, args.reps,
                           shape_baselines[(B, L, H, N)] if args.baselines else None, args.breakdown)
            r["pct_copy_bw"] = round(100 * r["kv_gbs"] / bw, 1)
            flops, kv_bytes = shape_work(B, L, H, N, args.fp8)
            r["floor_us"] = round(floor_us(flops, kv_bytes, bw, gemm), 2)
            r["floor_mma_sync_us"] = round(floor_us(flops, kv_bytes, bw, mma_sync), 2)
            rows.append(r)
            print(f"{var:>8} {B:>3} {L:>7} {H:>4} {N:>3} {r['us']:>9.1f} {r['tflops']:>8.1f} {r['kv_gbs']:>8.0f} "
                  f"{r['pct_copy_bw']:>7.1f} {r['floor_us']:>8.1f} {r['floor_mma_sync_us']:>9.1f}"
                  + (f"  triton {r['triton_mla_us']:.1f} us ({r['x_vs_triton']}x)  "
                  f"flashmla {r['flashmla_causal_us']:.1f} us (ours = {r['x_of_flashmla']}x its speed)  "
                  f"hopper split {r['ours_hopper_us']:.1f} us ({r['hopper_x_vs_triton']}x triton, "
                  f"{r['hopper_x_of_flashmla']}x flashmla)"
                  if "triton_mla_us" in r else ""), flush=True)
            if "kernels_us" in r:
                print("          per kernel (us, eager): " + ", ".join(f"{k} {v}" for k, v in r["kernels_us"].items()))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_gbs=round(bw, 1), gemm_tflops=round(gemm, 1),
                           mma_sync_tflops=round(mma_sync, 1), rotate=args.rotate,
                           shapes=args.shapes, method="CUDA-graph replay, median over reps, per call",
                           csrc=envs.VLLM_DDTREE_CSRC or "repository", rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
