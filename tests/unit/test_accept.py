"""Tree acceptance: the tensor walk against a plain Python walk, losslessness of the sampled walk, CUDA graphs."""

import itertools
import math
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_ddtree.accept import (
    AcceptedPaths,
    greedy_walk,
    sample_per_node,
    sampled_walk,
    walk_trees,
    walk_verify_batch,
)
from vllm_ddtree.constants import ANCESTOR_WORD_BITS

WORD = ANCESTOR_WORD_BITS


@dataclass
class Trees:
    """A batch of draft trees in the ``DraftTrees`` layout, plus the Python lists the reference walk reads."""

    node_tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    anc_bits: torch.Tensor
    num_nodes: torch.Tensor
    py_parents: list[list[int]]
    py_tokens: list[list[int]]

    def to(self, device: torch.device) -> "Trees":
        fields = (self.node_tokens, self.parents, self.depth, self.anc_bits, self.num_nodes)
        return Trees(*(t.to(device) for t in fields), self.py_parents, self.py_tokens)


def to_int64(word: int) -> int:
    return word - (1 << WORD) if word >= 1 << (WORD - 1) else word


def build_trees(rows: list[tuple[list[int], list[int]]], budget: int) -> Trees:
    """Lay out trees given as (parents of nodes 1..n, tokens of nodes 1..n), padded to ``budget`` nodes."""
    width = budget + 1
    tokens, parents, depths, ancs, counts, py_parents, py_tokens = [], [], [], [], [], [], []
    for row_parents, row_tokens in rows:
        n = len(row_parents)
        par = [-1] + row_parents + [-1] * (budget - n)
        dep, anc = [0] * width, [1 << i for i in range(width)]
        for i in range(1, n + 1):
            dep[i] = dep[par[i]] + 1
            anc[i] |= anc[par[i]]
        ancs.append([to_int64(a) for a in anc])
        tokens.append(row_tokens + [0] * (budget - n))
        parents.append(par)
        depths.append(dep)
        counts.append(n)
        py_parents.append(par)
        py_tokens.append(row_tokens)

    def t(x: list) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64)

    node_tokens = t(tokens).view(len(rows), budget)
    return Trees(node_tokens, t(parents), t(depths), t(ancs), t(counts), py_parents, py_tokens)


def random_tree(rng: random.Random, budget: int, vocab: int) -> tuple[list[int], list[int]]:
    """A random topological tree with distinct sibling tokens; biased towards chains so that deep paths occur."""
    r = rng.random()
    n = 0 if r < 0.1 else budget if r < 0.35 else rng.randint(0, budget)
    parents, tokens = [], []
    used: dict[int, set[int]] = {}
    for i in range(1, n + 1):
        p = i - 1 if rng.random() < 0.5 else rng.randrange(i)
        if len(used.get(p, ())) == vocab:
            p = i - 1  # node i-1 has no children yet, so a free token always exists
        tok = rng.choice([v for v in range(vocab) if v not in used.get(p, ())])
        used.setdefault(p, set()).add(tok)
        parents.append(p)
        tokens.append(tok)
    return parents, tokens


def random_targets(rng: random.Random, trees: Trees, vocab: int, p_match: float) -> torch.Tensor:
    """Target picks per node; with probability ``p_match`` a node picks one of its children's tokens."""
    width = trees.parents.shape[1]
    out = []
    for par, toks in zip(trees.py_parents, trees.py_tokens, strict=True):
        kids: dict[int, list[int]] = {}
        for i in range(1, len(toks) + 1):
            kids.setdefault(par[i], []).append(toks[i - 1])
        out.append(
            [
                rng.choice(kids[i]) if i in kids and rng.random() < p_match else rng.randrange(vocab)
                for i in range(width)
            ]
        )
    return torch.tensor(out, dtype=torch.int64)


def reference_walk(parents: list[int], tokens: list[int], target: list[int], max_depth: int) -> tuple[list, list]:
    """The walk as the DDTree reference writes it: follow the child keyed by the target's pick, via child maps."""
    child = {}
    for i in range(1, len(tokens) + 1):
        child.setdefault(parents[i], {})[tokens[i - 1]] = i
    path = [0]
    while len(path) - 1 < max_depth and target[path[-1]] in child.get(path[-1], {}):
        path.append(child[path[-1]][target[path[-1]]])
    return path, [tokens[p - 1] for p in path[1:]] + [target[path[-1]]]


def run_walk(trees: Trees, target: torch.Tensor, max_depth: int) -> AcceptedPaths:
    return walk_trees(trees.node_tokens, trees.parents, trees.anc_bits, trees.num_nodes, target, max_depth)


