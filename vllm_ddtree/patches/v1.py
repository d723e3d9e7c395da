"""Model Runner V1 seams (vLLM-CPU only; GPUs run DDTree on Model Runner V2).

* ``GPUModelRunner.__init__``: build ``DDTreeProposer`` where vLLM builds its ``DFlashProposer`` (the module global
  is swapped only during construction, so vLLM's ``isinstance(drafter, DFlashProposer)`` checks keep working),
  after clearing the process's tree masks (an engine built after a ddtree engine must not read its stale words);
  then the tree rejection sampler takes the place of vLLM's, and the runner keeps the proposer's step state.
* ``GPUModelRunner._prepare_inputs``: after vLLM computed slot mappings from linear positions, rewrite the tree
  rows' RoPE positions to ``base + depth`` in place and fill the batch-ordered ancestor masks. The paths of the
  previous step's tree walk are dropped first: they belong to that step's batch, and vLLM skips the drafter that
  would consume them when a request nears the drafter's length limit.
* ``GPUModelRunner._bookkeeping_sync``: vLLM rewinds a seeded request's generator after a discarded sample (a
  partial prefill chunk) with ``set_offset``, which CPU generators refuse (``CPU Generator does not use offset``,
  an engine death on vLLM-CPU). CPU generators are instead restored to the state they had before this step's
  sampling, which is the same draw-for-draw rewind.
* ``InputBatch.swap_states``: vLLM swaps two rows of the allowed-token-ids mask with a tuple assignment of row
  views, which copies one row over the other; when the decode-first reorder swaps a request that restricts its tokens
  with one that does not, the second gets the first one's mask (a greedy request then decodes from the wrong tokens).
  The rows are put right after vLLM's swap. ``InputBatch.condense`` moves a request's mask row down without clearing
  the row it leaves, and ``add_request`` writes rows only for requests with allowed ids, so the next request appended
  there inherited the stale mask: rows past the batch are cleared after each condense.
* ``GPUModelRunner.propose_draft_token_ids``: with an adaptive budget the proposer chooses the next step's budget
  first; for 0 the step returns empty per-request draft lists before vLLM prepares the drafter's inputs (a step
  without speculation then costs what it costs without a drafter).
* ``CPUModelRunner.warming_up_model``: afterwards, with an adaptive budget, time dummy decode steps of every
  candidate budget and give the proposer its policy (``vllm_ddtree.adaptive``).
``CPUModelRunner`` subclasses ``GPUModelRunner``, so it inherits the runner seams.
"""

from __future__ import annotations

from typing import Any

from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.patches import patch_attr
from vllm_ddtree.tree_mask import install_tree_masks
from vllm_ddtree.v1.step_state import needs_chain


def _runner_init(self: Any, vllm_config: Any, device: Any, *args: Any, **kwargs: Any) -> None:
    from vllm.v1.worker import gpu_model_runner

    from vllm_ddtree.v1.proposer import DDTreeProposer
    from vllm_ddtree.v1.sampler import DDTreeRejectionSamplerV1

    install_tree_masks(None)  # a ddtree runner installs its own; no other engine may read a predecessor's
    orig = gpu_model_runner.GPUModelRunner._orig___init__
    if get_ddtree_config(vllm_config) is None:
        orig(self, vllm_config, device, *args, **kwargs)
        return
    dflash = gpu_model_runner.DFlashProposer
    gpu_model_runner.DFlashProposer = DDTreeProposer
    try:
        orig(self, vllm_config, device, *args, **kwargs)
    finally:
        gpu_model_runner.DFlashProposer = dflash
    state = self.drafter.state
    self._ddtree_state = state
    self.rejection_sampler = DDTreeRejectionSamplerV1(self.sampler, self.speculative_config, device, state, self)


