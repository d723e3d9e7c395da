"""The CUDA sources' mirror of vllm_ddtree/constants.py (one header, parsed here) holds the same numbers, and the
numbers relate as the code assumes (CPU; the header's static_asserts check the same relations at build time)."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_ddtree import constants

HEADER = Path(constants.__file__).resolve().parent / "kernels" / "csrc" / "params.h"
MIRROR = re.compile(r"^constexpr\s+(?:int|double)\s+(k\w+)\s*=\s*([0-9.]+);\s*//\s*([A-Z][A-Z0-9_]*)\s*$", re.M)


def public_constants() -> dict[str, int | float]:
    return {k: v for k, v in vars(constants).items() if k.isupper() and isinstance(v, int | float)}


def test_header_mirrors_every_constant() -> None:
    mirrors = MIRROR.findall(HEADER.read_text())
    assert mirrors, f"no mirror lines in {HEADER}"
    mirrored = {py: float(value) if "." in value else int(value) for _, value, py in mirrors}
    assert len(mirrored) == len(mirrors), f"a constant is mirrored twice: {mirrors}"
    assert mirrored == public_constants(), f"{HEADER.name} and constants.py disagree"


def test_relations() -> None:
    assert constants.MAX_TREE_WIDTH == constants.ANCESTOR_WORD_BITS == 64
    assert constants.MAX_TREE_BUDGET == constants.MAX_TREE_WIDTH - 1
    assert constants.MLA_HEAD_DIM == constants.MLA_KV_LORA_RANK + constants.MLA_ROPE_DIM == 576
