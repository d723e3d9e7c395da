"""The only place that monkeypatches vLLM: each submodule patches one seam, idempotently, keeping ``_orig_*``.

``PATCHED`` lists every seam installed in this process (``owner.name``), so a test can hold the set against what
the installed vLLM offers, and a vLLM that lost a seam fails at registration with the seam's name.
"""

from __future__ import annotations

from typing import Any

PATCHED: list[str] = []


def _qualname(owner: Any) -> str:
    """``package.module`` for a module, ``package.module.Class`` for a class."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return owner.__name__


def patch_attr(owner: Any, name: str, replacement: Any) -> bool:
    """Replace ``owner.name`` once, remembering the original as ``owner._orig_<name>``; False if already patched.

    Idempotence matters because vLLM runs general plugins in every process, and forked children inherit the
    parent's patched classes.
    """
    orig_name = f"_orig_{name}"
    if orig_name in vars(owner):
        return False
    if not hasattr(owner, name):
        raise RuntimeError(
            f"vllm-ddtree patches {_qualname(owner)}.{name}, which this vLLM does not have; "
            f"install the vLLM version the plugin supports."
        )
    # An inherited attribute is patched on ``owner`` itself; the original then comes from the base class.
    setattr(owner, orig_name, vars(owner)[name] if name in vars(owner) else getattr(owner, name))
    setattr(owner, name, replacement)
    PATCHED.append(f"{_qualname(owner)}.{name}")
    return True
