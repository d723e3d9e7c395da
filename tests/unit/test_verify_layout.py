"""The V2 verify-step layout (depth positions, per-token tree bits), path permutation and tree-row scatter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vllm_ddtree.accept import AcceptedPaths
from vllm_ddtree.tree import build_trees_torch
from vllm_ddtree.tree_mask import causal_bits
from vllm_ddtree.v2.step_state import TreeBuffers

REPO = Path(__file__).resolve().parents[2]


def random_step(seed: int, device: str = "cpu") -> dict:
    """A V2-like batch: decode rows with 0..budget drafts, prefill chunks, padded idx -1, trees stored per state."""
    return random_batch(seed, device)[0]


def random_batch(seed: int, device: str = "cpu") -> tuple[dict, TreeBuffers]:
    """``random_step``'s layout arguments and the tree buffers they were drawn from."""
    gen = torch.Generator().manual_seed(seed)
    budget, max_reqs = int(torch.randint(1, 63, (1,), generator=gen)), 12
    trees = TreeBuffers(max_reqs, budget, torch.device(device))
    lp = -torch.rand(max_reqs, 6, 4, generator=gen).sort(dim=-1).values.flip(-1).cumsum(-1)
    ids = torch.randint(0, 50, (max_reqs, 6, 4), generator=gen)
    trees.store(torch.arange(max_reqs, device=device), build_trees_torch(lp.to(device), ids.to(device), budget))
    num_reqs = int(torch.randint(1, max_reqs + 1, (1,), generator=gen))
    idx = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    q_lens, logits = [], []
    for _ in range(num_reqs):
        kind = int(torch.randint(0, 3, (1,), generator=gen))
        if kind == 0:  # prefill chunk (maybe longer than 64 rows)
            q = int(torch.randint(1, 90, (1,), generator=gen))
            q_lens.append(q)
            logits.append(1)
        else:  # decode with k drafts
            k = int(torch.randint(0, budget + 1, (1,), generator=gen))
            q_lens.append(k + 1)
            logits.append(k + 1)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(logits).cumsum(0).tolist()], dtype=torch.int32)
    num_tokens = int(qsl[-1])
    positions = torch.zeros(num_tokens + 5, dtype=torch.int64)
    for b in range(num_reqs):
        base = int(torch.randint(0, 1000, (1,), generator=gen))
        positions[qsl[b] : qsl[b + 1]] = base + torch.arange(q_lens[b])
    return dict(
        positions=positions.to(device),
        token_bits=torch.full((num_tokens + 5,), 7, dtype=torch.int64, device=device),
        query_start_loc=qsl.to(device),
        cu_num_logits=cu.to(device),
        idx_mapping=idx.to(device),
        tree_depth=trees.depth,
        tree_anc=trees.anc_bits,
        num_reqs=num_reqs,
    ), trees


def test_reference_layout_semantics() -> None:
    step = random_step(3)
    linear = step["positions"].clone()
    from vllm_ddtree.v2.verify_layout import verify_layout_reference

    verify_layout_reference(**step)
    qsl, cu = step["query_start_loc"], step["cu_num_logits"]
    causal = causal_bits(64)
    for b in range(step["num_reqs"]):
        q0, q1, n = int(qsl[b]), int(qsl[b + 1]), int(cu[b + 1] - cu[b])
        rsi = int(step["idx_mapping"][b])
        if n > 1:
            assert torch.equal(step["positions"][q0:q1], linear[q0] + step["tree_depth"][rsi, :n])
            assert torch.equal(step["token_bits"][q0:q1], step["tree_anc"][rsi, :n])
        else:
            assert torch.equal(step["positions"][q0:q1], linear[q0:q1])
            rows = min(q1 - q0, 64)
            assert torch.equal(step["token_bits"][q0 : q0 + rows], causal[:rows])


