"""bench/meta.py: every bench JSON records commit, vLLM, torch and GPU, and no absolute path; the committed results
carry the same ``meta`` object."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import meta  # noqa: E402

KEYS = {"commit", "vllm", "torch", "gpu"}


def test_run_meta_names_the_run_without_paths() -> None:
    info = meta.run_meta()
    assert set(info) == KEYS and all(isinstance(v, str) and v for v in info.values())
    assert not any(v.startswith("/") for v in info.values())


def test_commit_comes_from_the_environment_where_there_is_no_git(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(meta.COMMIT_ENV, "abc1234")
    assert meta.commit() == "abc1234"


def test_repo_path_is_relative_inside_the_repository_and_anonymous_outside(tmp_path: Path) -> None:
    assert meta.repo_path(ROOT / "csrc") == "csrc"
    outside = meta.repo_path(tmp_path / "ab" / "csrc")
    assert outside == "<outside the repository>/ab/csrc" and str(tmp_path) not in outside


def test_committed_results_carry_meta_and_no_machine_paths() -> None:
    files = sorted((ROOT / "bench" / "results").rglob("*.json"))
    assert files
    for path in files:
        text = path.read_text()
        data = json.loads(text)
        assert set(data["meta"]) == KEYS, path
        for prefix in ('"/work', '"/tmp', '"/root', '"/home'):
            assert prefix not in text, (path, prefix)
