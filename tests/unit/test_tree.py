"""Tests for the draft-tree builders: torch and Triton paths against the heap reference, and tree structure."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_ddtree.tree import DraftTrees, build_trees, build_trees_reference, build_trees_torch, build_trees_triton

FIELDS = ("node_tokens", "parents", "depth", "anc_bits", "num_nodes")
REPO = Path(__file__).resolve().parents[2]


def random_inputs(
    rng: np.random.Generator, batch: int, max_depth: int, k: int, style: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted log-probs of one of several styles; the quantised ones make many exact score ties."""
    shape = (batch, max_depth, k)
    if style == "continuous":
        lp = np.log(rng.dirichlet(np.ones(max(k, 2)), size=(batch, max_depth))[..., :k])
    elif style == "half":
        lp = -0.5 * rng.integers(0, 8, size=shape)
    elif style == "repeat":
        lp = rng.choice(np.array([0.0, -0.25, -1.0, -3.0]), size=shape)
    elif style == "zeros":
        lp = np.zeros(shape)
    elif style == "neginf":
        lp = -0.5 * rng.integers(0, 6, size=shape)
        lp[rng.random(shape) < 0.3] = -np.inf
    else:
        raise AssertionError(style)
    lp = -np.sort(-lp.astype(np.float32), axis=-1)
    ids = rng.integers(0, 50_000, size=shape)
    return torch.from_numpy(np.ascontiguousarray(lp)), torch.from_numpy(ids)


STYLES = ("continuous", "half", "repeat", "zeros", "neginf")


def assert_same(got: DraftTrees, want: DraftTrees, what: str = "") -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype == torch.int64, (what, name, a.dtype, b.dtype)
        assert a.shape == b.shape, (what, name, a.shape, b.shape)
        assert torch.equal(a.cpu(), b.cpu()), (what, name, a, b)


def full_tree_size(max_depth: int, k: int) -> int:
    return sum(k**d for d in range(1, max_depth + 1))


def has_bit(word: np.uint64, j: int) -> bool:
    return bool((int(word) >> j) & 1)


def check_structure(trees: DraftTrees, topk_ids: torch.Tensor, budget: int) -> None:
    batch, max_depth, k = topk_ids.shape
    width = budget + 1
    anc = trees.anc_bits.cpu().numpy().view(np.uint64)
    assert anc.shape == (batch, width)
    parents, depth = trees.parents.cpu(), trees.depth.cpu()
    tokens, num = trees.node_tokens.cpu(), trees.num_nodes.cpu()
    ids = topk_ids.cpu()
    for b in range(batch):
        n = int(num[b])
        assert n == min(budget, full_tree_size(max_depth, k))
        assert parents[b, 0] == -1 and depth[b, 0] == 0
        assert [has_bit(anc[b, 0], j) for j in range(width)] == [j == 0 for j in range(width)]
        children: dict[int, set[int]] = {}
        for i in range(1, width):
            own = np.uint64(1) << np.uint64(i)
            if i > n:  # padding
                assert parents[b, i] == -1 and depth[b, i] == 0 and tokens[b, i - 1] == 0
                assert anc[b, i] == own
                continue
            p = int(parents[b, i])
            assert 0 <= p < i
            assert depth[b, i] == depth[b, p] + 1 <= max_depth
            assert anc[b, i] == anc[b, p] | own
            assert int(tokens[b, i - 1]) in set(ids[b, int(depth[b, i]) - 1].tolist())
            siblings = children.setdefault(p, set())
            assert int(tokens[b, i - 1]) not in siblings
            siblings.add(int(tokens[b, i - 1]))


def distinct_ids(rng: np.random.Generator, batch: int, max_depth: int, k: int) -> torch.Tensor:
    """Top-k ids are distinct within a row, as real top-k output is (siblings then have distinct tokens)."""
    return torch.from_numpy(np.argsort(rng.random((batch, max_depth, 64)), axis=-1)[..., :k].astype(np.int64))


