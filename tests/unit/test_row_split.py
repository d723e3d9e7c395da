"""Which rows the tree backends attend and which take vLLM's prefill attention (``backends/row_split.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_ddtree.backends.row_split import first_prefill_request, tree_row_limit


def _config(budget: int | None) -> SimpleNamespace:
    spec = None if budget is None else SimpleNamespace(num_speculative_tokens=budget)
    return SimpleNamespace(speculative_config=spec)


@pytest.mark.parametrize(("budget", "limit"), [(None, 1), (7, 8), (15, 16), (63, 64), (100, 64)])
def test_limit_is_the_verify_width(budget: int | None, limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_DDTREE_PREFILL", raising=False)
    assert tree_row_limit(_config(budget)) == limit


def test_knob_keeps_every_row_on_the_tree_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_DDTREE_PREFILL", "ddtree")
    assert tree_row_limit(_config(7)) is None
    monkeypatch.setenv("VLLM_DDTREE_PREFILL", "flash")
    with pytest.raises(ValueError, match="VLLM_DDTREE_PREFILL must be one of vllm, ddtree"):
        tree_row_limit(_config(7))


def _qsl(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@pytest.mark.parametrize(
    ("lengths", "prefilling", "first"),
    [
        ([8, 8, 1, 5, 30, 60], None, 4),  # V2's order: uniform verify rows, then by length
        ([8, 8, 1, 5, 30, 60], [False, False, False, True, True, True], 4),
        ([8, 8], None, 2),  # no long rows
        ([30, 60], [True, True], 0),  # a prompt-only step
        ([8, 30, 8], None, 3),  # long rows are not a suffix: all on the tree backend
        ([8, 30, 60], [False, False, True], 3),  # a long row that is not prefilling never leaves
        ([8, 30, 0], [False, True], 3),  # FULL-graph padding (q_len 0) after a long row
    ],
)
def test_first_prefill_request(lengths: list[int], prefilling: list[bool] | None, first: int) -> None:
    assert first_prefill_request(_qsl(lengths), 8, prefilling) == first
