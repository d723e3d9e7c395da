"""KV compaction: torch reference vs a naive per-token loop, the Triton kernel (interpreter and CUDA) vs the reference.

Caches are filled with random bytes (NaN payloads included) and compared byte for byte over their whole physical
storage, so untouched slots must stay bit-identical.
"""

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor

from vllm_ddtree.kv_compact import KVCompactor, compact_kv_reference

NUM_LAYERS = 3
HEADS = 2
HEAD_X2 = 16  # 2 * head_size, K and V packed in the last dim


@dataclass(frozen=True)
class Layout:
    """How one cache layout is allocated (physical, contiguous) and viewed (the per-layer logical tensors)."""

    dtype: torch.dtype
    block_dim: int
    offset_dim: int
    physical: Callable[[int, int], list[tuple[int, ...]]]  # (num_blocks, block_size) -> physical shapes
    views: Callable[[list[Tensor]], list[Tensor]]  # physical tensors -> per-layer logical views


def _per_layer(shape: Callable[[int, int], tuple[int, ...]]) -> Callable[[int, int], list[tuple[int, ...]]]:
    return lambda nb, bs: [shape(nb, bs)] * NUM_LAYERS


LAYOUTS = {
    "mla_bf16": Layout(torch.bfloat16, 0, 1, _per_layer(lambda nb, bs: (nb, bs, 576)), list),
    "mla_fp8_uint8": Layout(torch.uint8, 0, 1, _per_layer(lambda nb, bs: (nb, bs, 576)), list),
    "mla_odd_fp32": Layout(torch.float32, 0, 1, _per_layer(lambda nb, bs: (nb, bs, 37)), list),
    "gqa_hnd_fp16": Layout(torch.float16, 0, 2, _per_layer(lambda nb, bs: (nb, HEADS, bs, HEAD_X2)), list),
    "gqa_nhd_bf16": Layout(
        torch.bfloat16,
        0,
        2,
        _per_layer(lambda nb, bs: (nb, bs, HEADS, HEAD_X2)),
        lambda phys: [p.permute(0, 2, 1, 3) for p in phys],
    ),
    "gqa_nhd_odd_fp32": Layout(
        torch.float32,
        0,
        2,
        _per_layer(lambda nb, bs: (nb, bs, 3, 10)),
        lambda phys: [p.permute(0, 2, 1, 3) for p in phys],
    ),
    # One tensor with a layers dim, physical order from FlashAttention's stride order with layers included:
    # NHD (1, 0, 3, 2, 4) -> (num_blocks, num_layers, block_size, heads, 2*head_size);
    # HND (1, 2, 0, 3, 4) -> (num_blocks, heads, num_layers, block_size, 2*head_size).
    "gqa_nhd_layers_bf16": Layout(
        torch.bfloat16,
        0,
        2,
        lambda nb, bs: [(nb, NUM_LAYERS, bs, HEADS, HEAD_X2)],
        lambda phys: list(phys[0].permute(1, 0, 3, 2, 4).unbind(0)),
    ),
    "gqa_hnd_layers_fp16": Layout(
        torch.float16,
        0,
        2,
        lambda nb, bs: [(nb, HEADS, NUM_LAYERS, bs, HEAD_X2)],
        lambda phys: list(phys[0].permute(2, 0, 1, 3, 4).unbind(0)),
    ),
}


@dataclass
class Batch:
    """One step's compaction inputs."""

    slot_mapping: Tensor
    query_start_loc: Tensor
    accepted_nodes: Tensor
    num_accepted: Tensor

    def to(self, device: str) -> "Batch":
        return Batch(*(t.to(device) for t in self.args()))

    def args(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.slot_mapping, self.query_start_loc, self.accepted_nodes, self.num_accepted


def make_caches(layout: Layout, num_blocks: int, block_size: int, gen: torch.Generator) -> list[Tensor]:
    """Physical cache tensors full of random bytes (so float caches hold NaNs and infs too)."""
    phys = []
    for shape in layout.physical(num_blocks, block_size):
        t = torch.empty(shape, dtype=layout.dtype)
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen, dtype=torch.uint8))
        phys.append(t)
    return phys