def test_torch_matches_reference_bulk() -> None:
    rng = np.random.default_rng(1234)
    cases = 0
    while cases < 10_000:
        batch = int(rng.integers(1, 48))
        max_depth, k, budget = int(rng.integers(1, 17)), int(rng.integers(1, 9)), int(rng.integers(1, 64))
        lp, ids = random_inputs(rng, batch, max_depth, k, STYLES[int(rng.integers(len(STYLES)))])
        assert_same(build_trees_torch(lp, ids, budget), build_trees_reference(lp, ids, budget), f"{lp} {budget}")
        cases += batch
    assert cases >= 10_000


LOGPROB = st.one_of(
    st.sampled_from([0.0, -0.5, -1.0, -1.5, -2.0, -float("inf")]),
    st.floats(min_value=-30.0, max_value=0.0, width=32),
)


@st.composite
def tree_inputs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, int]:
    batch, max_depth, k = draw(st.integers(1, 3)), draw(st.integers(1, 16)), draw(st.integers(1, 8))
    budget = draw(st.integers(1, 63))
    values = draw(st.lists(LOGPROB, min_size=batch * max_depth * k, max_size=batch * max_depth * k))
    lp = torch.tensor(values, dtype=torch.float32).reshape(batch, max_depth, k).sort(dim=-1, descending=True).values
    ids = torch.tensor(draw(st.permutations(range(batch * max_depth * k))), dtype=torch.int64)
    return lp, ids.reshape(batch, max_depth, k), budget


@settings(max_examples=300, deadline=None)
@given(tree_inputs())
def test_torch_matches_reference_hypothesis(inputs: tuple[torch.Tensor, torch.Tensor, int]) -> None:
    lp, ids, budget = inputs
    assert_same(build_trees_torch(lp, ids, budget), build_trees_reference(lp, ids, budget))


@pytest.mark.parametrize("style", STYLES)
def test_structure(style: str) -> None:
    rng = np.random.default_rng(sum(map(ord, style)))
    for _ in range(40):
        batch, max_depth, k = int(rng.integers(1, 5)), int(rng.integers(1, 17)), int(rng.integers(1, 9))
        budget = int(rng.integers(1, 64))
        lp, _ = random_inputs(rng, batch, max_depth, k, style)
        ids = distinct_ids(rng, batch, max_depth, k)
        check_structure(build_trees_torch(lp, ids, budget), ids, budget)


def test_scores_are_best_first() -> None:
    """Selection order is (score desc, rank tuple asc), checked by brute force over every node of small trees."""
    rng = np.random.default_rng(7)
    for _ in range(60):
        max_depth, k, budget = int(rng.integers(1, 5)), int(rng.integers(1, 4)), int(rng.integers(1, 40))
        lp, _ = random_inputs(rng, 1, max_depth, k, STYLES[int(rng.integers(len(STYLES)))])
        ids = distinct_ids(rng, 1, max_depth, k)
        lpn, idn = lp[0].numpy(), ids[0].numpy()
        nodes = []
        frontier: list[tuple[tuple[int, ...], np.float32]] = [((), np.float32(0.0))]
        while frontier:
            ranks, score = frontier.pop()
            for r in range(k if len(ranks) < max_depth else 0):
                child = (ranks + (r,), score + lpn[len(ranks), r])
                nodes.append(child)
                frontier.append(child)
        nodes.sort(key=lambda node: (-float(node[1]), node[0]))
        trees = build_trees_torch(lp, ids, budget)
        n = int(trees.num_nodes[0])
        assert n == min(budget, len(nodes))
        for i, (ranks, _) in enumerate(nodes[:n], start=1):
            assert trees.node_tokens[0, i - 1] == idn[len(ranks) - 1, ranks[-1]]
            assert trees.depth[0, i] == len(ranks)


def test_chain_and_narrow_edges() -> None:
    rng = np.random.default_rng(3)
    # K=1: a chain of D nodes, the rest padding.
    lp, ids = random_inputs(rng, 2, 5, 1, "continuous")
    trees = build_trees_torch(lp, ids, 9)
    assert trees.num_nodes.tolist() == [5, 5]
    assert trees.parents[0].tolist() == [-1, 0, 1, 2, 3, 4, -1, -1, -1, -1]
    assert_same(trees, build_trees_reference(lp, ids, 9))
    # budget=63: W=64, the last node's own bit is the sign bit of its word.
    lp, ids = random_inputs(rng, 3, 16, 8, "half")
    trees = build_trees_torch(lp, ids, 63)
    assert trees.anc_bits.shape == (3, 64)
    assert (trees.anc_bits[:, 63] < 0).all()
    assert_same(trees, build_trees_reference(lp, ids, 63))


