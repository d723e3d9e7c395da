"""ReplayCounter counts one manager instance's FULL-graph replays and passes them through unchanged."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_ddtree.v2.graphs import ReplayCounter


def test_counts_replays_of_one_instance_and_keeps_their_results() -> None:
    manager = SimpleNamespace(run_fullgraph=lambda desc: f"replayed {desc}")
    other = SimpleNamespace(run_fullgraph=lambda desc: desc)
    counter = ReplayCounter(manager)
    assert manager.run_fullgraph("a") == "replayed a" and manager.run_fullgraph("b") == "replayed b"
    other.run_fullgraph("c")
    assert counter.count == 2
    assert ReplayCounter(None).count == 0  # a V1 runner has no graph manager
