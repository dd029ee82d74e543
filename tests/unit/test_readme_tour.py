"""The README's API tour runs as printed (with only its imports added): docs that drift from
the API fail here, not in a user's first session."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
IMPORTS = """\
import torch
from kvxfer.backends.loopback import LoopbackBackend, LoopbackFabric
from kvxfer.contract import TransferMode
from kvxfer.lender import InPlaceLender
from kvxfer.pool import LayerGroupSpec, PagedKVPool
"""


def test_the_api_tour_runs_and_delivers_every_row() -> None:
    text = README.read_text()
    start = text.index("```python", text.index("## API tour")) + len("```python")
    code = text[start:text.index("```", start)]
    scope: dict[str, object] = {}
    exec(compile(IMPORTS + code, "README.md (API tour)", "exec"), scope)  # noqa: S102
    outcome, bounds = scope["outcome"], scope["bounds"]
    assert type(outcome).__name__ == "Delivered" and outcome.rows_delivered == scope["decode_view"].rows  # type: ignore[attr-defined]
    assert (bounds.usable_until, bounds.restart_floor) == (100, 0)  # type: ignore[attr-defined]
