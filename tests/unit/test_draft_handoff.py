"""The drafts handed back with the step's output (``patches/draft_handoff.py``): the engine core's ``post_step``
gets exactly the drafts the worker's RPC would have returned, only for the step that just ran, and vLLM's RPC is
still used for outputs that carry none."""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_ddtree.patches import draft_handoff
from vllm_ddtree.v1.proposer import DDTreeProposer

draft_handoff.apply()


def _output() -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}, sampled_token_ids=[[5], [6]])


def _runner(drafter: Any, async_scheduling: bool = False) -> SimpleNamespace:
    """The runner attributes the worker half reads; the batch's live id list is what vLLM's runner hands over."""
    live_ids = ["a", "b"]
    runner = SimpleNamespace(drafter=drafter, use_async_scheduling=async_scheduling, live_ids=live_ids)
    runner.take_draft_token_ids = lambda: DraftTokenIds(live_ids, [[7, 8], []])
    return runner


def test_worker_attaches_this_steps_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GPUModelRunner, "_orig_sample_tokens", lambda self, grammar: _output())
    runner = _runner(DDTreeProposer.__new__(DDTreeProposer))
    output = draft_handoff._runner_sample_tokens(runner, None)
    runner.live_ids.append("c")  # the next step's batch: the reply holds this step's ids
    received = pickle.loads(pickle.dumps(output))  # as the engine core gets it from the worker's reply
    drafts = getattr(received, draft_handoff.DRAFTS_ATTR)
    assert (drafts.req_ids, drafts.draft_token_ids) == (["a", "b"], [[7, 8], []])
    assert received.sampled_token_ids == [[5], [6]]


@pytest.mark.parametrize(("drafter", "async_scheduling"), [(None, False), ("ddtree", True)])
def test_worker_leaves_other_outputs_alone(
    monkeypatch: pytest.MonkeyPatch, drafter: Any, async_scheduling: bool
) -> None:
    """vLLM's own drafters (and no speculation) keep vLLM's RPC; async scheduling has no post_step RPC."""
    monkeypatch.setattr(GPUModelRunner, "_orig_sample_tokens", lambda self, grammar: _output())
    proposer = DDTreeProposer.__new__(DDTreeProposer) if drafter == "ddtree" else drafter
    output = draft_handoff._runner_sample_tokens(_runner(proposer, async_scheduling), None)
    assert not hasattr(output, draft_handoff.DRAFTS_ATTR)


class _Executor(MultiprocExecutor):
    """A MultiprocExecutor without workers: its RPCs are counted stubs."""

    def __init__(self, reply: ModelRunnerOutput) -> None:
        self.reply = reply
        self.rpcs: list[str] = []


@pytest.fixture
def executor(monkeypatch: pytest.MonkeyPatch) -> _Executor:
    def rpc(name: str, result: Any) -> Any:
        def call(self: _Executor, *args: Any, **kwargs: Any) -> Any:
            self.rpcs.append(name)
            return result(self) if callable(result) else result

        return call

    monkeypatch.setattr(MultiprocExecutor, "_orig_execute_model", rpc("execute_model", None))
    monkeypatch.setattr(MultiprocExecutor, "_orig_sample_tokens", rpc("sample_tokens", lambda self: self.reply))
    from_worker = DraftTokenIds(["rpc"], [[1]])
    monkeypatch.setattr(MultiprocExecutor, "_orig_take_draft_token_ids", rpc("take_draft_token_ids", from_worker))
    return _Executor(_output())


def test_engine_core_takes_attached_drafts_without_an_rpc(executor: _Executor) -> None:
    drafts = DraftTokenIds(["a", "b"], [[7, 8], []])
    setattr(executor.reply, draft_handoff.DRAFTS_ATTR, drafts)
    executor.execute_model(None, non_block=True)
    output = executor.sample_tokens(None)
    assert not hasattr(output, draft_handoff.DRAFTS_ATTR)  # the scheduler sees vLLM's output as it was
    assert executor.take_draft_token_ids() is drafts
    assert executor.rpcs == ["execute_model", "sample_tokens"]
    assert executor.take_draft_token_ids().req_ids == ["rpc"]  # a second ask is the worker's to answer


def test_attached_none_means_no_drafts(executor: _Executor) -> None:
    setattr(executor.reply, draft_handoff.DRAFTS_ATTR, None)
    executor.sample_tokens(None)
    assert executor.take_draft_token_ids() is None
    assert "take_draft_token_ids" not in executor.rpcs


def test_drafts_left_unasked_do_not_outlive_their_step(executor: _Executor) -> None:
    setattr(executor.reply, draft_handoff.DRAFTS_ATTR, DraftTokenIds(["old"], [[9]]))
    executor.sample_tokens(None)
    executor.reply = _output()  # the next step's output carries none (vLLM's own path)
    executor.execute_model(None)
    assert executor.take_draft_token_ids().req_ids == ["rpc"]
