"""Load-aware node budget: each decode step verifies the tree prefix (or no drafts) worth most tokens per second.

A best-first tree is built in topological order, so its first ``k`` nodes are themselves a tree: verifying a
prefix changes the verify width, never the output (the walk still follows the target's own choices). The policy
picks ``k`` from a few candidate budgets (``candidate_budgets``: 0 = no speculation, then 1, 3, 7, ... up to the
configured budget) for a batch of ``r`` requests by maximising ``(1 + E[accepted | k]) / seconds(r, k)``
(speculating only where that beats no speculation by ``SPECULATION_MARGIN``):

* ``StepCosts``: seconds of a decode step of ``r`` requests at budget ``k``, timed at start-up (dummy decode
  steps of the real runner, graphs where vLLM captured them) and corrected online by what served steps of each
  ``k`` take (``observe``), without waiting on the device: vLLM-CPU's runner times its steps, and on Model Runner
  V2 the interval between two of the scheduler's choices is one engine step (``ServedPeriods``), with the host's
  share of serving that the dummy steps leave out.
* ``AcceptanceStats``: accepted draft tokens per request for every candidate ``k`` at once, from each step's
  accepted paths: a ``k``-node prefix accepts exactly the path's nodes numbered ``<= k``. Counted on the device,
  read back through a copy that is only looked at once it has landed (no host synchronisation in the decode loop).

Budgets never seen get the optimistic ``min(k, max_depth)`` until a step shows them; in a request-count bucket first
seen each budget runs a burst of ``EXPLORE_BURST`` steps, and then every ``EXPLORE_EVERY`` choices a neighbouring budget
above 0 that is not far behind (or whose step times rest on few steps) runs a burst, and now and then the other side of
the speculation switch (``switch_explore_interval``; its burst replaces that side's step-time readings in the bucket),
so the estimates follow the traffic. Speculation switches off as soon as it stops paying (once the estimate saying so
rests on ``TRUSTED_ROWS`` rows), and on again only ``MODE_DWELL`` choices after the last switch.
``VLLM_DDTREE_ADAPTIVE_FORCE`` replaces the choice by a fixed cycle of budgets (tests and benches).
"""

from __future__ import annotations

import bisect
import logging
import math
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger("vllm.ddtree")

EXPLORE_EVERY = 32
"""Every this many choices a neighbour of the best budget runs a burst (the next larger, then the next smaller, in
turn), to keep its acceptance and cost estimates current."""
EXPLORE_WITHIN = 0.7
"""Only budgets expected at this fraction of the best's tokens per second or more are explored, once their step
times are settled (``SETTLED_READINGS``)."""
MODE_DWELL = 32
"""Choices after a switch of speculation before it may switch on again, so that switches stay rare. Switching off
never waits: a batch that grew (a burst of arrivals after a quiet spell) must not verify trees it cannot afford for
the dwell's steps (budgets above 0 switch freely)."""
SWITCH_EXPLORE_EVERY = 512
"""At least this many choices between bursts of the best budget while not speculating, so an estimate gone stale on
that side cannot pin the choice."""
SWITCH_EXPLORE_WHILE_ON = 64
"""At least this many choices between bursts of no drafts while speculating. Contention on a shared CPU (a burst of
arrivals) can slow the plain steps for a while; if speculation switched on then, their readings must not stand for
long: tens of seconds of trees verified where plain steps would serve more. Where trees serve far more than plain
steps the bursts come rarer (``SWITCH_EXPLORE_SHARE``)."""
SWITCH_EXPLORE_SHARE = 0.02
"""Bursts of the other side of the speculation switch may cost at most this share: while not speculating, of the
steps' time (where a tree step costs many plain ones, a compute-bound CPU, they come rarer than every
``SWITCH_EXPLORE_EVERY`` choices); while speculating, of the tokens the trees would have served instead."""
EXPLORE_BURST = 4
"""Consecutive steps an explored budget runs (its first step follows another budget and is not observed)."""
SETTLED_READINGS = 2 * EXPLORE_BURST
"""Timed steps of a budget in a request-count bucket before its estimate may keep it from being explored
(``EXPLORE_WITHIN``). A bucket's first burst can time stalls that are not the budget's (a kernel compiling at first
use, a request ending and the next one's prefill between two choices at one request): a budget priced by that burst
alone would never run again to correct it. Twice a burst's length: the at most three readings of a stalled burst
end up a minority."""
RATIO_WINDOW = 16
"""Observed-over-predicted step times kept per budget and request-count bucket (their median scales the curve)."""
SPECULATION_MARGIN = 1.1
"""Speculate only where the best budget is expected to beat no speculation by this factor: its gain is an estimate
and its cost varies more (deeper steps, KV compaction), so near-ties go to the plain decode step."""
LOG_INTERVAL_S = 10.0
"""How often the policy logs what it chose (vLLM's own stats interval)."""
MIN_BUCKET_RATIOS = 3
"""Ratios a bucket needs before its own median replaces the budget's."""
ACCEPTANCE_DECAY = 0.99
"""Per-step decay of the acceptance counts (an effective window of about a hundred steps)."""
MIN_OBSERVATIONS = 1.0
"""Decayed row count below which a budget's acceptance is treated as unseen."""
SERVED_IDLE_GAP_S = 0.5
"""Intervals between choices longer than this are idle gaps (no requests), not steps (``ServedPeriods``)."""
TRUSTED_ROWS = 32.0
"""Decayed request rows the best speculating budget's acceptance must rest on before speculation may switch off. The
first bursts are a few steps of one request at low concurrency, which can read far below what the trees accept; an
estimate that small could keep speculation off for long (for good where trees explored while off are not counted,
``AdaptiveBudget.record``)."""


