"""Process-0 logging seam: ``SpecDecodingLogging.log`` adds the tree's own figures beside vLLM's line.

vLLM counts every node of a verified tree as a draft token, so its "draft acceptance rate" is accepted tokens over
``budget`` per step (a quarter or so even when trees do well). For a tree the figures that mean something are the
tokens per verify step (vLLM's mean acceptance length, which stays right) and how often the accepted path reaches
each depth, which is vLLM's per-position rate read as depth 1, 2, ... of the path.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from vllm_ddtree.config import DDTreeConfig
from vllm_ddtree.patches import patch_attr

logger = logging.getLogger("vllm.ddtree")
_active: list[DDTreeConfig] = []


def note_ddtree(config: DDTreeConfig) -> None:
    """Called where process 0 resolves the ddtree config: its engine's spec-decode logs are about trees."""
    _active[:] = [config]


def tree_summary(num_drafts: int, num_accepted: int, accepted_per_pos: list[list[int]], config: DDTreeConfig) -> str:
    """One line: tokens per verify step and the share of steps whose accepted path reaches each depth."""
    per_depth = np.sum(np.array(accepted_per_pos), axis=0) / num_drafts if accepted_per_pos else np.zeros(0)
    depths = ", ".join(f"{rate:.3f}" for rate in per_depth[: config.max_depth])
    return (
        f"DDTree: {1 + num_accepted / num_drafts:.2f} tokens per verify step over {num_drafts} trees of "
        f"{config.budget} nodes; accepted path reaches depth 1..{config.max_depth}: {depths} "
        f"(vLLM's draft acceptance rate divides by all {config.budget} nodes of each tree)"
    )


def _log(self: Any, log_fn: Any = None) -> None:
    from vllm.v1.spec_decode.metrics import SpecDecodingLogging

    num_drafts = int(np.sum(self.num_drafts)) if self.num_drafts else 0
    if _active and num_drafts and not self.is_diffusion:
        line = tree_summary(
            num_drafts, int(np.sum(self.num_accepted_tokens)), self.accepted_tokens_per_pos_lists, _active[0]
        )
        (log_fn or logger.info)(line)
    if log_fn is None:
        SpecDecodingLogging._orig_log(self)
    else:
        SpecDecodingLogging._orig_log(self, log_fn)


def apply() -> None:
    """Install the logging seam (idempotent)."""
    from vllm.v1.spec_decode.metrics import SpecDecodingLogging

    patch_attr(SpecDecodingLogging, "log", _log)
