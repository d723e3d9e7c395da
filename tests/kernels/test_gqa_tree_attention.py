"""GQA tree-verify attention: the fp32 reference against a naive loop, the Triton kernel against the reference
(CPU through Triton's interpreter in a subprocess, CUDA at realistic sizes, CUDA-graph replay), and a timing table
(``python tests/kernels/test_gqa_tree_attention.py`` on a GPU)."""

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_ddtree.kernels import gqa_tree_attention, gqa_tree_attention_ref

REPO = Path(__file__).resolve().parents[2]
# Block ids of q_len-0 padding requests and of unused block-table slots: reading one faults or trips a check.
BAD_BLOCK = 1 << 30


def tree_bits(rng: np.random.Generator, n: int, kind: str) -> list[int]:
    """Ancestor-or-self bits of an n-node tree in topological order (node 0 is the root), as signed int64."""
    if kind == "chain":
        parents = list(range(-1, n - 1))
    elif kind == "star":
        parents = [-1] + [0] * (n - 1)
    else:
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    anc: list[int] = []
    for i, p in enumerate(parents):
        anc.append((anc[p] if p >= 0 else 0) | (1 << i))
    return [a - (1 << 64) if a >= 1 << 63 else a for a in anc]


def make_case(
    rng: np.random.Generator,
    reqs: list[tuple[int, int, str]],
    hq: int = 4,
    hkv: int = 2,
    d: int = 64,
    page: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = "HND",
    device: str = "cpu",
    rows: int | None = None,
    num_blocks: int | None = None,
    table_width: int | None = None,
) -> dict:
    """reqs: (q_len, context length before the tail, tree kind). Pages are shuffled, unused cache slots are NaN,
    q_len-0 requests have seq_len 0 and a block-table row of invalid ids, causal requests get garbage tree bits.
    rows / num_blocks / table_width pad the shapes (fixed shapes for CUDA-graph replay)."""
    lens = [q + c if q else 0 for q, c, _ in reqs]
    need = [-(-n // page) for n in lens]
    num_blocks = num_blocks or sum(need) + 3
    perm = torch.from_numpy(rng.permutation(num_blocks)).int()
    table = torch.full((len(reqs), table_width or max(need) + 2), BAD_BLOCK, dtype=torch.int32)
    used = torch.zeros(num_blocks, page, dtype=torch.bool)
    start = 0
    for b, (n, k) in enumerate(zip(lens, need, strict=True)):
        table[b, :k] = perm[start : start + k]
        start += k
        pos = torch.arange(n)
        used[table[b, pos // page].long(), pos % page] = True
    shape = (num_blocks, hkv, page, 2 * d) if layout == "HND" else (num_blocks, page, hkv, 2 * d)
    phys = torch.randn(shape, device=device).to(dtype)
    cache = phys if layout == "HND" else phys.permute(0, 2, 1, 3)
    cache.transpose(1, 2)[~used.to(device)] = float("nan")
    q_lens = [q for q, _, _ in reqs]
    qsl = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
    rows = rows or int(qsl[-1])
    bits: list[int] = []
    for q, _, kind in reqs:
        bits += tree_bits(rng, q, kind) if q <= 64 else [-1] * q
    bits += [-1] * (rows - len(bits))
    case = dict(
        query=torch.randn(rows, hq, d, device=device).to(dtype),
        kv_cache=cache,
        block_table=table,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=qsl,
        tree_bits=torch.tensor(bits, dtype=torch.int64),
        scale=1.0 / math.sqrt(d),
    )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def run_kernel(case: dict, num_splits: int | None = None) -> torch.Tensor:
    out = torch.full_like(case["query"], 7.0)
    gqa_tree_attention(**case, out=out, num_splits=num_splits)
    return out


def context_attention(case: dict, empty_lse: float = float("inf")) -> tuple[torch.Tensor, torch.Tensor]:
    """What FlashAttention returns for each request's context pass (the keys before its last q_len and the root,
    ``tree_mask.context_key_counts``): ``out`` [T, Hq, D] (query dtype) and ``lse`` [Hq, T] (natural log; rows with
    no keys get ``empty_lse``, FlashAttention's +inf)."""
    q, cache, table = case["query"].float(), case["kv_cache"].float(), case["block_table"]
    rows, hq, d = q.shape
    page, group = cache.shape[2], hq // cache.shape[1]
    out = torch.zeros(rows, hq, d, device=q.device)
    lse = torch.full((hq, rows), empty_lse, device=q.device)
    qsl, lens = case["query_start_loc"].tolist(), case["seq_lens"].tolist()
    for b, seq_len in enumerate(lens):
        q0, q1 = qsl[b], qsl[b + 1]
        ctx = seq_len - max(q1 - q0 - 1, 0)
        if q1 == q0 or ctx <= 0:
            continue
        pages = table[b, : -(-ctx // page)].long()
        kv = cache[pages].permute(1, 0, 2, 3).reshape(cache.shape[1], -1, 2 * d)[:, :ctx]
        k, v = kv[..., :d].repeat_interleave(group, 0), kv[..., d:].repeat_interleave(group, 0)
        s = (q[q0:q1].transpose(0, 1) @ k.transpose(1, 2)) * case["scale"]  # [Hq, n, ctx]
        lse[:, q0:q1] = torch.logsumexp(s, -1)
        out[q0:q1] = (torch.softmax(s, -1) @ v).transpose(0, 1)
    return out.to(case["query"].dtype), lse


def run_tail_kernel(case: dict, prefix: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    out = torch.full_like(case["query"], 7.0)
    gqa_tree_attention(**case, out=out, prefix_out=prefix[0], prefix_lse=prefix[1])
    return out


def check_close(out: torch.Tensor, case: dict, rel: float = 1e-2, untouched: bool = True) -> None:
    """Rows of requests match the reference within rel (of the reference's largest value, and as a norm ratio);
    rows of no request still hold the 7.0 run_kernel put there."""
    ref = gqa_tree_attention_ref(**case)
    covered = ~ref.isnan().any(-1).any(-1)
    diff = out[covered].float() - ref[covered]
    err = diff.abs().max().item()
    assert err <= rel * ref[covered].abs().max().item(), err
    assert diff.norm().item() <= rel * ref[covered].norm().item()
    assert not untouched or (out[~covered] == 7.0).all()


def naive(case: dict) -> torch.Tensor:
    """Per (row, head) loop with the visibility rule spelled out key by key."""
    q, cache, table = case["query"].float(), case["kv_cache"].float(), case["block_table"]
    hq, d = q.shape[1:]
    page, group = cache.shape[2], hq // cache.shape[1]
    qsl, lens, bits = case["query_start_loc"].tolist(), case["seq_lens"].tolist(), case["tree_bits"].tolist()
    out = torch.full(q.shape, float("nan"))
    for b, seq_len in enumerate(lens):
        n = qsl[b + 1] - qsl[b]
        for t in range(n):
            row = qsl[b] + t
            keys = [
                j
                for j in range(seq_len)
                if j < seq_len - n or (bits[row] >> (j - seq_len + n) & 1 if n <= 64 else j <= seq_len - n + t)
            ]
            for h in range(hq):
                kv = torch.stack([cache[table[b, j // page], h // group, j % page] for j in keys])
                p = torch.softmax(kv[:, :d] @ q[row, h] * case["scale"], 0)
                out[row, h] = p @ kv[:, d:]
    return out


def test_reference_matches_naive_loop() -> None:
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    reqs = [(5, 9, "random"), (0, 0, ""), (1, 20, "root"), (4, 0, "chain"), (70, 3, ""), (6, 17, "star")]
    for layout in ("HND", "NHD"):
        case = make_case(rng, reqs, hq=4, hkv=2, d=16, page=16, dtype=torch.float32, layout=layout)
        ref, want = gqa_tree_attention_ref(**case), naive(case)
        assert torch.allclose(ref, want, atol=1e-5, equal_nan=True)
        assert ref.isnan().sum() == 0


def chain_as_causal(rng: np.random.Generator, d: int = 16, dtype: torch.dtype = torch.float32) -> tuple[dict, dict]:
    """A causal request of q_len 70 and a 64-node chain over the same cache and the causal request's last 64
    queries: row i of the chain must equal row 6 + i of the causal request."""
    causal = make_case(rng, [(70, 11, "")], d=d, dtype=dtype)
    chain = dict(
        causal,
        query=causal["query"][6:].clone(),
        query_start_loc=torch.tensor([0, 64], dtype=torch.int32),
        tree_bits=torch.tensor(tree_bits(rng, 64, "chain"), dtype=torch.int64),
    )
    return chain, causal


def test_reference_chain_tree_is_causal() -> None:
    torch.manual_seed(1)
    chain, causal = chain_as_causal(np.random.default_rng(1))
    assert torch.allclose(gqa_tree_attention_ref(**chain), gqa_tree_attention_ref(**causal)[6:], atol=1e-6)


def test_rejects_bad_shapes() -> None:
    case = make_case(np.random.default_rng(2), [(2, 3, "chain")], d=16, dtype=torch.float32)
    with pytest.raises(ValueError):
        gqa_tree_attention(**dict(case, query=case["query"][..., :8]), out=case["query"][..., :8].clone())
    with pytest.raises(ValueError):
        gqa_tree_attention(**case, out=case["query"].double())


# The interpreter flag must be set before Triton first compiles a kernel, so the check runs in a fresh process.
INTERPRETER_CHECK = textwrap.dedent(
    """
    import numpy as np, torch
    from test_gqa_tree_attention import (
        chain_as_causal, check_close, context_attention, make_case, run_kernel, run_tail_kernel,
    )

    torch.manual_seed(0)
    rng = np.random.default_rng(7)
    cases = [
        # (requests, kwargs, num_splits)
        ([(7, 40, "random")], dict(), 1),
        ([(16, 50, "chain"), (1, 33, "root"), (0, 0, ""), (9, 5, "star")], dict(page=32), 3),
        ([(12, 70, "random"), (0, 0, ""), (1, 100, "root"), (64, 2, "random")], dict(layout="NHD"), 2),
        ([(66, 20, ""), (5, 30, "random")], dict(page=64, layout="NHD"), 1),
        ([(66, 20, ""), (3, 0, "chain")], dict(dtype=torch.float32), 4),
        ([(20, 60, "random"), (1, 17, "root")], dict(hq=8, hkv=2, d=128, dtype=torch.float32, layout="NHD"), 2),
        ([(4, 90, "random"), (0, 0, "")], dict(hq=6, hkv=2, rows=7), 2),
        ([(1, 45, "root"), (1, 0, "root")], dict(hq=4, hkv=4), 1),
    ]
    for reqs, kw, splits in cases:
        case = make_case(rng, reqs, **kw)
        tol = 1e-4 if kw.get("dtype") == torch.float32 else 2e-2
        check_close(run_kernel(case, splits), case, tol)
        # The same case with the context attended elsewhere (FlashAttention's out + lse) and only the tail here.
        check_close(run_tail_kernel(case, context_attention(case, float("inf" if splits % 2 else "-inf"))), case, tol)
    chain, causal = chain_as_causal(rng, d=64)
    assert torch.allclose(run_kernel(chain, 2), run_kernel(causal, 1)[6:], atol=1e-5)
    print("cases", len(cases))
    """
)


def test_triton_interpreter_matches_reference() -> None:
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent), str(REPO / "tests"), str(REPO)]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETER_CHECK], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert int(proc.stdout.split()[-1]) == 8


GPU_SHAPE = dict(hq=32, hkv=8, d=128, device="cuda")


# name: (batch, seq_len, tree width W, layout kwargs); every request verifies a random W-node tree.
GPU_CASES = {
    "B1-L32k-W16": (1, 32768, 16, dict(page=16)),
    "B1-L32k-W64": (1, 32768, 64, dict(page=16, layout="NHD")),
    "B16-L4k-W16": (16, 4096 + 17, 16, dict(page=64, layout="NHD")),
    "B16-L4k-W64": (16, 4096 + 17, 64, dict(page=32)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_cuda_matches_reference(name: str, num_splits: int | None) -> None:
    torch.manual_seed(3)
    batch, seq_len, width, kw = GPU_CASES[name]
    case = make_case(np.random.default_rng(3), [(width, seq_len - width, "random")] * batch, **GPU_SHAPE, **kw)
    out = run_kernel(case, num_splits)
    check_close(out, case)
    assert torch.equal(out, run_kernel(case, num_splits))  # deterministic: no atomics, fixed split order


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_varlen_mix(dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    rng = np.random.default_rng(4)
    reqs = [
        (64, 4113, "random"),
        (0, 0, ""),
        (1, 3000, "root"),
        (300, 1000, ""),
        (16, 20, "chain"),
        (33, 2048, "star"),
        (64, 0, "chain"),
        (0, 0, ""),
    ]
    for d in (64, 128, 256):
        case = make_case(rng, reqs, **dict(GPU_SHAPE, d=d), page=16, dtype=dtype, rows=500)
        for splits in (None, 5):
            check_close(run_kernel(case, splits), case)
    case = make_case(rng, reqs, **GPU_SHAPE, page=16, dtype=torch.bfloat16, rows=500)
    check_close(run_tail_kernel(case, flash_context(case)), case)
    chain, causal = chain_as_causal(rng, d=128)
    chain = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in chain.items()}
    causal = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in causal.items()}
    torch.testing.assert_close(run_kernel(chain, 3), run_kernel(causal, 1)[6:], atol=1e-5, rtol=1e-5)


def flash_context(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The context part from vLLM's FlashAttention, as the DDTree GQA backend calls it."""
    from vllm_ddtree.backends.gqa import flash_context_attention
    from vllm_ddtree.tree_mask import context_key_counts

    q_lens = case["query_start_loc"][1:] - case["query_start_loc"][:-1]
    return flash_context_attention(
        case["query"],
        case["kv_cache"],
        case["block_table"],
        context_key_counts(case["seq_lens"], case["query_start_loc"]),
        case["query_start_loc"],
        case["scale"],
        max_query_len=int(q_lens.max()),
        max_seq_len=int(case["seq_lens"].max()),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_cuda_flash_context_plus_tree_tail(name: str) -> None:
    torch.manual_seed(5)
    batch, seq_len, width, kw = GPU_CASES[name]
    case = make_case(np.random.default_rng(5), [(width, seq_len - width, "random")] * batch, **GPU_SHAPE, **kw)
    check_close(run_tail_kernel(case, flash_context(case)), case)


def capture(case: dict, num_splits: int | None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture one launch (after a warm-up that compiles outside the capture); no host sync is allowed inside."""
    out = torch.full_like(case["query"], 7.0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gqa_tree_attention(**case, out=out, num_splits=num_splits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            gqa_tree_attention(**case, out=out, num_splits=num_splits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return graph, out


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1])
def test_cuda_graph_replay_with_new_inputs(num_splits: int | None) -> None:
    torch.manual_seed(5)
    rng = np.random.default_rng(5)
    shapes = dict(GPU_SHAPE, rows=200, num_blocks=1200, table_width=400, page=16)
    batches = [
        [(64, 4000, "random"), (16, 100, "chain"), (0, 0, ""), (1, 50, "root")],
        [(0, 0, ""), (100, 6000, ""), (64, 2, "star"), (16, 3000, "random")],
        [(1, 6300, "root"), (64, 300, "random"), (64, 5000, "random"), (0, 0, "")],
    ]
    static = make_case(rng, batches[0], **shapes)
    graph, out = capture(static, num_splits)
    for reqs in batches:
        case = make_case(rng, reqs, **shapes)
        for k, v in case.items():
            if isinstance(v, torch.Tensor):
                static[k].copy_(v)
        graph.replay()
        first = out.clone()
        graph.replay()
        torch.cuda.synchronize()
        check_close(first, case, untouched=False)
        assert torch.equal(first, out)


def bench() -> None:
    """CUDA-graph replay time (median of 200) per shape and split count. H200, 2026-11-30, median us (splits):
    B1-L32k-W16 63.0 (32), B1-L32k-W64 137.3 (8), B16-L4k-W16 85.3 (2), B16-L4k-W64 269.3 (1): the split counts
    the default now picks, measured as explicit counts before the default was changed to pick them."""
    print(f"{'case':<14} {'splits':>6} {'median us':>10} {'KV GB/s':>8}")
    for name, (batch, seq_len, width, kw) in GPU_CASES.items():
        reqs = [(width, seq_len - width, "random")] * batch
        case = make_case(np.random.default_rng(0), reqs, **GPU_SHAPE, **dict(kw, layout="HND"))
        kv_bytes = batch * seq_len * 8 * 256 * 2
        for splits in (None, 1, 8, 16, 32):
            graph, _ = capture(case, splits)
            for _ in range(20):
                graph.replay()
            times = []
            for _ in range(200):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            us = float(np.median(times))
            print(f"{name:<14} {str(splits or 'auto'):>6} {us:>10.1f} {kv_bytes / us / 1e3:>8.0f}", flush=True)


if __name__ == "__main__":
    bench()
