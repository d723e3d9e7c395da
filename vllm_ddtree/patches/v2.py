"""Model Runner V2 seams (GPUs), installed in every process; each is a no-op unless the config asks for ddtree.

* ``GPUModelRunner.__init__``: clear the process's tree masks first, so an engine built after a ddtree engine in the
  same process (notebooks, tests) never reads that engine's stale words; a ddtree speculator installs its own.
* ``model_runner.init_speculator`` (the module global the runner calls): ``DDTreeSpeculator`` instead of DFlash's.
* ``DefaultModelState.custom_sampler``: vLLM's own hook for the rejection sampler; returns ``DDTreeRejectionSampler``.
* ``GPUModelRunner.initialize_kv_cache``: afterwards, bind the tree sampler to the block tables and KV caches,
  hand the speculator the target's graph manager (its persistent auxiliary outputs), and note the target's
  attention groups without the drafter's.
* ``DefaultModelState.prepare_attn``: the target step's metadata is built for the target's attention groups only:
  vLLM builds it for every group, the drafter's too, which DFlash plans again for its own pass (FlashAttention's
  scheduler metadata twice a step, host time in a batch-1 step that is host-bound).
* ``GPUModelRunner.prepare_attn``: after slot mappings were computed from linear positions, write the depth
  positions of tree rows in place and the per-token tree bits the tree-attention backend reads.
* ``Scheduler.__init__``: with Model Runner V2 the scheduler's per-step scan for blocks common to all running
  requests (an input of V1's cascade attention, which V2 never reads) is skipped: a Python loop over every block of
  a request, ~0.1 ms a step at 32k tokens, in a batch-1 step that is host-bound.
* ``CudaPlatform.get_attn_backend_cls``: vLLM has one ``CUSTOM`` slot; point it at the MLA or the GQA tree backend
  for the layer being built (a model's target layers are all MLA or all not).
"""

from __future__ import annotations

from typing import Any

from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.patches import patch_attr


def _runner_init(self: Any, *args: Any, **kwargs: Any) -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm_ddtree.backends.tree_mask import install_tree_masks

    install_tree_masks(None)
    GPUModelRunner._orig___init__(self, *args, **kwargs)


def _init_speculator(vllm_config: Any, device: Any) -> Any:
    from vllm.v1.worker.gpu import model_runner

    if get_ddtree_config(vllm_config) is None:
        return model_runner._orig_init_speculator(vllm_config, device)
    from vllm_ddtree.speculator import DDTreeSpeculator

    return DDTreeSpeculator(vllm_config, device)


def _custom_sampler(self: Any, sampler: Any) -> Any:
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    spec_config = self.vllm_config.speculative_config
    if get_ddtree_config(spec_config) is None:
        return DefaultModelState._orig_custom_sampler(self, sampler)
    from vllm_ddtree.sampler import DDTreeRejectionSampler

    return sampler, DDTreeRejectionSampler(sampler, spec_config, self.device)


def _initialize_kv_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm_ddtree.sampler import DDTreeRejectionSampler

    result = GPUModelRunner._orig_initialize_kv_cache(self, *args, **kwargs)
    if isinstance(getattr(self, "rejection_sampler", None), DDTreeRejectionSampler):
        self.rejection_sampler.attach(self)
        self.speculator.target_cudagraph_manager = self.cudagraph_manager
        draft_layers = set(self.speculator.draft_attn_layer_names)
        self.model_state.ddtree_target_attn_groups = (self.attn_groups,
                                                      target_attn_groups(self.attn_groups, draft_layers))
    return result


def target_attn_groups(attn_groups: list[list[Any]], draft_layers: set[str]) -> list[list[Any]]:
    """Per KV-cache group, the attention groups that hold a target layer (a group of drafter layers only is left
    out; the list keeps one entry per KV-cache group, as ``build_attn_metadata`` indexes it)."""
    return [[group for group in groups if not set(group.layer_names) <= draft_layers] for groups in attn_groups]


def _model_state_prepare_attn(self: Any, input_batch: Any, cudagraph_mode: Any, block_tables: Any,
                              slot_mappings: Any, attn_groups: Any, kv_cache_config: Any,
                              for_capture: bool = False) -> Any:
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    runner_groups, target_groups = getattr(self, "ddtree_target_attn_groups", (None, None))
    if attn_groups is runner_groups:
        attn_groups = target_groups
    return DefaultModelState._orig_prepare_attn(self, input_batch, cudagraph_mode, block_tables, slot_mappings,
                                                attn_groups, kv_cache_config, for_capture)


def _prepare_attn(self: Any, input_batch: Any) -> Any:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm_ddtree.backends.tree_mask import current_tree_masks
    from vllm_ddtree.speculator import DDTreeSpeculator
    from vllm_ddtree.verify_layout import write_verify_layout

    result = GPUModelRunner._orig_prepare_attn(self, input_batch)
    speculator = getattr(self, "speculator", None)
    masks = current_tree_masks()
    if isinstance(speculator, DDTreeSpeculator) and masks is not None:
        trees = speculator.trees
        write_verify_layout(
            input_batch.positions, masks.token_bits, input_batch.query_start_loc, input_batch.cu_num_logits,
            input_batch.idx_mapping, trees.depth, trees.anc_bits, input_batch.num_reqs,
        )  # fmt: skip
    return result


def _scheduler_init(self: Any, *args: Any, **kwargs: Any) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    Scheduler._orig___init__(self, *args, **kwargs)
    if self.use_v2_model_runner and get_ddtree_config(self.vllm_config) is not None:
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        self.kv_cache_manager.get_num_common_prefix_blocks = lambda request_id: [0] * num_groups


GQA_BACKEND = "vllm_ddtree.backends.gqa.DDTreeGQABackend"
MLA_BACKEND = "vllm_ddtree.backends.mla.DDTreeMLABackend"


def _get_attn_backend_cls(cls: Any, selected_backend: Any, attn_selector_config: Any, num_heads: Any = None) -> str:
    from vllm.platforms.cuda import CudaPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if selected_backend == AttentionBackendEnum.CUSTOM:
        register_backend(AttentionBackendEnum.CUSTOM, MLA_BACKEND if attn_selector_config.use_mla else GQA_BACKEND)
    return CudaPlatform._orig_get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)


def apply() -> None:
    """Install the V2 runner seams (idempotent)."""
    from vllm.v1.worker.gpu import model_runner
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    patch_attr(model_runner.GPUModelRunner, "__init__", _runner_init)
    patch_attr(model_runner, "init_speculator", _init_speculator)
    patch_attr(DefaultModelState, "custom_sampler", _custom_sampler)
    patch_attr(model_runner.GPUModelRunner, "initialize_kv_cache", _initialize_kv_cache)
    patch_attr(model_runner.GPUModelRunner, "prepare_attn", _prepare_attn)
    patch_attr(DefaultModelState, "prepare_attn", _model_state_prepare_attn)
    from vllm.v1.core.sched.scheduler import Scheduler

    patch_attr(Scheduler, "__init__", _scheduler_init)
    from vllm.platforms.cuda import CudaPlatform

    patch_attr(CudaPlatform, "get_attn_backend_cls", classmethod(_get_attn_backend_cls))
