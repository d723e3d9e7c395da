"""Every environment knob of vllm-ddtree, defined in this one file, in vLLM's style (``vllm/envs.py``).

``vllm_ddtree.envs.VLLM_DDTREE_X`` reads and validates ``$VLLM_DDTREE_X`` at each access (nothing is cached, so a
test or a benchmark may change a knob between calls); a value outside a knob's choices fails with them. All knobs
share the ``VLLM_DDTREE_`` prefix. The names some of them had before (``DDTREE_MLA_*``) are refused with the new
name the first time envs is used in a process (and again at plugin registration and when the CUDA ops load), so a
stale setting never goes unnoticed. Variables of other tools that the plugin reads (``TRITON_INTERPRET``,
``TORCH_CUDA_ARCH_LIST``, ``CUDA_HOME``) are read here too, under the meaning those tools give them.

The kernels get the MLA knobs as launch parameters (``kernels/mla_dispatch.py``), never from the environment, so a
CUDA graph replays the values its capture saw.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    VLLM_DDTREE_CSRC: str | None = None
    VLLM_DDTREE_CACHE: str = str(Path.home() / ".cache" / "vllm-ddtree")
    VLLM_DDTREE_MLA_CONTEXT: str = "auto"
    VLLM_DDTREE_PREFILL: str = "vllm"
    VLLM_DDTREE_MLA_VARIANT: str = "auto"
    VLLM_DDTREE_MLA_PDL: bool = True
    VLLM_DDTREE_MLA_DECODE_CTAS_PER_SM: int = 0
    VLLM_DDTREE_ADAPTIVE_FORCE: str | None = None
    TRITON_INTERPRET: bool = False
    TORCH_CUDA_ARCH_LIST: str = ""
    CUDA_HOME: str = "/usr/local/cuda"

MLA_CONTEXTS = ("auto", "flashmla", "ddtree")
"""``VLLM_DDTREE_MLA_CONTEXT``: who attends the context keys of MLA decode rows (``kernels/mla_dispatch.py``)."""
PREFILLS = ("vllm", "ddtree")
"""``VLLM_DDTREE_PREFILL``: who attends rows longer than the verify width (``backends/row_split.py``)."""
MLA_VARIANTS = ("auto", "portable", "decode", "decode-shallow")
"""``VLLM_DDTREE_MLA_VARIANT``: which of our CUDA kernels runs an MLA verify launch (``kernels/mla_dispatch.py``)."""

RENAMED = {
    "DDTREE_MLA_CONTEXT": "VLLM_DDTREE_MLA_CONTEXT",
    "DDTREE_MLA_VARIANT": "VLLM_DDTREE_MLA_VARIANT",
    "DDTREE_MLA_PDL": "VLLM_DDTREE_MLA_PDL",
    "DDTREE_MLA_DECODE_CTAS_PER_SM": "VLLM_DDTREE_MLA_DECODE_CTAS_PER_SM",
}
"""Former names of knobs, refused with their new names."""


def _choice(name: str, default: str, choices: tuple[str, ...]) -> Callable[[], str]:
    def read() -> str:
        value = os.environ.get(name, default)
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)} (or unset: {default}), got {value!r}")
        return value

    return read


def _flag(name: str, default: bool) -> Callable[[], bool]:
    def read() -> bool:
        value = os.environ.get(name, "1" if default else "0")
        if value not in ("0", "1"):
            raise ValueError(f"{name} must be 0 or 1 (or unset: {int(default)}), got {value!r}")
        return value == "1"

    return read


def _positive_int_or_unset(name: str, meaning: str) -> Callable[[], int]:
    def read() -> int:
        value = os.environ.get(name)
        if value is None:
            return 0
        if not (value.isascii() and value.isdigit()) or int(value) < 1:
            raise ValueError(f"{name} must be a positive integer ({meaning}), got {value!r}")
        return int(value)

    return read


def _budget_cycle(name: str) -> Callable[[], str | None]:
    def read() -> str | None:
        value = os.environ.get(name) or None
        if value is not None and not all(part.isascii() and part.isdigit() for part in value.split(",")):
            raise ValueError(f"{name} must be comma-separated node budgets such as 15,0,7 (or unset), got {value!r}")
        return value

    return read


environment_variables: dict[str, Callable[[], Any]] = {
    # Kernel sources to build instead of the packaged vllm_ddtree/kernels/csrc (A/B timing of a kernel change).
    "VLLM_DDTREE_CSRC": lambda: os.environ.get("VLLM_DDTREE_CSRC") or None,
    # Where built artifacts are cached (the CUDA extension, the benchmarks' libraries).
    "VLLM_DDTREE_CACHE": lambda: os.environ.get("VLLM_DDTREE_CACHE", str(Path.home() / ".cache" / "vllm-ddtree")),
    # MLA decode rows' context keys: auto (FlashMLA where it can and the launch has many rows a request), flashmla
    # (FlashMLA for every launch where it can), ddtree (our CUDA kernel for the whole verify).
    "VLLM_DDTREE_MLA_CONTEXT": _choice("VLLM_DDTREE_MLA_CONTEXT", "auto", MLA_CONTEXTS),
    # Rows longer than the verify width (prefill chunks): vllm (vLLM's own prefill attention, as the target computes
    # them without speculation) or ddtree (the tree backends attend them too: GQA every row, MLA rows of <= 64).
    "VLLM_DDTREE_PREFILL": _choice("VLLM_DDTREE_PREFILL", "vllm", PREFILLS),
    # Our MLA kernel: auto (per launch), or one forced for tests and benchmarks: portable (the <= 99 KB kernel of
    # sm_80 / sm_120), decode (the 16-row decode kernel), decode-shallow (it with sm_120's 2-stage ring).
    "VLLM_DDTREE_MLA_VARIANT": _choice("VLLM_DDTREE_MLA_VARIANT", "auto", MLA_VARIANTS),
    # 0 launches the decode kernel and its combine without programmatic dependent launch (separate timings).
    "VLLM_DDTREE_MLA_PDL": _flag("VLLM_DDTREE_MLA_PDL", True),
    # CTAs per SM that size the decode kernel's split-KV parts; unset (read as 0): the occupancy of its kernel.
    "VLLM_DDTREE_MLA_DECODE_CTAS_PER_SM": _positive_int_or_unset(
        "VLLM_DDTREE_MLA_DECODE_CTAS_PER_SM", "CTAs of the decode kernel per SM; unset: its occupancy"
    ),
    # Tests and benches: the adaptive budget cycles through these comma-separated budgets, one per step, instead of
    # choosing (each must be one of its candidate budgets; checked where the policy is built).
    "VLLM_DDTREE_ADAPTIVE_FORCE": _budget_cycle("VLLM_DDTREE_ADAPTIVE_FORCE"),
}
"""The plugin's knobs: name -> reader (validates, returns the typed value)."""

