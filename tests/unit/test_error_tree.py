"""The error tree drawn in ``kvxfer/contract/errors.py`` is the whole tree, both ways: every
public exception class in the package (deriving, directly or through others, from KvxferError
or from any other exception) is a KvxferError drawn under its own base, in the module that
defines it or the package that exports it; and the drawing names no class that does not exist.
So a new error with no place in the tree fails here. Read from the source (no module imported)."""

from __future__ import annotations

import builtins
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import kvxfer
from kvxfer.contract import errors

PACKAGE = Path(kvxfer.__file__).parent
_NODE = re.compile(r"^(?P<lead>[ │]*)[├└]── (?P<name>\w+)\b.*?(?:\[(?P<module>[\w.]+)\])?\s*$")
_CLASS = re.compile(r"^[ \t]*class (\w+)\(([^)]*)\)", re.M)
BUILTIN_EXCEPTIONS = frozenset(name for name, value in vars(builtins).items()
                               if isinstance(value, type) and issubclass(value, BaseException))


@dataclass(frozen=True)
class Found:
    name: str
    module: str  # under kvxfer: "backends.ipc.channel"
    bases: frozenset[str]  # the last part of each direct base's name


@dataclass(frozen=True)
class Drawn:
    parent: str
    module: str  # its own brackets, else its parent's


@cache
def _classes() -> tuple[Found, ...]:
    """Every class in the package (a regular expression over the source: ast over every file
    took 3 s on the CI machine)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for name, bases in _CLASS.findall(path.read_text()):
            names = frozenset(b.strip().split(".")[-1].split("[")[0] for b in bases.split(",")
                              if b.strip() and "=" not in b)
            found.append(Found(name, module, names))
    return tuple(found)


def _derived(roots: set[str]) -> list[Found]:
    """The classes that derive, directly or through others of the package, from one of
    ``roots`` (names)."""
    names = set(roots)
    out: list[Found] = []
    grew = True
    while grew:
        grew = False
        for cls in _classes():
            if cls not in out and cls.bases & names:
                out.append(cls)
                names.add(cls.name)
                grew = True
    return out


def _exceptions() -> list[Found]:
    """Every exception class of the package: it derives from a builtin exception, or from a
    base another library names ...Error or ...Exception (httpx.HTTPError, say)."""
    foreign = {base for cls in _classes() for base in cls.bases if base.endswith(("Error", "Exception"))}
    return _derived(set(BUILTIN_EXCEPTIONS) | foreign)


def _public_errors() -> dict[str, Found]:
    return {cls.name: cls for cls in _derived({"KvxferError"}) if not cls.name.startswith("_")}


def _drawn() -> dict[str, Drawn]:
    """The drawing: each class named in it, the class it hangs under, and its module."""
    assert errors.__doc__ is not None
    drawn: dict[str, Drawn] = {}
    stack: list[tuple[int, str, str]] = [(-1, "KvxferError", "contract.errors")]
    for line in errors.__doc__.splitlines():
        match = _NODE.match(line)
        if match is None:
            continue
        depth = len(match["lead"])
        while stack[-1][0] >= depth:
            stack.pop()
        module = match["module"] or stack[-1][2]
        drawn[match["name"]] = Drawn(stack[-1][1], module)
        stack.append((depth, match["name"], module))
    return drawn


def test_every_public_exception_is_a_kvxfer_error() -> None:
    others = sorted(f"{cls.module}.{cls.name}" for cls in _exceptions()
                    if not cls.name.startswith("_") and cls.name not in _public_errors() and cls.name != "KvxferError")
    assert others == [], "public exception classes that are not KvxferErrors (derive from one, or start with _)"


def test_each_public_error_has_one_name() -> None:
    seen: dict[str, list[str]] = {}
    for cls in _derived({"KvxferError"}):
        if not cls.name.startswith("_"):
            seen.setdefault(cls.name, []).append(cls.module)
    assert {name: modules for name, modules in seen.items() if len(modules) > 1} == {}


def test_every_public_kvxfer_error_is_drawn_and_nothing_else() -> None:
    public, drawn = _public_errors(), _drawn()
    assert sorted(public.keys() - drawn.keys()) == [], "errors missing from the tree in kvxfer/contract/errors.py"
    assert sorted(drawn.keys() - public.keys()) == [], "the tree draws classes that are not KvxferErrors of the package"


def test_each_drawn_error_hangs_under_its_base() -> None:
    public = _public_errors()
    misplaced = sorted(name for name, at in _drawn().items() if name in public and at.parent not in public[name].bases)
    assert misplaced == [], "drawn under another class than their base"


def _exports(package: str, cls: Found) -> bool:
    """Whether the package ``package`` exports ``cls`` from the module below it that defines it."""
    init = PACKAGE.joinpath(*package.split("."), "__init__.py")
    if not cls.module.startswith(package + ".") or not init.exists():
        return False
    text = init.read_text()
    return f"from kvxfer.{cls.module} import" in text and re.search(rf"\b{cls.name}\b", text) is not None


def test_each_drawn_error_names_its_module() -> None:
    public = _public_errors()
    wrong = sorted(f"{name}: drawn in [{at.module}], defined in {public[name].module}"
                   for name, at in _drawn().items()
                   if name in public and at.module != public[name].module and not _exports(at.module, public[name]))
    assert wrong == [], "the tree names a module that neither defines the error nor exports it"
