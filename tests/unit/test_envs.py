"""vllm_ddtree/envs.py: every knob's default, choices and error sentence, and the former names refused with the new
ones wherever the plugin starts (envs' first use, plugin registration, the CUDA ops' load)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_ddtree import envs

DEFAULTS = {
    "VLLM_DDTREE_CSRC": None,
    "VLLM_DDTREE_CACHE": str(Path.home() / ".cache" / "vllm-ddtree"),
    "VLLM_DDTREE_MLA_CONTEXT": "auto",
    "VLLM_DDTREE_PREFILL": "vllm",
    "VLLM_DDTREE_MLA_VARIANT": "auto",
    "VLLM_DDTREE_MLA_PDL": True,
    "VLLM_DDTREE_MLA_DECODE_CTAS_PER_SM": 0,
    "VLLM_DDTREE_ADAPTIVE_FORCE": None,
}


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [*envs.environment_variables, *envs.RENAMED]:
        monkeypatch.delenv(name, raising=False)


def test_one_prefix_and_the_defaults() -> None:
    assert set(envs.environment_variables) == set(DEFAULTS)
    assert all(name.startswith("VLLM_DDTREE_") for name in envs.environment_variables)
    assert {name: getattr(envs, name) for name in DEFAULTS} == DEFAULTS
    assert set(dir(envs)) >= set(DEFAULTS) | {"TRITON_INTERPRET", "TORCH_CUDA_ARCH_LIST", "CUDA_HOME"}
    with pytest.raises(AttributeError):
        envs.VLLM_DDTREE_NOT_A_KNOB  # noqa: B018


@pytest.mark.parametrize(
    ("name", "value", "want"),
    [
        ("VLLM_DDTREE_CSRC", "other/csrc", "other/csrc"),
        ("VLLM_DDTREE_CACHE", "/tmp/c", "/tmp/c"),
        ("VLLM_DDTREE_MLA_CONTEXT", "ddtree", "ddtree"),
        ("VLLM_DDTREE_PREFILL", "ddtree", "ddtree"),
        ("VLLM_DDTREE_MLA_VARIANT", "decode-shallow", "decode-shallow"),
        ("VLLM_DDTREE_MLA_PDL", "0", False),
        ("VLLM_DDTREE_MLA_PDL", "1", True),
        ("VLLM_DDTREE_MLA_DECODE_CTAS_PER_SM", "7", 7),
        ("VLLM_DDTREE_ADAPTIVE_FORCE", "15,0,7", "15,0,7"),
    ],
)
def test_values(name: str, value: str, want: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, value)
    assert getattr(envs, name) == want


@pytest.mark.parametrize(
    ("name", "value", "sentence"),
    [
        ("VLLM_DDTREE_MLA_CONTEXT", "flash", "must be one of auto, flashmla, ddtree"),
        ("VLLM_DDTREE_MLA_VARIANT", "resident", "must be one of auto, portable, decode, decode-shallow"),
        ("VLLM_DDTREE_MLA_PDL", "off", "must be 0 or 1"),
        ("VLLM_DDTREE_MLA_DECODE_CTAS_PER_SM", "0", "must be a positive integer"),
        ("VLLM_DDTREE_MLA_DECODE_CTAS_PER_SM", "two", "must be a positive integer"),
        ("VLLM_DDTREE_ADAPTIVE_FORCE", "15;0", "must be comma-separated node budgets"),
    ],
)
def test_bad_values_are_refused(name: str, value: str, sentence: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} {sentence}"):
        getattr(envs, name)
    with pytest.raises(ValueError, match=f"{name} {sentence}"):
        envs.check_environ()  # at startup, before any launch reads it


@pytest.mark.parametrize("old", list(envs.RENAMED))
def test_former_names_are_refused_with_the_new_one(old: str, monkeypatch: pytest.MonkeyPatch) -> None:
    new = envs.RENAMED[old]
    assert new == "VLLM_" + old
    monkeypatch.setenv(old, "1")
    sentence = f"{old} was renamed to {new}: set {new}=1 instead"
    with pytest.raises(ValueError, match=sentence):
        envs.check_environ()
    monkeypatch.setattr(envs, "_checked", [False])  # a fresh process: its first read checks
    with pytest.raises(ValueError, match=sentence):
        envs.VLLM_DDTREE_CACHE  # noqa: B018


def test_former_names_are_refused_where_the_plugin_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_ddtree.plugin as plugin
    from vllm_ddtree.kernels import ops

    monkeypatch.setenv("DDTREE_MLA_CONTEXT", "ddtree")
    monkeypatch.setattr(plugin, "_state", {"registered": False, "refused": False})
    applied = []
    monkeypatch.setattr("vllm_ddtree.patches.config.apply", lambda: applied.append(1))
    with pytest.raises(ValueError, match="renamed to VLLM_DDTREE_MLA_CONTEXT"):
        plugin.register()
    assert applied == []
    monkeypatch.setattr(ops, "_loaded", False)
    with pytest.raises(ValueError, match="renamed to VLLM_DDTREE_MLA_CONTEXT"):
        ops.load_extension()  # refused before anything builds
