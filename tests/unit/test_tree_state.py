"""Which batches DDTree's V1 adapter drafts and verifies as chains (exactness over speed)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_ddtree.config import DDTreeConfig
from vllm_ddtree.tree import DraftTrees, build_trees
from vllm_ddtree.v1.step_state import V1StepState, needs_chain


def _metadata(**overrides: object) -> SimpleNamespace:
    base = dict(
        max_num_logprobs=None,
        no_penalties=True,
        bad_words_token_ids={},
        allowed_token_ids_mask=None,
        logitsprocs=SimpleNamespace(
            non_argmax_invariant=[
                SimpleNamespace(min_toks={}),
                SimpleNamespace(biases={}),
                SimpleNamespace(min_p_count=0),
            ]
        ),
    )
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


def _state() -> V1StepState:
    return V1StepState(DDTreeConfig(budget=4, topk=2, max_depth=3), max_num_reqs=4, device=torch.device("cpu"))


def _trees(batch: int) -> DraftTrees:
    logprobs = torch.log_softmax(torch.randn(batch, 3, 2, generator=torch.Generator().manual_seed(0)), -1)
    ids = torch.arange(batch * 6).view(batch, 3, 2) + 10
    return build_trees(logprobs.sort(-1, descending=True).values, ids, 4)


def test_a_proposal_is_used_by_one_step_only() -> None:
    """Drafts that reach a later step (vLLM skipped the drafter in between) are verified as chains, not against an
    older step's trees."""
    state = _state()
    trees = _trees(2)
    state.record_proposal(["a", "b"], trees)
    drafts = [trees.node_tokens[0].tolist(), trees.node_tokens[1].tolist()]
    assert state.proposed_tree("a", drafts[0]) == 0
    state.begin_step(["a", "b"], drafts, torch.zeros(10, dtype=torch.int64), [0, 5, 10])
    assert state.proposed_tree("a", drafts[0]) is None
    state.record_proposal(["a"], trees)
    state.skip_step()
    assert state.proposed_tree("a", drafts[0]) is None


def test_the_v1_step_hook_drops_the_last_steps_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Paths belong to the step whose walk made them; vLLM skips the drafter that consumes them near the length
    limit, so the next step's hook drops them before any later proposer could apply them to another batch."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_ddtree.patches import v1

    v1.apply()
    monkeypatch.setattr(GPUModelRunner, "_orig__prepare_inputs", lambda self, *args: (None, None), raising=False)
    state = _state()
    state.paths = object()  # type: ignore[assignment]
    runner = SimpleNamespace(
        _ddtree_state=state,
        input_batch=SimpleNamespace(num_reqs=0, req_ids=[], generators={}),
        discard_request_mask=SimpleNamespace(np=np.zeros(4, dtype=bool)),
    )
    v1._prepare_inputs(runner, SimpleNamespace(scheduled_spec_decode_tokens={}), np.zeros(0, dtype=np.int32))
    assert state.paths is None


def test_swapping_two_requests_swaps_their_allowed_token_masks() -> None:
    """vLLM's own swap copies one mask row over the other (a tuple assignment of row views); with the seam both rows
    go where their requests went."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    from vllm_ddtree.patches import v1

    v1.apply()
    sizes = {"block_sizes": [16], "max_num_blocks_per_req": [4]}
    if "kernel_block_sizes" in inspect.signature(InputBatch).parameters:  # vLLM 0.26; 0.32 dropped it
        sizes["kernel_block_sizes"] = [16]
    batch = InputBatch(
        max_num_reqs=3,
        max_model_len=64,
        max_num_batched_tokens=64,
        device=torch.device("cpu"),
        vocab_size=5,
        **sizes,
    )
    batch._req_ids, batch.req_id_to_index = ["a", "b", "c"], {"a": 0, "b": 1, "c": 2}
    batch.req_output_token_ids = [[], [], []]
    batch.allowed_token_ids_mask_cpu_tensor = torch.zeros(3, 5, dtype=torch.bool)
    batch.allowed_token_ids_mask_cpu_tensor[0, 1] = True  # request 0 restricts its tokens; request 2 does not
    batch.swap_states(0, 2)
    assert batch.allowed_token_ids_mask_cpu_tensor[2].tolist() == [False, True, False, False, False]
    assert not batch.allowed_token_ids_mask_cpu_tensor[0].any()
