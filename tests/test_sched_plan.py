"""CI (CPU): the split-KV line planner's arithmetic (csrc/mla_sched_plan.cuh), run on the host by a C++ harness that
emulates the device kernel's threads and checks every invariant the decode kernel and the combine rely on."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a host C++ compiler")
def test_line_planner_invariants(tmp_path: Path) -> None:
    exe = tmp_path / "sched_plan_check"
    src = ROOT / "tests" / "csrc" / "sched_plan_check.cpp"
    build = subprocess.run(["c++", "-std=c++17", "-O2", "-Wall", "-Werror", f"-I{ROOT / 'csrc'}", str(src), "-o",
                            str(exe)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "0 failed" in res.stdout, res.stdout
