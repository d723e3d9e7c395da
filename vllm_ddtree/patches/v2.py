"""Model Runner V2 seams (GPUs), installed in every process; each is a no-op unless the config asks for ddtree.

* ``GPUModelRunner.__init__``: clear the process's tree masks first, so an engine built after a ddtree engine in the
  same process (notebooks, tests) never reads that engine's stale words; a ddtree speculator installs its own.
* ``model_runner.init_speculator`` (the module global the runner calls): ``DDTreeSpeculator`` instead of DFlash's.
* ``DefaultModelState.custom_sampler``: vLLM's own hook for the rejection sampler; returns ``DDTreeRejectionSampler``.
* ``GPUModelRunner.initialize_kv_cache``: afterwards, hand the speculator's step state (``v2.step_state``) to the
  tree sampler (with the block tables and KV caches) and to the model state, with the target's graph manager (its
  persistent auxiliary outputs) and the target's attention groups without the drafter's.
* ``DefaultModelState.add_request``: mark a new request whose sampling features read drafts as one sequence, so
  its trees are top-1 chains.
* ``DefaultModelState.prepare_attn``: the target step's metadata is built for the target's attention groups only:
  vLLM builds it for every group, the drafter's too, which DFlash plans again for its own pass (FlashAttention's
  scheduler metadata twice a step, host time in a batch-1 step that is host-bound).
* ``GPUModelRunner.prepare_attn``: after slot mappings were computed from linear positions, write the depth
  positions of tree rows in place and the per-token tree bits the tree-attention backend reads.
* ``GPUModelRunner.capture_model``: afterwards, with an adaptive budget, time dummy decode steps of every candidate
  budget (``v2.step_costs``) and register the policy for this process's scheduler (``vllm_ddtree.adaptive``).
* ``GPUModelRunner.execute_model``: tell the speculator the budget the scheduler chose for the next step
  (``SchedulerOutput.num_spec_tokens_to_schedule``), so it skips the drafter pass when that step verifies nothing.
* ``CudaPlatform.get_attn_backend_cls``: vLLM has one ``CUSTOM`` slot; point it at the MLA or the GQA tree backend
  for the layer being built (a model's target layers are all MLA or all not).
* The DFlash drafter model's ``precompute_and_store_context_kv`` (an instance attribute, nothing in vLLM's classes):
  replaced by its CUDA graphs (``install_context_kv_graphs``, called by the speculator's ``capture``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.patches import patch_attr
from vllm_ddtree.v2.graphs import ContextKVGraphs, Slots


def _runner_init(self: Any, *args: Any, **kwargs: Any) -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm_ddtree.tree_mask import install_tree_masks

    install_tree_masks(None)
    GPUModelRunner._orig___init__(self, *args, **kwargs)


def _init_speculator(vllm_config: Any, device: Any) -> Any:
    from vllm.v1.worker.gpu import model_runner

    if get_ddtree_config(vllm_config) is None:
        return model_runner._orig_init_speculator(vllm_config, device)
    from vllm_ddtree.v2.speculator import DDTreeSpeculator

    return DDTreeSpeculator(vllm_config, device)


def _custom_sampler(self: Any, sampler: Any) -> Any:
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    spec_config = self.vllm_config.speculative_config
    if get_ddtree_config(spec_config) is None:
        return DefaultModelState._orig_custom_sampler(self, sampler)
    from vllm_ddtree.v2.sampler import DDTreeRejectionSampler

    return sampler, DDTreeRejectionSampler(sampler, spec_config, self.device)


def _initialize_kv_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm_ddtree.v2.sampler import DDTreeRejectionSampler

    result = GPUModelRunner._orig_initialize_kv_cache(self, *args, **kwargs)
    if isinstance(getattr(self, "rejection_sampler", None), DDTreeRejectionSampler):
        step = self.speculator.step
        step.target_cudagraph_manager = self.cudagraph_manager
        draft_layers = set(self.speculator.draft_attn_layer_names)
        step.attn_groups = (self.attn_groups, target_attn_groups(self.attn_groups, draft_layers))
        self.rejection_sampler.attach(self)
        self.model_state.ddtree_step = step
    return result


def target_attn_groups(attn_groups: list[list[Any]], draft_layers: set[str]) -> list[list[Any]]:
    """Per KV-cache group, the attention groups that hold a target layer (a group of drafter layers only is left
    out; the list keeps one entry per KV-cache group, as ``build_attn_metadata`` indexes it)."""
    return [[group for group in groups if not set(group.layer_names) <= draft_layers] for groups in attn_groups]


def _model_state_prepare_attn(
    self: Any,
    input_batch: Any,
    cudagraph_mode: Any,
    block_tables: Any,
    slot_mappings: Any,
    attn_groups: Any,
    kv_cache_config: Any,
    for_capture: bool = False,
) -> Any:
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    step = getattr(self, "ddtree_step", None)
    if step is not None and step.attn_groups is not None and attn_groups is step.attn_groups[0]:
        attn_groups = step.attn_groups[1]
    return DefaultModelState._orig_prepare_attn(
        self, input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups, kv_cache_config, for_capture
    )


def _model_state_add_request(self: Any, req_index: int, new_req_data: Any) -> None:
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    DefaultModelState._orig_add_request(self, req_index, new_req_data)
    step = getattr(self, "ddtree_step", None)
    if step is not None:
        step.add_request(req_index, new_req_data.sampling_params)


def _prepare_attn(self: Any, input_batch: Any) -> Any:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm_ddtree.tree_mask import current_tree_masks
    from vllm_ddtree.v2.speculator import DDTreeSpeculator
    from vllm_ddtree.v2.verify_layout import write_verify_layout

    result = GPUModelRunner._orig_prepare_attn(self, input_batch)
    speculator = getattr(self, "speculator", None)
    masks = current_tree_masks()
    if isinstance(speculator, DDTreeSpeculator) and masks is not None:
        trees = speculator.step.trees
        write_verify_layout(
            input_batch.positions,
            masks.token_bits,
            input_batch.query_start_loc,
            input_batch.cu_num_logits,
            input_batch.idx_mapping,
            trees.depth,
            trees.anc_bits,
            input_batch.num_reqs,
        )
    return result


def _capture_model(self: Any) -> int:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm_ddtree.v2.speculator import DDTreeSpeculator

    size = GPUModelRunner._orig_capture_model(self)
    if isinstance(getattr(self, "speculator", None), DDTreeSpeculator):
        self.speculator.init_adaptive_budget(self)
    return size


def _execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm_ddtree.v2.speculator import DDTreeSpeculator

    speculator = getattr(self, "speculator", None)
    if isinstance(speculator, DDTreeSpeculator) and not kwargs.get("dummy_run", False):
        speculator.step.note_schedule(scheduler_output)
    return GPUModelRunner._orig_execute_model(self, scheduler_output, *args, **kwargs)


GQA_BACKEND = "vllm_ddtree.backends.gqa.DDTreeGQABackend"
MLA_BACKEND = "vllm_ddtree.backends.mla.DDTreeMLABackend"


def _get_attn_backend_cls(cls: Any, selected_backend: Any, attn_selector_config: Any, num_heads: Any = None) -> str:
    from vllm.platforms.cuda import CudaPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if selected_backend == AttentionBackendEnum.CUSTOM:
        register_backend(AttentionBackendEnum.CUSTOM, MLA_BACKEND if attn_selector_config.use_mla else GQA_BACKEND)
    return CudaPlatform._orig_get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)


def install_context_kv_graphs(
    model: Any,
    states: torch.Tensor,
    positions: torch.Tensor,
    slot_rows: torch.Tensor,
    layer_groups: list[int] | None,
    sizes: Iterable[int],
) -> ContextKVGraphs | None:
    """Capture ``model``'s context K/V write for ``sizes`` on DFlash's persistent buffers (hidden rows, positions,
    one context-slot row per KV-cache group; ``layer_groups`` maps each drafter layer to its row, None when all
    share row 0) and put the graphs in the write's place (an instance attribute: nothing in vLLM's classes changes;
    a second capture replaces the first, whose graphs would hold stale cache addresses). None when the drafter has
    no such write."""
    precompute = getattr(model, "precompute_and_store_context_kv", None)
    if isinstance(precompute, ContextKVGraphs):
        precompute = precompute.original
    if precompute is None:
        return None

    def slots_for(n: int) -> Slots:
        if layer_groups is not None:
            return [slot_rows[g][:n] for g in layer_groups]
        return slot_rows[0][:n]

    graphs = ContextKVGraphs(precompute, states, positions, slot_rows, slots_for)
    graphs.capture(sizes)
    model.precompute_and_store_context_kv = graphs
    return graphs


def apply() -> None:
    """Install the V2 runner seams and the tree-attention backends in vLLM's CUSTOM slot (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.worker.gpu import model_runner
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    register_backend(AttentionBackendEnum.CUSTOM, GQA_BACKEND)

    patch_attr(model_runner.GPUModelRunner, "__init__", _runner_init)
    patch_attr(model_runner, "init_speculator", _init_speculator)
    patch_attr(DefaultModelState, "custom_sampler", _custom_sampler)
    patch_attr(model_runner.GPUModelRunner, "initialize_kv_cache", _initialize_kv_cache)
    patch_attr(model_runner.GPUModelRunner, "prepare_attn", _prepare_attn)
    patch_attr(DefaultModelState, "prepare_attn", _model_state_prepare_attn)
    patch_attr(DefaultModelState, "add_request", _model_state_add_request)
    patch_attr(model_runner.GPUModelRunner, "capture_model", _capture_model)
    patch_attr(model_runner.GPUModelRunner, "execute_model", _execute_model)
    from vllm.platforms.cuda import CudaPlatform

    patch_attr(CudaPlatform, "get_attn_backend_cls", classmethod(_get_attn_backend_cls))
