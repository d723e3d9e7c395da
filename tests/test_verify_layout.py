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
from vllm_ddtree.backends.tree_mask import causal_bits
from vllm_ddtree.tree import build_trees_torch
from vllm_ddtree.tree_state import TreeBuffers

REPO = Path(__file__).resolve().parents[1]


def random_step(seed: int, device: str = "cpu") -> dict:
    """A V2-like batch: decode rows with 0..budget drafts, prefill chunks, padded idx -1, trees stored per state."""
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
    return dict(positions=positions.to(device), token_bits=torch.full((num_tokens + 5,), 7, dtype=torch.int64,
                device=device), query_start_loc=qsl.to(device), cu_num_logits=cu.to(device),
                idx_mapping=idx.to(device), tree_depth=trees.depth, tree_anc=trees.anc_bits, num_reqs=num_reqs)


def test_reference_layout_semantics() -> None:
    step = random_step(3)
    linear = step["positions"].clone()
    from vllm_ddtree.verify_layout import verify_layout_reference

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
    from vllm_ddtree.speculator import path_permutation

    accepted = torch.tensor([[0, 2, 5, -1], [0, -1, -1, -1], [0, 1, 3, 4]])
    paths = AcceptedPaths(accepted, torch.tensor([2, 0, 3]), torch.zeros(3, 8, dtype=torch.int64))
    starts = torch.tensor([0, 7, 8])
    order = path_permutation(starts, paths, 14)
    expect = torch.arange(14)
    expect[[1, 2]] = torch.tensor([2, 5])
    expect[[9, 10, 11]] = torch.tensor([9, 11, 12])
    assert torch.equal(order, expect)


def test_flat_to_tree_rows() -> None:
    from vllm_ddtree.sampler import _flat_to_tree_rows

    flat = torch.arange(10, 20)
    cu = torch.tensor([0, 3, 4, 10])
    starts, counts = cu[:-1], cu[1:] - cu[:-1]
    want = [[10, 11, 12, -1], [13, -1, -1, -1], [14, 15, 16, 17]]
    assert _flat_to_tree_rows(flat, starts, counts, 4, -1).tolist() == want
    assert _flat_to_tree_rows(flat, starts + 1, counts - 1, 3, 0).tolist() == [[11, 12, 0], [0, 0, 0], [15, 16, 17]]


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
    from vllm_ddtree.verify_layout import restore_linear_positions, verify_layout_reference, write_verify_layout

    for seed in range(40):
        want, got = random_step(seed), random_step(seed)
        linear = got["positions"].clone()
        verify_layout_reference(**want)
        write_verify_layout(**got)
        assert torch.equal(want["positions"], got["positions"]), seed
        assert torch.equal(want["token_bits"], got["token_bits"]), seed
        args = {k: v for k, v in got.items() if k != "token_bits"}
        restore_linear_positions(**args)
        assert torch.equal(got["positions"], linear), seed
    print("ok")
    """
)


def test_triton_layout_kernel_matches_reference() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO)]))
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_CHECK], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.gpu
def test_cuda_layout_kernel_matches_reference() -> None:
    from vllm_ddtree.verify_layout import verify_layout_reference, write_verify_layout

    for seed in range(40):
        want, got = random_step(seed), random_step(seed, "cuda")
        verify_layout_reference(**want)
        write_verify_layout(**got)
        assert torch.equal(want["positions"], got["positions"].cpu())
        assert torch.equal(want["token_bits"], got["token_bits"].cpu())


def test_mla_backend_causal_words_per_token() -> None:
    from vllm_ddtree.backends.mla import causal_token_bits

    words = causal_token_bits([0, 3, 4, 70], 70)
    assert words[:4].tolist() == [1, 3, 7, 1]
    assert torch.equal(words[4:68], causal_bits(64))  # a 66-token row: words of its first 64, then all bits
    assert words[68:].tolist() == [-1, -1]


def test_chain_rows_get_the_argmax_chain_and_nothing_else() -> None:
    from vllm_ddtree.speculator import build_trees_with_chains

    gen = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(3, 5, 4, generator=gen), -1).sort(-1, descending=True).values
    ids = torch.randperm(60, generator=gen).view(3, 5, 4)
    trees = build_trees_with_chains(lp, ids, 12, torch.tensor([True, False, True]))
    for b in (0, 2):
        assert int(trees.num_nodes[b]) == 5
        assert trees.parents[b, :6].tolist() == [-1, 0, 1, 2, 3, 4]
        assert torch.equal(trees.node_tokens[b, :5], ids[b, :, 0])
    assert int(trees.num_nodes[1]) == 12 and trees.parents[1, :13].tolist() != list(range(-1, 12))