def _prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> Any:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    result = GPUModelRunner._orig__prepare_inputs(self, scheduler_output, num_scheduled_tokens)
    _snapshot_discarded_cpu_generators(self)
    state = getattr(self, "_ddtree_state", None)
    if state is None:
        return result
    state.paths = None
    num_reqs = self.input_batch.num_reqs
    req_ids = list(self.input_batch.req_ids[:num_reqs])
    spec = scheduler_output.scheduled_spec_decode_tokens
    drafts = [list(spec.get(req_id, ())) for req_id in req_ids]
    state.note_step_shape([int(n) for n in num_scheduled_tokens[:num_reqs]], drafts)
    if result[1] is None:  # no drafts scheduled this step
        state.skip_step()
        return result
    query_start = self.query_start_loc.np[: num_reqs + 1].tolist()
    chain = needs_chain(self.input_batch.sampling_metadata, scheduler_output.has_structured_output_requests)
    state.begin_step(req_ids, drafts, self.positions, query_start, chain_only=chain)
    return result


def _propose_draft_token_ids(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_ddtree.v1.proposer import DDTreeProposer

    drafter = getattr(self, "drafter", None)
    if isinstance(drafter, DDTreeProposer) and drafter.choose_budget(self.input_batch.num_reqs) == 0:
        # No drafts as per-request lists (vLLM's form for host-side proposers): a tensor, even [B, 0], would be
        # copied to the host on a side stream, whose set-up alone costs a step 0.3 ms on vLLM-CPU.
        return [[] for _ in range(self.input_batch.num_reqs)]
    return GPUModelRunner._orig_propose_draft_token_ids(self, scheduler_output, *args, **kwargs)


def _warming_up_model(self: Any) -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from vllm_ddtree.v1.proposer import DDTreeProposer

    CPUModelRunner._orig_warming_up_model(self)
    if isinstance(getattr(self, "drafter", None), DDTreeProposer):
        self.drafter.init_adaptive_budget(self)


def _snapshot_discarded_cpu_generators(runner: Any) -> None:
    """Save the state of each CPU generator whose request's sample is discarded this step (``_bookkeeping_sync``
    puts it back)."""
    num_reqs = runner.input_batch.num_reqs
    generators = runner.input_batch.generators
    runner._ddtree_generator_states = {
        int(i): generators[int(i)].get_state()
        for i in runner.discard_request_mask.np[:num_reqs].nonzero()[0]
        if int(i) in generators and generators[int(i)].device.type == "cpu"
    }


def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    states = getattr(self, "_ddtree_generator_states", None) or {}
    self._ddtree_generator_states = {}
    generators = self.input_batch.generators
    hidden = {i: generators.pop(i) for i in states}  # vLLM's set_offset rewind skips requests without a generator
    try:
        return GPUModelRunner._orig__bookkeeping_sync(self, *args, **kwargs)
    finally:
        for i, generator in hidden.items():
            generator.set_state(states[i])
            generators[i] = generator


def _swap_states(self: Any, i1: int, i2: int) -> None:
    from vllm.v1.worker.gpu_input_batch import InputBatch

    mask = self.allowed_token_ids_mask_cpu_tensor
    rows = (mask[i1].clone(), mask[i2].clone()) if mask is not None else None
    InputBatch._orig_swap_states(self, i1, i2)
    if rows is not None:
        mask[i1], mask[i2] = rows[1], rows[0]


def _condense(self: Any) -> None:
    from vllm.v1.worker.gpu_input_batch import InputBatch

    InputBatch._orig_condense(self)
    mask = self.allowed_token_ids_mask_cpu_tensor
    if mask is not None:
        mask[self.num_reqs :] = False


CPU_BACKEND = "vllm_ddtree.backends.cpu.DDTreeCPUAttentionBackend"


def apply() -> None:
    """Install the V1 runner seams and the tree-aware CPU attention in CPU_ATTN's slot (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
    patch_attr(GPUModelRunner, "__init__", _runner_init)
    patch_attr(GPUModelRunner, "_prepare_inputs", _prepare_inputs)
    patch_attr(GPUModelRunner, "_bookkeeping_sync", _bookkeeping_sync)
    patch_attr(GPUModelRunner, "propose_draft_token_ids", _propose_draft_token_ids)
    patch_attr(InputBatch, "swap_states", _swap_states)
    patch_attr(InputBatch, "condense", _condense)
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    patch_attr(CPUModelRunner, "warming_up_model", _warming_up_model)