def check_against_reference(trees: Trees, target: torch.Tensor, res: AcceptedPaths, max_depth: int) -> None:
    width = trees.parents.shape[1]
    assert res.output_tokens.dtype == res.accepted_nodes.dtype == res.num_accepted.dtype == torch.int64
    assert res.output_tokens.shape == (len(trees.py_tokens), width)
    assert res.accepted_nodes.shape == (len(trees.py_tokens), max_depth + 1)
    nodes, num, out = res.accepted_nodes.tolist(), res.num_accepted.tolist(), res.output_tokens.tolist()
    for b, (par, toks) in enumerate(zip(trees.py_parents, trees.py_tokens, strict=True)):
        path, tokens = reference_walk(par, toks, target[b].tolist(), max_depth)
        assert nodes[b] == path + [-1] * (max_depth + 1 - len(path)), b
        assert num[b] == len(path) - 1, b
        assert out[b] == tokens + [-1] * (width - len(tokens)), b


def random_case(rng: random.Random, batch: int, budget: int, vocab: int, p_match: float) -> tuple[Trees, torch.Tensor]:
    trees = build_trees([random_tree(rng, budget, vocab) for _ in range(batch)], budget)
    return trees, random_targets(rng, trees, vocab, p_match)


def test_random_trees_seeded() -> None:
    """2,400 trees of every budget up to the largest (63: W = 64, the last node's bit is the sign bit)."""
    rng = random.Random(1234)
    for it in range(300):
        budget = 63 if it % 8 == 0 else rng.randint(1, 63)
        trees, target = random_case(rng, 8, budget, rng.randint(2, 30), rng.choice([0.5, 0.8, 0.95, 1.0]))
        max_depth = int(trees.depth.max())
        check_against_reference(trees, target, run_walk(trees, target, max_depth), max_depth)


@settings(max_examples=250, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.integers(1, 6),
    budget=st.integers(1, 63),
    vocab=st.integers(2, 50),
    p_match=st.floats(0.0, 1.0),
    depth_slack=st.integers(-3, 3),
)
def test_random_trees_hypothesis(
    seed: int, batch: int, budget: int, vocab: int, p_match: float, depth_slack: int
) -> None:
    """Also covers ``max_depth`` below the trees' depth (paths cut there) and above it (extra -1 columns)."""
    trees, target = random_case(random.Random(seed), batch, budget, vocab, p_match)
    max_depth = max(0, int(trees.depth.max()) + depth_slack)
    check_against_reference(trees, target, run_walk(trees, target, max_depth), max_depth)


def test_wider_masks_are_refused() -> None:
    """One int64 word per node is the whole contract: a tree of 65 tokens, or masks with a word axis, fail with the
    limit instead of being walked wrong."""
    trees = build_trees([([0], [1])], 1)
    target = torch.zeros(1, 2, dtype=torch.int64)
    for anc in (torch.ones(1, WORD + 1, dtype=torch.int64), trees.anc_bits.unsqueeze(-1)):
        with pytest.raises(ValueError, match="W <= 64"):
            walk_trees(trees.node_tokens, trees.parents, anc, trees.num_nodes, target, 1)
        with pytest.raises(ValueError, match="budget <= 63"):
            walk_verify_batch(
                torch.zeros(2, dtype=torch.int64),
                torch.zeros(2, dtype=torch.int64),
                torch.tensor([0, 2]),
                torch.zeros(1, dtype=torch.int64),
                trees.parents,
                anc,
                trees.num_nodes,
                1,
            )


def test_output_layout_and_root_only_rows() -> None:
    """Root-only rows emit just the bonus; padding nodes are never accepted even when their token would match."""
    # Row 0: chain 1 -> 2 plus padding node 3, whose token 0 equals the root's pick (and its parent reads as -1).
    # Row 1: num_nodes = 0, all padding, the root's pick equals the padding token.  Row 2: chain plus a sibling.
    trees = build_trees([([0, 1], [0, 8]), ([], []), ([0, 1, 0], [7, 8, 9])], budget=3)
    target = torch.tensor([[0, 8, 0, 5], [0, 1, 1, 1], [7, 8, 6, 2]])
    res = run_walk(trees, target, max_depth=3)
    assert res.accepted_nodes.tolist() == [[0, 1, 2, -1], [0, -1, -1, -1], [0, 1, 2, -1]]
    assert res.num_accepted.tolist() == [2, 0, 2]
    assert res.output_tokens.tolist() == [[0, 8, 0, -1], [0, -1, -1, -1], [7, 8, 6, -1]]
    assert res.output_tokens.dtype == torch.int64 and res.output_tokens.shape == (3, 4)


