"""The drafter's per-row top-k log-probs: the two-pass Triton kernel against the stable-sort torch reference."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from vllm_ddtree.draft_topk import topk_logprobs, topk_logprobs_reference

REPO = Path(__file__).resolve().parents[2]


def random_logits(seed: int, rows: int, vocab: int, dtype: torch.dtype, ties: bool) -> torch.Tensor:
    """Peaky rows (a few large logits, the rest noise); with ``ties`` the top values repeat on purpose, and some
    entries are -inf (masked vocabulary)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * 2
    hot = torch.randint(0, vocab, (rows, 12), generator=gen)
    x.scatter_(1, hot, 8 + 4 * torch.rand(rows, 12, generator=gen))
    if ties:
        x.scatter_(1, hot[:, 6:], x.gather(1, hot[:, :6]))  # six exact duplicates of hot values per row
        x[:, torch.randint(0, vocab, (vocab // 7,), generator=gen)] = float("-inf")
    return x.to(dtype)


CASES = [  # (rows, vocab, k, dtype, ties)
    (1, 100, 1, torch.float32, False),
    (3, 4096, 8, torch.float32, True),
    (5, 4097, 8, torch.bfloat16, True),  # a last slice of one token
    (7, 9001, 5, torch.bfloat16, True),
    (2, 20000, 16, torch.float16, True),
    (4, 12288, 3, torch.float32, False),
]


def flat_logits() -> torch.Tensor:
    """Rows of equal logits (0.0 and -0.0 alike), so only the lowest ids may win, and rows with few finite ones."""
    x = torch.zeros(3, 5000)
    x[0, 1::3] = -0.0
    x[1, ::2] = float("-inf")
    x[2, :4990] = float("-inf")  # ten finite tokens, all in the last slice
    return x


def check(device: str, fast: Callable = topk_logprobs) -> None:
    cases = [
        (random_logits(seed, rows, vocab, dtype, ties), k) for seed, (rows, vocab, k, dtype, ties) in enumerate(CASES)
    ]
    cases += [(flat_logits(), 8), (flat_logits().bfloat16(), 16)]
    for seed, (logits, k) in enumerate(cases):
        logits = logits.to(device)
        want_lp, want_ids = topk_logprobs_reference(logits.cpu(), k)
        got_lp, got_ids = fast(logits, k)
        assert got_lp.dtype == torch.float32 and got_ids.dtype == torch.int64
        assert torch.equal(got_ids.cpu(), want_ids), (seed, got_ids, want_ids)
        torch.testing.assert_close(got_lp.cpu(), want_lp, rtol=0, atol=2e-5)


def test_torch_path_matches_the_reference_without_ties() -> None:
    for seed, (rows, vocab, k, _, _) in enumerate(CASES):
        logits = random_logits(seed, rows, vocab, torch.float32, ties=False)
        want_lp, want_ids = topk_logprobs_reference(logits, k)
        got_lp, got_ids = topk_logprobs(logits, k)
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=1e-5)


def test_reference_breaks_ties_to_the_lower_id() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, float("-inf"), 3.0]])
    lp, ids = topk_logprobs_reference(logits, 4)
    assert ids.tolist() == [[1, 3, 5, 2]]
    torch.testing.assert_close(lp, logits[:, [1, 3, 5, 2]] - torch.logsumexp(logits, dim=-1, keepdim=True))


INTERPRETER_CHECK = textwrap.dedent(
    """
    from test_draft_topk import check
    import vllm_ddtree.draft_topk as draft_topk

    for slice_len in (1024, 256):  # several slices a row even for the small cases
        draft_topk.MIN_SLICE = slice_len
        check("cpu", lambda logits, k: draft_topk._fused(logits, k, *logits.shape))  # the Triton path on CPU tensors
    """
)


def test_triton_kernel_matches_the_reference_under_the_interpreter() -> None:
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent), str(REPO / "tests"), str(REPO)]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETER_CHECK], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.gpu
def test_cuda_kernel_matches_the_reference() -> None:
    check("cuda")
    logits = random_logits(99, 240, 163840, torch.bfloat16, ties=True).cuda()  # Kimi-K2 vocabulary, batch 16 x 15
    want_lp, want_ids = topk_logprobs_reference(logits.cpu(), 8)
    got_lp, got_ids = topk_logprobs(logits, 8)
    assert torch.equal(got_ids.cpu(), want_ids)
    torch.testing.assert_close(got_lp.cpu(), want_lp, rtol=0, atol=2e-5)
