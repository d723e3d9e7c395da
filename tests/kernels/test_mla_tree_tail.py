"""The MLA tree tail (Triton) merged with a context pass equals the fp32 reference of the whole tree verify.

On the H200 the context pass is FlashMLA (the tail on a second stream, also inside a CUDA graph); here it is
``mla_context_reference`` (fp32), and the kernels run under
the Triton interpreter (in a subprocess: the flag must be set before Triton compiles anything). Inputs: a paged
bf16 latent cache with shuffled pages and NaN-poisoned unused pages/slots, requests with q_len 1..64 (trees and
causal rows), contexts from 0 up, a q_len-0 padding request.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def random_case(seed: int, device: str = "cpu", heads: int = 8, page: int = 16, uniform: int = 0) -> dict:
    """Three random requests, a one-token one and a q_len-0 padding one; with ``uniform`` > 0, four requests of
    ``uniform`` tokens each instead (a ddtree verify batch)."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = 96 * 16 // page + 8
    q_lens = [int(torch.randint(1, 65, (1,), generator=gen)) for _ in range(3)] + [1, 0]
    if uniform:
        q_lens = [uniform] * 4
    contexts = [int(torch.randint(0, 300, (1,), generator=gen)) for _ in range(3)] + [0, 0]
    if uniform:
        contexts = [int(torch.randint(1, 300, (1,), generator=gen)) for _ in q_lens]
    seq_lens = [c + n for c, n in zip(contexts, q_lens, strict=True)]
    kv = torch.full((num_pages, page, 576), float("nan"))
    perm = torch.randperm(num_pages, generator=gen)
    max_blocks = max(-(-s // page) for s in seq_lens) + 1
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, length in enumerate(seq_lens):
        blocks = -(-length // page)
        block_table[b, :blocks] = perm[used : used + blocks].to(torch.int32)
        for i in range(length):
            kv[perm[used + i // page], i % page] = torch.randn(576, generator=gen)
        used += blocks
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    tokens = int(qsl[-1])
    bits = torch.zeros(tokens, dtype=torch.int64)
    for b, n in enumerate(q_lens):
        for i in range(n):  # an ancestor-like word: self and the root (every node's ancestor), plus random others
            word = 1 << i | 1
            for j in range(i):
                if torch.rand(1, generator=gen) < 0.5:
                    word |= 1 << j
            bits[int(qsl[b]) + i] = word - (1 << 64) if word >= 1 << 63 else word
    q_nope = torch.randn(tokens, heads, 512, generator=gen)
    q_pe = torch.randn(tokens, heads, 64, generator=gen)
    dtype = torch.bfloat16
    return dict(
        q_nope=q_nope.to(dtype).to(device),
        q_pe=q_pe.to(dtype).to(device),
        kv_cache=kv.to(dtype).to(device),
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        query_start_loc=qsl.to(device),
        tree_bits=bits.to(device),
        softmax_scale=576**-0.5,
        max_query_len=max(q_lens),
    )


def check_case(case: dict, with_prefix: bool, v_split: int | None = None) -> None:
    """Tail alone, or ``split_verify`` with the context reference as its context pass (on a second stream on CUDA),
    vs the whole-verify fp32 reference, on the rows that exist; ``v_split`` output parts per row tile (None: the
    launcher's choice; the tail alone only)."""
    from vllm_ddtree.kernels import mla_context_reference, mla_tree_tail, mla_tree_verify_ref, split_verify
    from vllm_ddtree.tree_mask import context_key_counts

    args = {k: case[k] for k in ("q_nope", "q_pe", "kv_cache", "block_table", "seq_lens", "query_start_loc")}
    seq_lens, qsl = case["seq_lens"].cpu(), case["query_start_loc"].cpu()
    q_lens = qsl[1:] - qsl[:-1]
    if not with_prefix:  # the tail alone must equal the verify of a request whose keys are only its tree
        ref_case = dict(case, seq_lens=q_lens.to(torch.int32))
        cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in ref_case.items()}
        shift = (seq_lens - q_lens).tolist()
        table = cpu["block_table"].clone()
        kv = cpu["kv_cache"].float()
        # A copy of each request's tail at the start of fresh pages, so the reference sees only tree keys.
        pages = kv.shape[0]
        kv = torch.cat([kv, torch.full((len(shift) * 4, kv.shape[1], 576), float("nan"))])
        for b, s in enumerate(shift):
            for j in range(int(q_lens[b])):
                pos = s + j
                src = kv[table[b, pos // kv.shape[1]], pos % kv.shape[1]]
                kv[pages + b * 4 + j // kv.shape[1], j % kv.shape[1]] = src
            table[b, :4] = torch.arange(pages + b * 4, pages + b * 4 + 4)
        want, want_lse = mla_tree_verify_ref(
            cpu["q_nope"],
            cpu["q_pe"],
            kv,
            table,
            cpu["seq_lens"],
            cpu["query_start_loc"],
            cpu["tree_bits"],
            case["softmax_scale"],
        )
    else:
        cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
        want, want_lse = mla_tree_verify_ref(
            cpu["q_nope"],
            cpu["q_pe"],
            cpu["kv_cache"],
            cpu["block_table"],
            cpu["seq_lens"],
            cpu["query_start_loc"],
            cpu["tree_bits"],
            case["softmax_scale"],
        )
    tokens, heads = case["q_nope"].shape[:2]
    device = case["q_nope"].device
    out = torch.full((tokens, heads, 512), float("nan"), dtype=case["q_nope"].dtype, device=device)
    lse = torch.full((tokens, heads), float("nan"), device=device)
    common = dict(
        **args,
        tree_bits=case["tree_bits"],
        softmax_scale=case["softmax_scale"],
        out=out,
        lse=lse,
        max_query_len=case["max_query_len"],
    )
    if with_prefix:
        po, pl = mla_context_reference(
            cpu["q_nope"],
            cpu["q_pe"],
            cpu["kv_cache"],
            cpu["block_table"],
            context_key_counts(seq_lens, qsl),
            qsl,
            case["softmax_scale"],
            case["max_query_len"],
        )
        side = torch.cuda.Stream() if device.type == "cuda" else None
        split_verify(lambda: (po.to(case["q_nope"].dtype).to(device), pl.to(device)), **common, side_stream=side)
    else:
        mla_tree_tail(**common, v_split=v_split)
    got, got_lse = out.float().cpu(), lse.cpu()
    assert not got.isnan().any() and not got_lse.isnan().any()
    err = (got - want).norm() / want.norm()
    assert err < 1e-2, float(err)
    assert torch.allclose(got_lse, want_lse, atol=2e-2, rtol=1e-3), float((got_lse - want_lse).abs().max())


def fake_flashmla(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    tile_scheduler_metadata: object,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's dense decode contract in fp32 (out ``[B, s_q, H, 512]`` in q's dtype, lse ``[B, H, s_q]``, +inf for
    an empty context), for checking the backend's glue on the CPU."""
    from vllm_ddtree.kernels import mla_context_reference

    assert not causal and head_dim_v == 512 and k_cache.dim() == 4
    num_reqs, width, heads, _ = q.shape
    qsl = torch.arange(0, (num_reqs + 1) * width, width, dtype=torch.int32)
    flat = q.reshape(num_reqs * width, heads, 576)
    out, lse = mla_context_reference(
        flat[..., :512], flat[..., 512:], k_cache.squeeze(-2), block_table, cache_seqlens, qsl, softmax_scale, width
    )
    return out.to(q.dtype), lse


def check_backend_split(case: dict) -> None:
    """``DDTreeMLAImpl``'s Hopper decode (rows padded for FlashMLA, context pass, tail merge) with ``fake_flashmla``,
    vs the fp32 reference of the whole verify."""
    from vllm.v1.attention.ops import flashmla

    from vllm_ddtree.backends.mla import DDTreeMLADecodeMetadata, DDTreeMLAImpl, padded_query_rows, uniform_query_rows
    from vllm_ddtree.kernels import mla_tree_verify_ref
    from vllm_ddtree.tree_mask import context_key_counts

    flashmla.flash_mla_with_kvcache = fake_flashmla
    qsl, seq_lens, width = case["query_start_loc"], case["seq_lens"], case["max_query_len"]
    tokens, heads = case["q_nope"].shape[:2]
    rows = None if uniform_query_rows(qsl.tolist(), width) else padded_query_rows(qsl, width, tokens, torch.arange(64))
    decode = DDTreeMLADecodeMetadata(
        block_table=case["block_table"],
        seq_lens=seq_lens,
        dcp_tot_seq_lens=None,
        query_start_loc=qsl,
        max_query_len=width,
        causal_token_bits=case["tree_bits"],
        context_lens=context_key_counts(seq_lens, qsl),
        padded_rows=rows,
        flashmla_sched=object(),
    )
    impl = object.__new__(DDTreeMLAImpl)
    impl.scale = case["softmax_scale"]
    out = torch.full((tokens, heads, 512), float("nan"), dtype=case["q_nope"].dtype)
    lse = torch.full((tokens, heads), float("nan"))
    impl._flashmla_context_and_tail(case["q_nope"], case["q_pe"], case["kv_cache"], decode, case["tree_bits"], out, lse)
    want, want_lse = mla_tree_verify_ref(
        case["q_nope"],
        case["q_pe"],
        case["kv_cache"],
        case["block_table"],
        seq_lens,
        qsl,
        case["tree_bits"],
        case["softmax_scale"],
    )
    assert (out.float() - want).norm() / want.norm() < 1e-2
    assert torch.allclose(lse, want_lse, atol=2e-2, rtol=1e-3)


def check_pack(seed: int, tokens: int, heads: int, device: str = "cpu", gather: bool = False) -> None:
    """``pack_context_query`` on the query as vLLM hands it over (``q_nope`` a head-major GEMM output seen
    transposed, ``q_pe`` a slice of a wider per-head row whose other columns are NaN), optionally gathering rows
    (repeats, as FlashMLA's padding does): bit-equal to ``torch.cat``."""
    from vllm_ddtree.kernels import pack_context_query

    gen = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(heads, tokens, 512, generator=gen).to(torch.bfloat16).to(device).transpose(0, 1)
    q_wide = torch.full((tokens, heads, 192), float("nan"), dtype=torch.bfloat16, device=device)
    q_wide[..., 128:] = torch.randn(tokens, heads, 64, generator=gen).to(torch.bfloat16).to(device)
    q_pe = q_wide[..., 128:]
    rows = torch.randint(0, max(tokens, 1), (tokens + 3,), generator=gen).to(device) if gather and tokens else None
    got = pack_context_query(q_nope, q_pe, rows)
    want = torch.cat([q_nope, q_pe], -1)
    want = want if rows is None else want[rows]
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got, want)


def test_output_parts_fill_small_grids_only() -> None:
    from vllm_ddtree.kernels.mla_tree_tail import output_parts

    assert [output_parts(n) for n in (1, 9, 16, 17, 64, 65, 128, 272, 4096)] == [8, 8, 4, 4, 4, 1, 1, 1, 1]


def test_tree_keys_round_the_longest_query_up() -> None:
    from vllm_ddtree.kernels.mla_tree_tail import tree_keys

    assert [tree_keys(n) for n in (1, 2, 9, 16, 17, 32, 33, 64)] == [16, 16, 16, 16, 32, 32, 64, 64]


def test_uniform_query_rows_need_no_gather() -> None:
    from vllm_ddtree.backends.mla import uniform_query_rows

    assert uniform_query_rows([0, 17, 34], 17) and uniform_query_rows([0, 1, 2, 3], 1)
    assert not uniform_query_rows([0, 17, 34, 34], 17)  # a q_len-0 padding request: gather
    assert not uniform_query_rows([0, 3, 4], 3)


def test_padded_query_rows() -> None:
    from vllm_ddtree.backends.mla import padded_query_rows

    rows = padded_query_rows(torch.tensor([0, 3, 4, 4], dtype=torch.int32), 4, 4, torch.arange(64))
    assert rows.tolist() == [0, 1, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3]


INTERPRETER_CHECK = textwrap.dedent(
    """
    from test_mla_tree_tail import check_backend_split, check_case, check_pack, random_case

    for seed in range(3):
        check_case(random_case(seed), with_prefix=True)
        check_case(random_case(seed + 10), with_prefix=False)
        check_backend_split(random_case(seed + 20, page=64))
    check_backend_split(random_case(23, page=64, uniform=17))  # a verify batch: FlashMLA takes the rows as they are
    check_case(random_case(30), with_prefix=False, v_split=1)  # one program per row tile (large batches)
    check_case(random_case(31), with_prefix=False, v_split=4)
    check_case(random_case(32, uniform=9), with_prefix=True)  # 16 key columns
    check_case(random_case(33, uniform=17), with_prefix=False)  # 32 key columns
    for seed, (tokens, heads) in enumerate([(7, 5), (17, 64), (1, 128), (0, 8)]):
        check_pack(seed, tokens, heads)
        check_pack(seed, tokens, heads, gather=True)
    print("ok")
    """
)


def test_tail_with_context_pass_and_backend_split_match_reference_in_interpreter() -> None:
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent), str(REPO / "tests"), str(REPO)]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETER_CHECK], env=env, cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [5, 16, 64, 128])
def test_cuda_pack_context_query_equals_cat(heads: int) -> None:
    for seed, tokens in enumerate([1, 17, 1024, 4097]):
        check_pack(seed, tokens, heads, "cuda")
        check_pack(seed, tokens, heads, "cuda", gather=True)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [8, 16, 64, 128])
def test_cuda_tail_matches_reference(heads: int) -> None:
    for seed in range(4):
        check_case(random_case(seed, "cuda", heads), with_prefix=True)
        check_case(random_case(seed + 10, "cuda", heads), with_prefix=False)
        check_case(random_case(seed + 20, "cuda", heads), with_prefix=False, v_split=1)
        check_case(random_case(seed + 30, "cuda", heads, uniform=9), with_prefix=True)  # 16 key columns
        check_case(random_case(seed + 40, "cuda", heads, uniform=17), with_prefix=False)  # 32 key columns


def flashmla_context_pass(case: dict) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """vLLM's FlashMLA over each request's context keys and root, its rows padded to the launch's uniform width (the
    last row repeated), as the backend calls it."""
    from vllm.v1.attention.ops.flashmla import flash_mla_with_kvcache, get_mla_metadata

    from vllm_ddtree.tree_mask import context_key_counts

    qsl, seq_lens, width = case["query_start_loc"], case["seq_lens"], case["max_query_len"]
    q_lens = (qsl[1:] - qsl[:-1]).long()
    cols = torch.arange(width, device="cuda")
    rows = (qsl[:-1, None].long() + torch.minimum(cols[None, :], (q_lens - 1).clamp(min=0)[:, None])).flatten()
    tokens, heads = case["q_nope"].shape[:2]
    sched = get_mla_metadata()[0]

    def context_pass() -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.cat([case["q_nope"], case["q_pe"]], -1)[rows.clamp(max=tokens - 1)]
        return flash_mla_with_kvcache(
            q=q.view(len(q_lens), width, heads, 576),
            k_cache=case["kv_cache"].unsqueeze(-2),
            block_table=case["block_table"],
            cache_seqlens=context_key_counts(seq_lens, qsl).int(),
            head_dim_v=512,
            tile_scheduler_metadata=sched,
            softmax_scale=case["softmax_scale"],
            causal=False,
        )

    return context_pass


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [8, 64, 128])
def test_cuda_flashmla_context_plus_tail_matches_reference(heads: int) -> None:
    """The backend's Hopper decode: vLLM's FlashMLA over the context (no mask, rows padded to a uniform width) while
    the tail runs on a second stream, then the merge; eager and replayed from a CUDA graph (fork and join captured),
    against the fp32 reference of the whole verify."""
    from vllm.v1.attention.ops.flashmla import is_flashmla_dense_supported

    from vllm_ddtree.kernels import mla_tree_verify_ref, split_verify

    if not is_flashmla_dense_supported()[0]:
        pytest.skip("FlashMLA dense needs Hopper")
    side = torch.cuda.Stream()
    for seed in range(4):
        case = random_case(seed, "cuda", heads, page=64)
        tokens = case["q_nope"].shape[0]
        out = torch.full((tokens, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((tokens, heads), float("nan"), device="cuda")
        args = (
            flashmla_context_pass(case),
            case["q_nope"],
            case["q_pe"],
            case["kv_cache"],
            case["block_table"],
            case["seq_lens"],
            case["query_start_loc"],
            case["tree_bits"],
            case["softmax_scale"],
            out,
            lse,
            case["max_query_len"],
            side,
        )
        split_verify(*args)
        torch.cuda.synchronize()
        eager = out.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            split_verify(*args)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
        want, want_lse = mla_tree_verify_ref(
            cpu["q_nope"],
            cpu["q_pe"],
            cpu["kv_cache"],
            cpu["block_table"],
            cpu["seq_lens"],
            cpu["query_start_loc"],
            cpu["tree_bits"],
            case["softmax_scale"],
        )
        got = out.float().cpu()
        assert not got.isnan().any()
        assert (got - want).norm() / want.norm() < 1e-2
        assert torch.allclose(lse.cpu(), want_lse, atol=2e-2, rtol=1e-3)
