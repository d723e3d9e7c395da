"""bench/divergence.py's comparison: where a speculative row leaves the reference, and how far its log-probs move at
the positions whose context both rows share."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import divergence  # noqa: E402

REFERENCE = [[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9]]
GAPS = [[3.0, 2.0, 0.25, 4.0], [5.0, 5.0, 5.0, 5.0], [1.0, float("inf"), 2.0]]


def test_divergences_give_the_first_divergent_position_and_the_reference_gap_there() -> None:
    got = [[5, 6, 2, 2], [1, 2, 3, 4], [9, 9]]
    assert divergence.divergences(REFERENCE, GAPS, got) == [
        {"prompt": 0, "position": 2, "gap": 0.25, "target_token": 7, "token": 2},
        {"prompt": 2, "position": 2, "gap": 2.0, "target_token": 9, "token": None},  # a prefix: diverges at its end
    ]
    assert divergence.divergences(REFERENCE, GAPS, [[5, 6, 7, 8], [1, 2, 3, 4], [9, 8, 9]])[0]["gap"] is None  # inf


def test_logprob_deviations_cover_the_shared_context_and_the_tokens_in_both_sets() -> None:
    want = [[5, 6, 7], [1, 2]]
    want_lps = [
        [{5: -0.1, 4: -2.0}, {6: -0.2, 3: -3.0}, {7: -0.5, 2: -1.0}],
        [{1: -0.3, 8: -1.5}, {2: -0.1}],
    ]
    got = [[5, 6, 2], [4, 2]]
    got_lps = [
        [{5: -0.15, 4: -2.5}, {6: -0.2, 9: -3.0}, {2: -0.75, 7: -0.5}],  # position 2 diverges: its context agrees
        [{4: -0.2, 1: -0.4}, {2: -9.0}],  # diverges at 0: position 1's context differs, left out
    ]
    deviations = divergence.logprob_deviations(want, want_lps, got, got_lps)
    assert sorted(round(d, 6) for d in deviations) == [0.0, 0.0, 0.05, 0.1, 0.25, 0.5]


def test_identical_rows_compare_every_position() -> None:
    want_lps = [[{1: -0.5, 2: -1.0}, {3: -0.25}]]
    got_lps = [[{1: -0.5, 2: -1.125}, {3: -0.5}]]
    assert sorted(divergence.logprob_deviations([[1, 3]], want_lps, [[1, 3]], got_lps)) == [0.0, 0.125, 0.25]


def test_p99_is_the_nearest_rank_percentile() -> None:
    assert divergence.p99([float(v) for v in range(100, 0, -1)]) == 99.0
    assert divergence.p99([0.5]) == 0.5
    assert divergence.p99([]) is None


def test_compare_row_reads_the_output_pass_and_the_logprob_pass_separately() -> None:
    lps = [[{t: -0.5} for t in seq] for seq in REFERENCE]
    reference = {"tokens": REFERENCE, "gaps": GAPS, "logprobs": lps}
    row_lps = [[{t: -0.5 - 0.01 * (i + 1)} for t in seq] for i, seq in enumerate(REFERENCE)]
    row = {"tokens": [[5, 6, 2, 2], [1, 2, 3, 4], [9, 9, 9]], "logprob_tokens": REFERENCE, "logprobs": row_lps}
    got = divergence.compare_row(reference, row)
    assert got["divergent"] == 1 and got["divergences"][0]["position"] == 2
    assert got["logprob_pass_divergent"] == 0 and got["dlogprob_pairs"] == 11
    assert got["dlogprob_max"] == pytest.approx(0.03) and got["dlogprob_p99"] == pytest.approx(0.03)


def test_table_has_a_line_per_row_and_the_error_of_a_failed_one() -> None:
    rows = [
        {"config": "c", "method": "none", "budget": 0, "runner": "V1"},
        {"config": "c", "method": "ddtree", "budget": 7, "divergent": 0, "dlogprob_p99": 1e-6, "dlogprob_max": 2e-6}
        | {"mean_acceptance_length": 1.5, "runner": "V1"},
        {
            "config": "c",
            "method": "dflash",
            "budget": 15,
            "error": "c dflash failed (rc 1):\nValueError: bad\n  see docs\n",
        },
    ]
    lines = divergence.table(rows, prompts=24).splitlines()
    assert len(lines) == 5 and all(line.count("|") == 8 for line in lines)
    assert "| c | ddtree 7 | 0/24 | 1e-06 | 2e-06 | 1.5 | V1 |" in lines
    assert "error: ValueError: bad" in lines[4]
