"""The "ddtree" speculative-config surface: keys, defaults and validation.

Users write ``--speculative-config '{"method": "ddtree", "model": "<DFlash checkpoint>",
"num_speculative_tokens": <node budget>, "topk": 8, "max_depth": 15}'``. vLLM's ``SpeculativeConfig`` forbids
unknown keys and has no "ddtree" method, so process 0 splits the dict here: vLLM gets ``method="dflash"`` plus its
own keys, and the DDTree keys become a :class:`DDTreeConfig` that is attached to the resulting ``SpeculativeConfig``
(and travels with it, pickled, to the engine-core and worker processes).

Every invalid value raises :class:`DDTreeConfigError` with one sentence naming the key, the bad value and the
accepted range.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_ddtree.adaptive import candidate_budgets, forced_budgets
from vllm_ddtree.constants import MAX_TREE_BUDGET, MAX_TREE_WIDTH

METHOD = "ddtree"

# vLLM's rejection sampler asserts max_spec_len <= MAX_SPEC_LEN (vllm/v1/sample/rejection_sampler.py).
VLLM_MAX_SPEC_LEN = 128
# One int64 ancestor word per node covers the root plus 63 nodes; the verify kernels read exactly that word.
MAX_BUDGET = min(VLLM_MAX_SPEC_LEN, MAX_TREE_BUDGET)

# DDTree's own keys, with what each one means (used in error messages and the README).
DDTREE_KEYS: dict[str, str] = {
    "topk": "candidate tokens per depth (1..budget; default min(budget, 8))",
    "max_depth": "deepest tree level (1..drafter block_size-1; default block_size-1)",
    "adaptive_budget": "true (default): each decode step verifies the tree prefix, or no drafts, that a cost model and "
    "running acceptance make fastest for the batch; false: every step verifies the whole budget",
}
DEFAULT_TOPK = 8


class DDTreeConfigError(ValueError):
    """A DDTree speculative-config value that cannot work; the message names the key and the fix."""


@dataclass(frozen=True)
class DDTreeConfig:
    """Resolved DDTree settings, attached to vLLM's SpeculativeConfig as ``.ddtree``."""

    budget: int
    """Draft-tree nodes per request, root excluded (= vLLM's num_speculative_tokens, verify width budget+1)."""
    topk: int
    """Candidates kept per depth; the tree is the best-first top-`budget` subset of this K-ary tree."""
    max_depth: int
    """Tree depth D: the drafter predicts D positions in one pass (DFlash block_size - 1 by default, at most the
    budget)."""
    adaptive_budget: bool = True
    """Each decode step verifies a prefix of ``budgets`` nodes chosen for the load (``vllm_ddtree.adaptive``)."""

    @property
    def width(self) -> int:
        """Tokens per request in the verify step (root + nodes)."""
        return self.budget + 1

    @property
    def budgets(self) -> tuple[int, ...]:
        """Node budgets a decode step may verify: the candidates when adaptive, else the budget alone."""
        return candidate_budgets(self.budget) if self.adaptive_budget else (self.budget,)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int_range(key: str, value: Any, low: int, high: int, why: str = "") -> int:
    if not _is_int(value) or not low <= value <= high:
        reason = f" ({why})" if why else ""
        raise DDTreeConfigError(
            f"ddtree speculative config: '{key}' is {value!r}, but it must be an integer from {low} to {high}{reason}."
        )
    return value