def test_greedy_walk_uses_argmax() -> None:
    rng = random.Random(5)
    trees, target = random_case(rng, 6, 40, 12, 0.9)
    logits = torch.randn(6, 41, 12)
    logits.scatter_(2, target.unsqueeze(-1), 100.0)
    res = greedy_walk(trees.node_tokens, trees.parents, trees.anc_bits, trees.num_nodes, logits, 40)
    check_against_reference(trees, target, res, 40)


def test_sample_per_node_generator_reproducible() -> None:
    probs = torch.rand(4, 9, 50)
    draws = [sample_per_node(probs, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1]) and draws[0].shape == (4, 9) and draws[0].dtype == torch.int64
    probs[..., 7] = 0.0
    assert not (sample_per_node(probs, torch.Generator().manual_seed(4)) == 7).any()


# ---- Losslessness: a toy target over a tiny vocabulary ------------------------------------------------------------

V, L = 3, 4  # vocabulary size; length of the sequences whose distribution is compared


def toy_target() -> dict[tuple[int, ...], list[float]]:
    """p(next | context) for every context shorter than L: a fixed random table (Dirichlet(1) rows)."""
    rng = random.Random(2024)
    table = {}
    for k in range(L):
        for ctx in itertools.product(range(V), repeat=k):
            w = [rng.expovariate(1.0) for _ in range(V)]
            table[ctx] = [x / sum(w) for x in w]
    return table


def seq_prob(table: dict, seq: tuple[int, ...], start: int = 0) -> float:
    """Probability that the toy target continues ``seq[:start]`` with ``seq[start:]``."""
    return math.prod(table[seq[:k]][seq[k]] for k in range(start, len(seq)))


# (parents, tokens) of nodes 1..n: a branching tree (depth 3), a chain (depth 3), and a root-only tree.
TOY_TREES = {
    "branching": ([0, 0, 1, 1, 2, 3], [0, 1, 0, 2, 1, 1]),
    "chain": ([0, 1, 2], [2, 0, 1]),
    "root_only": ([], []),
}
TOY_BUDGET = 7  # at least one padding node in every toy tree


def node_contexts(parents: list[int], tokens: list[int]) -> list[tuple[int, ...]]:
    ctx = [()]
    for i, p in enumerate(parents):
        ctx.append(ctx[p] + (tokens[i],))
    return ctx


@pytest.mark.parametrize("name", list(TOY_TREES))
def test_lossless_exact_enumeration(name: str) -> None:
    """Enumerate every joint per-node pick, weight it, walk all of them in one batch: the law of the output
    extended to length L by the toy target equals the toy target's own joint law, up to float rounding."""
    table = toy_target()
    parents, tokens = TOY_TREES[name]
    ctx = node_contexts(parents, tokens)
    picks = list(itertools.product(range(V), repeat=len(ctx)))
    trees = build_trees([(parents, tokens)] * len(picks), TOY_BUDGET)
    pad = [0] * (TOY_BUDGET + 1 - len(ctx))
    target = torch.tensor([list(p) + pad for p in picks], dtype=torch.int64)
    out = run_walk(trees, target, max_depth=3).output_tokens.tolist()

    law: dict[tuple[int, ...], float] = {}
    for pick, row in zip(picks, out, strict=True):
        weight = math.prod(table[c][t] for c, t in zip(ctx, pick, strict=True))
        emitted = tuple(t for t in row if t >= 0)
        assert len(emitted) <= L
        for tail in itertools.product(range(V), repeat=L - len(emitted)):
            seq = emitted + tail
            law[seq] = law.get(seq, 0.0) + weight * seq_prob(table, seq, len(emitted))
    for seq in itertools.product(range(V), repeat=L):
        assert law.get(seq, 0.0) == pytest.approx(seq_prob(table, seq), abs=1e-12)


