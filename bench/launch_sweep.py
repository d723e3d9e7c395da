"""Launch-shape sweeps behind two constants of the verify step's small kernels, on one GPU, CUDA-graph replay.

* ``mla_tree_tail`` (the Hopper split's tree tail): microseconds per call for each output-part count in
  ``V_SPLITS`` at verify shapes (B requests of N tree tokens, H heads; the request's context does not change the
  tail's work), alone (as it runs on its own stream beside FlashMLA), over 4 rotating caches. The default rule
  (``output_parts``) is printed beside the best.
* ``topk_logprobs`` (the drafter's per-depth top-k): microseconds per call for several first-pass slice lengths
  (``MIN_SLICE``) at R = batch x 15 depths rows of a 163,840-token vocabulary, bf16 logits, k = 8.
* The DFlash drafter's attention as vLLM runs it (FA3, paged KV, non-causal, 32 query / 8 KV heads of 128): per
  query count a request (ddtree's drafter runs 1 + 15, vLLM's chain of budget 16 runs 17), context and batch, with
  vLLM's FULL-graph scheduler metadata (at most 32 splits) and with the split count forced.

    python bench/launch_sweep.py --out bench/results/launch_sweep_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_mla import graph_time_us, random_tree_bits  # noqa: E402
from meta import run_meta  # noqa: E402

TAIL_SHAPES = [
    (1, 64, 9),
    (1, 64, 17),
    (1, 64, 33),
    (1, 64, 64),
    (16, 64, 9),
    (16, 64, 17),
    (16, 64, 33),
    (16, 64, 64),
    (8, 64, 16),
    (32, 16, 16),
    (1, 128, 16),
]
TOPK_BATCHES = [1, 8, 16, 32, 64]
SLICES = [4096, 8192, 16384, 32768]
VOCAB = 163840
DEPTH = 15


def _tail_calls(caches: list, tables: list, inputs: tuple, parts: int) -> None:
    from vllm_ddtree.kernels import mla_tree_tail

    q_nope, q_pe, seq_lens, qsl, bits, out, lse, n = inputs
    for cache, table in zip(caches, tables, strict=True):
        mla_tree_tail(q_nope, q_pe, cache, table, seq_lens, qsl, bits, 1 / 24, out, lse, n, v_split=parts)


def tail_rows(reps: int, rotate: int = 4, context: int = 4096, page: int = 64) -> list[dict]:
    """``mla_tree_tail`` per output-part count, each shape."""
    from vllm_ddtree.kernels.mla_tree_tail import BLOCK_M, V_SPLITS, output_parts

    rng = random.Random(0)
    rows = []
    for B, H, N in TAIL_SHAPES:
        L = context + N
        nblk = -(-L // page)
        T = B * N
        q = (torch.randn(T, H, 576, device="cuda") / 10).to(torch.bfloat16)
        caches = [(torch.randn(B * nblk, page, 576, device="cuda") / 10).to(torch.bfloat16) for _ in range(rotate)]
        tables = [torch.randperm(B * nblk, device="cuda").to(torch.int32).view(B, nblk) for _ in range(rotate)]
        seq_lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        qsl = torch.arange(0, T + 1, N, dtype=torch.int32, device="cuda")
        bits = torch.tensor(sum((random_tree_bits(N, rng) for _ in range(B)), []), dtype=torch.int64, device="cuda")
        out = torch.empty(T, H, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(T, H, dtype=torch.float32, device="cuda")
        programs = B * math.ceil(N * H / BLOCK_M)
        row = dict(B=B, H=H, N=N, default_parts=output_parts(programs))
        inputs = (q[..., :512], q[..., 512:], seq_lens, qsl, bits, out, lse, N)
        for parts in V_SPLITS:
            run = partial(_tail_calls, caches, tables, inputs, parts)
            row[f"us_parts_{parts}"] = round(graph_time_us(run, reps, rotate), 2)
        row["best_parts"] = min(V_SPLITS, key=lambda p: row[f"us_parts_{p}"])
        rows.append(row)
        times = "  ".join(f"{p}: {row[f'us_parts_{p}']:7.2f}" for p in V_SPLITS)
        choice = f"default {row['default_parts']}, best {row['best_parts']}"
        print(f"tail B={B:>2} H={H:>3} N={N:>2}  {times}  us   {choice}", flush=True)
    return rows


def topk_rows(reps: int) -> list[dict]:
    """``topk_logprobs`` per first-pass slice length, each batch."""
    from vllm_ddtree import draft_topk

    default = draft_topk.MIN_SLICE
    rows = []
    for batch in TOPK_BATCHES:
        logits = torch.randn(batch * DEPTH, VOCAB, device="cuda").to(torch.bfloat16)
        row = dict(batch=batch, rows=batch * DEPTH, vocab=VOCAB, default_slice=default)
        for slice_len in SLICES:
            draft_topk.MIN_SLICE = slice_len
            run = partial(draft_topk.topk_logprobs, logits, 8)
            row[f"us_slice_{slice_len}"] = round(graph_time_us(run, reps, 1), 2)
        draft_topk.MIN_SLICE = default
        row["best_slice"] = min(SLICES, key=lambda s: row[f"us_slice_{s}"])
        rows.append(row)
        print(
            f"topk batch {batch:>3} ({batch * DEPTH} rows)  "
            + "  ".join(f"{s}: {row[f'us_slice_{s}']:7.2f}" for s in SLICES)
            + f"  us   default {default}, best {row['best_slice']}",
            flush=True,
        )
    return rows


FA_CASES = [(1, 4096), (16, 4096), (1, 32768), (16, 32768)]
FA_QUERIES = [16, 17]
FA_SPLITS = [0, 1, 4, 16]  # 0: vLLM's FULL-graph scheduler metadata (at most 32 splits); else a static split count


def drafter_attention_rows(reps: int, page: int = 64) -> list[dict]:
    """vLLM's FA3 on the DFlash drafter's shapes."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    rows = []
    for batch, context in FA_CASES:
        nblk = -(-(context + 32) // page)
        k = (torch.randn(batch * nblk, page, 8, 128, device="cuda") / 10).to(torch.bfloat16)
        v = (torch.randn(batch * nblk, page, 8, 128, device="cuda") / 10).to(torch.bfloat16)
        table = torch.randperm(batch * nblk, device="cuda").to(torch.int32).view(batch, nblk)
        for nq in FA_QUERIES:
            q = (torch.randn(batch * nq, 32, 128, device="cuda") / 10).to(torch.bfloat16)
            out = torch.empty_like(q)
            cu_q = torch.arange(0, batch * nq + 1, nq, dtype=torch.int32, device="cuda")
            seqused = torch.full((batch,), context + nq, dtype=torch.int32, device="cuda")
            row = dict(batch=batch, context=context, queries=nq)
            for splits in FA_SPLITS:
                sched = (
                    None
                    if splits
                    else get_scheduler_metadata(
                        batch_size=batch,
                        max_seqlen_q=nq,
                        max_seqlen_k=context + nq,
                        num_heads_q=32,
                        num_heads_kv=8,
                        headdim=128,
                        cache_seqlens=seqused,
                        qkv_dtype=torch.bfloat16,
                        cu_seqlens_q=cu_q,
                        page_size=page,
                        causal=False,
                        num_splits=32,
                    )
                )

                run = partial(
                    flash_attn_varlen_func,
                    q=q,
                    k=k,
                    v=v,
                    out=out,
                    cu_seqlens_q=cu_q,
                    max_seqlen_q=nq,
                    seqused_k=seqused,
                    max_seqlen_k=context + nq,
                    softmax_scale=128**-0.5,
                    causal=False,
                    block_table=table,
                    scheduler_metadata=sched,
                    num_splits=splits or 32,
                    fa_version=3,
                )
                row[f"us_splits_{splits or 'vllm'}"] = round(graph_time_us(run, reps, 1), 2)
            rows.append(row)
            print(
                f"drafter FA3 B={batch:>2} ctx={context:>6} q={nq}  "
                + "  ".join(f"{key[10:]}: {val:8.2f}" for key, val in row.items() if key.startswith("us_"))
                + "  us",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    result: dict = dict(
        meta=run_meta(), device=torch.cuda.get_device_name(), method="CUDA-graph replay, median over reps, per call"
    )
    for name, sweep in (("tail", tail_rows), ("topk", topk_rows), ("drafter_attention", drafter_attention_rows)):
        try:
            result[name] = sweep(args.reps)
        except Exception as e:  # noqa: BLE001 - report and keep the other sweeps
            print(f"{name} sweep failed: {e}", flush=True)
            result[name] = f"failed: {e}"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
