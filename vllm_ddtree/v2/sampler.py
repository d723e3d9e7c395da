"""Model Runner V2's tree rejection sampler (GPUs): verify the batch's draft trees, compact the accepted KV.

It keeps the contract of vLLM's V2 rejection sampler, so the scheduler sees an ordinary accepted prefix, and every
node's target choice comes from vLLM's own ``Sampler`` (greedy or sampled, keyed by the node's true position), which
is what makes the walk lossless.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
from vllm.v1.worker.gpu.metrics.logits import get_num_nans
from vllm.v1.worker.gpu.sample.output import SamplerOutput as SamplerOutputV2
from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler as RejectionSamplerV2

from vllm_ddtree.accept import walk_verify_batch
from vllm_ddtree.kv_compact import KVCompactor
from vllm_ddtree.v2.step_state import V2StepState


class DDTreeRejectionSampler(RejectionSamplerV2):
    """Model Runner V2's rejection sampler for DDTree trees (installed through ``ModelState.custom_sampler``).

    Per step: every verified node gets the target's own choice from vLLM's ``Sampler`` (greedy or sampled, keyed by
    the node's true position), the GPU walk follows the choices down the request's tree, the accepted nodes' KV
    moves to the path's linear slots in every target layer (before the drafter rewrites the shared slot mappings),
    and the output is an ordinary accepted prefix for vLLM's scheduler. ``attach`` binds the runner's block tables,
    KV caches and the speculator's step state once the KV cache exists.
    """

    def __init__(self, sampler: Any, spec_config: Any, device: torch.device) -> None:
        super().__init__(sampler, spec_config, device)
        self.budget = spec_config.ddtree.budget
        self.max_depth = spec_config.ddtree.max_depth
        self._step: V2StepState | None = None
        self._block_tables: Any = None
        self._compactors: list[tuple[int, KVCompactor]] = []

    def attach(self, runner: Any) -> None:
        """Bind the runner's pieces (after ``initialize_kv_cache``): step state, slot mappings, target KV caches."""
        self._step = runner.speculator.step
        self._block_tables = runner.block_tables
        draft_layers = set(runner.speculator.draft_attn_layer_names)
        forward_context = runner.vllm_config.compilation_config.static_forward_context
        self._compactors = []
        for group_id, group in enumerate(runner.kv_cache_config.kv_cache_groups):
            caches = [forward_context[name].kv_cache for name in group.layer_names if name not in draft_layers]
            if not caches:
                continue
            # Logical cache views: MLA (blocks, page, dim); tree-attention GQA (blocks, kv_heads, page, 2*head).
            block_dim, offset_dim = (0, 1) if caches[0].dim() == 3 else (0, 2)
            compactor = KVCompactor(caches, block_dim, offset_dim, runner.max_num_reqs, self.max_depth)
            self._compactors.append((group_id, compactor))

    def __call__(self, logits: torch.Tensor, input_batch: Any, draft_logits: torch.Tensor | None = None) -> Any:
        num_nans = get_num_nans(logits) if self.sampler.compute_nans else None
        draft_sampled = input_batch.input_ids[input_batch.logits_indices]
        pos = input_batch.positions[input_batch.logits_indices]  # each node's own position (base + depth)
        choices, processed_logits = self.sampler.sample(
            logits,
            input_batch.expanded_idx_mapping,
            input_batch.idx_mapping_np,
            pos,
            draft_sampled,
            input_batch.expanded_local_pos,
        )
        # One launch: row i of a request's verify rows is node i (the root holds the last accepted token).
        assert self._step is not None, "attach() binds the step state after the KV cache is built"
        trees = self._step.trees
        paths, num_sampled = walk_verify_batch(
            choices,
            draft_sampled,
            input_batch.cu_num_logits,
            input_batch.idx_mapping,
            trees.parents,
            trees.anc_bits,
            trees.num_nodes,
            self.max_depth,
        )
        for group_id, compactor in self._compactors:
            compactor(
                self._block_tables.slot_mappings[group_id],
                input_batch.query_start_loc,
                paths.accepted_nodes,
                paths.num_accepted,
            )
        sampled = paths.output_tokens
        logprobs_tensors = self._get_logprobs_tensors(
            input_batch,
            sampled,
            num_sampled,
            processed_logits if self.sampler.logprobs_mode in ("processed_logprobs", "processed_logits") else logits,
        )
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            num_sampled,
            input_batch.seq_lens,
            input_batch.cu_num_logits,
            input_batch.idx_mapping,
            self.sampler.req_states.prefill_len.gpu,
        )
        if self._step.adaptive is not None:
            num_verified = input_batch.cu_num_logits[1:] - input_batch.cu_num_logits[:-1] - 1
            self._step.adaptive.record(paths.accepted_nodes, num_verified[: paths.accepted_nodes.shape[0]])
        self._step.pending_paths = paths
        return SamplerOutputV2(
            sampled_token_ids=sampled,
            logprobs_tensors=logprobs_tensors,
            num_nans=num_nans,
            num_sampled=num_sampled,
            num_rejected=num_rejected,
        )
