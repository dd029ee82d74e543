"""Multi-host tests: each host a network namespace on a bridge (``kvxfer.testing.netns``),
UCX over TCP through the veths. Root only: elsewhere every test here skips and says why.

    .venv/bin/python -m pytest -m netns tests/netns
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvxfer.testing.netns import PREFIX, list_namespaces, namespaces_available


@pytest.fixture(autouse=True, scope="session")
def namespaces_here() -> None:
    """Session-wide and first: a module's own fixtures make namespaces only where they can be made."""
    why = namespaces_available()
    if why is not None:
        pytest.skip(f"network namespaces cannot be made here: {why}")


@pytest.fixture(autouse=True, scope="module")
def no_namespace_left() -> Iterator[None]:
    yield
    ours = f"{PREFIX}{os.getpid()}-"
    left = [name for name in list_namespaces() if name.startswith(ours)]
    assert not left, f"network namespaces left after the module: {left}"