def test_path_permutation_puts_path_rows_in_order() -> None:
    from vllm_ddtree.accept import path_permutation

    accepted = torch.tensor([[0, 2, 5, -1], [0, -1, -1, -1], [0, 1, 3, 4]])
    paths = AcceptedPaths(accepted, torch.tensor([2, 0, 3]), torch.zeros(3, 8, dtype=torch.int64))
    starts = torch.tensor([0, 7, 8])
    order = path_permutation(starts, paths, 14)
    expect = torch.arange(14)
    expect[[1, 2]] = torch.tensor([2, 5])
    expect[[9, 10, 11]] = torch.tensor([9, 11, 12])
    assert torch.equal(order, expect)


def verify_batch(seed: int) -> tuple[dict, TreeBuffers, torch.Tensor, torch.Tensor, AcceptedPaths]:
    """A random V2 verify batch (target picks that mostly follow the trees, draft tokens read from the trees) and
    its accepted paths from an independent per-request oracle (``walk_trees_torch`` on one gathered tree)."""
    from vllm_ddtree.accept import walk_trees_torch

    step, trees = random_batch(seed)
    gen = torch.Generator().manual_seed(seed)
    cu, idx, width = step["cu_num_logits"].tolist(), step["idx_mapping"].tolist(), trees.parents.shape[1]
    picks = torch.randint(0, 50, (cu[-1],), generator=gen)
    inputs = torch.randint(0, 50, (cu[-1],), generator=gen)
    accepted, num_accepted, outputs = [], [], []
    for b in range(step["num_reqs"]):
        rsi, start, count = idx[b], cu[b], cu[b + 1] - cu[b]
        parents = trees.parents[rsi]
        for i in range(1, count):  # node i's draft token, distinct among siblings
            inputs[start + i] = int(trees.parents[rsi, i]) * 64 + i
        for i in range(count):
            children = [j for j in range(1, count) if int(parents[j]) == i]
            if children and torch.rand(1, generator=gen) < 0.8:
                picks[start + i] = inputs[start + children[int(torch.randint(len(children), (1,), generator=gen))]]
        target = torch.full((1, width), -1)
        target[0, :count] = picks[start : start + count]
        tokens = torch.zeros(1, width - 1, dtype=torch.int64)
        tokens[0, : count - 1] = inputs[start + 1 : start + count]
        num_nodes = torch.tensor([min(count - 1, int(trees.num_nodes[rsi]))])
        one = walk_trees_torch(
            tokens, trees.parents[rsi : rsi + 1], trees.anc_bits[rsi : rsi + 1], num_nodes, target, 6
        )
        accepted.append(one.accepted_nodes)
        num_accepted.append(one.num_accepted)
        outputs.append(one.output_tokens)
    want = AcceptedPaths(torch.cat(accepted), torch.cat(num_accepted), torch.cat(outputs))
    return step, trees, picks, inputs, want


