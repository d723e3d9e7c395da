"""Model Runner V1's DDTree drafter (vLLM-CPU; CI runs DDTree end to end through it).

``DDTreeProposer`` is a ``DFlashProposer`` whose drafter pass always predicts ``max_depth`` positions, whatever the
node budget, and whose output is the ``[B, budget]`` node tokens of the trees in topological order. Before drafting
it rewrites the drafter's context to the accepted path: the target hidden states of path nodes are permuted into
path order and positions are made linear again, so DFlash sees exactly the history the scheduler believes in.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree.accept import AcceptedPaths, path_permutation
from vllm_ddtree.adaptive import AdaptiveBudget, timed_policy
from vllm_ddtree.config import DDTreeConfig, get_ddtree_config
from vllm_ddtree.draft_topk import topk_logprobs
from vllm_ddtree.tree import DraftTrees, build_trees
from vllm_ddtree.v1.step_state import V1StepState, needs_chain

CPU_TIMING_MAX_TOKENS = 1024
"""Largest dummy step timed at start-up on vLLM-CPU (larger batches follow the last timings' slope)."""
IDLE_GAP_FACTOR = 20.0
"""A time between proposals beyond this many predicted steps (plus a second) was an idle engine, not a step."""


def path_context(
    hidden: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor, paths: AcceptedPaths
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter context after a tree verify: hidden rows in path order, linear positions (base + row)."""
    batch = paths.num_accepted.shape[0]
    qsl = query_start_loc[: batch + 1].to(torch.int64)
    index = path_permutation(qsl[:-1], paths, hidden.shape[0])
    lengths = qsl[1:] - qsl[:-1]
    starts = torch.repeat_interleave(qsl[:-1], lengths, output_size=int(qsl[-1]))
    base = torch.repeat_interleave(positions[qsl[:-1]], lengths, output_size=int(qsl[-1]))
    linear = positions.clone()
    linear[: int(qsl[-1])] = base + torch.arange(int(qsl[-1]), device=positions.device) - starts
    return hidden[index], linear


class DDTreeProposer(DFlashProposer):
    """V1 DFlash proposer that drafts DDTree trees (used on vLLM-CPU)."""

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None) -> None:
        ddtree = get_ddtree_config(vllm_config)
        assert ddtree is not None, "DDTreeProposer needs a ddtree speculative config"
        # Buffers sized for budget+1 queries per request also hold the drafter's 1+max_depth (max_depth <= budget).
        super().__init__(vllm_config, device, runner)
        self.ddtree: DDTreeConfig = ddtree
        self.runner = runner
        self.state = V1StepState(ddtree, vllm_config.scheduler_config.max_num_seqs, device)
        self._trees: DraftTrees | None = None
        self._chain = False
        self._next_budget = ddtree.budget

    def _greedy_sample(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Instead of DFlash's argmax chain: per-depth top-k of the drafter's D positions, then the trees (the
        argmax chain itself, K = 1, for batches that must be verified as chains)."""
        depth, budget = self.ddtree.max_depth, self.ddtree.budget
        logits = self.model.compute_logits(hidden_states)
        logprobs, ids = topk_logprobs(logits, 1 if self._chain else self.ddtree.topk)
        batch = hidden_states.shape[0] // depth
        self._trees = build_trees(logprobs.view(batch, depth, -1), ids.view(batch, depth, -1), budget)
        return ids[:, 0]

    def _has_structured_output(self, batch: int) -> bool:
        requests = self.runner.requests
        return any(
            getattr(requests[req_id].sampling_params, "structured_outputs", None) is not None
            for req_id in self.runner.input_batch.req_ids[:batch]
            if req_id in requests and requests[req_id].sampling_params is not None
        )

    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: Any,
        sampling_metadata: Any,
        mm_embed_inputs: Any = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings: Any = None,
    ) -> torch.Tensor:
        """The next step's drafts: the first ``k`` nodes of each request's tree, ``k`` the configured budget or
        the adaptive budget's choice for this batch (``choose_budget``; for 0 the runner seam never calls this)."""
        batch = common_attn_metadata.batch_size()
        budget = self._next_budget if self.state.adaptive is not None else self.ddtree.budget
        self._chain = needs_chain(sampling_metadata, self._has_structured_output(common_attn_metadata.batch_size()))
        paths = self.state.paths
        if paths is not None:
            target_hidden_states, target_positions = path_context(
                target_hidden_states, target_positions, common_attn_metadata.query_start_loc, paths
            )
            self.state.paths = None
        super().propose(
            self.ddtree.max_depth,
            target_token_ids,
            target_positions,
            target_hidden_states,
            next_token_ids,
            token_indices_to_sample,
            common_attn_metadata,
            sampling_metadata,
            mm_embed_inputs,
            num_rejected_tokens_gpu,
            slot_mappings,
        )
        self.num_speculative_tokens = self.ddtree.budget
        assert self._trees is not None
        self.state.record_proposal(list(self.runner.input_batch.req_ids[:batch]), self._trees)
        return self._trees.node_tokens[:, :budget]

    def choose_budget(self, batch: int) -> int:
        """The next step's budget (the runner asks before vLLM prepares the drafter's inputs): the configured one,
        or the adaptive budget's choice after folding in the step that just ran; 0 voids this step's paths and
        proposal (nothing will consume them)."""
        policy = self.state.adaptive
        if policy is None:
            return self.ddtree.budget
        self._observe_step(policy)
        self._next_budget = policy.choose(batch)
        if self._next_budget == 0:
            self.state.paths = None
            self.state.skip_step()
        return self._next_budget

    def _observe_step(self, policy: AdaptiveBudget) -> None:
        """The time since the last proposal is one whole engine step (vLLM-CPU runs synchronously), the previous
        step's tail included: a uniform decode step after one of the same shape corrects the cost model of its
        budget; idle gaps (far beyond the model) are dropped."""
        now = time.perf_counter()
        last, self.state.last_propose_time = self.state.last_propose_time, now
        shape, previous = self.state.step_shape, self.state.previous_shape
        self.state.previous_shape = shape
        if last is None or shape is None or shape != previous:
            return
        num_reqs, budget = shape
        predicted = policy.costs.predicted(num_reqs, budget)
        expected = None if predicted is None else predicted * policy.costs.scale(budget, num_reqs)
        if expected is not None and now - last < IDLE_GAP_FACTOR * expected + 1.0:
            policy.costs.observe(num_reqs, budget, now - last)

    def init_adaptive_budget(self, runner: Any) -> None:
        """After warm-up: time a dummy decode step of every candidate budget (the drafter pass sized as it runs:
        ``1 + max_depth`` queries a request; none for budget 0) and hold the policy."""
        self.state.adaptive = None
        if not self.ddtree.adaptive_budget:
            return
        budgets = self.ddtree.budgets
        depth = self.ddtree.max_depth
        max_tokens = min(runner.max_num_tokens, CPU_TIMING_MAX_TOKENS)
        self.state.adaptive = timed_policy(
            lambda r, k: self._dummy_decode_step(runner, r, k),
            budgets,
            runner.scheduler_config.max_num_seqs,
            lambda r, k: r * (max(k, depth) + 1) <= max_tokens,
            lambda: None,
            self.device,
            depth,
            scheduler_side=False,  # _observe_step
        )

    @torch.inference_mode()
    def _dummy_decode_step(self, runner: Any, num_reqs: int, budget: int) -> None:
        saved = runner.uniform_decode_query_len
        dummy_run = self.dummy_run
        depth = self.ddtree.max_depth

        def drafter_pass(num_tokens: int, *args: Any, **kwargs: Any) -> None:
            if budget > 0:
                dummy_run(num_reqs * (depth + 1), *args, **kwargs)

        runner.uniform_decode_query_len = budget + 1
        self.dummy_run = drafter_pass
        try:
            runner._dummy_run(num_reqs * (budget + 1), uniform_decode=True)
        finally:
            runner.uniform_decode_query_len = saved
            del self.dummy_run
