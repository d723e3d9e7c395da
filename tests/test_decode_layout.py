"""CI (CPU): the decode kernel's shared-memory layout and fragment addressing (csrc/mla_decode_layout.cuh), checked
by a C++ harness that emulates ldmatrix / mma.m16n8k16 at the kernel's lane addresses (QK and PV against direct
products, bf16 and widened fp8 slices), bank-conflict freedom, and the coverage of its load and output maps."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a host C++ compiler")
def test_decode_fragments(tmp_path: Path) -> None:
    exe = tmp_path / "decode_frag_check"
    src = ROOT / "tests" / "csrc" / "decode_frag_check.cpp"
    build = subprocess.run(["c++", "-std=c++17", "-O2", "-Wall", "-Werror", f"-I{ROOT / 'csrc'}", str(src), "-o",
                            str(exe)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
