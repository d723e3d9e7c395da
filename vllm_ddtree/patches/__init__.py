"""The only place that monkeypatches vLLM: each submodule patches one seam, idempotently, keeping ``_orig_*``."""

from __future__ import annotations

from typing import Any


def patch_attr(owner: Any, name: str, replacement: Any) -> bool:
    """Replace ``owner.name`` once, remembering the original as ``owner._orig_<name>``; False if already patched.

    Idempotence matters because vLLM runs general plugins in every process, and forked children inherit the
    parent's patched classes.
    """
    orig_name = f"_orig_{name}"
    if orig_name in vars(owner):
        return False
    # An inherited attribute is patched on ``owner`` itself; the original then comes from the base class.
    setattr(owner, orig_name, vars(owner)[name] if name in vars(owner) else getattr(owner, name))
    setattr(owner, name, replacement)
    return True
