"""bench/step_time.py's report (rounds combine into one row, ratios use the medians) and the probes the benches
install in the engine's process."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import step_time  # noqa: E402


def row(method: str, budget: int, step_ms: float, round_index: int, replays: int | None = 10) -> dict:
    return {"method": method, "budget": budget, "width": budget + 1, "context": 4096, "batch": 1, "step_ms": step_ms,
            "samples_ms": [step_ms], "steps": 30, "verify_graph_replays": replays, "draft_graph_replays": replays,
            "round": round_index}  # fmt: skip


def test_rounds_combine_to_their_median_and_ratios_use_it(tmp_path: Path) -> None:
    rows = [row("dflash", 16, ms, i) for i, ms in enumerate([4.0, 3.0, 5.0])]
    rows += [row("ddtree", 16, ms, i) for i, ms in enumerate([3.5, 9.0, 4.2])]
    rows += [row("dflash-v1", 16, ms, i, None) for i, ms in enumerate([14.0, 14.0, 16.0])]
    args = argparse.Namespace(target="kimi-mla", rounds=3, out=tmp_path / "r.json")
    table = step_time._write(args, rows)
    by_method = {r["method"]: r for r in table}
    assert len(table) == 3 and all("round" not in r for r in table)
    assert by_method["ddtree"]["round_ms"] == [3.5, 9.0, 4.2] and by_method["ddtree"]["step_ms"] == 4.2
    assert by_method["ddtree"]["vs_chain"] == round(4.2 / 4.0, 3)
    assert by_method["ddtree"]["vs_chain_v1"] == round(4.2 / 14.0, 3)
    assert by_method["ddtree"]["steps"] == 90 and by_method["ddtree"]["verify_graph_replays"] == 30
    assert by_method["dflash-v1"]["verify_graph_replays"] is None
    written = json.loads(args.out.read_text())
    assert written["rounds"] == 3 and written["rows"] == table


@pytest.mark.e2e
def test_probes_reach_the_engine_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The benches' step clock works where vLLM runs the model (a separate engine process, as when serving)."""
    from engine_probes import engine_process_env, install_probes, read_probes, run_on_worker, shut_down
    from vllm import LLM, SamplingParams

    from vllm_ddtree import tiny_models

    for key, value in {**engine_process_env(inline=False), "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
        monkeypatch.setenv(key, value)
    target = tiny_models.write_target(tmp_path / "target")
    llm = LLM(model=str(target), skip_tokenizer_init=True, max_model_len=256, dtype="float32", max_num_seqs=2,
              max_num_batched_tokens=256, seed=0)  # fmt: skip
    run_on_worker(llm, install_probes, inline=False)
    llm.generate([{"prompt_token_ids": list(range(2, 30))}], SamplingParams(max_tokens=12, ignore_eos=True))
    starts, verify, draft = run_on_worker(llm, read_probes, inline=False)
    assert len(starts) >= 12 and starts == sorted(starts)
    assert verify == draft == 0  # a V1 runner has no graph manager to count
    assert run_on_worker(llm, read_probes, inline=False)[0] == []  # a read resets the clock
    shut_down(llm)