def candidate_budgets(budget: int) -> tuple[int, ...]:
    """0 (no speculation), 1, 3, 7, 15, ... below ``budget``, and ``budget`` itself."""
    budgets = {0, budget}
    k = 1
    while k < budget:
        budgets.add(k)
        k = 2 * k + 1
    return tuple(sorted(budgets))


def forced_budgets(spec: str, budgets: Sequence[int]) -> tuple[int, ...]:
    """Parse ``VLLM_DDTREE_ADAPTIVE_FORCE`` (comma-separated budgets, each one of the candidates)."""
    try:
        forced = tuple(int(part) for part in spec.split(","))
    except ValueError:
        forced = ()
    if not forced or any(k not in budgets for k in forced):
        raise ValueError(
            f"VLLM_DDTREE_ADAPTIVE_FORCE must be comma-separated budgets from {list(budgets)} (the candidates of "
            f"this 'num_speculative_tokens'), got {spec!r}"
        )
    return forced


def _bucket(num_reqs: int) -> int:
    """The power-of-two bucket of a request count (1, 2, 3-5 -> 4, 6-11 -> 8, ...)."""
    return 1 << max(0, round(math.log2(max(num_reqs, 1))))


def request_grid(max_num_reqs: int) -> list[int]:
    """Request counts the start-up timings visit: 1, 2, 4, ... below ``max_num_reqs``, and ``max_num_reqs``."""
    grid, r = [], 1
    while r < max_num_reqs:
        grid.append(r)
        r *= 2
    return [*grid, max_num_reqs]


def measure_step_costs(
    run_step: Callable[[int, int], None],
    budgets: Sequence[int],
    max_num_reqs: int,
    fits: Callable[[int, int], bool],
    sync: Callable[[], None],
    repeats: int = 3,
) -> dict[int, dict[int, float]]:
    """``{k: {r: seconds}}``: the fastest of ``repeats`` timed ``run_step(r, k)`` (after one untimed) for each budget
    and each grid request count that ``fits`` (start-up only: every run waits for the device)."""
    costs: dict[int, dict[int, float]] = {}
    for k in budgets:
        costs[k] = {}
        for r in request_grid(max_num_reqs):
            if not fits(r, k):
                break
            run_step(r, k)
            sync()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                run_step(r, k)
                sync()
                times.append(time.perf_counter() - start)
            costs[k][r] = min(times)  # interference only ever adds time
    return costs