other_tools_variables: dict[str, Callable[[], Any]] = {
    # Triton runs kernels in its Python interpreter (CPU tests); some launches then take interpreter-safe paths.
    "TRITON_INTERPRET": lambda: os.environ.get("TRITON_INTERPRET") == "1",
    # torch.utils.cpp_extension's target GPUs; part of the extension's cache key.
    "TORCH_CUDA_ARCH_LIST": lambda: os.environ.get("TORCH_CUDA_ARCH_LIST", ""),
    # The CUDA toolkit that builds the extension and the benchmarks' libraries.
    "CUDA_HOME": lambda: os.environ.get("CUDA_HOME") or "/usr/local/cuda",
}
"""Variables of other tools the plugin reads (not ours to define): name -> reader."""

_checked = [False]


def check_environ() -> None:
    """Refuses the knobs' former names with their new ones, and any knob set to a value outside its choices, so
    that a misconfiguration fails where the plugin starts rather than at the first launch that reads it."""
    for old, new in RENAMED.items():
        if old in os.environ:
            raise ValueError(f"{old} was renamed to {new}: set {new}={os.environ[old]} instead (and unset {old}).")
    for name, read in environment_variables.items():
        if name in os.environ:
            read()
    _checked[0] = True


def __getattr__(name: str) -> Any:
    """Reads a knob (or another tool's variable) lazily; the first read in a process runs ``check_environ``."""
    read = environment_variables.get(name) or other_tools_variables.get(name)
    if read is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _checked[0]:
        check_environ()
    return read()


def __dir__() -> list[str]:
    return [*environment_variables, *other_tools_variables]
