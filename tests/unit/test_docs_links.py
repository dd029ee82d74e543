"""Every relative link in the README, docs/ and the results index leads to a file that is
there: pages and result sets move (docs/performance.md took the README's figures), and a
link that silently points nowhere is a page a reader cannot follow."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "results" / "README.md",
         *sorted((ROOT / "kvxfer").rglob("README.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_somewhere(page: Path) -> None:
    assert page.exists(), page
    missing = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to files that are not there: {missing}"