class StepCosts:
    """Seconds of one decode step of ``r`` requests verifying ``k`` drafts each.

    ``measured[k]`` maps request counts to start-up timings; between them the cost is interpolated linearly, below
    the smallest it is the smallest, above the largest it follows the last two points' slope. Budgets without
    timings are not offered, nor where ``offered(r, k)`` says no (``covers``; Model Runner V2: verify batches
    beyond the largest FULL CUDA graph, which run without graphs for the whole step). ``observe`` scales a
    budget's curve by what its steps take over what was predicted, which picks up the per-step work a dummy step
    does not do (the tree walk, KV compaction, the host's share): the median of the last ``RATIO_WINDOW`` ratios in
    the observed request count's power-of-two bucket, else of the budget's, else 1. Medians, because a step's time
    only ever grows by interference (another process on the core, a collection).
    """

    def __init__(
        self, measured: dict[int, dict[int, float]], offered: Callable[[int, int], bool] | None = None
    ) -> None:
        self._offered = offered
        self._reqs = {k: sorted(v) for k, v in measured.items() if v}
        self._secs = {k: [measured[k][r] for r in self._reqs[k]] for k in self._reqs}
        self._ratios: dict[tuple[int, int], deque[float]] = {}
        self._budget_ratios: dict[int, deque[float]] = {k: deque(maxlen=RATIO_WINDOW) for k in self._reqs}

    @property
    def budgets(self) -> list[int]:
        return sorted(self._reqs)

    def covers(self, num_reqs: int, k: int) -> bool:
        return k in self._reqs and (self._offered is None or self._offered(num_reqs, k))

    def predicted(self, num_reqs: int, k: int) -> float | None:
        """The start-up curve at ``num_reqs`` (None for budgets without timings)."""
        if k not in self._reqs:
            return None
        reqs, secs = self._reqs[k], self._secs[k]
        i = bisect.bisect_left(reqs, num_reqs)
        if i < len(reqs) and (reqs[i] == num_reqs or i == 0):
            return secs[i]
        if i == len(reqs):
            if len(reqs) == 1:
                return secs[0] * num_reqs / reqs[0]
            i -= 1
        r0, r1 = reqs[i - 1], reqs[i]
        return max(secs[i - 1] + (secs[i] - secs[i - 1]) * (num_reqs - r0) / (r1 - r0), 0.0)

    def cost(self, num_reqs: int, k: int) -> float | None:
        """The scaled curve where budget ``k`` is offered for ``num_reqs`` requests, else None."""
        predicted = self.predicted(num_reqs, k) if self.covers(num_reqs, k) else None
        return None if predicted is None else predicted * self.scale(k, num_reqs)

    def readings(self, k: int, num_reqs: int) -> int:
        """Timed steps of budget ``k`` in the bucket of ``num_reqs`` behind its scale (at most ``RATIO_WINDOW``)."""
        return len(self._ratios.get((k, _bucket(num_reqs)), ()))

    def observe(self, num_reqs: int, k: int, seconds: float) -> None:
        """Fold in one timed uniform decode step of ``num_reqs`` requests at budget ``k``."""
        predicted = self.predicted(num_reqs, k)
        if predicted is None or predicted <= 0.0 or seconds <= 0.0:
            return
        ratio = seconds / predicted
        self._ratios.setdefault((k, _bucket(num_reqs)), deque(maxlen=RATIO_WINDOW)).append(ratio)
        self._budget_ratios[k].append(ratio)

    def forget(self, k: int, num_reqs: int) -> None:
        """Drop budget ``k``'s ratios in the bucket of ``num_reqs``: the burst about to run reads it afresh (until
        it has ``MIN_BUCKET_RATIOS`` the budget's other ratios stand in)."""
        self._ratios.pop((k, _bucket(num_reqs)), None)

    def scale(self, k: int, num_reqs: int = 1) -> float:
        """Observed over predicted seconds for budget ``k`` near ``num_reqs`` requests (1 before any step); of an
        even count the lower middle, since interference only ever adds time (of two readings, one stall is ignored)."""
        ratios = self._ratios.get((k, _bucket(num_reqs)), ())
        if len(ratios) < MIN_BUCKET_RATIOS:
            ratios = self._budget_ratios.get(k, ())
        return statistics.median_low(ratios) if ratios else 1.0

    def observations(self, k: int) -> int:
        return len(self._budget_ratios.get(k, ()))


