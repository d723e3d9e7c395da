"""bench/step_time.py's report (rounds combine into one row, ratios use the medians) and the probes the benches
install in the engine's process."""

from __future__ import annotations

import argparse
import json
import os
import sys
from itertools import pairwise
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import step_time  # noqa: E402


def row(method: str, budget: int, step_ms: float, round_index: int, replays: int | None = 10) -> dict:
    return {
        "method": method,
        "budget": budget,
        "width": budget + 1,
        "context": 4096,
        "batch": 1,
        "step_ms": step_ms,
        "samples_ms": [step_ms],
        "steps": 30,
        "verify_graph_replays": replays,
        "draft_graph_replays": replays,
        "round": round_index,
    }


def test_rounds_combine_to_their_median_and_ratios_use_it(tmp_path: Path) -> None:
    rows = [row("dflash", 16, ms, i) for i, ms in enumerate([4.0, 3.0, 5.0])]
    rows += [row("ddtree", 16, ms, i) for i, ms in enumerate([3.5, 9.0, 4.2])]
    rows += [row("dflash-v1", 16, ms, i, None) for i, ms in enumerate([14.0, 14.0, 16.0])]
    rows += [row("dflash-v1-plain", 16, ms, i, None) for i, ms in enumerate([20.0, 21.0, 19.0])]
    args = argparse.Namespace(target="kimi-mla", rounds=3, out=tmp_path / "r.json", paired=True, pin=False)
    table = step_time._write(args, rows)
    by_method = {r["method"]: r for r in table}
    assert len(table) == 4 and all("round" not in r for r in table)
    assert by_method["ddtree"]["round_ms"] == [3.5, 9.0, 4.2] and by_method["ddtree"]["step_ms"] == 4.2
    assert by_method["ddtree"]["vs_chain"] == round(4.2 / 4.0, 3)
    assert by_method["ddtree"]["vs_chain_v1"] == round(4.2 / 14.0, 3)
    assert by_method["ddtree"]["vs_chain_v1_plain"] == round(4.2 / 20.0, 3)
    assert by_method["ddtree"]["vs_chain_pairs"] == 0.875  # median of 3.5/4, 9/3, 4.2/5: the slow round outvoted
    assert by_method["ddtree"]["vs_chain_q1"] == round(3.5 / 3.0, 3)
    assert by_method["dflash"]["vs_chain_q1"] is None and by_method["dflash"]["vs_chain_pairs"] is None
    assert by_method["dflash-v1"]["vs_chain_v1_plain"] is None  # only ddtree rows compare with the V1 chains
    assert by_method["ddtree"]["vs_chain_v1_plain_pairs"] == round(4.2 / 19.0, 3)  # 3.5/20, 9/21, 4.2/19
    assert by_method["dflash-v1"]["vs_chain_v1_plain_q1"] is None
    assert by_method["ddtree"]["steps"] == 90 and by_method["ddtree"]["verify_graph_replays"] == 30
    assert by_method["dflash-v1"]["verify_graph_replays"] is None
    written = json.loads(args.out.read_text())
    assert written["rounds"] == 3 and written["rows"] == table and written["engines"] == "paired"
    assert set(written["meta"]) == {"commit", "vllm", "torch", "gpu"}


