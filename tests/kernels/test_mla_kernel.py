"""MLA tree-verify kernel vs the fp32 reference (GPU tests run on the H200; one CPU test checks the reference)."""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

from vllm_ddtree.envs import MLA_VARIANTS
from vllm_ddtree.kernels import mla_tree_verify_ref

SCALE = 1.0 / math.sqrt(576)
BIG_PAGE = 2**30  # block-table filler: reading it would fault, so untouched entries prove they were never read


def tree_bits_for(kind: str, n: int, rng: random.Random) -> list[int]:
    """Ancestor-or-self masks (bit j of entry i: node j is an ancestor of i or i itself), parents before children."""
    anc: list[int] = []
    for i in range(n):
        if i == 0:
            anc.append(1)
        elif kind == "chain":
            anc.append(anc[i - 1] | (1 << i))
        elif kind == "star":
            anc.append(1 | (1 << i))
        else:  # random
            anc.append(anc[rng.randrange(i)] | (1 << i))
    return [a - (1 << 64) if a >= 1 << 63 else a for a in anc]  # int64 view


def make_case(
    n_list: list[int],
    L_list: list[int],
    H: int,
    page: int,
    trees: list[str],
    seed: int,
    fp8: bool = False,
    q_dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
) -> dict:
    """Paged case with shuffled pages, NaN in unused pages and slots past L, strided q views, q_len-0 padding."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    rng = random.Random(seed)
    B = len(n_list)
    T = sum(n_list)
    qfull = (torch.randn(T, H, 640, generator=g) / 10).clamp(-1, 1).to(q_dtype)
    qdev = qfull.to(device)
    q_nope = qdev[..., :512]  # strided views, like vLLM's (ql_nope, q_pe)
    q_pe = qdev[..., 576:640]
    need = [-(-L // page) if n > 0 else 0 for n, L in zip(n_list, L_list, strict=True)]
    nblocks = sum(need) + 3
    max_blocks = max(max(need), 1) + 2
    perm = torch.randperm(nblocks, generator=g).tolist()
    if fp8:
        cache = torch.full((nblocks, page, 576), 0x7F, dtype=torch.uint8)  # 0x7F is NaN in e4m3
    else:
        cache = torch.full((nblocks, page, 576), float("nan"), dtype=torch.bfloat16)
    bt = torch.full((B, max_blocks), BIG_PAGE, dtype=torch.int32)
    pos = 0
    for b in range(B):
        if n_list[b] == 0:
            continue
        L = L_list[b]
        pages = perm[pos : pos + need[b]]
        pos += need[b]
        bt[b, : need[b]] = torch.tensor(pages, dtype=torch.int32)
        kv = (torch.randn(L, 576, generator=g) / 10).clamp(-1, 1)
        for i, pg in enumerate(pages):
            chunk = kv[i * page : (i + 1) * page]
            if fp8:
                cache[pg, : chunk.shape[0]] = chunk.to(torch.float8_e4m3fn).view(torch.uint8)
            else:
                cache[pg, : chunk.shape[0]] = chunk.to(torch.bfloat16)
    bits: list[int] = []
    for b in range(B):
        bits += tree_bits_for(trees[b % len(trees)], n_list[b], rng)
    qsl = [0]
    for n in n_list:
        qsl.append(qsl[-1] + n)
    return dict(
        q_nope=q_nope,
        q_pe=q_pe,
        kv_cache=cache.to(device),
        block_table=bt.to(device),
        seq_lens=torch.tensor(L_list, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        tree_bits=torch.tensor(bits, dtype=torch.int64, device=device),
    )


def run_kernel(case: dict, kv_scale: float = 1.0, out_dtype: torch.dtype = torch.bfloat16, max_q: int | None = None):
    from vllm_ddtree.kernels import mla_tree_verify

    T, H, _ = case["q_nope"].shape
    out = torch.full((T, H, 512), float("nan"), dtype=out_dtype, device="cuda")
    lse = torch.full((T, H), float("nan"), dtype=torch.float32, device="cuda")
    mla_tree_verify(**case, softmax_scale=SCALE, kv_scale=kv_scale, out=out, lse=lse, max_query_len=max_q)
    return out, lse


def ref_of(case: dict, kv_scale: float = 1.0):
    return mla_tree_verify_ref(**case, softmax_scale=SCALE, kv_scale=kv_scale)


def check_close(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor, tag: str) -> float:
    rows = ~torch.isnan(ref_lse)
    o, r = out.float()[rows], ref_out[rows]
    assert torch.isfinite(o).all(), f"{tag}: non-finite output"
    rel = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
    maxabs = (o - r).abs().max().item()
    lse_err = (lse[rows] - ref_lse[rows]).abs().max().item()
    assert rel <= 1e-2, f"{tag}: relative error {rel:.3e}"
    assert maxabs <= 2e-2 * max(r.abs().max().item(), 1e-3), f"{tag}: max abs error {maxabs:.3e}"
    assert lse_err <= 1e-2, f"{tag}: lse error {lse_err:.3e}"
    return rel


TREES = ["chain", "star", "random", "chain"]


@pytest.fixture(params=MLA_VARIANTS, autouse=True)
def kernel_variant(request: pytest.FixtureRequest):
    """Every GPU test runs once per VLLM_DDTREE_MLA_VARIANT: auto (the launch's choice: the decode kernel at few rows a
    request, else resident-V on sm_90, portable elsewhere), portable (the <= 99 KB configuration sm_80 / sm_120
    build), decode (the 16-row decode kernel, forced at every size, which exercises its masking and split paths on
    every shape) and decode-shallow (the same with the 2-stage ring sm_120 gets), so the H200 checks all of them."""
    old = os.environ.get("VLLM_DDTREE_MLA_VARIANT")
    os.environ["VLLM_DDTREE_MLA_VARIANT"] = request.param
    yield request.param
    if old is None:
        os.environ.pop("VLLM_DDTREE_MLA_VARIANT", None)
    else:
        os.environ["VLLM_DDTREE_MLA_VARIANT"] = old


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("H", [8, 16, 64, 128])
@pytest.mark.parametrize("N", [1, 2, 7, 16, 33, 64])
def test_shapes(N: int, H: int, page: int, kernel_variant: str) -> None:
    """One varlen batch per (N, H, page) covers L in {N, 63, 64, 65, 4k+17, 32k} and chain/star/random trees
    (N=1 is the root-only tree), with q_len-0 padding requests whose block-table rows are unreadable."""
    Ls = [max(N, 1), max(N, 63), max(N, 64), max(N, 65), 4096 + 17, 32768]
    n_list = [N] * len(Ls)
    # padding requests: q_len 0, nonzero seq_len, unreadable block table
    n_list = n_list[:3] + [0] + n_list[3:] + [0]
    L_list = Ls[:3] + [1000] + Ls[3:] + [5]
    case = make_case(n_list, L_list, H, page, TREES, seed=N * 1000 + H * 10 + page)
    out, lse = run_kernel(case, max_q=N)
    ref_out, ref_lse = ref_of(case)
    check_close(out, lse, ref_out, ref_lse, f"N={N} H={H} page={page}")


@pytest.mark.gpu
def test_varlen_qlen_and_default_max_q() -> None:
    """Different q_len per request (incl. 0) and max_query_len left to its default."""
    n_list = [3, 0, 16, 1, 0, 64, 7]
    L_list = [100, 7, 2000, 1, 9, 4096 + 17, 700]
    case = make_case(n_list, L_list, 16, 16, ["random", "star", "chain"], seed=7)
    ref_out, ref_lse = ref_of(case)
    for mq in (None, 64):
        out, lse = run_kernel(case, max_q=mq)
        check_close(out, lse, ref_out, ref_lse, f"varlen max_q={mq}")


@pytest.mark.gpu
def test_block_size_32_and_fp16() -> None:
    case = make_case([16, 5], [5000, 77], 32, 32, ["random"], seed=11, q_dtype=torch.float16)
    out, lse = run_kernel(case, out_dtype=torch.float16, max_q=16)
    ref_out, ref_lse = ref_of(case)
    check_close(out, lse, ref_out, ref_lse, "fp16 page32")


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64])
def test_fp8_cache(page: int) -> None:
    """fp8 e4m3 cache with a per-tensor scale, against the reference on dequantized values."""
    case = make_case([16, 64, 1], [32768, 4096 + 17, 65], 64, page, ["random", "chain"], seed=5, fp8=True)
    out, lse = run_kernel(case, kv_scale=0.75, max_q=64)
    ref_out, ref_lse = ref_of(case, kv_scale=0.75)
    check_close(out, lse, ref_out, ref_lse, f"fp8 page={page}")


@pytest.mark.gpu
def test_chain_is_causal() -> None:
    """A chain tree equals plain causal attention over the same keys (independent dense computation)."""
    N, H, L = 16, 16, 300
    case = make_case([N], [L], H, 16, ["chain"], seed=3)
    out, _ = run_kernel(case, max_q=N)
    kv = case["kv_cache"][case["block_table"][0, : -(-L // 16)].long()].reshape(-1, 576)[:L].float()
    q = torch.cat([case["q_nope"], case["q_pe"]], -1).float()
    s = torch.einsum("nhd,ld->nhl", q, kv) * SCALE
    causal = torch.arange(L, device="cuda")[None, :] <= (L - N + torch.arange(N, device="cuda"))[:, None]
    s = s.masked_fill(~causal[:, None, :], float("-inf"))
    ref = torch.einsum("nhl,ld->nhd", torch.softmax(s, -1), kv[:, :512])
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel <= 1e-2, rel


@pytest.mark.gpu
@pytest.mark.parametrize("H,N", [(128, 64), (8, 1), (16, 1)])
def test_deterministic(H: int, N: int) -> None:
    """Two runs are bit-identical (fixed-order split merge; at H*N <= 16 hundreds of split pieces a request)."""
    case = make_case([N, N], [32768, 4096 + 17], H, 64, ["random"], seed=9)
    o1, l1 = run_kernel(case, max_q=N)
    o2, l2 = run_kernel(case, max_q=N)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


@pytest.mark.gpu
@pytest.mark.parametrize("H,N", [(64, 16), (8, 1), (16, 1), (8, 2)])
def test_cuda_graph_replay(H: int, N: int) -> None:
    """Capture once, then replay with new seq_lens, trees, block tables and queries copied into the same buffers."""
    from vllm_ddtree.kernels import mla_tree_verify

    page, B = 64, 4
    Lmax = 8192
    max_blocks = Lmax // page + 2
    first = make_case([N] * B, [Lmax] * B, H, page, ["random"], seed=100)
    static = {k: v.clone() for k, v in first.items() if k not in ("q_nope", "q_pe", "kv_cache")}
    qbuf = torch.zeros(B * N, H, 640, dtype=torch.bfloat16, device="cuda")
    q_nope, q_pe = qbuf[..., :512], qbuf[..., 576:]
    nblocks = B * (Lmax // page) + 3
    kv = torch.zeros(nblocks, page, 576, dtype=torch.bfloat16, device="cuda")
    static["block_table"] = torch.zeros(B, max_blocks, dtype=torch.int32, device="cuda")
    out = torch.empty(B * N, H, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(B * N, H, dtype=torch.float32, device="cuda")

    def load(case: dict) -> None:
        q_nope.copy_(case["q_nope"])
        q_pe.copy_(case["q_pe"])
        kv.fill_(float("nan"))
        kv[: case["kv_cache"].shape[0]].copy_(case["kv_cache"])
        bt = case["block_table"]
        static["block_table"].fill_(BIG_PAGE)
        static["block_table"][:, : bt.shape[1]].copy_(bt)
        for k in ("seq_lens", "query_start_loc", "tree_bits"):
            static[k].copy_(case[k])

    def call() -> None:
        mla_tree_verify(
            q_nope,
            q_pe,
            kv,
            static["block_table"],
            static["seq_lens"],
            static["query_start_loc"],
            static["tree_bits"],
            SCALE,
            1.0,
            out,
            lse,
            max_query_len=N,
        )

    load(first)
    call()  # warm-up (build, function attributes) outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    rng = random.Random(0)
    for it in range(4):
        Ls = [rng.choice([N, 65, 1000, 4096 + 17, Lmax]) for _ in range(B)]
        n_list = [N] * B
        if it == 3:  # graph padding: trailing requests with q_len 0 keep their token slots unused
            n_list = [N, N, 0, 0]
        case = make_case(n_list, Ls, H, page, ["random", "star", "chain"], seed=200 + it)
        if it == 3:
            # keep T fixed for the captured graph: pad queries with zeros at the end
            for k in ("q_nope", "q_pe"):
                full = torch.zeros(B * N, H, case[k].shape[-1], dtype=torch.bfloat16, device="cuda")
                full[: case[k].shape[0]] = case[k]
                case[k] = full
            tb = torch.zeros(B * N, dtype=torch.int64, device="cuda")
            tb[: case["tree_bits"].numel()] = case["tree_bits"]
            case["tree_bits"] = tb
        load(case)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_case = dict(case, kv_cache=kv, block_table=static["block_table"])
        ref_out, ref_lse = ref_of(ref_case)
        check_close(out, lse, ref_out, ref_lse, f"graph replay {it}")
        if it == 3:
            assert torch.isnan(out[2 * N :].float()).all(), "padding rows must not be written"


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("H,N", [(8, 1), (16, 1), (8, 2)])
def test_decode_fp8(H: int, N: int, page: int) -> None:
    """Decode-shaped launches (max_q * H <= 16, what the decode variant is built for) over an fp8 cache with a
    per-tensor scale, NaN-poisoned unused pages and slots, odd lengths and q_len-0 padding."""
    n_list = [N, N, 0, N, N, 0]
    L_list = [max(N, 1), 65, 1000, 4096 + 17, 32768, 5]
    case = make_case(n_list, L_list, H, page, TREES, seed=300 + H + N + page, fp8=True)
    out, lse = run_kernel(case, kv_scale=0.75, max_q=N)
    ref_out, ref_lse = ref_of(case, kv_scale=0.75)
    check_close(out, lse, ref_out, ref_lse, f"decode fp8 H={H} N={N} page={page}")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("H,N", [(8, 1), (16, 1), (8, 2)])
def test_decode_long_context(H: int, N: int, fp8: bool) -> None:
    """B = 1 at 128k + 5 keys: one request cut into hundreds of split pieces, merged by the combine."""
    case = make_case([N, 0], [131072 + 5, 9], H, 64, ["random"], seed=400 + H + N, fp8=fp8)
    out, lse = run_kernel(case, max_q=N)
    ref_out, ref_lse = ref_of(case)
    check_close(out, lse, ref_out, ref_lse, f"decode 128k H={H} N={N} fp8={fp8}")


@pytest.mark.gpu
def test_decode_varlen_and_fp16() -> None:
    """Mixed q_len 0 / 1 / 2 at H = 8 (max_q given and left to its default), and fp16 queries and output."""
    n_list = [1, 0, 2, 1, 0, 2, 2, 1]
    L_list = [1, 7, 2, 700, 9, 4096 + 17, 65, 16]
    case = make_case(n_list, L_list, 8, 16, ["random", "chain"], seed=17)
    ref_out, ref_lse = ref_of(case)
    for mq in (2, None):
        out, lse = run_kernel(case, max_q=mq)
        check_close(out, lse, ref_out, ref_lse, f"decode varlen max_q={mq}")
    case = make_case([1, 1, 0], [5000, 77, 3], 16, 32, ["random"], seed=19, q_dtype=torch.float16)
    out, lse = run_kernel(case, out_dtype=torch.float16, max_q=1)
    ref_out, ref_lse = ref_of(case)
    check_close(out, lse, ref_out, ref_lse, "decode fp16 page32")


@pytest.mark.gpu
@pytest.mark.parametrize("ctas", ["1", "7"])
def test_decode_parts_sizing(ctas: str, kernel_variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_DDTREE_MLA_DECODE_CTAS_PER_SM changes the number of split parts (1: one part per SM; 7: tiny pieces of a
    few 16-key tiles): the result must not depend on it."""
    if not kernel_variant.startswith("decode"):
        pytest.skip("decode variants only")
    monkeypatch.setenv("VLLM_DDTREE_MLA_DECODE_CTAS_PER_SM", ctas)
    n_list = [1, 2, 0, 1, 2]
    L_list = [32768, 4096 + 17, 11, 65, 2]
    case = make_case(n_list, L_list, 8, 64, ["random"], seed=23)
    out, lse = run_kernel(case, max_q=2)
    ref_out, ref_lse = ref_of(case)
    check_close(out, lse, ref_out, ref_lse, f"decode ctas/SM={ctas}")


def test_reference_cpu_tiny() -> None:
    """The reference itself, on CPU: paged gather + tree mask against a dense hand computation."""
    N, H, L, page = 3, 2, 10, 4
    case = make_case([N], [L], H, page, ["star"], seed=1, device="cpu")
    out, lse = mla_tree_verify_ref(**case, softmax_scale=SCALE)
    kv = case["kv_cache"][case["block_table"][0, :3].long()].reshape(-1, 576)[:L].float()
    assert torch.isfinite(kv).all()
    q = torch.cat([case["q_nope"], case["q_pe"]], -1).float()
    for i in range(N):
        visible = list(range(L - N)) + [L - N] + ([L - N + i] if i > 0 else [])
        k = kv[visible]
        s = q[i] @ k.T * SCALE  # [H, |visible|]
        torch.testing.assert_close(lse[i], torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[i], torch.softmax(s, -1) @ k[:, :512], rtol=1e-5, atol=1e-5)
