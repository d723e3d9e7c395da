"""The "ddtree" speculative-config surface: parsing, defaults, one-sentence errors, and the EngineArgs patch."""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path

import pytest

from vllm_ddtree.config import (
    MAX_BUDGET,
    DDTreeConfig,
    DDTreeConfigError,
    drafter_block_size,
    get_ddtree_config,
    resolve_ddtree_config,
    split_speculative_config,
)

VLLM_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "draft_load_config",
    "draft_sample_method",
    "rejection_sample_method",
    "num_speculative_tokens_per_batch_size",
    "attention_backend",
}


def _split(**extra):
    raw = {"method": "ddtree", "model": "/m", "num_speculative_tokens": 16, **extra}
    return split_speculative_config(raw, VLLM_KEYS)


def test_split_maps_to_dflash_and_keeps_vllm_keys() -> None:
    vllm_dict, request = _split(topk=4, max_depth=7, **{"draft-load-config": {"load_format": "safetensors"}})
    assert vllm_dict == {
        "method": "dflash",
        "model": "/m",
        "num_speculative_tokens": 16,
        "draft_load_config": {"load_format": "safetensors"},
    }
    assert (request.budget, request.topk, request.max_depth, request.adaptive_budget) == (16, 4, 7, True)


def test_defaults_follow_the_drafter_block_size() -> None:
    _, request = _split()
    cfg = resolve_ddtree_config(request, block_size=16)
    assert cfg == DDTreeConfig(budget=16, topk=8, max_depth=15)
    assert cfg.width == 17
    assert cfg.adaptive_budget and cfg.budgets == (0, 1, 3, 7, 15, 16)
    _, fixed = _split(adaptive_budget=False)
    assert resolve_ddtree_config(fixed, block_size=16).budgets == (16,)
    _, small = split_speculative_config({"method": "ddtree", "model": "/m", "num_speculative_tokens": 3}, VLLM_KEYS)
    assert resolve_ddtree_config(small, block_size=4).topk == 3


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"num_speculative_tokens": 64}, f"is 64, but it must be an integer from 1 to {MAX_BUDGET}"),
        ({"num_speculative_tokens": 0}, "'num_speculative_tokens' is 0"),
        ({"num_speculative_tokens": "8"}, "'num_speculative_tokens' is '8'"),
        ({"num_speculative_tokens": True}, "'num_speculative_tokens' is True"),
        ({"topk": 0}, "'topk' is 0, but it must be an integer from 1 to 16"),
        ({"topk": 17}, "'topk' is 17, but it must be an integer from 1 to 16"),
        ({"max_depth": 0}, "'max_depth' is 0"),
        ({"adaptive_budget": "yes"}, "'adaptive_budget' is 'yes', but it must be true (choose each step's node budget"),
        ({"adaptive_budget": 1}, "'adaptive_budget' is 1, but it must be true"),
        ({"top_k": 3}, "unknown key 'top_k'; did you mean 'topk'?"),
        ({"draft_sample_method": "probabilistic"}, "accepts only 'greedy'"),
        ({"rejection_sample_method": "synthetic"}, "accepts only 'standard'"),
        ({"num_speculative_tokens_per_batch_size": [[1, 4]]}, "one fixed node budget"),
        ({"model": ""}, "'model' is missing"),
    ],
)
def test_bad_values_raise_one_sentence(extra: dict, fragment: str) -> None:
    with pytest.raises(DDTreeConfigError) as err:
        _split(**extra)
    message = str(err.value)
    assert fragment in message
    assert message.count(". ") == 0 or "did you mean" in message  # one sentence (a suggestion may follow a semicolon)
    assert message.startswith("ddtree speculative config:")


def test_missing_budget_names_the_key() -> None:
    with pytest.raises(DDTreeConfigError, match="'num_speculative_tokens' .* is missing"):
        split_speculative_config({"method": "ddtree", "model": "/m"}, VLLM_KEYS)


def test_max_depth_is_checked_against_the_drafter() -> None:
    _, request = _split(max_depth=9)
    with pytest.raises(DDTreeConfigError, match="'max_depth' is 9, but it must be an integer from 1 to 7"):
        resolve_ddtree_config(request, block_size=8)
    _, no_depth = _split()
    with pytest.raises(DDTreeConfigError, match="'max_depth' is unset and the drafter config has no 'block_size'"):
        resolve_ddtree_config(no_depth, block_size=None)
    assert resolve_ddtree_config(request, block_size=None).max_depth == 9


