"""Process-0 config seams: accept ``method="ddtree"`` and size vLLM's scheduler for trees.

* ``EngineArgs.create_speculative_config``: turn the user's ddtree dict into vLLM's DFlash config plus an attached
  :class:`~vllm_ddtree.config.DDTreeConfig` (``SpeculativeConfig.ddtree``), and pick Model Runner V2 on CUDA.
  On CUDA it also widens vLLM's CUDA graphs to ``GRAPH_TOKENS`` where the user chose none (``_widen_cuda_graphs``).
* ``SpeculativeConfig.max_num_new_slots_for_drafting``: a DDTree drafter adds the slots of a DFlash chain of
  ``max_depth`` drafts per request, not of ``budget`` drafts as a chain of the same width would.

With an adaptive budget the resulting config also names every candidate budget in vLLM's
``num_speculative_tokens_per_batch_size``, which makes Model Runner V2 capture FULL decode graphs for each of them
(``adaptive.dynamic_sd_table``); the scheduler seam (``patches.scheduler``) replaces the lookup vLLM builds from it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from vllm_ddtree import envs
from vllm_ddtree.adaptive import dynamic_sd_table
from vllm_ddtree.config import (
    METHOD,
    DDTreeConfigError,
    check_drafter_architectures,
    check_forced_budgets,
    check_parallel_config,
    check_target_and_features,
    drafter_block_size,
    get_ddtree_config,
    resolve_ddtree_config,
    split_speculative_config,
)
from vllm_ddtree.patches import metrics, patch_attr, requests, scheduler, structured_outputs

logger = logging.getLogger("vllm.ddtree")  # under "vllm": vLLM's log handlers print it

V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"
GRAPH_TOKENS = 1024
"""The largest CUDA-graph batch ddtree asks vLLM to capture where the user sets no capture sizes (vLLM's own 512)."""
_SHORTHANDS = (("spec_method", "method"), ("spec_model", "model"), ("spec_tokens", "num_speculative_tokens"))


def _requests_ddtree(engine_args: Any) -> bool:
    spec = engine_args.speculative_config
    return engine_args.spec_method == METHOD or (isinstance(spec, dict) and spec.get("method") == METHOD)


def _merged_user_dict(engine_args: Any) -> dict[str, Any]:
    """The user's ddtree dict with the --spec-* shorthands folded in (they conflict with the same dict key)."""
    merged = dict(engine_args.speculative_config or {})
    for attr, key in _SHORTHANDS:
        value = getattr(engine_args, attr)
        if value is None:
            continue
        if key in merged:
            raise DDTreeConfigError(
                f"--{attr.replace('_', '-')} and --speculative-config['{key}'] are both set; keep only one of them."
            )
        merged[key] = value
    return merged


def _select_model_runner_v2() -> None:
    """On CUDA the ddtree path lives on Model Runner V2; children inherit the variable before envs are frozen."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return
    current = os.environ.get(V2_ENV)
    if current is not None and current.strip().lower() in ("0", "false"):
        raise DDTreeConfigError(
            f"ddtree runs on vLLM's Model Runner V2 on GPUs, but {V2_ENV}={current} asks for V1; "
            f"unset it or set it to 1."
        )
    os.environ[V2_ENV] = "1"
    import vllm.envs as envs

    if envs._is_envs_cache_enabled():
        envs.__getattr__.cache_clear()


def _disable_async_scheduling_on_v1(engine_args: Any) -> None:
    """The V1 (CPU) adapter matches each step's drafts to its trees, which async scheduling hides (placeholders)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return
    if engine_args.async_scheduling:
        raise DDTreeConfigError(
            "ddtree on vLLM-CPU (Model Runner V1) does not support async scheduling; drop --async-scheduling."
        )
    engine_args.async_scheduling = False


def _select_tree_attention(engine_args: Any) -> None:
    """On GPUs the target verifies trees through DDTree's attention backend, registered as vLLM's CUSTOM (the MLA
    or the GQA one, by the layer: ``patches.v2`` routes the slot)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if not current_platform.is_cuda():
        return
    chosen = engine_args.attention_backend or engine_args.attention_config.backend
    if chosen is None:
        engine_args.attention_backend = AttentionBackendEnum.CUSTOM
    elif chosen != AttentionBackendEnum.CUSTOM:
        raise DDTreeConfigError(
            f"ddtree verifies trees with its own attention backend (CUSTOM), but the target asks for "
            f"{getattr(chosen, 'name', chosen)}; drop --attention-backend (set the drafter's backend with the "
            f"speculative config's 'attention_backend' instead)."
        )


def _widen_cuda_graphs(engine_args: Any) -> None:
    """A tree verifies ``budget + 1`` tokens a request, and a verify beyond the largest FULL decode graph runs the
    whole step without graphs; at vLLM's default 512 tokens the adaptive budget could offer budget 15 only up to 32
    requests (``v2.speculator.full_graph_tokens``). Where the user sets no capture sizes, graphs go up to
    ``GRAPH_TOKENS`` (vLLM's own size steps): budget 15 up to 64 requests, 7 up to 128, 63 up to 16."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda() or engine_args.enforce_eager:
        return
    compilation = engine_args.compilation_config
    chosen = (
        engine_args.cudagraph_capture_sizes,
        engine_args.max_cudagraph_capture_size,
        compilation.cudagraph_capture_sizes,
        compilation.max_cudagraph_capture_size,
    )
    if any(value is not None for value in chosen):
        return
    engine_args.max_cudagraph_capture_size = GRAPH_TOKENS
    logger.info(
        "DDTree: CUDA graphs are captured up to %d tokens (vLLM's default: 512) so that trees verify inside them at "
        "higher load; --max-cudagraph-capture-size chooses another limit.",
        GRAPH_TOKENS,
    )


def _check_drafter(vllm_dict: dict[str, Any]) -> None:
    """The drafter's own config.json must name a DFlash architecture (unreadable configs are left to vLLM)."""
    from transformers import PretrainedConfig

    model = str(vllm_dict["model"])
    try:
        raw, _ = PretrainedConfig.get_config_dict(model, revision=vllm_dict.get("revision"))
    except (OSError, ValueError):
        return
    check_drafter_architectures(model, raw.get("architectures"))


def create_speculative_config(self: Any, target_model_config: Any, target_parallel_config: Any) -> Any:
    """EngineArgs.create_speculative_config, accepting ``{"method": "ddtree", ...}``."""
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs._orig_create_speculative_config
    if not _requests_ddtree(self):
        return orig(self, target_model_config, target_parallel_config)

    field_names = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    vllm_dict, request = split_speculative_config(_merged_user_dict(self), field_names)
    _check_drafter(vllm_dict)
    check_parallel_config(target_parallel_config)
    check_target_and_features(target_model_config, self.kv_transfer_config)
    _select_model_runner_v2()
    _select_tree_attention(self)
    _widen_cuda_graphs(self)
    _disable_async_scheduling_on_v1(self)

    # Call vLLM with the DFlash dict, then restore the user's values: EngineArgs may build configs more than once.
    saved = {"speculative_config": self.speculative_config, **{a: getattr(self, a) for a, _ in _SHORTHANDS}}
    try:
        self.speculative_config = vllm_dict
        for attr, _ in _SHORTHANDS:
            setattr(self, attr, None)
        spec_config = orig(self, target_model_config, target_parallel_config)
    finally:
        for attr, value in saved.items():
            setattr(self, attr, value)

    draft_hf = spec_config.draft_model_config.hf_config if spec_config.draft_model_config else None
    spec_config.ddtree = resolve_ddtree_config(request, drafter_block_size(draft_hf))
    ddtree = spec_config.ddtree
    check_forced_budgets(ddtree, envs.VLLM_DDTREE_ADAPTIVE_FORCE)
    if ddtree.adaptive_budget:
        spec_config.num_speculative_tokens_per_batch_size = dynamic_sd_table(ddtree.budgets)
    metrics.note_ddtree(ddtree)
    logger.info(
        "DDTree speculative decoding is on: trees of %d nodes (top-%d per depth, depth <= %d) drafted by the DFlash "
        "drafter %s, %s; vLLM's own logs call the method 'dflash' and count every tree node as a draft token.",
        ddtree.budget,
        ddtree.topk,
        ddtree.max_depth,
        vllm_dict["model"],
        f"each step verifying the prefix of {list(ddtree.budgets)} nodes that is fastest for the load"
        if ddtree.adaptive_budget
        else "every step verifying all of them",
    )
    return spec_config


def _max_num_new_slots_for_drafting(self: Any) -> int:
    """SpeculativeConfig.max_num_new_slots_for_drafting, sized by tree depth for DDTree: vLLM's count for a DFlash
    chain of ``max_depth`` drafts instead of ``budget`` (the drafter predicts ``max_depth`` positions whatever the
    budget). vLLM's count is the number of drafts plus a constant (0.26: K - 1; 0.32: K, the bonus query too)."""
    from vllm.config import SpeculativeConfig

    slots = SpeculativeConfig._orig_max_num_new_slots_for_drafting.fget(self)
    ddtree = get_ddtree_config(self)
    if ddtree is None:
        return slots
    return slots - self.num_speculative_tokens + ddtree.max_depth


def apply() -> None:
    """Install the process-0 config patches (harmless in every other process)."""
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    patch_attr(EngineArgs, "create_speculative_config", create_speculative_config)
    patch_attr(SpeculativeConfig, "max_num_new_slots_for_drafting", property(_max_num_new_slots_for_drafting))
    metrics.apply()
    requests.apply()
    scheduler.apply()
    structured_outputs.apply()
