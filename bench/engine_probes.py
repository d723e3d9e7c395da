"""How the benches set up vLLM's engine and the probes they install where its model runner lives: the FULL-graph
capture sizes, a step clock, FULL-graph replay counters, a profiler.

The benches run the engine core in its own process, as ``vllm serve`` does, so the probes travel there as functions
through ``LLM.collective_rpc`` (which vLLM accepts only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``); with
``inline`` the engine core runs inside the bench's process and the same functions are called on its worker directly.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, NamedTuple


def engine_process_env(inline: bool) -> dict[str, str]:
    """Environment for an engine whose worker the probes can reach (set before vLLM builds the engine). The engine
    process is spawned, not forked: the bench has touched CUDA by then, and a forked child cannot use it."""
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if inline else "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    }


def full_graph_sizes(batches: Iterable[int], method: str | None, budget: int, drafter_block: int) -> list[int]:
    """Token counts to capture FULL graphs for, so every decode step of the given batch sizes replays one: the verify
    width (1 + budget with speculation) and the drafter's (ddtree's drafter runs 1 + depth tokens a request whatever
    the budget; vLLM's chain drafter runs the verify width)."""
    width = 1 + budget if method else 1
    draft_width = 1 + min(budget, drafter_block - 1) if method == "ddtree" else width
    return sorted({n * w for n in batches for w in (width, draft_width)})


def run_on_worker(llm: Any, fn: Any, inline: bool) -> Any:
    """``fn(worker)`` on the (single) worker of ``llm``'s engine, wherever it runs."""
    if inline:
        return fn(llm.llm_engine.engine_core.engine_core.model_executor.driver_worker)
    return llm.collective_rpc(fn)[0]


