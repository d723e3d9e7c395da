"""The bf16 losslessness rule: a sequence may leave the reference only at the reference's own near-ties."""

from __future__ import annotations

from types import SimpleNamespace

from kit.greedy_equality import NEAR_TIE, compare_greedy, greedy_with_gaps, top2_gaps


def test_top2_gaps_from_vllm_logprobs() -> None:
    lp = SimpleNamespace
    positions = [
        {5: lp(logprob=-0.1), 7: lp(logprob=-2.6)},
        {3: lp(logprob=-0.5)},
        {1: lp(logprob=-3.0), 2: lp(logprob=-0.7)},
    ]
    gaps = top2_gaps(positions)
    assert gaps[0] == 2.5 and gaps[1] == float("inf") and abs(gaps[2] - 2.3) < 1e-9


def test_greedy_with_gaps_batches_the_prompts_and_keeps_their_order() -> None:
    lp = SimpleNamespace
    calls = []

    class FakeLLM:
        def generate(self, chunk, params, use_tqdm):
            calls.append(len(chunk))
            return [
                lp(outputs=[lp(token_ids=(p, p + 1), logprobs=[{p: lp(logprob=-0.5), 0: lp(logprob=-1.5)}] * 2)])
                for p in chunk
            ]

    tokens, gaps = greedy_with_gaps(FakeLLM(), [10, 20, 30], params=None, batch=2)
    assert calls == [2, 1]
    assert tokens == [[10, 11], [20, 21], [30, 31]] and gaps == [[1.0, 1.0]] * 3


def test_divergences_are_classified_by_the_reference_gap_where_they_start() -> None:
    want = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]
    gaps = [[5.0, 5.0, 5.0, 5.0], [5.0, NEAR_TIE / 2, 5.0, 5.0], [5.0, 5.0, NEAR_TIE, 5.0], [9.0, 9.0, 9.0, 9.0]]
    got = [[1, 2, 3, 4], [1, 9, 9, 9], [1, 2, 7, 4], [1, 2, 3]]
    seen = compare_greedy(got, want, gaps)
    assert seen.identical == 1
    assert seen.near_tie_gaps == [NEAR_TIE / 2]  # later tokens after a near-tie flip may differ freely
    # a gap of exactly NEAR_TIE counts as a clear winner, and so does an output cut short
    assert seen.clear_divergences == [(2, 2, NEAR_TIE), (3, 3, 9.0)]
    assert not seen.lossless
    assert compare_greedy(got[:2], want[:2], gaps[:2]).lossless
