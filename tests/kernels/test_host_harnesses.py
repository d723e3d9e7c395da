"""CI (CPU): C++ harnesses under tests/kernels/csrc/ that run the kernels' own host-and-device expressions on the CPU
(built by a plain C++ compiler against the csrc/ headers):
- decode_frag_check: the decode kernel's shared-memory layout and fragment addressing (csrc/variants/decode_layout.cuh),
  with emulated ldmatrix / mma.m16n8k16 at the kernel's lane addresses (QK and PV against direct products, bf16 and
  widened fp8 slices), bank-conflict freedom, and the coverage of its load and output maps;
- sched_plan_check: the decode kernel's split-KV line plan (csrc/scheduling/sched_plan.cuh): the global line planner it
  replaced, checked against every invariant the kernel and the combine rely on, and the per-part derivation each CTA
  now runs (emulating its threads), which must give exactly the same pieces, slots and per-request split counts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "vllm_ddtree" / "kernels" / "csrc"

needs_cxx = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a host C++ compiler")


def run_harness(name: str, tmp_path: Path) -> str:
    """Builds tests/kernels/csrc/NAME.cpp (warnings are errors), runs it, asserts it exits 0 and returns its stdout."""
    exe = tmp_path / name
    src = ROOT / "tests" / "kernels" / "csrc" / f"{name}.cpp"
    build = subprocess.run(
        ["c++", "-std=c++17", "-O2", "-Wall", "-Werror", f"-I{CSRC}", str(src), "-o", str(exe)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    return res.stdout


@needs_cxx
def test_decode_fragments(tmp_path: Path) -> None:
    run_harness("decode_frag_check", tmp_path)


@needs_cxx
def test_line_plan_per_part(tmp_path: Path) -> None:
    out = run_harness("sched_plan_check", tmp_path)
    assert "0 failed" in out, out