class AcceptanceStats:
    """Decayed mean of accepted draft tokens per request, for each candidate budget ``k > 0``.

    ``record`` runs on the device beside the tree walk; ``expected`` runs on the host (in the scheduler's thread
    on Model Runner V2) and reads the last copy that has completed, so neither waits on the other.
    """

    def __init__(self, budgets: Sequence[int], device: torch.device) -> None:
        self.budgets = [k for k in budgets if k > 0]
        self._k = torch.tensor(self.budgets, dtype=torch.int64, device=device)
        self._sums = torch.zeros(len(self.budgets), dtype=torch.float64, device=device)
        self._counts = torch.zeros_like(self._sums)
        on_gpu = device.type == "cuda"
        self._host = torch.zeros(2, len(self.budgets), dtype=torch.float64, pin_memory=on_gpu)
        self._event = torch.cuda.Event() if on_gpu else None
        self._pending = False
        self._expected: dict[int, float] = {}
        self._rows: dict[int, float] = {}
        self._lock = threading.Lock()

    def record(self, accepted_nodes: torch.Tensor, num_verified: torch.Tensor) -> None:
        """One verify step: ``accepted_nodes[b, d]`` is the path's node at depth ``d`` (column 0 the root, -1 past
        the path); ``num_verified[b]`` the drafts row ``b`` verified (0 for rows without drafts)."""
        nodes = accepted_nodes[:, 1:]
        on_path = nodes > 0
        accepted = ((nodes[:, :, None] <= self._k) & on_path[:, :, None]).sum(dim=1)  # [B, budgets]
        seen = num_verified.to(torch.int64)[:, None] >= self._k[None, :]
        self._sums.mul_(ACCEPTANCE_DECAY).add_((accepted * seen).sum(dim=0))
        self._counts.mul_(ACCEPTANCE_DECAY).add_(seen.sum(dim=0))
        with self._lock:
            if self._pending:
                return
            self._host[0].copy_(self._sums, non_blocking=True)
            self._host[1].copy_(self._counts, non_blocking=True)
            if self._event is not None:
                self._event.record()
            self._pending = True

    def expected(self) -> dict[int, float]:
        """Accepted draft tokens per request by budget, for the budgets seen recently enough."""
        with self._lock:
            if self._pending and (self._event is None or self._event.query()):
                sums, counts = self._host.tolist()
                self._expected = {
                    k: s / c for k, s, c in zip(self.budgets, sums, counts, strict=True) if c >= MIN_OBSERVATIONS
                }
                self._rows = dict(zip(self.budgets, counts, strict=True))
                self._pending = False
            return dict(self._expected)

    def rows(self, k: int) -> float:
        """The decayed request rows behind budget ``k``'s estimate, as of the last ``expected``."""
        with self._lock:
            return self._rows.get(k, 0.0)


class ServedPeriods:
    """Served steps timed from the choosing side: Model Runner V2's scheduler, which chooses each step's budget.

    Under async scheduling the interval between two choices is one engine step (the device's step or the host's
    loop, whichever is longer), with the host's share of serving in it (scheduling, output processing, streaming),
    which the start-up dummy steps leave out; timing it waits on nothing. With one step in flight, the step that
    ends between two choices was chosen two choices back, so the interval is a step of budget ``k`` once the three
    choices had ``k`` in one request-count bucket (requests come and go every few steps under load; the bucket's
    cost hardly moves).
    """

    def __init__(self) -> None:
        self._last: deque[tuple[tuple[int, int], int, float]] = deque(maxlen=2)  # ((k, bucket), requests, time)

    def tick(self, num_reqs: int, k: int, now: float) -> tuple[int, float] | None:
        """A choice of budget ``k`` for ``num_reqs`` requests at time ``now`` (seconds): the step it timed, as
        (its requests, seconds), or None."""
        shape = (k, _bucket(num_reqs))
        step = None
        if len(self._last) == 2 and all(s == shape for s, _, _ in self._last):
            period = now - self._last[-1][2]
            if 0.0 < period < SERVED_IDLE_GAP_S:
                step = (self._last[0][1], period)  # the step that ended in it was chosen two choices back
        self._last.append((shape, num_reqs, now))
        return step