def test_walk_verify_batch_reference_matches_per_request_oracle() -> None:
    from vllm_ddtree.accept import walk_verify_batch_torch

    for seed in range(20):
        step, trees, picks, inputs, want = verify_batch(seed)
        got = walk_verify_batch_torch(
            picks, inputs, step["cu_num_logits"], step["idx_mapping"], trees.parents, trees.anc_bits, trees.num_nodes, 6
        )
        for field in ("accepted_nodes", "num_accepted", "output_tokens"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (seed, field)
        assert (want.num_accepted > 0).any() or seed != 0


def test_move_path_rows_reference_is_the_path_permutation_gather() -> None:
    from vllm_ddtree.accept import path_permutation

    accepted = torch.tensor([[0, 2, 5, -1], [0, -1, -1, -1], [0, 1, 3, 4]])
    paths = AcceptedPaths(accepted, torch.tensor([2, 0, 3]), torch.zeros(3, 8, dtype=torch.int64))
    qsl, cu = torch.tensor([0, 7, 8, 14]), torch.tensor([0, 7, 8, 14])
    hidden = torch.arange(14.0)[:, None].repeat(1, 3)
    moved = hidden[path_permutation(qsl[1:] - (cu[1:] - cu[:-1]), paths, 14)]
    assert moved[:, 0].tolist() == [0, 2, 5, 3, 4, 5, 6, 7, 8, 9, 11, 12, 12, 13]


def test_tree_buffers_route_padded_rows_to_trash() -> None:
    trees = TreeBuffers(4, 3, torch.device("cpu"))
    built = build_trees_torch(-torch.rand(2, 3, 2).sort(-1).values.flip(-1), torch.randint(0, 9, (2, 3, 2)), 3)
    trees.store(torch.tensor([2, -1]), built)
    assert torch.equal(trees.parents[2], built.parents[0])
    assert torch.equal(trees.parents[4], built.parents[1])
    assert (trees.parents[[0, 1, 3], 1:] == -1).all()


INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch
    from test_verify_layout import random_step
    from vllm_ddtree.v2.verify_layout import verify_layout_reference, write_verify_layout

    for seed in range(40):
        want, got = random_step(seed), random_step(seed)
        verify_layout_reference(**want)
        write_verify_layout(**got)
        assert torch.equal(want["positions"], got["positions"]), seed
        assert torch.equal(want["token_bits"], got["token_bits"]), seed

    from test_verify_layout import verify_batch
    from vllm_ddtree.accept import walk_verify_batch
    from vllm_ddtree.accept import path_permutation
    from vllm_ddtree.v2.verify_layout import restore_path_context

    for seed in range(20):
        step, trees, picks, inputs, want = verify_batch(seed)
        got, num_sampled = walk_verify_batch(picks, inputs.to(torch.int32), step["cu_num_logits"],
                                             step["idx_mapping"], trees.parents, trees.anc_bits, trees.num_nodes, 6)
        for field in ("accepted_nodes", "num_accepted", "output_tokens"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (seed, field)
        assert torch.equal(num_sampled, (want.num_accepted + 1).to(torch.int32))
        # the drafter's context: linear positions back, and the path rows in order in 0, 2 or 5 hidden tensors
        # (5: two launches), rows of 1,100 (two column chunks)
        qsl, cu, n = step["query_start_loc"], step["cu_num_logits"], int(step["query_start_loc"][-1])
        linear = step["positions"].clone()
        write_verify_layout(**step)
        hiddens = [torch.randn(n + 3, 1100) for _ in range(seed % 3 * 5 // 2)]
        expect = [h.clone() for h in hiddens]
        for e, h in zip(expect, hiddens, strict=True):
            e[:n] = h[path_permutation(qsl[1:] - (cu[1:] - cu[:-1]), want, n)]
        restore_path_context(step["positions"], hiddens, qsl, cu, step["idx_mapping"], want, step["num_reqs"])
        assert torch.equal(step["positions"], linear), seed
        assert all(torch.equal(h, e) for h, e in zip(hiddens, expect, strict=True)), seed
    print("ok")
    """
)


@pytest.mark.v2
def test_triton_layout_kernel_matches_reference() -> None:
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent), str(REPO / "tests"), str(REPO)]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETER_CHECK], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.gpu
def test_cuda_layout_kernel_matches_reference() -> None:
    from vllm_ddtree.v2.verify_layout import verify_layout_reference, write_verify_layout

    for seed in range(40):
        want, got = random_step(seed), random_step(seed, "cuda")
        verify_layout_reference(**want)
        write_verify_layout(**got)
        assert torch.equal(want["positions"], got["positions"].cpu())
        assert torch.equal(want["token_bits"], got["token_bits"].cpu())


@pytest.mark.gpu
def test_cuda_walk_and_path_rows_match_the_oracle() -> None:
    from vllm_ddtree.accept import path_permutation, walk_verify_batch
    from vllm_ddtree.v2.verify_layout import restore_path_context, write_verify_layout

    for seed in range(20):
        step, trees, picks, inputs, want = verify_batch(seed)
        cuda = {k: v.cuda() for k, v in step.items() if isinstance(v, torch.Tensor)}
        got, num_sampled = walk_verify_batch(
            picks.cuda(),
            inputs.cuda().to(torch.int32),
            cuda["cu_num_logits"],
            cuda["idx_mapping"],
            trees.parents.cuda(),
            trees.anc_bits.cuda(),
            trees.num_nodes.cuda(),
            6,
        )
        for field in ("accepted_nodes", "num_accepted", "output_tokens"):
            assert torch.equal(getattr(got, field).cpu(), getattr(want, field)), (seed, field)
        assert torch.equal(num_sampled.cpu(), (want.num_accepted + 1).to(torch.int32))
        qsl, cu = step["query_start_loc"], step["cu_num_logits"]
        hiddens = [torch.randn(int(qsl[-1]), 2560, dtype=torch.bfloat16) for _ in range(5)]
        expect = [h[path_permutation(qsl[1:] - (cu[1:] - cu[:-1]), want, int(qsl[-1]))] for h in hiddens]
        moved = [h.cuda() for h in hiddens]
        linear = cuda["positions"].clone()
        write_verify_layout(
            cuda["positions"],
            cuda["token_bits"],
            cuda["query_start_loc"],
            cuda["cu_num_logits"],
            cuda["idx_mapping"],
            trees.depth.cuda(),
            trees.anc_bits.cuda(),
            step["num_reqs"],
        )
        restore_path_context(
            cuda["positions"],
            moved,
            cuda["query_start_loc"],
            cuda["cu_num_logits"],
            cuda["idx_mapping"],
            got,
            step["num_reqs"],
        )
        assert torch.equal(cuda["positions"], linear), seed
        assert all(torch.equal(m.cpu(), e) for m, e in zip(moved, expect, strict=True)), seed


def test_mla_backend_causal_words_per_token() -> None:
    from vllm_ddtree.backends.mla import causal_token_bits

    words = causal_token_bits([0, 3, 4, 70], 70)
    assert words[:4].tolist() == [1, 3, 7, 1]
    assert torch.equal(words[4:68], causal_bits(64))  # a 66-token row: words of its first 64, then all bits
    assert words[68:].tolist() == [-1, -1]


def test_chain_rows_get_the_argmax_chain_and_nothing_else() -> None:
    from vllm_ddtree.v2.speculator import build_trees_with_chains

    gen = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(3, 5, 4, generator=gen), -1).sort(-1, descending=True).values
    ids = torch.randperm(60, generator=gen).view(3, 5, 4)
    trees = build_trees_with_chains(lp, ids, 12, torch.tensor([True, False, True]))
    for b in (0, 2):
        assert int(trees.num_nodes[b]) == 5
        assert trees.parents[b, :6].tolist() == [-1, 0, 1, 2, 3, 4]
        assert torch.equal(trees.node_tokens[b, :5], ids[b, :, 0])
    assert int(trees.num_nodes[1]) == 12 and trees.parents[1, :13].tolist() != list(range(-1, 12))


@pytest.mark.parametrize("seed", range(4))
def test_every_row_sees_the_root_key_that_the_context_pass_attends(seed: int) -> None:
    """The backends' context pass attends every key before a request's tail and the tail's first key
    (``context_key_counts``), and the tree kernels then skip that key: sound only because every word the layout
    writes, tree or causal, has bit 0 set."""
    from vllm_ddtree.tree_mask import context_key_counts
    from vllm_ddtree.v2.verify_layout import verify_layout_reference

    step = random_step(seed)
    verify_layout_reference(**step)
    qsl = step["query_start_loc"]
    tokens = int(qsl[step["num_reqs"]])
    assert bool(((step["token_bits"][:tokens] & 1) == 1).all())
    seq_lens = torch.tensor([50, 7, 3, 0], dtype=torch.int32)
    counts = context_key_counts(seq_lens, torch.tensor([0, 16, 17, 20, 20], dtype=torch.int32))
    assert counts.tolist() == [35, 7, 1, 0] and counts.dtype == torch.int32
