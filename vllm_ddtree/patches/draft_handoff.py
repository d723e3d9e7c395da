"""Drafts ride back with the step's output (vLLM-CPU): one engine-to-worker round trip a step instead of two.

Without async scheduling (vLLM-CPU has none) vLLM's engine core asks the worker for the next step's drafts with a
second RPC after every step (``EngineCore.post_step`` -> ``take_draft_token_ids``). Behind ``vllm serve`` on a
small CPU, where the API server, the engine core and the worker share the cores, that round trip costs about as
much as a tenth to a fifth of a decode step, also in the steps where the adaptive budget verifies no drafts. So:

* worker, ``GPUModelRunner.sample_tokens`` (Model Runner V1; ``CPUModelRunner`` inherits it): with a DDTree
  drafter and synchronous scheduling, the drafts ``take_draft_token_ids`` would return are attached to the
  ``ModelRunnerOutput`` (``DRAFTS_ATTR``), which is pickled to the engine core in the same reply;
* engine core, ``MultiprocExecutor``: ``sample_tokens`` keeps the attached drafts, ``take_draft_token_ids``
  answers with them without an RPC, and ``execute_model`` drops any that a step left unasked, so drafts are only
  ever those of the step that just ran. An output without them (vLLM's chain, no speculation) takes vLLM's RPC.

What the scheduler receives, and when, is unchanged: the same ``DraftTokenIds`` in the same ``post_step``.
"""

from __future__ import annotations

from typing import Any

from vllm_ddtree.patches import patch_attr

DRAFTS_ATTR = "ddtree_draft_token_ids"
"""The attribute of a ``ModelRunnerOutput`` that carries the next step's ``DraftTokenIds`` (or None)."""
_KEPT = "_ddtree_kept_drafts"
"""The executor's attribute holding the last step's drafts, as a one-tuple (absent: ask the worker)."""


def _runner_sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_ddtree.v1.proposer import DDTreeProposer

    output = GPUModelRunner._orig_sample_tokens(self, *args, **kwargs)
    if (
        isinstance(getattr(self, "drafter", None), DDTreeProposer)
        and not self.use_async_scheduling
        and type(output) is ModelRunnerOutput
    ):
        drafts = self.take_draft_token_ids()
        if drafts is not None:  # vLLM hands over the live list of the batch's ids: the reply must hold this step's
            drafts = DraftTokenIds(list(drafts.req_ids), drafts.draft_token_ids)
        setattr(output, DRAFTS_ATTR, drafts)
    return output


def _executor_execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    self.__dict__.pop(_KEPT, None)
    return MultiprocExecutor._orig_execute_model(self, *args, **kwargs)


def _executor_sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    output = MultiprocExecutor._orig_sample_tokens(self, *args, **kwargs)
    attached = getattr(output, "__dict__", {})  # a Future (non-blocking calls) carries nothing yet
    if DRAFTS_ATTR in attached:
        self.__dict__[_KEPT] = (attached.pop(DRAFTS_ATTR),)
    return output


def _executor_take_draft_token_ids(self: Any) -> Any:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    kept = self.__dict__.pop(_KEPT, None)
    if kept is not None:
        return kept[0]
    return MultiprocExecutor._orig_take_draft_token_ids(self)


def apply() -> None:
    """Install both halves (idempotent); each is a no-op for outputs without DDTree drafts."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patch_attr(GPUModelRunner, "sample_tokens", _runner_sample_tokens)
    patch_attr(MultiprocExecutor, "execute_model", _executor_execute_model)
    patch_attr(MultiprocExecutor, "sample_tokens", _executor_sample_tokens)
    patch_attr(MultiprocExecutor, "take_draft_token_ids", _executor_take_draft_token_ids)
