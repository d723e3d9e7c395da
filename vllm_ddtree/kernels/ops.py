"""Python face of the CUDA ops in ``csrc/``: lazy ninja build (cached under ~/.cache), checks, ``ddtree::`` op calls.

Importing this module never compiles or touches CUDA, so it is safe on CPU-only machines; the extension is built on
first use (or by :func:`load_extension`) and registers ``torch.ops.ddtree.mla_tree_verify`` through TORCH_LIBRARY,
which makes the op usable inside ``torch.compile`` graphs and CUDA-graph capture. Which kernel a launch runs is
decided by ``mla_dispatch`` and passed to the op as parameters.
"""

from __future__ import annotations

import hashlib
import math
import threading
from pathlib import Path

import torch

from vllm_ddtree import envs
from vllm_ddtree.constants import MAX_TREE_WIDTH, MLA_HEAD_DIM, MLA_KV_LORA_RANK, MLA_ROPE_DIM
from vllm_ddtree.kernels.mla_dispatch import mla_launch

# The extension's translation units, relative to csrc/ (which is also the include root). Every file under csrc/, the
# headers included, enters the build's cache key.
SOURCES = (
    "api/bindings.cpp",
    "scheduling/sched_kernel.cu",
    "variants/resident_v.cu",
    "variants/portable.cu",
    "variants/decode.cu",
    "combine/combine.cu",
)
_lock = threading.Lock()
_loaded = False


def csrc_dir() -> Path:
    """Kernel sources: ``$VLLM_DDTREE_CSRC`` when set (A/B timing of a kernel change), else the packaged
    ``vllm_ddtree/kernels/csrc``."""
    override = envs.VLLM_DDTREE_CSRC
    if override:
        if not (Path(override) / SOURCES[0]).is_file():
            raise FileNotFoundError(f"VLLM_DDTREE_CSRC={override} has no {SOURCES[0]}; point it at a csrc/ tree")
        return Path(override).resolve()  # absolute: the build files name the sources
    packaged = Path(__file__).resolve().parent / "csrc"
    if not (packaged / SOURCES[0]).is_file():
        raise FileNotFoundError(f"vllm_ddtree: the kernel sources are missing from {packaged}")
    return packaged


def cache_root() -> Path:
    """Where built artifacts are cached: ``$VLLM_DDTREE_CACHE``, else ``~/.cache/vllm-ddtree``."""
    return Path(envs.VLLM_DDTREE_CACHE)


def _build_dir(src: Path, arch_list: str) -> tuple[str, Path]:
    """Cache key: every source file's path and contents + arch list + torch/CUDA versions, so a stale build is never
    loaded."""
    h = hashlib.sha256()
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        h.update(path.relative_to(src).as_posix().encode())
        h.update(path.read_bytes())
    h.update(f"{arch_list}|{torch.__version__}|{torch.version.cuda}".encode())
    key = h.hexdigest()[:16]
    d = cache_root() / "torch_ext" / f"ddtree_C_{key}"
    d.mkdir(parents=True, exist_ok=True)
    return f"ddtree_C_{key}", d


def cxx_standard(torch_version: str | None = None) -> str:
    """The C++ standard torch's headers need: C++20 from torch 2.14 on (vLLM 0.33's torch), C++17 before."""
    from packaging.version import Version

    release = Version(torch_version or torch.__version__).release
    return "c++20" if release >= (2, 14) else "c++17"


