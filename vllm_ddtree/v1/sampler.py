"""Model Runner V1's tree rejection sampler (vLLM-CPU): verify the batch's draft trees, compact the accepted KV.

It replaces vLLM's rejection sampler and keeps its contract, so the scheduler sees an ordinary accepted prefix:
``sampled_token_ids`` holds the accepted path's tokens, then the bonus, then -1. Each node's target choice uses the
request's own decoding rule (argmax when greedy; one draw from the temperature/top-k/top-p-processed distribution
otherwise, from the request's generator when it is seeded), which is what makes the walk lossless.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.rejection_sampler import RejectionSampler, apply_sampling_constraints

from vllm_ddtree.accept import walk_trees
from vllm_ddtree.kv_compact import compact_kv_slabs
from vllm_ddtree.patches import versions
from vllm_ddtree.v1.step_state import V1StepState

_SAMPLING_EPS = 1e-5


def node_choices(logits: torch.Tensor, rows_per_req: torch.Tensor, sampling_metadata: Any) -> torch.Tensor:
    """The target's token at every verified node (``logits`` rows, request-major): greedy or one draw per node."""
    greedy = logits.argmax(dim=-1)
    if sampling_metadata.all_greedy:
        return greedy
    cu_rows = torch.cumsum(rows_per_req, 0).to(torch.int32)
    processed = apply_sampling_constraints(logits.float().clone(), cu_rows, sampling_metadata)
    probs = processed.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    if sampling_metadata.generators:  # seeded requests draw from their own generators (a host read of the rows)
        starts = (cu_rows - rows_per_req.to(torch.int32)).tolist()
        for req_index, generator in sampling_metadata.generators.items():
            rows = slice(starts[req_index], starts[req_index] + int(rows_per_req[req_index]))
            noise[rows].exponential_(generator=generator)
    sampled = (probs / noise).argmax(dim=-1)
    temperature = sampling_metadata.temperature
    greedy_rows = torch.repeat_interleave(temperature < _SAMPLING_EPS, rows_per_req.to(temperature.device))
    return torch.where(greedy_rows, greedy, sampled)


class DDTreeRejectionSamplerV1(RejectionSampler):
    """vLLM's RejectionSampler interface over DDTree's tree walk (V1 runner)."""

    def __init__(self, sampler: Any, spec_config: Any, device: torch.device, state: V1StepState, runner: Any) -> None:
        super().__init__(sampler, spec_config, device)
        self.state = state
        self.runner = runner
        self._compactors: list[tuple[int, Callable[..., None]]] | None = None

    def forward(
        self, metadata: Any, draft_probs: torch.Tensor | None, logits: torch.Tensor, sampling_metadata: Any
    ) -> SamplerOutput:
        batch_trees = self.state.batch
        if batch_trees is None or batch_trees.chain_only:
            # Dummy runs, and batches verified as chains (logprobs, penalties, ...): vLLM's own sampler is exact.
            self.state.end_step()
            return super().forward(metadata, draft_probs, logits, sampling_metadata)
        device = logits.device
        num_drafts = torch.tensor(metadata.num_draft_tokens, dtype=torch.int64, device=device)
        batch, width = num_drafts.shape[0], self.state.width
        rows_per_req = num_drafts + 1
        choices = node_choices(logits, rows_per_req, sampling_metadata)

        # Scatter the request-major rows into [B, W] (node i of request b), padding beyond each request's drafts.
        node = torch.arange(width, device=device)
        present = node[None, :] <= num_drafts[:, None]
        row_start = torch.cumsum(rows_per_req, 0) - rows_per_req
        flat = (row_start[:, None] + node[None, :]).clamp(max=choices.shape[0] - 1)
        target_tokens = torch.where(present, choices[flat], -1)
        draft_start = torch.cumsum(num_drafts, 0) - num_drafts
        drafts = metadata.draft_token_ids.to(torch.int64)
        draft_flat = (draft_start[:, None] + node[None, 1:] - 1).clamp(0, max(drafts.shape[0] - 1, 0))
        node_tokens = torch.where(present[:, 1:], drafts[draft_flat] if drafts.numel() else 0, 0)

        paths = walk_trees(
            node_tokens,
            batch_trees.parents[:batch],
            batch_trees.anc_bits[:batch],
            batch_trees.num_nodes[:batch],
            target_tokens,
            self.state.config.max_depth,
        )
        self._compact(paths, batch)
        if self.state.adaptive is not None:
            self.state.adaptive.record(paths.accepted_nodes, num_drafts)
        depth = torch.arange(paths.accepted_nodes.shape[1], device=device)
        off_chain = ((paths.accepted_nodes != depth) & (depth <= paths.num_accepted[:, None])).any(dim=1)
        self.state.counters["off_chain_paths"] += int(off_chain.sum())  # V1 runs on the CPU: no device sync
        self.state.paths = paths
        self.state.end_step()
        out = paths.output_tokens[:, : metadata.max_spec_len + 1].to(torch.int32)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)

    def _compact(self, paths: Any, batch: int) -> None:
        """Move the accepted nodes' KV to the path's linear slots in every target layer (before the drafter)."""
        runner = self.runner
        if self._compactors is None:
            self._compactors = self._build_compactors()
        query_start_loc = runner.query_start_loc.gpu[: batch + 1]
        for group_id, compactor in self._compactors:
            slot_mapping = runner.input_batch.block_table[group_id].slot_mapping.gpu
            compactor(slot_mapping, query_start_loc, paths.accepted_nodes, paths.num_accepted)

    def _build_compactors(self) -> list[tuple[int, Callable[..., None]]]:
        """One compaction per KV-cache group with target layers; vLLM-CPU packs every block for its ISA, so tokens
        move through the layout map that the CPU tree-attention backend learns from CPU_ATTN itself."""
        from vllm_ddtree.backends.cpu import cache_layout

        runner = self.runner
        draft_layers = set(getattr(runner.drafter, "_draft_attn_layer_names", ()))
        forward_context = runner.compilation_config.static_forward_context
        compactors = []
        for group_id, group in enumerate(runner.kv_cache_config.kv_cache_groups):
            layers = [forward_context[name] for name in group.layer_names if name not in draft_layers]
            if not layers:
                continue
            caches = [layer.kv_cache for layer in layers]
            cache = caches[0]
            isa = versions.cpu_attention_isa(layers[0].impl, layers[0])
            k_map, v_map = cache_layout(isa, cache.dtype, cache.shape[2], cache.shape[3] // 2)
            token_elems = torch.cat([k_map, v_map], dim=1).to(cache.device)
            compactors.append((group_id, partial(compact_kv_slabs, caches, token_elems)))
        return compactors
