"""DFlash's context K/V write and its combine of the target's auxiliary hidden states, replayed from CUDA graphs
(``vllm_ddtree.v2.graphs``): a replay writes what the eager code writes, the capture itself writes nothing
into the cache, and every call a graph cannot serve runs (or is left to) the eager code."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.patches.v2 import install_context_kv_graphs
from vllm_ddtree.v2.graphs import CombineGraphs, ContextKVGraphs, decode_context_sizes

HIDDEN, HEAD, ROWS = 48, 16, 40


class ToyDrafter:
    """A stand-in for DFlash's write with its shape of work: a GEMM of the hidden rows, a position-dependent
    rotation, one cache write per layer at the context slots (slot -1 writes nothing: it lands on a trash row)."""

    def __init__(self, device: torch.device, layers: int = 2) -> None:
        gen = torch.Generator().manual_seed(0)
        self.weight = torch.randn(HIDDEN, layers * HEAD, generator=gen).to(device)
        self.caches = [torch.full((ROWS + 1, HEAD), float("nan"), device=device) for _ in range(layers)]
        self.calls = 0

    def precompute(self, states: torch.Tensor, positions: torch.Tensor, slots: object) -> None:
        self.calls += 1
        kv = (states @ self.weight).view(states.shape[0], len(self.caches), HEAD)
        kv = kv * torch.cos(positions.float())[:, None, None]
        for i, cache in enumerate(self.caches):
            layer_slots = slots[i] if isinstance(slots, list) else slots
            if layer_slots is None:
                continue
            rows = torch.where(layer_slots >= 0, layer_slots, ROWS)
            cache.index_copy_(0, rows, kv[:, i])


def buffers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.zeros(32, HIDDEN, device=device),
        torch.zeros(32, dtype=torch.int64, device=device),
        torch.zeros(2, 32, dtype=torch.int64, device=device),
    )


def test_decode_context_sizes_are_whole_verify_widths_up_to_the_graph_limit() -> None:
    assert decode_context_sizes(17, 8, 64) == [17, 34, 51]
    assert decode_context_sizes(9, 2, 512) == [9, 18]
    assert decode_context_sizes(65, 4, 64) == []


def test_uncaptured_calls_run_the_original_write() -> None:
    drafter = ToyDrafter(torch.device("cpu"))
    states, positions, rows = buffers(torch.device("cpu"))
    graphs = ContextKVGraphs(drafter.precompute, states, positions, rows, lambda n: rows[0][:n])
    states[:3] = 1.0
    rows[0, :3] = torch.tensor([5, -1, 7])
    graphs(states[:3], positions[:3], rows[0][:3])
    assert drafter.calls == 1 and graphs.replays == 0
    assert torch.equal(drafter.caches[0][5], drafter.caches[0][7])
    assert torch.isnan(drafter.caches[0][:5]).all()


def test_installing_twice_wraps_the_original_write_once() -> None:
    """The graphs take the write's place on the model instance; a second capture (vLLM re-captures after a KV-cache
    re-init) wraps the original again, never the first graphs, whose cache addresses would be stale."""
    drafter = ToyDrafter(torch.device("cpu"))
    model = type("Model", (), {"precompute_and_store_context_kv": lambda self, *a: drafter.precompute(*a)})()
    states, positions, rows = buffers(torch.device("cpu"))
    first = install_context_kv_graphs(model, states, positions, rows, None, [])
    second = install_context_kv_graphs(model, states, positions, rows, [0, 1], [])
    assert model.precompute_and_store_context_kv is second and isinstance(second, ContextKVGraphs)
    assert first is not None and second.original == first.original and not isinstance(second.original, ContextKVGraphs)
    rows[0, :2] = torch.tensor([4, 9])
    states[:2] = 2.0
    model.precompute_and_store_context_kv(states[:2], positions[:2], [rows[0][:2], rows[0][:2]])
    assert drafter.calls == 1 and not torch.isnan(drafter.caches[1][9]).any()
    assert install_context_kv_graphs(object(), states, positions, rows, None, [3]) is None


@pytest.mark.gpu
@pytest.mark.parametrize("per_layer", [False, True])
def test_replays_write_what_the_eager_write_writes(per_layer: bool) -> None:
    device = torch.device("cuda")
    drafter, reference = ToyDrafter(device), ToyDrafter(device)
    states, positions, rows = buffers(device)
    layer_groups = [1, 0]

    def slots_for(n: int) -> object:
        return [rows[g][:n] for g in layer_groups] if per_layer else rows[0][:n]

    rows.fill_(3)  # stale slots: the capture must not write through them
    graphs = ContextKVGraphs(drafter.precompute, states, positions, rows, slots_for)
    graphs.capture([6, 3, 40, 0])
    assert graphs.sizes == [3, 6]
    assert all(torch.isnan(cache[:ROWS]).all() for cache in drafter.caches), "the capture wrote into the cache"

    gen = torch.Generator(device=device).manual_seed(1)
    for step, n in enumerate([3, 6, 5, 3]):
        states.copy_(torch.randn(states.shape, generator=gen, device=device))
        positions.copy_(torch.randint(0, 1000, positions.shape, generator=gen, device=device))
        perm = torch.randperm(ROWS, generator=gen, device=device)
        rows[0].copy_(perm[:32])
        rows[1].copy_(perm.flip(0)[:32])
        rows[:, 1] = -1  # a padded row writes nothing
        calls = drafter.calls
        graphs(states[:n], positions[:n], slots_for(n))
        reference.precompute(states[:n], positions[:n], slots_for(n))
        assert drafter.calls == calls + (n == 5), f"step {step}: size {n} should {'not ' * (n != 5)}run eagerly"
        for got, want in zip(drafter.caches, reference.caches, strict=True):
            torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    assert graphs.replays == 3

    # Tensors other than the captured buffers (a copy, another slot row) run eagerly.
    calls = drafter.calls
    graphs(states[:3].clone(), positions[:3], slots_for(3))
    graphs(states[:3], positions[:3], [rows[0][:3], rows[0][:3]] if per_layer else rows[1][:3])
    assert drafter.calls == calls + 2 and graphs.replays == 3


def test_combine_graphs_without_a_capture_leave_every_call_to_the_eager_combine() -> None:
    aux = [torch.zeros(8, 4), torch.zeros(8, 4)]
    graphs = CombineGraphs(lambda x: x[:, :4], aux, torch.zeros(8, 4))
    graphs.capture([])
    assert graphs.sizes == [] and not graphs.replay([a[:3] for a in aux]) and not graphs.replay([])
    assert graphs.replays == 0


@pytest.mark.gpu
def test_combine_replays_write_what_the_eager_combine_writes() -> None:
    """DFlash's combine (concatenate the target layers' rows, one GEMM, copy into its hidden-row buffer), replayed
    for the captured row counts on the target's persistent auxiliary buffers, bit for bit; other row counts, other
    tensors and other shapes are refused (the caller then combines eagerly)."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(2)
    weight = torch.randn(3 * HIDDEN, HIDDEN, generator=gen, device=device, dtype=torch.bfloat16)

    def combine(x: torch.Tensor) -> torch.Tensor:
        return x @ weight

    aux = [torch.empty(48, HIDDEN, device=device, dtype=torch.bfloat16) for _ in range(3)]
    states = torch.full((40, HIDDEN), float("nan"), device=device, dtype=torch.bfloat16)
    graphs = CombineGraphs(combine, aux, states)
    graphs.capture([34, 17, 51, 0])
    assert graphs.sizes == [17, 34]  # 51 rows exceed the hidden-row buffer
    for n in [17, 34, 17]:
        for a in aux:
            a.copy_(torch.randn(a.shape, generator=gen, device=device))
        states.fill_(float("nan"))
        assert graphs.replay([a[:n] for a in aux])
        want = combine(torch.cat([a[:n] for a in aux], dim=-1))
        torch.testing.assert_close(states[:n], want, rtol=0, atol=0)
        assert torch.isnan(states[n:]).all(), "the replay wrote rows beyond its size"
    assert graphs.replays == 3
    assert not graphs.replay([a[:20] for a in aux])  # a size not captured
    assert not graphs.replay([a[:17].clone() for a in aux])  # other tensors
    assert not graphs.replay([a[1:18] for a in aux])  # other rows of the buffers
    assert not graphs.replay([a[:17] for a in aux[:2]])  # fewer target layers
    assert graphs.replays == 3


