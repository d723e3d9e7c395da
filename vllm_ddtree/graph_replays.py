"""Counting FULL CUDA-graph replays of a Model Runner V2 graph manager, to check that decode steps ran captured.

The GPU tests assert that verify and drafter steps replay graphs; ``bench/step_time.py`` records the counts with
each row, so a row whose steps fell out of the graphs shows it. Only the given instance is wrapped, nothing in vLLM.
"""

from __future__ import annotations

from typing import Any


class ReplayCounter:
    """Counts calls of one manager instance's ``run_fullgraph`` (none for ``None``: V1 runners have no manager)."""

    def __init__(self, manager: Any | None) -> None:
        self.count = 0
        if manager is None:
            return
        run = manager.run_fullgraph

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return run(*args, **kwargs)

        manager.run_fullgraph = counted
