"""Which decode launches of the MLA backend take the FlashMLA split and which our decode kernel (CPU: the choice
only; the kernels themselves run in the GPU tests)."""

from __future__ import annotations

import pytest

from vllm_ddtree.backends.mla import OWN_KERNEL_MAX_ROWS, context_choice, split_this_launch


def test_auto_keeps_launches_of_few_rows_on_our_kernel() -> None:
    # plain decode at 8 or 16 heads (TP 8 / 4 of Kimi-K2), trees of up to 4 tokens at 8 heads or 2 at 16: our kernel
    assert not split_this_launch("auto", 1, 8)
    assert not split_this_launch("auto", 1, 16)
    assert not split_this_launch("auto", 4, 8)
    assert not split_this_launch("auto", 2, 16)
    assert OWN_KERNEL_MAX_ROWS == 32
    # more rows a request: the split
    assert split_this_launch("auto", 5, 8)
    assert split_this_launch("auto", 3, 16)
    assert split_this_launch("auto", 1, 64)
    assert split_this_launch("auto", 17, 64)


def test_forced_choices() -> None:
    assert split_this_launch("flashmla", 1, 8)  # DDTREE_MLA_CONTEXT=flashmla splits every launch
    assert split_this_launch("flashmla", 64, 128)


def test_context_choice_default_and_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DDTREE_MLA_CONTEXT", raising=False)
    assert context_choice() == "auto"
    for value in ("flashmla", "ddtree", "auto"):
        monkeypatch.setenv("DDTREE_MLA_CONTEXT", value)
        assert context_choice() == value
    monkeypatch.setenv("DDTREE_MLA_CONTEXT", "flash")
    with pytest.raises(ValueError, match="'auto', 'flashmla' or 'ddtree'"):
        context_choice()
