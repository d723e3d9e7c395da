"""CI (CPU): csrc compiles for sm_80, sm_90 and sm_120 with nvcc, and the object carries sm_120 SASS (mma.sync,
no wgmma / tcgen05 / TMA).

Needs only nvcc (no GPU). The .cu files are torch-free, so they compile straight to one object each (csrc/ is the
include root, as in the extension build); the binding is syntax-checked against torch's headers when the host
compiler is present.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "vllm_ddtree" / "kernels" / "csrc"
ARCHS = ("80", "90", "120")
CU_SOURCES = (
    "scheduling/sched_kernel.cu",
    "variants/resident_v.cu",
    "variants/portable.cu",
    "variants/decode.cu",
    "combine/combine.cu",
)
# Hopper / Blackwell-datacenter-only SASS (wgmma, tcgen05 and TMEM, TMA): sm_120 must stay on mma.sync.
NOT_ON_SM120 = re.compile(r"\b(HGMMA|UTC\w+|UTMA\w+|UBLKCP)\b")


def _nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    cand = shutil.which("nvcc") or str(Path(cuda_home) / "bin" / "nvcc")
    return cand if Path(cand).is_file() else None


def _cuobjdump() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for cand in (shutil.which("cuobjdump"), str(Path(cuda_home) / "bin" / "cuobjdump")):
        if cand and Path(cand).is_file():
            return cand
    try:  # Triton's wheel ships one
        import triton

        cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return str(cand) if cand.is_file() else None
    except ImportError:
        return None


NVCC = _nvcc()


def _spills(stderr: str) -> dict[str, int]:
    """Spill-store bytes per function from ptxas' -warn-spills lines."""
    found = re.findall(r"spilled to local memory in function '([^']+)', (\d+) bytes spill stores", stderr)
    return {fn: int(b) for fn, b in found}


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME); the CUDA build check needs the toolkit")
@pytest.mark.parametrize("src", CU_SOURCES)
def test_cu_builds_for_80_90_120(src: str, tmp_path: Path) -> None:
    obj = tmp_path / (Path(src).name + ".o")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    cmd = [
        NVCC,
        "-std=c++17",
        "-O3",
        f"-I{CSRC}",
        "-c",
        str(CSRC / src),
        "-o",
        str(obj),
        f"--threads={len(ARCHS)}",
        "-Xptxas=-warn-spills",
        *gencode,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    spills = _spills(res.stderr)  # -warn-spills reports every spilling function
    # every kernel, the resident-V ones at 253-255 registers included, must build without spilling
    assert not spills, f"register spills (bytes stored per kernel): {spills}"
    dump = _cuobjdump()
    if dump is None:
        pytest.skip("cuobjdump not found; compiled fine but cannot list the cubins")
    listing = subprocess.run([dump, "--list-elf", str(obj)], capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr
    for a in ARCHS:
        assert f"sm_{a}" in listing.stdout, f"no sm_{a} cubin in {src}:\n{listing.stdout}"
    sass = subprocess.run(
        [dump, "--dump-sass", "--gpu-architecture", "sm_120", str(obj)], capture_output=True, text=True, timeout=300
    )
    assert sass.returncode == 0, sass.stderr
    assert not NOT_ON_SM120.search(sass.stdout), f"sm_120 SASS of {src} uses {NOT_ON_SM120.search(sass.stdout)[0]}"
    if src.startswith("variants/"):  # the tensor-core path really is in the sm_120 SASS
        assert "HMMA" in sass.stdout and "LDSM" in sass.stdout, "sm_120 SASS lacks HMMA/LDSM"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME); the CUDA build check needs the toolkit")
@pytest.mark.parametrize("src", CU_SOURCES)
def test_cu_builds_in_cxx20(src: str, tmp_path: Path) -> None:
    """With torch >= 2.14 the extension builds in C++20 (``ops.cxx_standard``); the kernels compile there too (sm_90
    only: the C++ dialect does not depend on the arch)."""
    cmd = [NVCC, "-std=c++20", "-O3", f"-I{CSRC}", "-c", str(CSRC / src), "-o", str(tmp_path / "k.o")]
    res = subprocess.run([*cmd, "-gencode=arch=compute_90,code=sm_90"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]


def test_the_build_compiles_these_sources() -> None:
    pytest.importorskip("torch")
    from vllm_ddtree.kernels import ops

    assert {s for s in ops.SOURCES if s.endswith(".cu")} == set(CU_SOURCES)
    assert all((CSRC / s).is_file() for s in ops.SOURCES)


@pytest.mark.skipif(NVCC is None or shutil.which("c++") is None, reason="needs nvcc and a host C++ compiler")
def test_binding_syntax() -> None:
    """The binding against the installed torch's headers, in the C++ standard the extension build uses for it."""
    torch_ext = pytest.importorskip("torch.utils.cpp_extension")
    from vllm_ddtree.kernels import ops

    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    incs = [f"-I{p}" for p in torch_ext.include_paths()] + [f"-I{cuda_home}/include"]
    cmd = ["c++", f"-std={ops.cxx_standard()}", "-fsyntax-only", *incs, f"-I{CSRC}", str(CSRC / "api" / "bindings.cpp")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.mark.parametrize(
    ("torch_version", "standard"), [("2.11.0", "c++17"), ("2.13.0+cpu", "c++17"), ("2.14.0", "c++20")]
)
def test_cxx_standard_follows_torch(torch_version: str, standard: str) -> None:
    """torch 2.14's ATen headers need C++20 (vLLM 0.33 pins it); older torch builds stay on C++17."""
    from vllm_ddtree.kernels import ops

    assert ops.cxx_standard(torch_version) == standard


@pytest.mark.skipif(NVCC is None or shutil.which("c++") is None, reason="needs nvcc and a host C++ compiler")
def test_extension_registers_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ninja build links and loads without a GPU and registers ddtree::mla_tree_verify with its Meta kernel
    (what torch.compile's fake tensors call). One arch keeps CI fast; the build above covers all three."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "12.0")
    monkeypatch.setenv("CUDA_HOME", os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    from vllm_ddtree.kernels import ops

    ops.load_extension()
    op = torch.ops.ddtree.mla_tree_verify
    schema = str(op.default._schema)
    assert "Tensor(a!) out" in schema and "Tensor(b!) lse" in schema, schema
    assert "int kernel, bool decode_deep, int decode_ctas_per_sm, bool pdl" in schema, schema
    T, H, B = 4, 8, 2
    m = dict(device="meta")
    op(
        torch.empty(T, H, 512, dtype=torch.bfloat16, **m),
        torch.empty(T, H, 64, dtype=torch.bfloat16, **m),
        torch.empty(3, 64, 576, dtype=torch.bfloat16, **m),
        torch.empty(B, 3, dtype=torch.int32, **m),
        torch.empty(B, dtype=torch.int32, **m),
        torch.empty(B + 1, dtype=torch.int32, **m),
        torch.empty(T, dtype=torch.int64, **m),
        0.04,
        1.0,
        torch.empty(T, H, 512, dtype=torch.bfloat16, **m),
        torch.empty(T, H, dtype=torch.float32, **m),
        2,
        2,
        True,
        0,
        True,
    )


def test_unknown_kernel_variant_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_DDTREE_MLA_VARIANT with a value the dispatch does not know fails with the accepted values, before any
    build."""
    torch = pytest.importorskip("torch")
    from vllm_ddtree import envs
    from vllm_ddtree.kernels import ops

    T, H, B = 2, 8, 1
    args = (
        torch.empty(T, H, 512, dtype=torch.bfloat16),
        torch.empty(T, H, 64, dtype=torch.bfloat16),
        torch.empty(3, 64, 576, dtype=torch.bfloat16),
        torch.empty(B, 3, dtype=torch.int32),
        torch.empty(B, dtype=torch.int32),
        torch.empty(B + 1, dtype=torch.int32),
        torch.empty(T, dtype=torch.int64),
        0.04,
        1.0,
        torch.empty(T, H, 512, dtype=torch.bfloat16),
        torch.empty(T, H, dtype=torch.float32),
    )
    monkeypatch.setenv("VLLM_DDTREE_MLA_VARIANT", "resident")
    with pytest.raises(ValueError, match="auto, portable, decode, decode-shallow"):
        ops.mla_tree_verify(*args)
    for value in envs.MLA_VARIANTS:
        monkeypatch.setenv("VLLM_DDTREE_MLA_VARIANT", value)
        assert envs.VLLM_DDTREE_MLA_VARIANT == value
    monkeypatch.delenv("VLLM_DDTREE_MLA_VARIANT")
    assert envs.VLLM_DDTREE_MLA_VARIANT == "auto"


def test_non_positive_scales_are_refused() -> None:
    """The kernels take each row's max over unscaled scores, which needs positive scales: others fail with that
    reason, before any build."""
    torch = pytest.importorskip("torch")
    from vllm_ddtree.kernels import ops

    T, H, B = 2, 8, 1
    tensors = (
        torch.empty(T, H, 512, dtype=torch.bfloat16),
        torch.empty(T, H, 64, dtype=torch.bfloat16),
        torch.empty(3, 64, 576, dtype=torch.bfloat16),
        torch.empty(B, 3, dtype=torch.int32),
        torch.empty(B, dtype=torch.int32),
        torch.empty(B + 1, dtype=torch.int32),
        torch.empty(T, dtype=torch.int64),
    )
    outs = (torch.empty(T, H, 512, dtype=torch.bfloat16), torch.empty(T, H, dtype=torch.float32))
    for scale, kv_scale in ((0.0, 1.0), (-0.04, 1.0), (0.04, 0.0), (float("inf"), 1.0), (float("nan"), 1.0)):
        with pytest.raises(ValueError, match="must be positive and finite"):
            ops.mla_tree_verify(*tensors, scale, kv_scale, *outs)


def test_csrc_override_is_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_DDTREE_CSRC (A/B of kernel sources) may be relative; the build gets it absolute (its ninja file names
    the sources from the build directory), and a directory without the sources fails with the fix."""
    pytest.importorskip("torch")
    from vllm_ddtree.kernels import ops

    (tmp_path / "other" / "csrc" / "api").mkdir(parents=True)
    (tmp_path / "other" / "csrc" / "api" / "bindings.cpp").write_text("// stand-in\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VLLM_DDTREE_CSRC", "other/csrc")
    assert ops.csrc_dir() == (tmp_path / "other" / "csrc").resolve()
    monkeypatch.setenv("VLLM_DDTREE_CSRC", "other")
    with pytest.raises(FileNotFoundError, match="point it at a csrc/ tree"):
        ops.csrc_dir()