def test_drafter_block_size_lookup() -> None:
    class Cfg:
        block_size = 16

    class Nested:
        dflash_config = {"block_size": 10}

    assert drafter_block_size(Cfg()) == 16
    assert drafter_block_size(Nested()) == 10
    assert drafter_block_size(object()) is None


def test_config_is_frozen_and_picklable() -> None:
    cfg = DDTreeConfig(budget=8, topk=4, max_depth=7)
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.budget = 9  # type: ignore[misc]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from kit import tiny_models

    root = tmp_path_factory.mktemp("tiny")
    return tiny_models.write_target(root / "target"), tiny_models.write_dflash_drafter(root / "drafter", block_size=8)


def _engine_args(target: Path, spec: dict):
    from vllm.engine.arg_utils import EngineArgs

    import vllm_ddtree.plugin

    vllm_ddtree.plugin.register()
    return EngineArgs(
        model=str(target), skip_tokenizer_init=True, max_model_len=512, dtype="float32", speculative_config=spec
    )


def test_engine_args_build_a_dflash_config_with_ddtree_attached(tiny_pair: tuple[Path, Path]) -> None:
    target, drafter = tiny_pair
    spec = {
        "method": "ddtree",
        "model": str(drafter),
        "num_speculative_tokens": 16,
        "topk": 4,
        "draft_load_config": {"load_format": "safetensors"},
    }
    args = _engine_args(target, dict(spec))
    config = args.create_engine_config()
    spec_cfg = config.speculative_config
    assert spec_cfg.method == "dflash"
    assert spec_cfg.num_speculative_tokens == 16
    assert get_ddtree_config(config) == DDTreeConfig(budget=16, topk=4, max_depth=7)
    # A DDTree drafter adds the slots of a DFlash chain of max_depth (7) drafts, not of budget (16) drafts.
    chain_slots = type(spec_cfg)._orig_max_num_new_slots_for_drafting.fget(spec_cfg)  # vLLM's, for K = 16
    assert spec_cfg.max_num_new_slots_for_drafting == chain_slots - 16 + 7
    # The user's dict is untouched, so building the config again gives the same answer.
    assert args.speculative_config == spec
    assert get_ddtree_config(args.create_engine_config()) == get_ddtree_config(config)
    # It survives the pickling that carries VllmConfig to the engine-core and worker processes.
    assert get_ddtree_config(pickle.loads(pickle.dumps(config))) == get_ddtree_config(config)


def test_spec_method_shorthand(tiny_pair: tuple[Path, Path]) -> None:
    from vllm.engine.arg_utils import EngineArgs

    import vllm_ddtree.plugin

    target, drafter = tiny_pair
    vllm_ddtree.plugin.register()
    args = EngineArgs(
        model=str(target),
        skip_tokenizer_init=True,
        max_model_len=512,
        dtype="float32",
        spec_method="ddtree",
        spec_model=str(drafter),
        spec_tokens=8,
        speculative_config={"draft_load_config": {"load_format": "safetensors"}},
    )
    assert get_ddtree_config(args.create_engine_config()) == DDTreeConfig(budget=8, topk=8, max_depth=7)


def test_plain_dflash_is_untouched(tiny_pair: tuple[Path, Path]) -> None:
    target, drafter = tiny_pair
    args = _engine_args(
        target,
        {
            "method": "dflash",
            "model": str(drafter),
            "num_speculative_tokens": 5,
            "draft_load_config": {"load_format": "safetensors"},
        },
    )
    config = args.create_engine_config()
    assert get_ddtree_config(config) is None
    spec = config.speculative_config
    assert spec.max_num_new_slots_for_drafting == type(spec)._orig_max_num_new_slots_for_drafting.fget(spec)
    assert spec.max_num_new_slots_for_drafting in (4, 5)  # K - 1 on 0.26, K (bonus query included) on 0.32


