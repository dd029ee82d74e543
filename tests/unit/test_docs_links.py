"""Every relative link in the README, docs/ and the results index leads to a file that is
there: pages and result sets move (docs/performance.md took the README's figures), and a
link that silently points nowhere is a page a reader cannot follow. And each backend package's
README, its reading order, names the modules the package holds, as they are now; and the results
index lists every script under bench/ with what runs it."""

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


BACKEND_PACKAGES = sorted(p.parent for p in (ROOT / "kvxfer" / "backends").glob("*/__init__.py"))
MODULE = re.compile(r"`(\w+\.py)`")


@pytest.mark.parametrize("package", BACKEND_PACKAGES, ids=lambda p: p.name)
def test_backend_readme_reading_order_names_the_modules_there(package: Path) -> None:
    """A backend package's README is its reading order: it names every module the package
    holds, and no module that has moved or gone."""
    named = set(MODULE.findall((package / "README.md").read_text())) - {"__init__.py"}
    there = {p.name for p in package.glob("*.py")} - {"__init__.py"}
    assert sorted(there - named) == [], f"{package.name}/README.md does not name these modules"
    assert sorted(named - there) == [], f"{package.name}/README.md names modules that are not there"


RESULTS = ROOT / "bench" / "results"
SCRIPT_ROW = re.compile(r"^\| `(\w+\.py)` \|.*\|(?P<run_by>[^|]*)\|\s*$", re.M)


def test_bench_scripts_each_run_in_ci_or_reproduce_a_result_set() -> None:
    """bench/results/README.md lists every script under bench/, and nothing that has gone; each
    row names a test that runs the script, or links a result set whose notes give its command."""
    rows = {m[1]: m["run_by"] for m in SCRIPT_ROW.finditer((RESULTS / "README.md").read_text())}
    there = {p.name for p in (ROOT / "bench").glob("*.py")}
    assert sorted(there - rows.keys()) == [], "bench scripts missing from bench/results/README.md"
    assert sorted(rows.keys() - there) == [], "bench/results/README.md lists scripts that are not there"
    unbacked = []
    for script, run_by in rows.items():
        tests = [ROOT / t for t in re.findall(r"`(tests/[\w/]+\.py)`", run_by)]
        notes = [p for link in LINK.findall(run_by) for p in (RESULTS / link).parent.rglob("*.md")]
        if not any(f"bench/{script}" in p.read_text() for p in tests + notes if p.exists()):
            unbacked.append(script)
    assert unbacked == [], "scripts whose row names no test that runs them, nor notes that give their command"