def random_path(width: int, depth: int, mode: str, gen: torch.Generator) -> list[int]:
    """Strictly increasing accepted nodes after the root (topological order makes ``p_k >= k``)."""
    if mode == "chain":
        return list(range(1, depth + 1))
    nodes = sorted((torch.randperm(width - 1, generator=gen)[:depth] + 1).tolist())
    if mode == "chain_prefix":
        keep = int(torch.randint(0, depth + 1, (1,), generator=gen))
        nodes = list(range(1, keep + 1)) + [n for n in nodes if n > keep][: depth - keep]
    return nodes


def make_batch(
    num_reqs: int,
    width: int,
    max_depth: int,
    block_size: int,
    num_blocks: int,
    mode: str,
    gen: torch.Generator,
    slot_dtype: torch.dtype = torch.int64,
    pad_rows: int = 5,
    pad_reqs: int = 2,
) -> Batch:
    """Requests with W-token trees (or q_len 0), shuffled block tables, -1 pad rows and pad requests at the end."""
    blocks = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 is the null block
    blocks_per_req = (num_blocks - 1) // num_reqs
    slots, starts, paths = [], [0], []
    for r in range(num_reqs):
        q_len = 0 if r % 4 == 3 else width
        table = blocks[r * blocks_per_req : (r + 1) * blocks_per_req]
        base = int(torch.randint(0, blocks_per_req * block_size - width + 1, (1,), generator=gen))
        req_slots = [table[(base + i) // block_size] * block_size + (base + i) % block_size for i in range(q_len)]
        if q_len and r % 5 == 4:  # a stray padding slot inside a request: copies touching it are skipped
            req_slots[int(torch.randint(1, q_len, (1,), generator=gen))] = -1
        slots += req_slots
        starts.append(starts[-1] + q_len)
        depth = 0 if q_len == 0 else int(torch.randint(0, max_depth + 1, (1,), generator=gen))
        paths.append(random_path(width, depth, mode, gen))
    slots += [-1] * pad_rows  # CUDA-graph pad rows
    starts += [starts[-1]] * pad_reqs
    accepted = torch.full((num_reqs + pad_reqs, max_depth + 1), -1, dtype=torch.int64)
    accepted[:num_reqs, 0] = 0
    for r, path in enumerate(paths):
        accepted[r, 1 : len(path) + 1] = torch.tensor(path, dtype=torch.int64)
    num_accepted = torch.tensor([len(p) for p in paths] + [0] * pad_reqs, dtype=torch.int64)
    return Batch(torch.tensor(slots, dtype=slot_dtype), torch.tensor(starts, dtype=torch.int32), accepted, num_accepted)


def naive_compact(views: list[Tensor], layout: Layout, batch: Batch) -> int:
    """Per-token loop that reads every source before writing any destination; returns the number of copies."""
    block_size = views[0].shape[layout.offset_dim]

    def index(slot: int) -> tuple:
        idx: list = [slice(None)] * views[0].dim()
        idx[layout.block_dim], idx[layout.offset_dim] = slot // block_size, slot % block_size
        return tuple(idx)

    sm, qs, acc, na = (t.tolist() for t in batch.args())
    copies = []
    for r in range(len(na)):
        for k in range(1, na[r] + 1):
            src, dst = sm[qs[r] + acc[r][k]], sm[qs[r] + k]
            if acc[r][k] != k and src >= 0 and dst >= 0:
                copies += [(v, index(dst), v[index(src)].clone()) for v in views]
    for view, dst, value in copies:
        view[dst] = value
    return len(copies) // len(views)


def has_hazard(batch: Batch) -> bool:
    """Whether some copy's destination is an earlier copy's source (``p_j == k`` for ``j < k``)."""
    acc, na = batch.accepted_nodes.tolist(), batch.num_accepted.tolist()
    return any(k in acc[r][1:k] for r in range(len(na)) for k in range(1, na[r] + 1) if acc[r][k] != k)


def same_bytes(a: list[Tensor], b: list[Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


def clone_all(phys: list[Tensor]) -> list[Tensor]:
    return [p.clone() for p in phys]


def geometry(block_size: int, num_reqs: int, width: int) -> int:
    """Number of blocks: the null block plus a few blocks per request."""
    return 1 + num_reqs * (math.ceil(width / block_size) + 2)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_reference_matches_naive(layout_name: str, block_size: int) -> None:
    layout = LAYOUTS[layout_name]
    gen = torch.Generator().manual_seed(sum(map(ord, layout_name)) + block_size)
    num_reqs, width, max_depth = 7, 12, 6
    num_blocks = geometry(block_size, num_reqs, width)
    hazards = copies = 0
    for trial, mode in enumerate(["random", "random", "chain_prefix", "random"]):
        batch = make_batch(
            num_reqs, width, max_depth, block_size, num_blocks, mode, gen, (torch.int64, torch.int32)[trial % 2]
        )
        phys = make_caches(layout, num_blocks, block_size, gen)
        original = clone_all(phys)
        expected = clone_all(phys)
        num_copies = naive_compact(layout.views(expected), layout, batch)
        copies += num_copies
        hazards += has_hazard(batch)
        compact_kv_reference(layout.views(phys), layout.block_dim, layout.offset_dim, *batch.args())
        assert same_bytes(phys, expected)
        assert same_bytes(phys, original) == (num_copies == 0)
    assert copies > 0 and hazards > 0, "the random cases must exercise copies and the overlap hazard"


@pytest.mark.parametrize("layout_name", ["mla_bf16", "gqa_nhd_layers_bf16"])
def test_chain_paths_leave_cache_bit_identical(layout_name: str) -> None:
    layout = LAYOUTS[layout_name]
    gen = torch.Generator().manual_seed(1)
    batch = make_batch(6, 10, 9, 16, geometry(16, 6, 10), "chain", gen)
    assert int(batch.num_accepted.sum()) > 0
    phys = make_caches(layout, geometry(16, 6, 10), 16, gen)
    original = clone_all(phys)
    compact_kv_reference(layout.views(phys), layout.block_dim, layout.offset_dim, *batch.args())
    assert same_bytes(phys, original)


def hazard_batch() -> Batch:
    """One request at positions 10..17 across blocks 3 and 1 (block size 16), path 0 -> 2 -> 5 -> 6: node 2's slot
    is both the source of depth 1 and the destination of depth 2."""
    table = [3, 1]
    slots = [table[(10 + i) // 16] * 16 + (10 + i) % 16 for i in range(8)]
    return Batch(
        torch.tensor(slots, dtype=torch.int64),
        torch.tensor([0, 8], dtype=torch.int32),
        torch.tensor([[0, 2, 5, 6]], dtype=torch.int64),
        torch.tensor([3], dtype=torch.int64),
    )


def test_overlap_hazard_reads_before_writes() -> None:
    layout = LAYOUTS["mla_odd_fp32"]
    gen = torch.Generator().manual_seed(2)
    phys = make_caches(layout, 4, 16, gen)
    original = clone_all(phys)
    batch = hazard_batch()
    compact_kv_reference(layout.views(phys), 0, 1, *batch.args())
    slots = batch.slot_mapping.tolist()
    for cache, before in zip(phys, original, strict=True):
        flat, flat_before = cache.view(torch.int32).flatten(0, 1), before.view(torch.int32).flatten(0, 1)
        for k, p in enumerate([0, 2, 5, 6]):
            assert torch.equal(flat[slots[k]], flat_before[slots[p]])
        assert torch.equal(flat[slots[4]], flat_before[slots[4]])  # node 4 was rejected and left alone


def test_padding_and_empty_requests_are_untouched() -> None:
    layout = LAYOUTS["gqa_nhd_bf16"]
    gen = torch.Generator().manual_seed(3)
    phys = make_caches(layout, 4, 16, gen)
    original = clone_all(phys)
    batch = Batch(
        torch.tensor([20, 21, -1, 23, 24, 40, 41, 42, -1, -1], dtype=torch.int64),
        torch.tensor([0, 5, 5, 8, 8, 8], dtype=torch.int32),  # request 1 has q_len 0, requests 3-4 are padding
        torch.tensor([[0, 2, -1], [0, -1, -1], [0, 1, 2], [-1, -1, -1], [-1, -1, -1]], dtype=torch.int64),
        torch.tensor([1, 0, 2, 0, 0], dtype=torch.int64),  # request 0 copies from a -1 slot, request 2 is a chain
    )
    compact_kv_reference(layout.views(phys), 0, 2, *batch.args())
    assert same_bytes(phys, original)


def test_compactor_cpu_matches_reference() -> None:
    layout = LAYOUTS["gqa_hnd_layers_fp16"]
    gen = torch.Generator().manual_seed(4)
    num_blocks = geometry(16, 5, 9)
    batch = make_batch(5, 9, 8, 16, num_blocks, "random", gen)
    phys = make_caches(layout, num_blocks, 16, gen)
    expected = clone_all(phys)
    compact_kv_reference(layout.views(expected), 0, 2, *batch.args())
    KVCompactor(layout.views(phys), 0, 2, max_num_reqs=8, max_path_len=8)(*batch.args())
    assert same_bytes(phys, expected)


def test_compactor_rejects_mismatched_caches() -> None:
    a = torch.zeros(4, 16, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        KVCompactor([a, a.to(torch.float16)], 0, 1, 4, 4)
    with pytest.raises(ValueError, match="shape"):
        KVCompactor([a, torch.zeros(5, 16, 8, dtype=torch.bfloat16)], 0, 1, 4, 4)
    with pytest.raises(ValueError, match="strides"):
        KVCompactor([a, torch.zeros(16, 4, 8, dtype=torch.bfloat16).transpose(0, 1)], 0, 1, 4, 4)
    with pytest.raises(ValueError, match="stride-1"):
        KVCompactor([a.transpose(1, 2)], 0, 1, 4, 4)
    with pytest.raises(ValueError, match="distinct"):
        KVCompactor([a], 0, 0, 4, 4)
    with pytest.raises(ValueError, match="at least one"):
        KVCompactor([], 0, 1, 4, 4)
    with pytest.raises(ValueError, match="max_path_len"):
        KVCompactor([a], 0, 1, 4, 2)(
            torch.zeros(8, dtype=torch.int64),
            torch.zeros(5, dtype=torch.int32),
            torch.zeros(4, 4, dtype=torch.int64),
            torch.zeros(4, dtype=torch.int64),
        )


# (name, layout, block size, requests, width, depth, compactor path length, slot dtype, batch mode)
KERNEL_CASES = [
    ("mla_bf16_bs16", "mla_bf16", 16, 6, 12, 6, 6, torch.int64, "random"),
    ("mla_fp8_bs64_int32_slots", "mla_fp8_uint8", 64, 5, 12, 6, 8, torch.int32, "random"),
    ("mla_odd_fp32_chain_prefix", "mla_odd_fp32", 16, 6, 10, 5, 5, torch.int64, "chain_prefix"),
    ("gqa_nhd_bf16", "gqa_nhd_bf16", 16, 6, 12, 6, 6, torch.int64, "random"),
    ("gqa_nhd_layers_bf16", "gqa_nhd_layers_bf16", 64, 6, 12, 6, 7, torch.int64, "random"),
    ("gqa_hnd_layers_fp16", "gqa_hnd_layers_fp16", 16, 6, 12, 6, 6, torch.int32, "random"),
    ("gqa_nhd_odd_fp32", "gqa_nhd_odd_fp32", 16, 5, 9, 8, 8, torch.int64, "random"),
]


def kernel_case(case: tuple, device: str) -> tuple[list[Tensor], list[Tensor], Batch, KVCompactor]:
    """Caches, expected result (reference), batch and compactor for one kernel case, on ``device``."""
    name, layout_name, block_size, num_reqs, width, depth, path_len, slot_dtype, mode = case
    layout = LAYOUTS[layout_name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    num_blocks = geometry(block_size, num_reqs, width)
    batch = make_batch(num_reqs, width, depth, block_size, num_blocks, mode, gen, slot_dtype).to(device)
    phys = [p.to(device) for p in make_caches(layout, num_blocks, block_size, gen)]
    expected = clone_all(phys)
    compact_kv_reference(layout.views(expected), layout.block_dim, layout.offset_dim, *batch.args())
    compactor = KVCompactor(layout.views(phys), layout.block_dim, layout.offset_dim, num_reqs + 4, path_len)
    return phys, expected, batch, compactor


def run_interpreter_cases() -> None:
    """Entry point of the TRITON_INTERPRET=1 subprocess: print ``{case: passed}`` as JSON."""
    results = {}
    for case in KERNEL_CASES:
        phys, expected, batch, compactor = kernel_case(case, "cpu")
        assert compactor._use_triton
        compactor(*batch.args())
        results[case[0]] = same_bytes(phys, expected)
    hazard_phys = make_caches(LAYOUTS["mla_bf16"], 4, 16, torch.Generator().manual_seed(5))
    hazard_expected = clone_all(hazard_phys)
    compact_kv_reference(hazard_expected, 0, 1, *hazard_batch().args())
    KVCompactor(hazard_phys, 0, 1, 1, 3)(*hazard_batch().args())
    results["hazard"] = same_bytes(hazard_phys, hazard_expected) and not same_bytes(
        hazard_phys, make_caches(LAYOUTS["mla_bf16"], 4, 16, torch.Generator().manual_seed(5))
    )
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, bool]:
    tests_dir = Path(__file__).resolve().parent
    path = os.pathsep.join([str(tests_dir.parents[1]), str(tests_dir), str(tests_dir.parent)])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-c", "import test_kv_compact as t; t.run_interpreter_cases()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.v2
@pytest.mark.parametrize("name", [c[0] for c in KERNEL_CASES] + ["hazard"])
def test_triton_kernel_interpreter_matches_reference(interpreter_results: dict[str, bool], name: str) -> None:
    assert interpreter_results[name]


@pytest.mark.gpu
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_compactor_cuda_matches_reference(case: tuple) -> None:
    phys, expected, batch, compactor = kernel_case(case, "cuda")
    compactor(*batch.args())
    torch.cuda.synchronize()
    assert same_bytes(phys, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("layout_name", ["mla_bf16", "gqa_nhd_layers_bf16"])
def test_compactor_cuda_graph_replay(layout_name: str) -> None:
    layout = LAYOUTS[layout_name]
    gen = torch.Generator().manual_seed(6)
    num_reqs, width, depth, block_size = 6, 12, 6, 16
    num_blocks = geometry(block_size, num_reqs, width)
    phys = [p.cuda() for p in make_caches(layout, num_blocks, block_size, gen)]
    static = make_batch(num_reqs, width, depth, block_size, num_blocks, "random", gen).to("cuda")
    compactor = KVCompactor(layout.views(phys), layout.block_dim, layout.offset_dim, num_reqs + 2, depth)
    static.num_accepted.zero_()
    compactor(*static.args())  # compile outside the capture; a no-op with nothing accepted
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compactor(*static.args())
    for step in range(3):
        fresh = make_batch(num_reqs, width, depth, block_size, num_blocks, ("random", "chain_prefix")[step % 2], gen)
        for dst, src in zip(static.args(), fresh.args(), strict=True):
            dst.copy_(src)
        expected = clone_all(phys)
        compact_kv_reference(layout.views(expected), layout.block_dim, layout.offset_dim, *static.args())
        graph.replay()
        torch.cuda.synchronize()
        assert same_bytes(phys, expected)