def test_cuda_selects_model_runner_v2_and_refuses_an_explicit_v1(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    from vllm_ddtree.patches import config as config_patches

    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    # setenv first so that monkeypatch restores the original (unset) state: the patch writes os.environ itself.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "unset")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    config_patches._select_model_runner_v2()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(DDTreeConfigError, match="VLLM_USE_V2_MODEL_RUNNER=0 asks for V1; unset it or set it to 1"):
        config_patches._select_model_runner_v2()


def test_cuda_picks_the_tree_attention_backend_for_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_ddtree.patches import config as config_patches

    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    args = SimpleNamespace(attention_backend=None, attention_config=SimpleNamespace(backend=None))
    config_patches._select_tree_attention(args)
    assert args.attention_backend == AttentionBackendEnum.CUSTOM
    config_patches._select_tree_attention(args)  # an explicit CUSTOM is kept
    assert args.attention_backend == AttentionBackendEnum.CUSTOM
    flash = SimpleNamespace(backend=AttentionBackendEnum.FLASH_ATTN)
    args = SimpleNamespace(attention_backend=None, attention_config=flash)
    with pytest.raises(DDTreeConfigError, match="asks for FLASH_ATTN; drop --attention-backend"):
        config_patches._select_tree_attention(args)


def test_cuda_widens_graphs_unless_the_user_chose_capture_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from vllm_ddtree.patches import config as config_patches

    def engine_args(**chosen: object) -> SimpleNamespace:
        compilation = SimpleNamespace(cudagraph_capture_sizes=None, max_cudagraph_capture_size=None)
        args = SimpleNamespace(cudagraph_capture_sizes=None, max_cudagraph_capture_size=None, enforce_eager=False)
        for name, value in chosen.items():
            target, _, attr = name.partition("__")
            setattr(compilation if target == "cc" else args, attr or target, value)
        args.compilation_config = compilation
        return args

    args = engine_args()
    config_patches._widen_cuda_graphs(args)  # the CPU platform keeps vLLM's sizes
    assert args.max_cudagraph_capture_size is None
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    config_patches._widen_cuda_graphs(args)
    assert args.max_cudagraph_capture_size == config_patches.GRAPH_TOKENS
    config_patches._widen_cuda_graphs(args)  # EngineArgs may build its configs twice
    assert args.max_cudagraph_capture_size == config_patches.GRAPH_TOKENS
    for chosen in (
        {"max_cudagraph_capture_size": 256},
        {"cudagraph_capture_sizes": [1, 8]},
        {"cc__max_cudagraph_capture_size": 128},
        {"cc__cudagraph_capture_sizes": [4]},
        {"enforce_eager": True},
    ):
        args = engine_args(**chosen)
        config_patches._widen_cuda_graphs(args)
        assert args.max_cudagraph_capture_size == chosen.get("max_cudagraph_capture_size")


def test_cpu_keeps_v1_and_turns_async_scheduling_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from vllm_ddtree.patches import config as config_patches

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "unset")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    config_patches._select_model_runner_v2()
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
    args = SimpleNamespace(async_scheduling=None)
    config_patches._disable_async_scheduling_on_v1(args)
    assert args.async_scheduling is False
    with pytest.raises(DDTreeConfigError, match="drop --async-scheduling"):
        config_patches._disable_async_scheduling_on_v1(SimpleNamespace(async_scheduling=True))


def test_unservable_targets_and_features_are_refused() -> None:
    from types import SimpleNamespace

    from vllm_ddtree.config import check_parallel_config, check_target_and_features

    plain = SimpleNamespace(is_hybrid=False, has_inner_state=False, is_attention_free=False)
    check_target_and_features(plain, None)
    with pytest.raises(DDTreeConfigError, match="hybrid or recurrent targets"):
        check_target_and_features(SimpleNamespace(is_hybrid=True), None)
    with pytest.raises(DDTreeConfigError, match="attention-free"):
        check_target_and_features(SimpleNamespace(is_attention_free=True), None)
    with pytest.raises(DDTreeConfigError, match="KV connectors"):
        check_target_and_features(plain, object())
    with pytest.raises(DDTreeConfigError, match="pipeline parallelism"):
        check_parallel_config(SimpleNamespace(pipeline_parallel_size=2))
    with pytest.raises(DDTreeConfigError, match="decode_context_parallel_size=2"):
        check_parallel_config(SimpleNamespace(decode_context_parallel_size=2))


def test_a_drafter_must_name_a_dflash_architecture() -> None:
    from vllm_ddtree.config import check_drafter_architectures

    check_drafter_architectures("d", ["DFlashDraftModel"])
    check_drafter_architectures("d", ["LagunaForCausalLMDFlash"])
    with pytest.raises(
        DDTreeConfigError,
        match=r"'model' \(t\) is not a DFlash drafter \(architectures "
        r"\['Qwen3ForCausalLM'\]\)",
    ):
        check_drafter_architectures("t", ["Qwen3ForCausalLM"])
    with pytest.raises(DDTreeConfigError, match=r"architectures \[\]"):
        check_drafter_architectures("t", None)