class AdaptiveBudget:
    """The per-step choice of a decode step's node budget from the batch's request count."""

    def __init__(
        self,
        budgets: Sequence[int],
        costs: StepCosts,
        stats: AcceptanceStats,
        max_depth: int,
        forced: Sequence[int] | None = None,
        served: ServedPeriods | None = None,
        full_context: bool = False,
    ) -> None:
        self.budgets = tuple(budgets)
        self.costs = costs
        self.stats = stats
        self.max_depth = max_depth
        self.forced = tuple(forced) if forced else None
        self._choices = 0
        self._tries: dict[tuple[int, int], int] = {}
        self._burst = (0, 0)
        self._mode, self._mode_since = self.budgets[-1], 0
        self._switch_explored_at = 0
        self.chosen: Counter[int] = Counter()
        """How often each budget was chosen (tests, benches)."""
        self._recent: Counter[int] = Counter()
        self._recent_reqs: Counter[int] = Counter()
        self.served = served
        """Times served steps from the choices (Model Runner V2); None where the runner ``observe``s its own."""
        self.full_context = full_context
        """Steps without drafts still write the drafter's context (Model Runner V2): trees drafted after them are
        drafted as they would be while speculating."""
        self._logged_at = time.monotonic()

    def record(self, accepted_nodes: torch.Tensor, num_verified: torch.Tensor) -> None:
        """A verify step's accepted paths into the acceptance counts (``AcceptanceStats.record``), only while the
        policy speculates:

        * before its first choice the steps are the engine's warm-up (Model Runner V2's ``warmup_kernels`` runs a
          decode step of every request slot with dummy drafts after graph capture), whose near-zero acceptance
          over ``max_num_seqs`` rows would outweigh the first hundreds of served steps;
        * while it does not speculate, unless steps without drafts write the drafter's context (``full_context``):
          where they skip the drafter pass, the trees of the exploration bursts are drafted from contexts with holes
          and accept less than trees would once speculating; counted, they would keep the policy from switching
          back. The estimate from the last speculating period stands instead, and the cost side decides."""
        if self._choices and (self._mode != 0 or self.full_context):
            self.stats.record(accepted_nodes, num_verified)

    def expected_accepted(self, k: int, seen: dict[int, float]) -> float:
        """E[accepted drafts | budget k]: what steps showed, else the optimistic bound (every node of a chain)."""
        if k == 0:
            return 0.0
        return seen.get(k, float(min(k, self.max_depth)))

    def ranked(self, num_reqs: int) -> list[tuple[float, int]]:
        """(tokens per second per request, budget) of every budget the cost model covers, best first."""
        seen = self.stats.expected()
        ranked = []
        for k in self.budgets:
            seconds = self.costs.cost(num_reqs, k)
            if seconds is not None and seconds > 0.0:
                ranked.append(((1.0 + self.expected_accepted(k, seen)) / seconds, k))
        return sorted(ranked, reverse=True)

    def choose(self, num_reqs: int) -> int:
        """The budget for the next decode step of ``num_reqs`` requests."""
        k = self._choose(num_reqs)
        self.chosen[k] += 1
        self._recent[k] += 1
        self._recent_reqs[_bucket(num_reqs)] += 1
        now = time.monotonic()
        if self.served is not None:
            step = self.served.tick(num_reqs, k, now)
            if step is not None:
                self.costs.observe(step[0], k, step[1])
        if now - self._logged_at >= LOG_INTERVAL_S:
            self._logged_at = now
            seen = self.stats.expected()
            reqs = self._recent_reqs.most_common(1)[0][0]  # the period's usual load, not this choice's
            costs = {b: self.costs.cost(reqs, b) for b in self.budgets}
            logger.info(
                "DDTree adaptive budget: the last %d steps verified %s; accepted drafts by budget %s; "
                "step ms by budget at %d requests (most steps' bucket) %s (start-up model x %s)",
                sum(self._recent.values()),
                ", ".join(f"{b} nodes {n}x" for b, n in sorted(self._recent.items())),
                {b: round(a, 2) for b, a in sorted(seen.items())},
                reqs,
                {b: round(c * 1e3, 2) for b, c in costs.items() if c is not None},
                {b: round(self.costs.scale(b, reqs), 2) for b in self.budgets},
            )
            self._recent.clear()
            self._recent_reqs.clear()
        return k

    def _choose(self, num_reqs: int) -> int:
        self._choices += 1
        if self.forced is not None:
            self.stats.expected()  # takes the last landed copy, so the next step's counts are copied (tests, logs)
            return self.forced[(self._choices - 1) % len(self.forced)]
        ranked = self.ranked(max(num_reqs, 1))
        if not ranked:
            return self.budgets[-1]
        if self._burst[1] > 0:
            self._burst = (self._burst[0], self._burst[1] - 1)
            return self._burst[0]
        bucket = _bucket(num_reqs)
        for _, k in ranked:  # a request-count bucket first seen: each budget runs a burst there
            if (k, bucket) not in self._tries:
                self._tries[k, bucket] = 1
                return self._start_burst(k)
        value = {k: v for v, k in ranked}
        speculating = [(v, k) for v, k in ranked if k > 0]
        best = speculating[0][1] if speculating else 0
        if 0 in value and (best == 0 or value[best] < SPECULATION_MARGIN * value[0]):
            best = 0
        if (best == 0) != (self._mode == 0):
            if best > 0 and self._choices - self._mode_since < MODE_DWELL:
                best = 0  # switching on waits for the dwell, switching off does not
            elif best == 0 and speculating and self.stats.rows(speculating[0][1]) < TRUSTED_ROWS:
                best = speculating[0][1]  # too few rows yet to trust the estimate that says stop
            else:  # the switch itself read the other side: its next burst waits a whole interval
                self._mode, self._mode_since = best, self._choices
                self._switch_explored_at = self._choices
        other = 0 if best > 0 else (speculating[0][1] if speculating else None)
        since = self._choices - self._switch_explored_at
        if (
            other is not None
            and since >= (SWITCH_EXPLORE_WHILE_ON if other == 0 else SWITCH_EXPLORE_EVERY)  # floor before cost lookups
            and since >= self.switch_explore_interval(num_reqs, best, other, value)
        ):
            self._switch_explored_at = self._choices
            self.costs.forget(other, num_reqs)  # its readings were taken under the load of the last switch
            return self._start_burst(other)  # the other side of the switch
        if self._choices % EXPLORE_EVERY == 0 and best > 0:
            upward = (self._choices // EXPLORE_EVERY) % 2 == 1
            neighbours = [k for _, k in speculating if (k > best if upward else k < best)]
            neighbours = [
                k
                for k in neighbours
                if value[k] >= EXPLORE_WITHIN * value[best] or self.costs.readings(k, num_reqs) < SETTLED_READINGS
            ]
            if neighbours:
                return self._start_burst(min(neighbours) if upward else max(neighbours))
        return best

    def switch_explore_interval(self, num_reqs: int, best: int, other: int, value: dict[int, float]) -> int:
        """Choices between bursts of ``other`` (the other side of the speculation switch) while ``best`` runs, so
        that the bursts cost at most ``SWITCH_EXPLORE_SHARE``: of the tokens (``value``: tokens per second by
        budget) for no drafts while speculating, at least ``SWITCH_EXPLORE_WHILE_ON``; of the time for trees while
        not speculating, at least ``SWITCH_EXPLORE_EVERY``."""
        if other == 0:
            loss = 1.0 - value.get(0, 0.0) / value[best] if value.get(best) else 0.0
            return max(SWITCH_EXPLORE_WHILE_ON, math.ceil(EXPLORE_BURST * loss / SWITCH_EXPLORE_SHARE))
        cost_best, cost_other = self.costs.cost(num_reqs, best), self.costs.cost(num_reqs, other)
        if not cost_best or not cost_other:
            return SWITCH_EXPLORE_EVERY
        return max(SWITCH_EXPLORE_EVERY, math.ceil(EXPLORE_BURST * cost_other / cost_best / SWITCH_EXPLORE_SHARE))

    def _start_burst(self, k: int) -> int:
        """Run ``k`` for ``EXPLORE_BURST`` consecutive steps: a step's time is observed only after a step of the
        same budget, whose tail (its outputs' bookkeeping) it then carries like every step in steady state."""
        self._burst = (k, EXPLORE_BURST - 1)
        return k


def describe_policy(policy: AdaptiveBudget, max_num_reqs: int) -> str:
    """One log line: the start-up choice at a few request counts, from the measured costs and optimistic
    acceptance (running acceptance moves it while serving)."""
    if policy.forced is not None:
        return f"forced cycle of budgets {list(policy.forced)} (VLLM_DDTREE_ADAPTIVE_FORCE)"
    points = sorted({r for r in (1, 4, 16, 64, 128, max_num_reqs) if r <= max_num_reqs})
    picks = []
    for r in points:
        ranked = policy.ranked(r)
        picks.append(f"{r} requests -> {ranked[0][1] if ranked else policy.budgets[-1]}")
    return f"budgets {list(policy.budgets)}; at start-up " + ", ".join(picks)


def timed_policy(
    run_step: Callable[[int, int], None],
    budgets: Sequence[int],
    max_num_reqs: int,
    fits: Callable[[int, int], bool],
    sync: Callable[[], None],
    device: torch.device,
    max_depth: int,
    scheduler_side: bool,
    offered: Callable[[int, int], bool] | None = None,
) -> AdaptiveBudget:
    """The policy of one runner: its start-up step timings (``measure_step_costs`` of the shapes that ``fits``;
    ``offered``: ``StepCosts``), fresh acceptance counts, and the forced cycle of ``VLLM_DDTREE_ADAPTIVE_FORCE`` if
    set; logged once. ``scheduler_side``: Model Runner V2's scheduler chooses (served steps are timed from its
    choices, ``ServedPeriods``) and steps without drafts write the drafter's context
    (``AdaptiveBudget.full_context``); else the runner observes its steps itself."""
    from vllm_ddtree import envs

    costs = StepCosts(measure_step_costs(run_step, budgets, max_num_reqs, fits, sync), offered)
    forced = envs.VLLM_DDTREE_ADAPTIVE_FORCE
    policy = AdaptiveBudget(
        budgets,
        costs,
        AcceptanceStats(budgets, device),
        max_depth,
        forced_budgets(forced, budgets) if forced else None,
        served=ServedPeriods() if scheduler_side else None,
        full_context=scheduler_side,
    )
    logger.info("DDTree adaptive budget: %s", describe_policy(policy, max_num_reqs))
    return policy


_LOCAL: list[AdaptiveBudget | None] = [None]
"""The policy of the engine whose worker runs in this process (Model Runner V2's scheduler reads it)."""


def register_local(policy: AdaptiveBudget | None) -> None:
    _LOCAL[0] = policy


def local_policy() -> AdaptiveBudget | None:
    return _LOCAL[0]


class SchedulerBudgets:
    """Stands in for vLLM's dynamic speculative-decoding lookup (``Scheduler.dynamic_sd_lookup[batch_size]``).

    With Model Runner V2 and a worker in the scheduler's process, ``[n]`` asks that worker's policy; otherwise
    (vLLM-CPU's worker process chooses its own budget; multi-process GPU executors) it is the configured budget.
    Being set at all also stops vLLM from padding new decodes with ``budget`` placeholder drafts.
    """

    def __init__(self, budget: int, ask_policy: bool) -> None:
        self.budget = budget
        self.ask_policy = ask_policy

    def __getitem__(self, batch_size: int) -> int:
        policy = local_policy() if self.ask_policy else None
        return self.budget if policy is None else policy.choose(batch_size)


def dynamic_sd_table(budgets: Sequence[int]) -> list[tuple[int, int, int]]:
    """A ``num_speculative_tokens_per_batch_size`` that names every candidate budget: vLLM's Model Runner V2
    captures FULL decode graphs for each budget in it (the batch-size ranges are placeholders: the scheduler's
    lookup is replaced by ``SchedulerBudgets``)."""
    return [(i + 1, i + 1, k) for i, k in enumerate(budgets)]
