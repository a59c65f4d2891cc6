"""Every link between the README and the docs pages leads somewhere: the file exists and, where the
link names a section (``page.md#section``), the page has a heading with that anchor.  Sections move
between pages (the README's reference moved to docs/); a stale link is a dead end for a newcomer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
PAGES += ["jetson/README.md", "dla/README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def prose(path: Path) -> list[str]:
    """The page's lines outside fenced blocks (a snippet's brackets are not links)."""
    lines, inside = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces to
    hyphens, ``-1``, ``-2`` ... for repeats."""
    found: set[str] = set()
    for line in prose(path):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading[1].lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in found:
            n += 1
            anchor = f"{slug}-{n}"
        found.add(anchor)
    return found


def test_github_anchors() -> None:
    assert anchors(ROOT / "docs" / "triton-compatibility.md") >= {
        "coming-from-triton",
        "texts-and-codes-that-differ-from-tritons-on-purpose",
    }
    assert "real-pretrained-ocr-bench_ocrpy" in anchors(ROOT / "docs" / "benchmarks.md")


@pytest.mark.parametrize("page", PAGES)
def test_links_lead_somewhere(page: str) -> None:
    source = ROOT / page
    dead = []
    for line in prose(source):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, section = target.partition("#")
            path = (source.parent / file).resolve() if file else source
            if not path.exists():
                dead.append(f"{target}: no such file")
            elif section and path.suffix == ".md" and section not in anchors(path):
                dead.append(f"{target}: no heading with that anchor in {path.relative_to(ROOT)}")
    assert not dead, f"{page}: dead links:\n" + "\n".join(dead)
