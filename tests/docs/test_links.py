"""Every relative link in the results on record and the user docs points at a file in the repository.

A clone is all a reader has: a report that links a figure the repository does not hold (because
``.gitignore`` hid it, or an export left it behind) is broken for everyone but its author.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Markdown links and images ``[text](target)``, and HTML ``src="..."`` / ``href="..."`` in Markdown files.
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|(?:src|href)=\"([^\"]+)\"")


def _links(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks show commands, not links
    out = []
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if target.startswith(("http://", "https://", "mailto:", "#", "data:")):
            continue
        out.append(target.split("#")[0])
    return [t for t in out if t]


def _tracked(paths: list[Path]) -> set[Path] | None:
    """Files git tracks (None outside a git checkout): a link to an untracked file is broken in a clone."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *map(str, paths)], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return {ROOT / p for p in out.stdout.decode().split("\0") if p}


REPORTS = sorted((ROOT / "results").rglob("report.md"))
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_there_are_reports_to_check():
    assert REPORTS, "results/**/report.md: no report on record"


def test_the_link_pattern_finds_links(tmp_path):
    # a guard on the checker itself: it must see a figure link, an HTML src and skip code blocks and anchors
    sample = "![f](claims/a.png) [d](docs/x.md#y) <img src=\"runs/b.png\"> [w](https://e.org) [s](#top)\n```\n[c](no.md)\n```"
    p = tmp_path / "sample.md"
    p.write_text(sample, encoding="utf-8")
    assert _links(p) == ["claims/a.png", "docs/x.md", "runs/b.png"]


@pytest.mark.parametrize("doc", REPORTS + DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path):
    if not doc.exists():
        pytest.skip(f"{doc.name} does not exist")
    targets = [(doc.parent / t).resolve() for t in _links(doc)]
    missing = [str(t.relative_to(ROOT)) if t.is_relative_to(ROOT) else str(t) for t in targets if not t.exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links files that do not exist: {missing}"
    files = [t for t in targets if t.is_file()]
    tracked = _tracked(files)
    if tracked is not None:
        untracked = [str(t.relative_to(ROOT)) for t in files if t not in tracked]
        assert not untracked, (f"{doc.relative_to(ROOT)} links files git does not track (ignored or never added): "
                               f"{untracked}")
