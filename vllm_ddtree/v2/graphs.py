"""DFlash's context K/V write, replayed from CUDA graphs on Model Runner V2.

Before every drafter pass DFlash writes the drafter's K/V of the step's target tokens (their hidden rows: norm, one
fused GEMM for all drafter layers, K norm, RoPE, one cache write per layer) — eagerly, because the token count
varies between steps, so each step pays about ten launches and their Python. A DDTree decode step of r requests
always has r × (budget + 1) target tokens, and DFlash hands them over in its persistent buffers (hidden rows,
positions, context slots), so those sizes are captured once and replayed: at batch 1 the decode step is host-bound
and this is host time it no longer spends. The write is row-wise, so a captured size serves any step of that many
tokens; other sizes, and calls on other tensors (dummy runs, profiling), run eagerly as before.

The hidden rows themselves come from DFlash's combine of the target's auxiliary hidden states (concatenate, one
``fc`` GEMM, a copy into its persistent buffer), eager too; on Model Runner V2 a decode step's auxiliary states are
views of the target graph manager's persistent output buffers, so ``CombineGraphs`` captures the combine for the
same sizes on those buffers. ``ReplayCounter`` counts a graph manager's FULL replays (GPU tests, benches), which
shows whether decode steps ran captured.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from vllm.v1.attention.backends.utils import PAD_SLOT_ID

Slots = torch.Tensor | list[torch.Tensor | None] | None


def _views(slots: Slots) -> tuple[tuple[int, int], ...] | None:
    """Where a context-slot argument points (address and length of each tensor), to recognise the captured one."""
    if slots is None:
        return None
    tensors = [slots] if isinstance(slots, torch.Tensor) else list(slots)
    if any(t is None for t in tensors):
        return None
    return tuple((t.data_ptr(), t.shape[0]) for t in tensors)


def wanted_sizes(sizes: Iterable[int], limit: int) -> list[int]:
    """The sizes to capture: each of ``sizes`` in ``1..limit`` once, largest first (the first capture sizes the
    shared memory pool)."""
    return sorted({n for n in sizes if 0 < n <= limit}, reverse=True)


def capture_each(run: Callable[[int], object], sizes: list[int]) -> dict[int, torch.cuda.CUDAGraph]:
    """One CUDA graph of ``run(n)`` per size, in one memory pool, each after a warm-up run outside the capture
    (library handles, kernel selection)."""
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    if not sizes:
        return graphs
    pool = torch.cuda.graph_pool_handle()
    for n in sizes:
        run(n)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            run(n)
        graphs[n] = graph
    torch.cuda.synchronize()
    return graphs


class ContextKVGraphs:
    """Callable in place of the drafter model's ``precompute_and_store_context_kv(states, positions, slots)``.

    ``slots_for(n)`` gives the context-slot argument DFlash passes for ``n`` tokens (one tensor, or one per drafter
    layer), views of ``slot_rows``; ``states`` and ``positions`` are the persistent buffers DFlash passes sliced to
    ``n``. A captured size replays when a call brings exactly those views, else the original runs.
    """

    def __init__(
        self,
        precompute: Callable[..., None],
        states: torch.Tensor,
        positions: torch.Tensor,
        slot_rows: torch.Tensor,
        slots_for: Callable[[int], Slots],
    ) -> None:
        self.original = precompute
        self._states = states
        self._positions = positions
        self._slot_rows = slot_rows
        self._slots_for = slots_for
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[tuple[int, int], ...] | None]] = {}  # + slot views
        self.replays = 0

    @property
    def sizes(self) -> list[int]:
        return sorted(self._graphs)

    def capture(self, sizes: Iterable[int]) -> None:
        """Capture the write for each token count (largest first, one memory pool). The slot rows are set to
        ``PAD_SLOT_ID`` first, so the capture's own runs write nothing into the cache; DFlash rewrites the rows it
        uses before every call."""
        wanted = wanted_sizes(sizes, self._states.shape[0])
        if not wanted:
            return
        self._slot_rows.fill_(PAD_SLOT_ID)
        graphs = capture_each(
            lambda n: self.original(self._states[:n], self._positions[:n], self._slots_for(n)), wanted
        )
        self._graphs = {n: (graph, _views(self._slots_for(n))) for n, graph in graphs.items()}

    def __call__(self, states: torch.Tensor, positions: torch.Tensor, slots: Slots = None) -> None:
        n = states.shape[0]
        graph, views = self._graphs.get(n, (None, None))
        if (
            graph is not None
            and views is not None
            and states.data_ptr() == self._states.data_ptr()
            and positions.data_ptr() == self._positions.data_ptr()
            and positions.shape[0] == n
            and _views(slots) == views
        ):
            graph.replay()
            self.replays += 1
            return
        self.original(states, positions, slots)


class CombineGraphs:
    """DFlash's combine ``states[:n] = combine(cat(aux[:n], -1))``, captured for decode sizes on the target graph
    manager's persistent auxiliary buffers ``aux`` (one per target layer DFlash reads) and DFlash's hidden-row
    buffer ``states``. ``replay(aux_views)`` replays when the views are exactly ``aux[i][:n]`` of a captured ``n``
    and says whether it did; otherwise the caller combines eagerly as before."""

    def __init__(
        self, combine: Callable[[torch.Tensor], torch.Tensor], aux: list[torch.Tensor], states: torch.Tensor
    ) -> None:
        self._combine = combine
        self._aux = aux
        self._states = states
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0

    @property
    def sizes(self) -> list[int]:
        return sorted(self._graphs)

    def _run(self, n: int) -> None:
        self._states[:n].copy_(self._combine(torch.cat([a[:n] for a in self._aux], dim=-1)))

    def capture(self, sizes: Iterable[int]) -> None:
        """Capture the combine for each row count (largest first, one memory pool); it reads the buffers as they
        are and writes only DFlash's scratch rows, which every step rewrites before reading."""
        if self._aux:
            limit = min([self._states.shape[0], *(a.shape[0] for a in self._aux)])
            self._graphs = capture_each(self._run, wanted_sizes(sizes, limit))

    def replay(self, aux: list[torch.Tensor]) -> bool:
        n = aux[0].shape[0] if aux else 0
        graph = self._graphs.get(n)
        if (
            graph is None
            or len(aux) != len(self._aux)
            or any(
                view.data_ptr() != buf.data_ptr() or view.shape != (n, *buf.shape[1:]) or view.stride() != buf.stride()
                for view, buf in zip(aux, self._aux, strict=True)
            )
        ):
            return False
        graph.replay()
        self.replays += 1
        return True


def decode_context_sizes(width: int, max_num_reqs: int, max_tokens: int) -> list[int]:
    """Target token counts of decode steps: ``r * width`` for ``r`` requests, up to ``max_tokens``."""
    return [r * width for r in range(1, max_num_reqs + 1) if r * width <= max_tokens]


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
