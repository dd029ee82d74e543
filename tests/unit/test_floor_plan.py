"""The floor plan's size rules (docs/architecture.md): a module fits one purpose, a backend
class stays readable, and no function needs a table of its branches to follow."""

from __future__ import annotations

import ast
from pathlib import Path

from radon.visitors import ComplexityVisitor, Function

PACKAGE = Path(__file__).resolve().parents[2] / "kvxfer"
MODULE_LINES = 600
BACKEND_CLASS_LINES = 420  # "about 400"
COMPLEXITY = 20  # radon grade C at most
WAIVER = "complexity:"  # a comment on the def line saying why a function must branch more


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_package_is_where_the_test_looks() -> None:
    assert (PACKAGE / "contract" / "__init__.py").is_file()
    assert len(_modules()) > 50


def test_no_module_is_over_600_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MODULE_LINES}
    assert not long, f"split these modules (one purpose each, at most {MODULE_LINES} lines): {long}"


def test_no_backend_class_is_over_about_400_lines() -> None:
    big = {}
    for path in (PACKAGE / "backends").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > BACKEND_CLASS_LINES:
                    big[f"{path.relative_to(PACKAGE)}:{node.name}"] = lines
    assert not big, f"backend classes over {BACKEND_CLASS_LINES} lines: {big}"


def test_no_function_is_above_complexity_20_without_a_reason() -> None:
    over = []
    for path in _modules():
        text = path.read_text()
        lines = text.splitlines()
        for block in ComplexityVisitor.from_code(text).blocks:  # functions and methods, as `radon cc` lists them
            if isinstance(block, Function) and block.complexity > COMPLEXITY and WAIVER not in lines[block.lineno - 1]:
                over.append(f"{path.relative_to(PACKAGE)}:{block.lineno} {block.fullname} ({block.complexity})")
    assert not over, f"functions above radon complexity {COMPLEXITY} (split them, or say why on the def line): {over}"


def test_no_two_test_modules_share_a_name() -> None:
    """pytest imports test modules by basename (the test directories are not packages): two
    of one name stop the whole collection of a clean clone ("import file mismatch")."""
    seen: dict[str, list[str]] = {}
    for path in (PACKAGE.parent / "tests").rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE.parent)))
    assert not {k: v for k, v in seen.items() if len(v) > 1}
