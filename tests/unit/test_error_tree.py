"""The error tree drawn in ``kvxfer/contract/errors.py`` is the whole tree: every public class
that derives from KvxferError, anywhere in the package, is drawn under its own base, and the
drawing names no class that does not exist. Read from the source (no module imported)."""

from __future__ import annotations

import re
from pathlib import Path

import kvxfer
from kvxfer.contract import errors

PACKAGE = Path(kvxfer.__file__).parent
_NODE = re.compile(r"^(?P<lead>[ │]*)[├└]── (?P<name>\w+)")


_CLASS = re.compile(r"^[ \t]*class (\w+)\(([^)]*)\)", re.M)


def _classes() -> dict[str, set[str]]:
    """Every class in the package: its name and its direct bases' names (a regular expression
    over the source: ast over every file took 3 s on the CI machine)."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for name, bases in _CLASS.findall(path.read_text()):
            names = {b.strip().split(".")[-1] for b in bases.split(",") if b.strip() and "=" not in b}
            found.setdefault(name, set()).update(names)
    return found


def _drawn() -> dict[str, str]:
    """The drawing: each class named in it, and the class it hangs under."""
    assert errors.__doc__ is not None
    parents: dict[str, str] = {}
    stack: list[tuple[int, str]] = [(-1, "KvxferError")]
    for line in errors.__doc__.splitlines():
        match = _NODE.match(line)
        if match is None:
            continue
        depth = len(match["lead"])
        while stack[-1][0] >= depth:
            stack.pop()
        parents[match["name"]] = stack[-1][1]
        stack.append((depth, match["name"]))
    return parents


def test_every_public_kvxfer_error_is_drawn_under_its_base() -> None:
    classes = _classes()
    tree = {"KvxferError"}
    grew = True
    while grew:
        grew = False
        for name, bases in classes.items():
            if name not in tree and bases & tree:
                tree.add(name)
                grew = True
    public = {name for name in tree - {"KvxferError"} if not name.startswith("_")}
    drawn = _drawn()
    assert sorted(public - drawn.keys()) == [], "errors missing from the tree in kvxfer/contract/errors.py"
    assert sorted(drawn.keys() - public) == [], "the tree draws classes that are not KvxferErrors of the package"
    misplaced = sorted(name for name, parent in drawn.items() if parent not in classes[name])
    assert misplaced == [], "drawn under another class than their base"