@pytest.mark.parametrize("replayed", [True, False])
def test_the_speculator_hands_dflash_the_replayed_rows_or_the_auxiliary_states(
    replayed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a combine replay DFlash gets no auxiliary states and its own hidden-row buffer as the step's hidden
    states (its copy of them onto themselves is then a no-op); without one, the auxiliary states as they came."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from vllm_ddtree.v2.speculator import DDTreeSpeculator

    handed: list[tuple[object, object]] = []
    monkeypatch.setattr(
        DFlashSpeculator, "propose", lambda self, batch, meta, slots, last, aux, *rest: handed.append((last, aux))
    )
    speculator = object.__new__(DDTreeSpeculator)
    speculator.step = SimpleNamespace(take_paths=lambda: None, skip_drafter=False)
    speculator.hidden_states = torch.zeros(8, 4)
    speculator._path_kernel_compiled = True  # dummy runs restore no paths once the path kernel has compiled
    offered: list[list[torch.Tensor]] = []
    speculator.combine_graphs = SimpleNamespace(replay=lambda aux: offered.append(aux) or replayed)
    last, aux = torch.ones(3, 4), [torch.ones(3, 4), torch.ones(3, 4)]
    rest = (None, None, None, None, None, None)
    batch = SimpleNamespace(num_reqs=3)
    speculator.propose(batch, {}, {}, last, aux, *rest)
    speculator.propose(batch, {}, {}, last, aux, *rest, dummy_run=True)
    assert offered == [aux], "dummy runs never replay"
    assert handed[0] == ((speculator.hidden_states, None) if replayed else (last, aux))
    assert handed[1] == (last, aux)
