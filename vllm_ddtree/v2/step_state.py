"""Model Runner V2's step state: the one object DDTree's pieces of a V2 decode step hand each other.

The speculator owns it (``DDTreeSpeculator.step``); ``patches.v2`` hands it to the tree sampler, the model state's
``prepare_attn`` and ``add_request`` seams once the KV cache exists. Per step: the drafter's CUDA graph writes the
trees (``trees``), the ``prepare_attn`` seam lays them out for the verify (``masks``), the tree sampler walks them
and leaves the accepted paths (``pending_paths``), and the next drafter pass reads those paths back.
With an adaptive budget it also holds the policy (``adaptive``), whose acceptance statistics the tree sampler
feeds.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_ddtree.accept import AcceptedPaths
from vllm_ddtree.adaptive import AdaptiveBudget
from vllm_ddtree.tree import DraftTrees
from vllm_ddtree.tree_mask import TreeMaskBuffers, causal_bits


class TreeBuffers:
    """Model Runner V2's persistent draft trees, one row per request state (``req_state_idx``), plus a trash row.

    The drafter's CUDA graph writes the trees it builds at ``idx_mapping[b]``; padded graph rows carry index -1 and
    land in the trash row (the last one), so they never overwrite a live request's tree. The next verify step reads
    the rows of its batch's request states. ``chain[r]`` marks requests whose sampling features read drafts as one
    sequence (logprobs, penalties, bad words, structured output): their trees are built from the top-1 chain.
    """

    def __init__(self, max_num_reqs: int, budget: int, device: torch.device) -> None:
        rows, width = max_num_reqs + 1, budget + 1
        self.trash_row = max_num_reqs
        self.parents = torch.full((rows, width), -1, dtype=torch.int64, device=device)
        self.depth = torch.zeros(rows, width, dtype=torch.int64, device=device)
        self.anc_bits = causal_bits(width, device).repeat(rows, 1)
        self.num_nodes = torch.zeros(rows, dtype=torch.int64, device=device)
        self.chain = torch.zeros(rows, dtype=torch.bool, device=device)

    def rows(self, idx_mapping: torch.Tensor) -> torch.Tensor:
        """Buffer rows for a batch's request-state indices (-1, a padded row, maps to the trash row)."""
        idx = idx_mapping.to(torch.int64)
        return torch.where(idx >= 0, idx, self.trash_row)

    def store(self, idx_mapping: torch.Tensor, trees: DraftTrees) -> None:
        """Write a batch of trees at their request states (graph-safe: index_copy_, no host reads)."""
        rows = self.rows(idx_mapping)
        self.parents.index_copy_(0, rows, trees.parents)
        self.depth.index_copy_(0, rows, trees.depth)
        self.anc_bits.index_copy_(0, rows, trees.anc_bits)
        self.num_nodes.index_copy_(0, rows, trees.num_nodes)


def request_needs_chain(sampling_params: Any) -> bool:
    """Whether a request uses a feature whose vLLM (V2) implementation reads its drafts as one sequence: logprobs,
    penalties (they count the earlier drafts), bad words (they match draft prefixes) and structured output (the
    grammar walks the drafts). Such requests are drafted and verified as top-1 chains, exactly as vLLM does."""
    if sampling_params is None:
        return False
    return (
        sampling_params.logprobs is not None
        or sampling_params.presence_penalty != 0.0
        or sampling_params.frequency_penalty != 0.0
        or sampling_params.repetition_penalty != 1.0
        or bool(getattr(sampling_params, "bad_words", None))
        or getattr(sampling_params, "structured_outputs", None) is not None
    )


class V2StepState:
    """Trees, masks and paths of the V2 decode step in flight, plus the runner pieces bound after the KV cache.

    ``attn_groups`` holds the runner's attention groups and the target-only ones (the drafter plans its own);
    ``target_cudagraph_manager`` is the runner's graph manager, whose persistent auxiliary outputs feed DFlash's
    combine.
    """

    def __init__(self, max_num_reqs: int, budget: int, device: torch.device, max_num_tokens: int) -> None:
        self.trees = TreeBuffers(max_num_reqs, budget, device)
        self.masks = TreeMaskBuffers(max_num_reqs, budget + 1, device, max_num_tokens)
        self.pending_paths: AcceptedPaths | None = None
        self.target_cudagraph_manager: Any = None
        self.attn_groups: tuple[Any, Any] | None = None
        self.adaptive: AdaptiveBudget | None = None
        self.skip_drafter = False
        """The next step verifies no drafts (the adaptive budget chose 0): this step's drafter pass is skipped."""

    def note_schedule(self, scheduler_output: Any) -> None:
        """A real step is about to run: its scheduler output says how many drafts the next step verifies."""
        self.skip_drafter = self.adaptive is not None and scheduler_output.num_spec_tokens_to_schedule == 0

    def add_request(self, req_idx: int, sampling_params: Any) -> None:
        """A new request at state ``req_idx``: its trees are top-1 chains when its features read drafts as one."""
        self.trees.chain[req_idx] = request_needs_chain(sampling_params)

    def take_paths(self) -> AcceptedPaths | None:
        """The paths the tree sampler left for this step's drafter pass (each is read once)."""
        paths, self.pending_paths = self.pending_paths, None
        return paths