@pytest.mark.parametrize("builder", [build_trees, build_trees_reference, build_trees_torch, build_trees_triton])
def test_rejects_trees_wider_than_one_word(builder) -> None:
    """A tree is at most 64 tokens (one int64 ancestor word per node): a larger budget fails with the limit."""
    lp, ids = random_inputs(np.random.default_rng(8), 1, 16, 8, "half")
    with pytest.raises(ValueError, match="at most 63 nodes"):
        builder(lp, ids, 64)


def test_build_trees_cpu_is_the_heap_and_matches_torch() -> None:
    lp, ids = random_inputs(np.random.default_rng(5), 4, 8, 4, "half")
    assert_same(build_trees(lp, ids, 20), build_trees_torch(lp, ids, 20))
    assert build_trees(lp, ids, 20).node_tokens.device.type == "cpu"


def test_rejects_bad_inputs() -> None:
    lp, ids = random_inputs(np.random.default_rng(6), 1, 2, 2, "half")
    with pytest.raises(ValueError):
        build_trees_torch(lp.double(), ids, 4)
    with pytest.raises(ValueError):
        build_trees_torch(lp, ids, 0)


# The interpreter flag must be set before Triton first compiles the kernel, so the check runs in a fresh process.
INTERPRETER_CHECK = textwrap.dedent(
    """
    import numpy as np
    from test_tree import STYLES, assert_same, random_inputs
    from vllm_ddtree.tree import build_trees_torch, build_trees_triton

    rng = np.random.default_rng(99)
    cases = 0
    for i in range(240):
        # The interpreter costs ~10 ms per program and step: mostly small budgets, a few full-size trees.
        budget = 63 if i % 60 == 0 else int(rng.integers(1, 33 if i % 6 == 0 else 9))
        batch, max_depth, k = int(rng.integers(1, 3)), int(rng.integers(1, 17)), int(rng.integers(1, 9))
        lp, ids = random_inputs(rng, batch, max_depth, k, STYLES[i % len(STYLES)])
        assert_same(build_trees_triton(lp, ids, budget), build_trees_torch(lp, ids, budget), (lp, budget))
        cases += batch
    print("cases", cases)
    """
)


def test_triton_interpreter_matches_torch() -> None:
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent), str(REPO / "tests"), str(REPO)]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETER_CHECK], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert int(proc.stdout.split()[-1]) >= 300


@pytest.mark.gpu
def test_triton_cuda_matches_torch_and_reference() -> None:
    rng = np.random.default_rng(11)
    for i in range(400):
        batch, max_depth, k = int(rng.integers(1, 65)), int(rng.integers(1, 17)), int(rng.integers(1, 9))
        budget = int(rng.integers(1, 64))
        lp, ids = random_inputs(rng, batch, max_depth, k, STYLES[i % len(STYLES)])
        want = build_trees_reference(lp, ids, budget)
        lp_cuda, ids_cuda = lp.cuda(), ids.cuda()
        assert_same(build_trees(lp_cuda, ids_cuda, budget), want, "triton")
        assert_same(build_trees_torch(lp_cuda, ids_cuda, budget), want, "torch cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("builder", [build_trees, build_trees_torch])
def test_cuda_graph_capture_and_replay(builder) -> None:
    rng = np.random.default_rng(12)
    batch, max_depth, k, budget = 8, 15, 8, 31
    static_lp = torch.zeros(batch, max_depth, k, device="cuda")
    static_ids = torch.zeros(batch, max_depth, k, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        builder(static_lp, static_ids, budget)  # warm-up: compile the kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = builder(static_lp, static_ids, budget)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for style in STYLES:
        lp, ids = random_inputs(rng, batch, max_depth, k, style)
        static_lp.copy_(lp)
        static_ids.copy_(ids)
        graph.replay()
        torch.cuda.synchronize()
        assert_same(out, build_trees_reference(lp, ids, budget), style)