def spec_decode_counters(llm: Any) -> dict[str, float]:
    """An in-process engine's ``vllm:spec_decode*`` counters (``vllm.LLM.get_metrics``); differences of two
    readings are a run's drafts and accepted tokens."""
    return {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")}


def shut_down(llm: Any) -> None:
    """Stop the engine and wait for its process to exit, so the next configuration's engine finds the GPU memory
    free (vLLM would otherwise stop it only at interpreter exit)."""
    llm.llm_engine.engine_core.shutdown(timeout=60)


class StepClock:
    """Per step of the model runner: when it starts (``execute_model`` is entered) and how long the worker spends
    inside ``execute_model`` and ``sample_tokens`` (host work, plus any wait on the GPU those calls make): with
    async scheduling a host-bound step lasts about that long, so comparing it between configurations shows whose
    host work sets the pace. Wraps the two methods of this runner instance only."""

    def __init__(self, runner: Any) -> None:
        self.starts: list[float] = []
        self.busy: list[float] = []
        run, sample = runner.execute_model, getattr(runner, "sample_tokens", None)

        def timed_run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            self.starts.append(start)
            try:
                return run(*args, **kwargs)
            finally:
                self.busy.append(time.perf_counter() - start)

        def timed_sample(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return sample(*args, **kwargs)
            finally:
                if self.busy:
                    self.busy[-1] += time.perf_counter() - start

        runner.execute_model = timed_run
        if sample is not None:
            runner.sample_tokens = timed_sample


class ProbeReading(NamedTuple):
    starts: list[float]  # step start times (s)
    busy: list[float]  # per step, seconds inside execute_model + sample_tokens
    verify: int  # FULL-graph replays of the verify step
    draft: int  # ... and of the drafter step
    context_kv: int  # ... and of ddtree's drafter context K/V write (0 without ddtree on V2)
    combine: int  # ... and of ddtree's combine of the target's auxiliary hidden states (0 likewise)


def install_probes(worker: Any) -> None:
    """A step clock and FULL-graph replay counters (verify, drafter; none on V1 runners) on the worker's runner."""
    from vllm_ddtree.v2.graphs import ReplayCounter

    runner = worker.model_runner
    speculator = getattr(runner, "speculator", None)
    worker.ddtree_probes = (
        StepClock(runner),
        ReplayCounter(getattr(runner, "cudagraph_manager", None)),
        ReplayCounter(getattr(speculator, "query_cudagraph_manager", None)),
        getattr(speculator, "context_kv_graphs", None),
        getattr(speculator, "combine_graphs", None),
    )


def read_probes(worker: Any) -> ProbeReading:
    """Steps and graph replays since the last read, which resets them."""
    clock, verify, draft, *graphs = worker.ddtree_probes
    read = ProbeReading(
        list(clock.starts),
        list(clock.busy),
        verify.count,
        draft.count,
        *(g.replays if g is not None else 0 for g in graphs),
    )
    clock.starts.clear()
    clock.busy.clear()
    verify.count = draft.count = 0
    for g in graphs:
        if g is not None:
            g.replays = 0
    return read


def kv_capacity(worker: Any) -> float:
    """How many requests of ``max_model_len`` tokens the worker's KV cache holds at once (vLLM's own count, the
    "maximum concurrency" it logs): a bench whose batch exceeds it would time preemptions, not decode steps."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    return get_max_concurrency_for_kv_cache_config(worker.vllm_config, worker.model_runner.kv_cache_config)


def start_profiler(worker: Any, with_stack: bool = False) -> None:
    """``with_stack`` also records every Python call (slower host, but its trace says which function the host time
    of a step goes to)."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    worker.ddtree_profiler = torch.profiler.profile(activities=activities, with_stack=with_stack)
    worker.ddtree_profiler.__enter__()


def stop_profiler(worker: Any, trace: str | None = None) -> str:
    """Kernels and host ops of the engine's process since ``start_profiler``, as two tables, then the 12 kernels of
    most GPU time with their full names and per-call microseconds (min / median / max): the tables cut template
    names, and a mean hides whether every call or a few got slower. ``trace``: also write the Chrome trace there."""
    import statistics

    import torch

    prof = worker.ddtree_profiler
    prof.__exit__(None, None, None)
    if trace:
        prof.export_chrome_trace(trace)
        return python_time_by_function(trace)
    calls: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            calls.setdefault(event.name, []).append(event.time_range.elapsed_us())
    top = sorted(calls.items(), key=lambda item: -sum(item[1]))[:12]
    lines = [
        f"{sum(us):10.0f} us {len(us):5d} calls  min/median/max {min(us):8.1f} {statistics.median(us):8.1f} "
        f"{max(us):8.1f}  {name}"
        for name, us in top
    ]
    averages = prof.key_averages()
    tables = [averages.table(sort_by=key, row_limit=40) for key in ("self_cuda_time_total", "cpu_time_total")]
    return "\n".join([*tables, *lines]) + "\n"


def python_time_by_function(trace: str, top: int = 80) -> str:
    """Host time of a ``with_stack`` Chrome trace by Python function (inclusive and self ms, calls), the ``top`` of
    most inclusive time among vLLM's, this plugin's and torch's CUDA-graph functions. The trace itself is deleted:
    with every Python call in it, it is too large to bring back from a lent machine."""
    import json
    from pathlib import Path

    path = Path(trace)
    events = [
        e
        for e in json.loads(path.read_text())["traceEvents"]
        if e.get("cat") == "python_function" and e.get("ph") == "X"
    ]
    path.unlink()
    inclusive: dict[str, float] = {}
    own: dict[str, float] = {}
    calls: dict[str, int] = {}
    by_thread: dict[Any, list[dict]] = {}
    for event in events:
        by_thread.setdefault(event.get("tid"), []).append(event)
    for thread_events in by_thread.values():
        stack: list[dict] = []
        for event in sorted(thread_events, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= event["ts"]:
                stack.pop()
            name = event["name"]
            inclusive[name] = inclusive.get(name, 0.0) + event["dur"]
            own[name] = own.get(name, 0.0) + event["dur"]
            calls[name] = calls.get(name, 0) + 1
            if stack:
                own[stack[-1]["name"]] -= event["dur"]
            stack.append(event)
    wanted = [n for n in inclusive if "vllm" in n or "ddtree" in n or "cuda/graphs" in n]
    lines = [
        f"{inclusive[n] / 1e3:10.2f} ms {own[n] / 1e3:9.2f} ms self {calls[n]:6d} calls  {n}"
        for n in sorted(wanted, key=lambda n: -inclusive[n])[:top]
    ]
    return "Python functions (with_stack trace), inclusive / self host time:\n" + "\n".join(lines) + "\n"