def test_lossless_chi_square() -> None:
    """20,000 sampled walks (sampled_walk + sample_per_node, seeded) on the branching tree, extended to length L
    with further draws: a chi-square test against the toy target's joint law."""
    table = toy_target()
    parents, tokens = TOY_TREES["branching"]
    ctx = node_contexts(parents, tokens)
    n = 20_000
    gen = torch.Generator().manual_seed(99)
    trees = build_trees([(parents, tokens)] * n, TOY_BUDGET)
    probs = torch.full((TOY_BUDGET + 1, V), 1.0 / V, dtype=torch.float64)
    probs[: len(ctx)] = torch.tensor([table[c] for c in ctx], dtype=torch.float64)
    res = sampled_walk(
        trees.node_tokens, trees.parents, trees.anc_bits, trees.num_nodes, probs.expand(n, -1, -1), 3, gen
    )

    # Extend every row to length L with draws from the toy target, vectorised over rows.
    contexts = [c for k in range(L) for c in itertools.product(range(V), repeat=k)]
    ctx_id = {c: i for i, c in enumerate(contexts)}
    ctx_probs = torch.tensor([table[c] for c in contexts], dtype=torch.float64)
    seqs = res.output_tokens[:, :L].clone()
    for k in range(L):
        offset = ctx_id[(0,) * k]
        code = sum(seqs[:, i].clamp(min=0) * V ** (k - 1 - i) for i in range(k)) if k else torch.zeros(n, dtype=int)
        draw = sample_per_node(ctx_probs[offset + code], gen)
        seqs[:, k] = torch.where(seqs[:, k] < 0, draw, seqs[:, k])

    codes = sum(seqs[:, i] * V ** (L - 1 - i) for i in range(L))
    observed = torch.bincount(codes, minlength=V**L).double()
    expected = torch.tensor([seq_prob(table, s) for s in itertools.product(range(V), repeat=L)]) * n
    small = expected < 5  # pool sparse cells so the chi-square approximation holds
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    stat = ((obs - exp) ** 2 / exp).sum()
    p_value = torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2.0), stat / 2).item()
    assert p_value > 1e-4, (stat.item(), p_value)


# ---- CUDA ------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
@pytest.mark.parametrize("budget", [31, 63])
def test_cuda_matches_reference_and_graph_replay(budget: int) -> None:
    """Eager CUDA walks agree with the reference without any host sync; a captured walk replays on new inputs."""
    dev = torch.device("cuda")
    rng = random.Random(budget)
    batch, vocab, max_depth = 8, 10, budget

    for _ in range(40):
        trees, target = random_case(rng, batch, budget, vocab, 0.9)
        trees, target_d = trees.to(dev), target.to(dev)
        torch.cuda.set_sync_debug_mode("error")
        try:
            res = run_walk(trees, target_d, max_depth)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        check_against_reference(trees, target, res, max_depth)

    # Sampled walk on CUDA: the same seed gives the same per-node draws, and the walk over them.
    probs = torch.rand(batch, budget + 1, vocab, device=dev)
    draws = sample_per_node(probs, torch.Generator(dev).manual_seed(11))
    torch.cuda.set_sync_debug_mode("error")
    try:
        res = sampled_walk(
            trees.node_tokens,
            trees.parents,
            trees.anc_bits,
            trees.num_nodes,
            probs,
            max_depth,
            torch.Generator(dev).manual_seed(11),
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check_against_reference(trees, draws.cpu(), res, max_depth)

    static, static_target = random_case(rng, batch, budget, vocab, 0.9)
    static, static_target = static.to(dev), static_target.to(dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run_walk(static, static_target, max_depth)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run_walk(static, static_target, max_depth)

    for _ in range(20):
        trees, target = random_case(rng, batch, budget, vocab, 0.9)
        for dst, src in [
            (static.node_tokens, trees.node_tokens),
            (static.parents, trees.parents),
            (static.anc_bits, trees.anc_bits),
            (static.num_nodes, trees.num_nodes),
            (static_target, target),
        ]:
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        check_against_reference(trees, target, captured, max_depth)


# The interpreter flag must be set before Triton first compiles a kernel, so the check runs in a fresh process.
TRITON_WALK_CHECK = """
import random, torch
from vllm_ddtree.accept import walk_trees_torch, walk_trees_triton
from vllm_ddtree.tree import build_trees_torch
random.seed(0)
gen = torch.Generator().manual_seed(0)
for case in range(60):
    batch, depth, k, budget = random.randint(1, 4), random.randint(1, 6), random.randint(1, 4), random.randint(1, 63)
    lp, ids = torch.log_softmax(torch.randn(batch, depth, 16, generator=gen) * 2, -1).topk(k, -1)
    t = build_trees_torch(lp, ids, budget)
    picks = torch.randint(0, 16, (batch, budget + 1), generator=gen)
    for b in range(batch):
        for i in range(budget + 1):
            children = [j for j in range(1, budget + 1) if t.parents[b, j] == i]
            if children and random.random() < 0.8:
                picks[b, i] = t.node_tokens[b, random.choice(children) - 1]
    max_depth = random.choice([depth, max(1, depth - 1), depth + 2])
    ref = walk_trees_torch(t.node_tokens, t.parents, t.anc_bits, t.num_nodes, picks, max_depth)
    out = walk_trees_triton(t.node_tokens, t.parents, t.anc_bits, t.num_nodes, picks, max_depth)
    for field in ("accepted_nodes", "num_accepted", "output_tokens"):
        assert torch.equal(getattr(ref, field), getattr(out, field)), (case, field)
print("ok")
"""


def test_triton_walk_matches_torch_in_interpreter() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(repo))
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_WALK_CHECK], env=env, cwd=repo, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
