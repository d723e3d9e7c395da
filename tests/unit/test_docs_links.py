"""The repository's markdown stands alone: every relative link names a file in the repository, and every #anchor a
heading of the file it points at (GitHub's heading slugs)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)


def markdown_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out]


def heading_slugs(path: Path) -> set[str]:
    slugs: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.*)$", FENCE.sub("", path.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


def test_markdown_links_resolve_inside_the_repository() -> None:
    bad = []
    for path in markdown_files():
        for target in LINK.findall(FENCE.sub("", path.read_text())):
            if re.match(r"^[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)} -> {target}"
            if not dest.is_relative_to(ROOT):
                bad.append(f"{where}: outside the repository")
            elif not dest.exists():
                bad.append(f"{where}: no such file")
            elif anchor and (not dest.is_file() or anchor not in heading_slugs(dest)):
                bad.append(f"{where}: no such heading")
    assert not bad, "\n".join(bad)
