"""Which batches DDTree's V1 adapter drafts and verifies as chains (exactness over speed)."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_ddtree.tree_state import needs_chain


def _metadata(**overrides: object) -> SimpleNamespace:
    base = dict(max_num_logprobs=None, no_penalties=True, bad_words_token_ids={}, allowed_token_ids_mask=None,
                logitsprocs=SimpleNamespace(non_argmax_invariant=[SimpleNamespace(min_toks={}),
                                                                  SimpleNamespace(biases={}),
                                                                  SimpleNamespace(min_p_count=0)]))
    return SimpleNamespace(**{**base, **overrides})


def test_plain_batches_use_trees() -> None:
    assert not needs_chain(_metadata(), has_structured_output=False)


def test_sequence_features_force_chains() -> None:
    assert needs_chain(_metadata(max_num_logprobs=0), False)
    assert needs_chain(_metadata(no_penalties=False), False)
    assert needs_chain(_metadata(bad_words_token_ids={0: [[5]]}), False)
    assert needs_chain(_metadata(allowed_token_ids_mask=object()), False)
    assert needs_chain(_metadata(), has_structured_output=True)
    min_tokens = SimpleNamespace(non_argmax_invariant=[SimpleNamespace(min_toks={0: (3, [], set())})])
    assert needs_chain(_metadata(logitsprocs=min_tokens), False)
    unknown = SimpleNamespace(non_argmax_invariant=[object()])
    assert needs_chain(_metadata(logitsprocs=unknown), False)
