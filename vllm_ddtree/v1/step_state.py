"""The V1 (vLLM-CPU) step state the seams hand each other: trees proposed last step, this step's batch-ordered trees,
the accepted paths.

Order of one step: ``_prepare_inputs`` hook (trees of the scheduled requests → depth positions, ancestor masks) →
tree rejection sampler (walk + KV compaction → accepted paths) → proposer (drafter context from the paths → next
trees). The V1 runner keeps requests in ``input_batch`` order, which can change between steps, so proposals are
remembered by request id and re-gathered in the new batch order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_ddtree.accept import AcceptedPaths
from vllm_ddtree.adaptive import AdaptiveBudget
from vllm_ddtree.config import DDTreeConfig
from vllm_ddtree.tree import DraftTrees
from vllm_ddtree.tree_mask import TreeMaskBuffers, causal_bits, install_tree_masks


def _logits_processor_active(processor: Any) -> bool:
    """Whether a non-argmax-invariant logits processor changes any row now (unknown processors: assume so)."""
    for attr in ("min_toks", "biases"):  # vLLM's built-in min_tokens and logit_bias processors
        if hasattr(processor, attr):
            return bool(getattr(processor, attr))
    if hasattr(processor, "min_p_count"):
        return processor.min_p_count > 0
    return True


def needs_chain(sampling_metadata: Any, has_structured_output: bool) -> bool:
    """Whether the batch uses a feature whose vLLM implementation reads drafts as one sequence.

    Logprobs, penalties, bad words, allowed-token masks, min_tokens (and other active logits processors) and
    structured outputs are then served exactly by vLLM's own chain rejection sampler: the batch is drafted and
    verified as DFlash chains for that step.
    """
    processors = getattr(sampling_metadata, "logitsprocs", None)
    return (
        sampling_metadata.max_num_logprobs is not None
        or not sampling_metadata.no_penalties
        or bool(sampling_metadata.bad_words_token_ids)
        or sampling_metadata.allowed_token_ids_mask is not None
        or has_structured_output
        or (processors is not None and any(_logits_processor_active(p) for p in processors.non_argmax_invariant))
    )


@dataclass
class BatchTrees:
    """Trees of the current verify step, one row per request in batch order (chains where no tree applies)."""

    parents: torch.Tensor  # [B, W] int64
    anc_bits: torch.Tensor  # [B, W] int64
    num_nodes: torch.Tensor  # [B] int64, capped at the number of scheduled drafts
    chain_only: bool  # every row is verified as a chain: vLLM's own rejection sampler applies


class V1StepState:
    """Per-worker DDTree state shared by the runner hook, the tree sampler and the proposer."""

    def __init__(self, config: DDTreeConfig, max_num_reqs: int, device: torch.device) -> None:
        self.config = config
        self.width = config.budget + 1
        self.device = device
        self.masks = TreeMaskBuffers(max_num_reqs, self.width, device)
        install_tree_masks(self.masks)
        self._proposed_rows: dict[str, int] = {}
        self._proposed: DraftTrees | None = None
        self.batch: BatchTrees | None = None
        self.paths: AcceptedPaths | None = None
        self.adaptive: AdaptiveBudget | None = None
        self.step_shape: tuple[int, int] | None = None
        """(requests, drafts each) of this step when it is a uniform decode step (the adaptive cost model's
        observations), else None."""
        self.last_propose_time: float | None = None
        self.previous_shape: tuple[int, int] | None = None
        # What actually ran (read by tests and debugging through collective_rpc): steps verified as trees, tree
        # rows that branch, accepted paths that left the first-child chain (their KV was compacted), and steps that
        # verified trees beside rows without drafts (prefill chunks, new requests).
        self.counters = {"tree_steps": 0, "chain_steps": 0, "branching_rows": 0, "off_chain_paths": 0, "mixed_steps": 0}

    def note_step_shape(self, num_scheduled_tokens: list[int], drafts: list[list[int]]) -> None:
        """Remember whether this step is a uniform decode step: every request verifies the same ``k`` drafts."""
        counts = {len(tokens) for tokens in drafts}
        uniform = len(counts) == 1 and all(
            n == len(tokens) + 1 for n, tokens in zip(num_scheduled_tokens, drafts, strict=True)
        )
        self.step_shape = (len(drafts), counts.pop()) if uniform and drafts else None

    def record_proposal(self, req_ids: list[str], trees: DraftTrees) -> None:
        """Remember the trees just proposed, row i belonging to ``req_ids[i]``."""
        self._proposed = trees
        self._proposed_rows = {req_id: i for i, req_id in enumerate(req_ids)}

    def proposed_tree(self, req_id: str, draft_tokens: list[int]) -> int | None:
        """Row of ``req_id``'s proposed tree if its first nodes are exactly the drafts the scheduler sent back."""
        row = self._proposed_rows.get(req_id)
        if row is None or self._proposed is None:
            return None
        k = len(draft_tokens)
        if self._proposed.node_tokens[row, :k].tolist() != list(draft_tokens):
            return None
        return row

    def begin_step(
        self,
        req_ids: list[str],
        drafts: list[list[int]],
        positions: torch.Tensor,
        query_start: list[int],
        chain_only: bool = False,
    ) -> None:
        """Lay out this step's trees in batch order: depth RoPE positions in place, ancestor masks, walk inputs.

        A request whose drafts are not a tree this worker proposed (or that has none), and every request when
        ``chain_only``, is verified as a chain: the causal mask and linear positions vLLM already set up.
        """
        batch = len(req_ids)
        self.counters["chain_steps" if chain_only else "tree_steps"] += 1
        chain_parents = torch.arange(-1, self.width - 1, dtype=torch.int64)
        parents = chain_parents.repeat(batch, 1)
        anc_bits = causal_bits(self.width, torch.device("cpu")).repeat(batch, 1)
        num_nodes = torch.zeros(batch, dtype=torch.int64)
        trees = 0
        for b, (req_id, tokens) in enumerate(zip(req_ids, drafts, strict=True)):
            k = len(tokens)
            num_nodes[b] = k
            row = self.proposed_tree(req_id, tokens) if k and not chain_only else None
            if row is None:
                continue
            trees += 1
            assert self._proposed is not None
            parents[b] = self._proposed.parents[row].cpu()
            self.counters["branching_rows"] += int(not torch.equal(parents[b, : k + 1], chain_parents[: k + 1]))
            anc_bits[b] = self._proposed.anc_bits[row].cpu()
            num_nodes[b] = min(k, int(self._proposed.num_nodes[row]))
            depth = self._proposed.depth[row, : k + 1].to(positions.device)
            start = query_start[b]
            positions[start : start + k + 1] = positions[start] + depth
        self.counters["mixed_steps"] += int(0 < trees and any(not tokens for tokens in drafts))
        self.masks.anc_bits[:batch] = anc_bits.to(self.device)
        self.masks.active = True
        self.batch = BatchTrees(
            parents.to(self.device), anc_bits.to(self.device), num_nodes.to(self.device), chain_only
        )
        self._forget_proposal()

    def _forget_proposal(self) -> None:
        """Proposals are single-use: drafts the scheduler sends later (after a step without a drafter pass, which
        vLLM skips near the length limit) are verified as chains, never against an older step's trees."""
        self._proposed = None
        self._proposed_rows = {}

    def end_step(self) -> None:
        """No tree verify in flight: attention goes back to plain causal."""
        self.masks.active = False
        self.batch = None

    def skip_step(self) -> None:
        """A step without drafts: plain causal attention, and the last proposal is void."""
        self.end_step()
        self._forget_proposal()
