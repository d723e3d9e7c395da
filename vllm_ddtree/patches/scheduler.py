"""Scheduler seam (the engine-core process), a no-op unless the config asks for ddtree.

``Scheduler.__init__``, afterwards:

* With an adaptive budget, vLLM's dynamic speculative-decoding lookup (``dynamic_sd_lookup[batch_size]``, the
  drafts to schedule per request next step) becomes ``adaptive.SchedulerBudgets``: on Model Runner V2 it asks the
  policy of the worker in this process; on vLLM-CPU the worker's drafter returns as many drafts as its policy chose
  and the scheduler schedules those. Either way new decodes are no longer padded with ``budget`` placeholders.
* With Model Runner V2 the scheduler's per-step scan for blocks common to all running requests (an input of V1's
  cascade attention, which V2 never reads) is skipped: a Python loop over every block of a request every step,
  host time in a batch-1 step that is host-bound.
"""

from __future__ import annotations

from typing import Any

from vllm_ddtree.adaptive import SchedulerBudgets
from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.patches import patch_attr


def _scheduler_init(self: Any, *args: Any, **kwargs: Any) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    Scheduler._orig___init__(self, *args, **kwargs)
    ddtree = get_ddtree_config(self.vllm_config)
    if ddtree is None:
        return
    if ddtree.adaptive_budget:
        # Model Runner V2 draws the next step's drafts from these placeholders only when scheduling is async.
        ask = self.use_v2_model_runner and bool(self.vllm_config.scheduler_config.async_scheduling)
        self.dynamic_sd_lookup = SchedulerBudgets(ddtree.budget, ask_policy=ask)
    if self.use_v2_model_runner:
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        self.kv_cache_manager.get_num_common_prefix_blocks = lambda request_id: [0] * num_groups


def apply() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    patch_attr(Scheduler, "__init__", _scheduler_init)