@pytest.mark.e2e
def test_probes_reach_the_engine_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The benches' step clock works where vLLM runs the model (a separate engine process, as when serving), and
    times the worker's part of each step."""
    from engine_probes import engine_process_env, install_probes, read_probes, run_on_worker, shut_down
    from kit import tiny_models
    from vllm import LLM, SamplingParams

    for key, value in {**engine_process_env(inline=False), "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
        monkeypatch.setenv(key, value)
    target = tiny_models.write_target(tmp_path / "target")
    llm = LLM(
        model=str(target),
        skip_tokenizer_init=True,
        max_model_len=256,
        dtype="float32",
        max_num_seqs=2,
        max_num_batched_tokens=256,
        seed=0,
    )
    run_on_worker(llm, install_probes, inline=False)
    llm.generate([{"prompt_token_ids": list(range(2, 30))}], SamplingParams(max_tokens=12, ignore_eos=True))
    probes = run_on_worker(llm, read_probes, inline=False)
    assert len(probes.starts) >= 12 and probes.starts == sorted(probes.starts)
    # every step's time inside execute_model + sample_tokens, shorter than the step interval it falls in
    assert len(probes.busy) == len(probes.starts) and all(b > 0 for b in probes.busy)
    assert all(b <= end - start for b, (start, end) in zip(probes.busy, pairwise(probes.starts), strict=False))
    assert probes.verify == probes.draft == 0  # a V1 runner has no graph manager to count
    assert run_on_worker(llm, read_probes, inline=False).starts == []  # a read resets the clock
    shut_down(llm)


FAKE_CHILD = """
import json, sys
name, log = sys.argv[1], sys.argv[2]
print("vLLM-like log line", flush=True)
print("READY", flush=True)
cell, repeats = None, 0
for line in sys.stdin:
    command = line.split()
    with open(log, "a") as f:
        f.write(f"{name} {line.strip()}\\n")
    if command[0] == "cell":
        cell, repeats = [int(v) for v in command[1:]], 0
        print("OK", flush=True)
    elif command[0] == "repeat":
        if name == "broken":
            sys.exit("the engine stopped")
        repeats += 1
        print("OK", flush=True)
    else:
        print("RESULT " + json.dumps({"method": name, "context": cell[0], "batch": cell[1], "repeats": repeats}),
              flush=True)
"""


def _fake_children(tmp_path: Path, names: list[str]) -> tuple[list, Path]:
    from paired_children import Child

    script, log = tmp_path / "child.py", tmp_path / "log.txt"
    script.write_text(FAKE_CHILD)
    return [Child([sys.executable, str(script), name, str(log)], name) for name in names], log


def test_paired_children_alternate_their_repeats(tmp_path: Path) -> None:
    """Every child prepares a cell before any is timed, the timed repeats alternate with a rotating first child, and
    each child reports its row for the cell; one command at a time, so no two engines ever work at once."""
    from paired_children import interleaved_rows

    children, log = _fake_children(tmp_path, ["chain", "tree"])
    rows = interleaved_rows(children, [(4096, 1), (32768, 16)], repeats=3)
    for child in children:
        child.close()
    assert rows == [
        {"method": m, "context": c, "batch": b, "repeats": 3}
        for c, b in [(4096, 1), (32768, 16)]
        for m in ("chain", "tree")
    ]
    cell = [
        "chain cell {}",
        "tree cell {}",
        "chain repeat",
        "tree repeat",
        "tree repeat",
        "chain repeat",
        "chain repeat",
        "tree repeat",
        "chain row",
        "tree row",
    ]
    want = [c.format("4096 1") for c in cell] + [c.format("32768 16") for c in cell]
    assert log.read_text().splitlines() == want


def test_a_paired_child_that_dies_names_itself_and_its_error(tmp_path: Path) -> None:
    from paired_children import ChildDied, interleaved_rows

    children, _ = _fake_children(tmp_path, ["chain", "broken"])
    with pytest.raises(ChildDied, match=r"(?s)broken exited \(rc 1\) while waiting for OK.*the engine stopped"):
        interleaved_rows(children, [(4096, 1)], repeats=2)
    for child in children:
        child.close()


def test_core_sets_split_whole_physical_cores_evenly() -> None:
    from paired_children import core_sets

    siblings = {c: {c % 5, c % 5 + 5} for c in range(10)}  # 5 cores, SMT pairs (c, c + 5)
    assert core_sets(2, set(range(10)), siblings) == [frozenset({0, 5, 1, 6, 2, 7}), frozenset({3, 8, 4, 9})]
    assert core_sets(1, {0, 5, 3}, siblings) == [frozenset({0, 5, 3})]  # only the allowed CPUs of a core
    with pytest.raises(ValueError, match="a physical core per engine: 3 engines, 2 cores"):
        core_sets(3, {0, 5, 3}, siblings)


def test_a_pinned_child_runs_on_its_cpus(tmp_path: Path) -> None:
    """The affinity reaches the child process (and so its engine core, which inherits it)."""
    from paired_children import Child

    script = tmp_path / "child.py"
    script.write_text(
        "import json, os, sys\nprint('READY', flush=True)\nfor line in sys.stdin:\n"
        "    print('RESULT ' + json.dumps({'cpus': sorted(os.sched_getaffinity(0))}), flush=True)\n"
    )
    cpu = min(os.sched_getaffinity(0))
    child = Child([sys.executable, str(script)], "pinned", cpus=frozenset({cpu}))
    assert child.row() == {"cpus": [cpu]}
    child.close()


def test_paired_groups_pair_the_v2_chain_with_ddtree_per_budget() -> None:
    configs = [
        ("none", 0),
        ("dflash", 8),
        ("dflash-v1", 8),
        ("ddtree", 8),
        ("ddtree-own", 8),
        ("dflash", 16),
        ("dflash-v1-plain", 16),
        ("ddtree", 16),
    ]
    assert step_time.paired_groups(configs) == [
        [("none", 0)],
        [("dflash-v1", 8)],
        [("dflash-v1-plain", 16)],
        [("dflash", 8), ("ddtree", 8), ("ddtree-own", 8)],
        [("dflash", 16), ("ddtree", 16)],
    ]
    assert step_time.paired_groups([("none", 0)]) == [[("none", 0)]]
    assert step_time.paired_groups(configs, chains=("dflash-v1-plain",)) == [
        [("none", 0)],
        [("dflash", 8)],
        [("dflash-v1", 8)],
        [("dflash", 16)],
        [("ddtree", 8), ("ddtree-own", 8)],
        [("dflash-v1-plain", 16), ("ddtree", 16)],
    ]


def test_python_time_by_function_splits_inclusive_and_self_time(tmp_path: Path) -> None:
    from engine_probes import python_time_by_function

    def call(name: str, ts: float, dur: float, tid: int = 1) -> dict:
        return {"cat": "python_function", "ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid}

    step, propose, walk = "vllm/worker.py(1): execute_model", "vllm_ddtree/speculator.py(2): propose", "x.py(3): walk"
    events = [
        call(step, 0, 1000),
        call(propose, 100, 600),
        call(walk, 200, 100),
        call(step, 2000, 500),
        call(step, 0, 50, tid=2),
        {"cat": "kernel", "ph": "X", "name": "k", "ts": 0, "dur": 9},
    ]
    trace = tmp_path / "t.trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    lines = python_time_by_function(str(trace)).splitlines()[1:]
    assert not trace.exists()
    assert [line.split() for line in lines] == [
        ["1.55", "ms", "0.95", "ms", "self", "3", "calls", *step.split()],
        ["0.60", "ms", "0.50", "ms", "self", "1", "calls", *propose.split()],
    ]


def test_robust_ratios_pair_repeats_only_when_the_engines_alternated() -> None:
    chain, ddtree = [2.6, 2.6, 3.9, 3.9, 2.6], [2.7, 2.7, 4.0, 4.0, 3.9]
    assert step_time.robust_ratios(ddtree, chain, paired=True)["vs_chain_pairs"] == round(2.7 / 2.6, 3)
    assert step_time.robust_ratios(ddtree, chain, paired=False) == {
        "vs_chain_q1": round(2.7 / 2.6, 3),
        "vs_chain_pairs": None,
    }
    assert step_time.robust_ratios([2.7], [2.6], paired=True) == {"vs_chain_q1": None, "vs_chain_pairs": None}
    assert step_time.robust_ratios(ddtree, chain, paired=True, key="vs_chain_v1_plain") == {
        "vs_chain_v1_plain_q1": round(2.7 / 2.6, 3),
        "vs_chain_v1_plain_pairs": round(2.7 / 2.6, 3),
    }
