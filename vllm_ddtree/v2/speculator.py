"""Model Runner V2's DDTree drafter (GPUs): one DFlash pass of depth D, per-depth top-k log-probs, best-first trees.

``DDTreeSpeculator`` is a ``DFlashSpeculator`` whose captured ``_generate_draft`` also takes the top-k and builds the
trees, so the whole drafter step replays as one FULL CUDA graph; the trees go to the persistent buffers of its step
state (``step``), indexed by request state. Before drafting it turns the verify step back into the accepted path:
linear positions, and the path nodes' target hidden states permuted into path order. Before a step without drafts
(the adaptive budget's 0) it writes the step's context into the drafter's cache and skips the drafter pass, so the
drafter's context has no holes when trees come back.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_ddtree.accept import AcceptedPaths
from vllm_ddtree.adaptive import register_local, timed_policy
from vllm_ddtree.config import DDTreeConfig, get_ddtree_config
from vllm_ddtree.draft_topk import topk_logprobs
from vllm_ddtree.patches.v2 import install_context_kv_graphs
from vllm_ddtree.tree import DraftTrees, build_trees
from vllm_ddtree.tree_mask import install_tree_masks
from vllm_ddtree.v2.graphs import CombineGraphs, ContextKVGraphs, decode_context_sizes
from vllm_ddtree.v2.step_state import V2StepState
from vllm_ddtree.v2.verify_layout import restore_path_context

logger = logging.getLogger("vllm.ddtree")


def build_trees_with_chains(
    topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, budget: int, chain_rows: torch.Tensor
) -> DraftTrees:
    """The batch's trees, except that rows flagged in ``chain_rows`` get the argmax chain: their candidates past
    top-1 score -inf, so the chain's nodes are selected first (nodes 1..D, topological), and their node count is
    capped at the depth so the -inf nodes that fill the budget are never verified. Static shapes, no sync."""
    depth, topk = topk_logprobs.shape[1:]
    not_first = torch.arange(topk, device=topk_logprobs.device) > 0
    masked = topk_logprobs.masked_fill(chain_rows[:, None, None] & not_first[None, None, :], float("-inf"))
    trees = build_trees(masked, topk_ids, budget)
    num_nodes = torch.where(chain_rows, trees.num_nodes.clamp(max=depth), trees.num_nodes)
    return dataclasses.replace(trees, num_nodes=num_nodes)


def full_graph_tokens(vllm_config: Any) -> int:
    """Tokens of the largest uniform decode batch that replays a FULL CUDA graph: the adaptive budget offers a
    width to ``r`` requests only where ``r * width`` tokens fit, since a wider verify runs the whole step without graphs
    (at ddtree's default 1,024 tokens, budget 15 up to 64 requests, 7 up to 128; ``patches.config.GRAPH_TOKENS``).
    Without FULL decode graphs, every batch the scheduler may form."""
    compilation = vllm_config.compilation_config
    max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    if compilation.cudagraph_mode.decode_mode() != CUDAGraphMode.FULL:
        return max_tokens
    return min(compilation.max_cudagraph_capture_size or max_tokens, max_tokens)


class DDTreeSpeculator(DFlashSpeculator):
    """Model Runner V2 DFlash speculator that drafts DDTree trees inside its FULL CUDA graph."""

    _speculator_name = "DDTree"

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        ddtree = get_ddtree_config(vllm_config)
        assert ddtree is not None, "DDTreeSpeculator needs a ddtree speculative config"
        self.ddtree: DDTreeConfig = ddtree
        # The drafter predicts max_depth positions whatever the node budget; draft_tokens keeps [max_reqs, budget].
        depth = ddtree.max_depth
        self.num_speculative_steps = depth
        self.num_query_per_req = 1 + depth
        num_samples = self.max_num_reqs * depth
        self.sample_indices = torch.zeros(num_samples, dtype=torch.int64, device=device)
        self.sample_pos = torch.zeros(num_samples, dtype=torch.int64, device=device)
        self.sample_idx_mapping = torch.zeros(num_samples, dtype=torch.int32, device=device)
        self.sample_col = torch.arange(depth, dtype=torch.int32, device=device).repeat(self.max_num_reqs)
        self.step = V2StepState(self.max_num_reqs, ddtree.budget, device, self.max_num_tokens)
        install_tree_masks(self.step.masks)
        self.context_kv_graphs: ContextKVGraphs | None = None
        self.combine_graphs: CombineGraphs | None = None
        self._context_only = False
        """This ``propose`` writes the drafter's context and skips its pass (the next step verifies no drafts)."""
        self._path_kernel_compiled = False

    def _copy_request_inputs(
        self, num_reqs: int, idx_mapping: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor
    ) -> None:
        super()._copy_request_inputs(num_reqs, idx_mapping, temperature, seeds)
        self.idx_mapping[num_reqs:].fill_(-1)  # padded graph rows write the trash tree row

    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        """DFlash's drafter graphs, sized by the drafter's own 1 + max_depth queries a request: the candidate
        budgets the config names for the target's verify graphs (``adaptive.dynamic_sd_table``) are hidden from
        its graph manager, which would otherwise derive drafter widths from them."""
        spec = self.vllm_config.speculative_config
        table, spec.num_speculative_tokens_per_batch_size = spec.num_speculative_tokens_per_batch_size, None
        try:
            super().init_cudagraph_manager(cudagraph_mode)
        finally:
            spec.num_speculative_tokens_per_batch_size = table

    def capture(self) -> None:
        """DFlash's drafter graphs (their dummy rows must not write live trees), then the combine of the target's
        auxiliary hidden states and the context K/V write of every decode size (``context_kv_graphs``); vLLM
        captures the target's graphs first, so their auxiliary output buffers exist by now."""
        self.idx_mapping.fill_(-1)
        super().capture()
        graph_tokens = self.vllm_config.compilation_config.max_cudagraph_capture_size or self.max_num_tokens
        # Every width a decode step can verify (the adaptive budget's candidates); capture drops n > buffers.
        sizes = sorted(
            {n for k in self.ddtree.budgets for n in decode_context_sizes(k + 1, self.max_num_reqs, graph_tokens)}
        )
        self.context_kv_graphs = install_context_kv_graphs(
            self.model,
            self.hidden_states,
            self.context_positions,
            self._context_slot_mappings,
            self._layer_group_idx,
            sizes,
        )
        aux = getattr(self.step.target_cudagraph_manager, "aux_hidden_states", None)
        combine = getattr(self.model, "combine_hidden_states", None)
        self.combine_graphs = None
        if aux and combine is not None:
            self.combine_graphs = CombineGraphs(combine, list(aux), self.hidden_states)
            self.combine_graphs.capture(sizes)

    def init_adaptive_budget(self, runner: Any) -> None:
        """After graph capture: time a decode step of every candidate budget and install the policy that the
        scheduler of this process asks each step. Model Runner V2 draws the next step's drafts from the scheduler's
        placeholders only when scheduling is async, and the scheduler sees the policy only when the worker shares
        its process (one GPU): otherwise every step keeps the whole budget."""
        register_local(None)
        self.step.adaptive = None
        if not self.ddtree.adaptive_budget:
            return
        if not self.vllm_config.scheduler_config.async_scheduling:
            logger.warning("DDTree: the adaptive budget needs async scheduling; every step verifies all nodes.")
            return
        if self.vllm_config.parallel_config.world_size > 1:
            logger.warning(
                "DDTree: the adaptive budget needs the worker in the scheduler's process (one GPU), not %d GPU "
                "workers; every step verifies all nodes.",
                self.vllm_config.parallel_config.world_size,
            )
            return
        budgets = self.ddtree.budgets
        graph_tokens = full_graph_tokens(self.vllm_config)

        def offered(num_reqs: int, k: int) -> bool:
            return k == 0 or num_reqs * (k + 1) <= graph_tokens

        policy = timed_policy(
            lambda r, k: self._dummy_decode_step(runner, r, k),
            budgets,
            runner.max_num_reqs,
            offered,
            torch.accelerator.synchronize,
            self.device,
            self.ddtree.max_depth,
            scheduler_side=True,
            offered=offered,
        )
        self.step.adaptive = policy
        register_local(policy)

    @torch.inference_mode()
    def _dummy_decode_step(self, runner: Any, num_reqs: int, budget: int) -> None:
        """The runner's dummy step of ``num_reqs`` uniform requests of ``budget + 1`` tokens (vLLM's dispatch
        replays the FULL graph captured for that shape, or runs it as serving would), then the drafter pass, which
        a step before a step without drafts skips."""
        saved = runner.decode_query_len
        runner.decode_query_len = budget + 1
        self.step.skip_drafter = budget == 0
        try:
            runner._dummy_run(num_reqs * (budget + 1), uniform_decode=True)
        finally:
            runner.decode_query_len = saved
            self.step.skip_drafter = False

    def _build_draft_attn_metadata(self, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
        return None if self._context_only else super()._build_draft_attn_metadata(*args, **kwargs)

    def _no_paths(self, num_reqs: int) -> AcceptedPaths | None:
        """Once, in a dummy run: paths that accept nothing, so that the path-context kernel compiles its
        specialisation during start-up (dummy steps verify no trees) instead of at the first served one."""
        if self._path_kernel_compiled or num_reqs == 0:
            return None
        self._path_kernel_compiled = True
        nodes = torch.full((num_reqs, self.ddtree.max_depth + 1), -1, dtype=torch.int64, device=self.device)
        none = torch.zeros(num_reqs, dtype=torch.int64, device=self.device)
        return AcceptedPaths(accepted_nodes=nodes, num_accepted=none, output_tokens=nodes)

    def _generate_draft(
        self,
        num_reqs: int,
        num_tokens_padded: int,
        attn_metadata: dict[str, Any] | None,
        slot_mappings: dict[str, torch.Tensor] | None,
        num_tokens_across_dp: torch.Tensor | None,
        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    ) -> None:
        """The captured drafter step: DFlash pass, per-depth top-k log-probs, trees into the persistent buffers."""
        if self._context_only:
            return
        hidden = self._run_model(
            num_tokens_padded, attn_metadata, slot_mappings, num_tokens_across_dp, cudagraph_runtime_mode
        )
        depth, topk = self.ddtree.max_depth, self.ddtree.topk
        logits = self.model.compute_logits(hidden[self.sample_indices[: num_reqs * depth]])
        logprobs, ids = topk_logprobs(logits, topk)
        rows = self.step.trees.rows(self.idx_mapping[:num_reqs])
        trees = build_trees_with_chains(
            logprobs.view(num_reqs, depth, topk),
            ids.view(num_reqs, depth, topk),
            self.ddtree.budget,
            self.step.trees.chain[rows],
        )
        self.draft_tokens[:num_reqs] = trees.node_tokens
        self.step.trees.store(self.idx_mapping[:num_reqs], trees)

    def propose(
        self,
        input_batch: Any,
        attn_metadata: dict[str, Any],
        slot_mappings: dict[str, torch.Tensor],
        last_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        num_tokens_across_dp: torch.Tensor | None = None,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs: Any = None,
        is_profile: bool = False,
    ) -> torch.Tensor:
        """Drafter context = the accepted path (linear positions, path-ordered hidden rows), combined from graphs
        where captured, then DFlash + trees. When the next step verifies no drafts (its drafts are never read),
        DFlash only writes the context K/V: its drafter pass runs through ``_generate_draft`` (``is_profile``
        dispatches it eagerly), which then returns at once, without attention metadata."""
        paths = self.step.take_paths()  # read once: a dummy run drops what a real step left
        if dummy_run:
            paths = self._no_paths(input_batch.num_reqs)
        if paths is not None:
            restore_path_context(
                input_batch.positions,
                list(aux_hidden_states or [last_hidden_states]),
                input_batch.query_start_loc,
                input_batch.cu_num_logits,
                input_batch.idx_mapping,
                paths,
                input_batch.num_reqs,
            )
        if (
            aux_hidden_states
            and not dummy_run
            and self.combine_graphs is not None
            and self.combine_graphs.replay(aux_hidden_states)
        ):
            # The replay wrote DFlash's hidden rows; DFlash's own copy of them onto themselves is a no-op.
            aux_hidden_states, last_hidden_states = None, self.hidden_states
        self._context_only = self.step.skip_drafter
        try:
            return super().propose(
                input_batch,
                attn_metadata,
                slot_mappings,
                last_hidden_states,
                aux_hidden_states,
                num_sampled,
                num_rejected,
                last_sampled,
                next_prefill_tokens,
                temperature,
                seeds,
                num_tokens_across_dp,
                dummy_run,
                skip_attn_for_dummy_run,
                mm_inputs,
                is_profile or self._context_only,
            )
        finally:
            self._context_only = False