def _suggest(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f"did you mean '{close[0]}'? " if close else ""


@dataclass(frozen=True)
class DDTreeRequest:
    """The user's DDTree keys after the first validation pass (before the drafter config is known)."""

    budget: int
    topk: int | None
    max_depth: int | None
    adaptive_budget: bool


def split_speculative_config(raw: Mapping[str, Any], vllm_keys: Iterable[str]) -> tuple[dict[str, Any], DDTreeRequest]:
    """Split a ``method == "ddtree"`` dict into vLLM's DFlash keys and DDTree's keys, validating what needs no model.

    ``vllm_keys`` are the field names SpeculativeConfig accepts; anything that is neither ours nor vLLM's is an error
    here, so the user gets our sentence rather than a pydantic dump.
    """
    vllm_keys = set(vllm_keys)
    spec = {k.replace("-", "_"): v for k, v in raw.items()}
    if spec.get("method") != METHOD:
        raise DDTreeConfigError(f"ddtree speculative config: 'method' is {spec.get('method')!r}, expected 'ddtree'.")
    for key in spec:
        if key not in vllm_keys and key not in DDTREE_KEYS:
            raise DDTreeConfigError(
                f"ddtree speculative config: unknown key '{key}'; {_suggest(key, [*DDTREE_KEYS, *vllm_keys])}"
                f"DDTree's keys are {', '.join(sorted(DDTREE_KEYS))} plus vLLM's SpeculativeConfig fields."
            )
    if not spec.get("model"):
        raise DDTreeConfigError(
            "ddtree speculative config: 'model' is missing; set it to a DFlash drafter checkpoint (path or name)."
        )
    if "num_speculative_tokens" not in spec:
        raise DDTreeConfigError(
            f"ddtree speculative config: 'num_speculative_tokens' (the tree node budget) is missing; "
            f"set it to an integer from 1 to {MAX_BUDGET}."
        )
    budget = _check_int_range(
        "num_speculative_tokens",
        spec["num_speculative_tokens"],
        1,
        MAX_BUDGET,
        f"the node budget: vLLM verifies at most {VLLM_MAX_SPEC_LEN} draft tokens and the ancestor bitmask "
        f"holds {MAX_TREE_WIDTH} nodes including the root",
    )
    topk = spec.pop("topk", None)
    if topk is not None:
        topk = _check_int_range("topk", topk, 1, budget, "more candidates per depth than nodes can never be used")
    max_depth = spec.pop("max_depth", None)
    if max_depth is not None:
        _check_int_range("max_depth", max_depth, 1, VLLM_MAX_SPEC_LEN)
    adaptive = spec.pop("adaptive_budget", True)
    if not isinstance(adaptive, bool):
        raise DDTreeConfigError(
            f"ddtree speculative config: 'adaptive_budget' is {adaptive!r}, but it must be true (choose each step's "
            f"node budget for the load) or false (always verify all {budget} nodes)."
        )
    if spec.get("draft_sample_method", "greedy") != "greedy":
        raise DDTreeConfigError(
            f"ddtree speculative config: 'draft_sample_method' is {spec['draft_sample_method']!r}, but DDTree expands "
            f"the drafter's most likely tokens and accepts only 'greedy' (sampling happens losslessly at verify)."
        )
    if spec.get("rejection_sample_method", "standard") != "standard":
        raise DDTreeConfigError(
            f"ddtree speculative config: 'rejection_sample_method' is {spec['rejection_sample_method']!r}, but DDTree "
            f"verifies trees with its own lossless walk and accepts only 'standard'."
        )
    if spec.get("num_speculative_tokens_per_batch_size") is not None:
        raise DDTreeConfigError(
            "ddtree speculative config: 'num_speculative_tokens_per_batch_size' is set, but DDTree needs one fixed "
            "node budget; remove it and set 'num_speculative_tokens'."
        )
    spec["method"] = "dflash"
    return spec, DDTreeRequest(budget=budget, topk=topk, max_depth=max_depth, adaptive_budget=adaptive)


def is_dflash_architecture(architecture: str) -> bool:
    """vLLM's own test (``EAGLEConfig`` for method "dflash"): DFlash drafters name their architecture DFlash*."""
    return architecture.startswith("DFlash") or architecture.endswith("DFlash")


def check_drafter_architectures(model: str, architectures: Iterable[str] | None) -> None:
    """Refuse a drafter checkpoint that is not a DFlash drafter, before vLLM turns its architecture into an unknown
    ``DFlash<arch>`` and answers with its whole model registry."""
    names = list(architectures or [])
    if not any(is_dflash_architecture(name) for name in names):
        raise DDTreeConfigError(
            f"ddtree speculative config: 'model' ({model}) is not a DFlash drafter (architectures {names}); set it "
            f"to a DFlash drafter checkpoint, whose config names an architecture such as 'DFlashDraftModel'."
        )


def drafter_block_size(draft_hf_config: Any) -> int | None:
    """The DFlash drafter's block size (anchor + predicted positions), wherever the HF config keeps it."""
    for holder in (draft_hf_config, getattr(draft_hf_config, "dflash_config", None)):
        if isinstance(holder, Mapping):
            value = holder.get("block_size")
        else:
            value = getattr(holder, "block_size", None)
        if _is_int(value) and value >= 2:
            return value
    return None


def resolve_ddtree_config(request: DDTreeRequest, block_size: int | None) -> DDTreeConfig:
    """Fill defaults that depend on the drafter (depth = block_size - 1) and check max_depth against it."""
    if block_size is None:
        if request.max_depth is None:
            raise DDTreeConfigError(
                "ddtree speculative config: 'max_depth' is unset and the drafter config has no 'block_size'; "
                "set 'max_depth' to the number of positions the DFlash drafter predicts per pass."
            )
        max_depth = request.max_depth
    else:
        max_depth = request.max_depth if request.max_depth is not None else block_size - 1
        _check_int_range(
            "max_depth", max_depth, 1, block_size - 1, f"the DFlash drafter predicts block_size-1 = {block_size - 1}"
        )
    topk = request.topk if request.topk is not None else min(request.budget, DEFAULT_TOPK)
    # A tree of `budget` nodes is never deeper than `budget`, and the drafter's extra query tokens would need KV
    # slots vLLM's scheduler does not reserve (it looks ahead budget+1 tokens for DFlash), so the depth is capped.
    max_depth = min(max_depth, request.budget)
    return DDTreeConfig(budget=request.budget, topk=topk, max_depth=max_depth, adaptive_budget=request.adaptive_budget)


def check_forced_budgets(ddtree: DDTreeConfig, forced: str | None) -> None:
    """``VLLM_DDTREE_ADAPTIVE_FORCE`` (tests, benches) must name candidate budgets of an adaptive config."""
    if forced is None:
        return
    if not ddtree.adaptive_budget:
        raise DDTreeConfigError(
            f"VLLM_DDTREE_ADAPTIVE_FORCE={forced} forces the adaptive budget's choices, but 'adaptive_budget' is "
            f"false; unset the variable or drop 'adaptive_budget': false."
        )
    try:
        forced_budgets(forced, ddtree.budgets)
    except ValueError as err:
        raise DDTreeConfigError(str(err)) from None


def check_parallel_config(parallel_config: Any) -> None:
    """Refuse parallel layouts the tree verify cannot serve, in one sentence each."""
    if getattr(parallel_config, "pipeline_parallel_size", 1) > 1:
        raise DDTreeConfigError(
            f"ddtree does not support pipeline parallelism (pipeline_parallel_size="
            f"{parallel_config.pipeline_parallel_size}): the drafter lives on the last stage; use tensor parallelism."
        )
    for key in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel_config, key, 1) > 1:
            raise DDTreeConfigError(
                f"ddtree does not support context parallelism ({key}={getattr(parallel_config, key)}): KV compaction "
                f"assumes each token's KV lives on every rank; set it to 1."
            )


def check_target_and_features(target_model_config: Any, kv_transfer_config: Any) -> None:
    """Refuse targets and deployment features the tree verify cannot serve, in one sentence each."""
    if getattr(target_model_config, "is_hybrid", False) or getattr(target_model_config, "has_inner_state", False):
        raise DDTreeConfigError(
            "ddtree does not support hybrid or recurrent targets (mamba/linear-attention layers): their state "
            "cannot branch over a draft tree; use method 'dflash' for this model."
        )
    if getattr(target_model_config, "is_attention_free", False):
        raise DDTreeConfigError("ddtree needs an attention target; this model is attention-free.")
    if kv_transfer_config is not None:
        raise DDTreeConfigError(
            "ddtree does not support KV connectors (--kv-transfer-config): layer-wise KV saves happen before the "
            "accepted path is compacted; remove the KV transfer config."
        )


def get_ddtree_config(config: Any) -> DDTreeConfig | None:
    """The DDTreeConfig of a VllmConfig or SpeculativeConfig, or None when DDTree is off."""
    spec = getattr(config, "speculative_config", config)
    ddtree = getattr(spec, "ddtree", None)
    return ddtree if isinstance(ddtree, DDTreeConfig) else None