def load_extension(verbose: bool = False) -> None:
    """Builds (once, cached) and loads the extension, which registers the ``torch.ops.ddtree`` ops; first refuses a
    misconfigured environment (``envs.check_environ``)."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        from torch.utils.cpp_extension import load

        envs.check_environ()
        src = csrc_dir()
        arch_list = envs.TORCH_CUDA_ARCH_LIST
        if not arch_list and torch.cuda.is_available():  # torch then builds for the visible GPUs; key on them
            caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
            arch_list = ";".join(f"{a}.{b}" for a, b in sorted(caps))
        name, bdir = _build_dir(src, arch_list)
        load(
            name=name,
            sources=[str(src / s) for s in SOURCES],
            extra_include_paths=[str(src)],
            extra_cflags=["-O3", f"-std={cxx_standard()}"],
            extra_cuda_cflags=["-O3", f"-std={cxx_standard()}", "-lineinfo", "--threads=4"],
            build_directory=str(bdir),
            is_python_module=False,
            verbose=verbose,
        )
        _loaded = True


def _rows16(t: torch.Tensor) -> torch.Tensor:
    """The kernel loads q rows with 16-byte copies; views that break that alignment get a contiguous copy."""
    if t.device.type == "meta":
        return t
    ok = t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0 and t.data_ptr() % 16 == 0
    return t if ok else t.contiguous()


def mla_tree_verify(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_bits: torch.Tensor,
    softmax_scale: float,
    kv_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    max_query_len: int | None = None,
) -> None:
    """Absorbed-MLA attention of draft-tree queries over a paged latent cache, written into ``out`` and ``lse``.

    Shapes: q_nope [T,H,512], q_pe [T,H,64] (bf16/fp16, strided views fine), kv_cache [blocks, block_size, 576]
    (bf16, or fp8 e4m3 as uint8 with ``kv_scale``), block_table [B, max_blocks] int32, seq_lens [B] int32 (tree
    tokens included; they are the last q_len keys), query_start_loc [B+1] int32, tree_bits [T] int64 (bit j: the
    query sees its request's tree key j), out [T,H,512], lse [T,H] float32 (natural log). Requests with q_len 0 write
    nothing. ``max_query_len`` (host int, >= every request's q_len, <= 64) sizes the grid; without it min(T, 64) is
    used, which is correct but launches idle CTAs for batches of many short requests. The kernel and its sizing
    come from ``mla_dispatch.mla_launch`` (shapes, GPU, ``VLLM_DDTREE_MLA_*`` knobs).
    """
    if q_nope.dim() != 3 or q_nope.shape[-1] != MLA_KV_LORA_RANK or q_pe.shape[-1] != MLA_ROPE_DIM:
        raise ValueError(
            f"q_nope must be [T,H,{MLA_KV_LORA_RANK}] and q_pe [T,H,{MLA_ROPE_DIM}], got "
            f"{tuple(q_nope.shape)}, {tuple(q_pe.shape)}"
        )
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != MLA_HEAD_DIM:
        raise ValueError(f"kv_cache must be [blocks, block_size, {MLA_HEAD_DIM}], got {tuple(kv_cache.shape)}")
    if not (softmax_scale > 0 and kv_scale > 0 and math.isfinite(softmax_scale * kv_scale)):
        raise ValueError(
            f"softmax_scale and kv_scale must be positive and finite (the kernels take each row's max "
            f"over unscaled scores), got {softmax_scale}, {kv_scale}"
        )
    if kv_cache.dtype == torch.float8_e4m3fn:
        kv_cache = kv_cache.view(torch.uint8)
    max_q = int(max_query_len) if max_query_len else min(q_nope.shape[0], MAX_TREE_WIDTH)
    launch = mla_launch(q_nope.device, max_q * q_nope.shape[1], block_table.shape[0], kv_cache.dtype == torch.uint8)
    q_nope, q_pe = _rows16(q_nope), _rows16(q_pe)
    load_extension()
    torch.ops.ddtree.mla_tree_verify(
        q_nope,
        q_pe,
        kv_cache,
        block_table,
        seq_lens,
        query_start_loc,
        tree_bits,
        float(softmax_scale),
        float(kv_scale),
        out,
        lse,
        max_q,
        launch.kernel,
        launch.decode_deep,
        launch.decode_ctas_per_sm,
        launch.pdl,
    )
