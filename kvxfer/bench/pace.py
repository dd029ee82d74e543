"""How long a bench run has left, from what its figures took so far: nothing is guessed up front.

Figures differ by orders of magnitude (a loopback memmove against 16,384 NIXL descriptors
per request; a latency sweep of hundreds of samples), so a count of figures done says
little about the time left. Each figure is timed as the run goes, and each figure still
to run is costed from those:

- a figure of a case begun costs the mean of its case's figures after its first (the first
  also paid for what the case starts once: a second process, NIXL's import, buffers); with
  only the case's first figure measured, that figure (an upper bound);
- a figure of a case not begun yet costs what the slowest case that ran its point (mode,
  row size, rows, slots...) took there (the slowest case's pace where none did), and its
  first figure adds the longest start a case has had: a case not begun may well be the
  slowest yet (in the cpu preset the two-process cases come last and take the longest per
  figure), so the estimate errs long rather than short. Over one whole cpu-preset run on
  the 2-core machine its median error was 24% of the time really left, against 63% for
  figures done over figures planned;
- the references' second pass is costed like any later figure of its case.

Figures that will be skipped here (a requirement missing, device memory without a GPU)
cost nothing and are left out of both sides. There is no estimate while the run's first
figure is all there is to go by. The figure is labelled "at this pace": a case not begun
yet is costed from the others until its own figures run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import fmean


@dataclass(frozen=True)
class Took:
    """A figure that ran: its case, its seconds, whether it was its case's first, and its
    point (mode and point, the case aside: what figures of several cases have in common)."""

    case: str
    seconds: float
    first: bool
    point: str = ""


@dataclass(frozen=True)
class Work:
    """A figure still to run: its case, whether it will be its case's first, and its point."""

    case: str
    first: bool
    point: str = ""


def seconds_left(took: Sequence[Took], left: Sequence[Work]) -> float | None:
    """The seconds ``left`` should take at the pace of ``took``. None while one figure, a
    case's first, is all there is to go by: its start-up says nothing of the figures after it."""
    firsts = [t for t in took if t.first]
    laters = [t for t in took if not t.first]
    if not laters and len(firsts) < 2:
        return None
    paced = laters or firsts  # what a figure costs once its case is up
    own = _means(laters, lambda t: t.case)
    own_first = {t.case: t.seconds for t in firsts}
    # A case not begun: the slowest case's cost at each of its points (the slowest case's
    # pace at a point none ran), plus the longest start a case has had.
    slowest_at = _slowest(paced)
    slowest = max(_means(paced, lambda t: t.case).values())
    start = max([own_first[c] - own[c] for c in own_first if c in own] + [0.0])
    total = 0.0
    for w in left:
        if w.case in own:
            total += own[w.case]
        elif w.case in own_first:
            total += own_first[w.case]  # its first figure alone: an upper bound, the start included
        else:
            total += slowest_at.get(w.point, slowest) + (start if w.first else 0.0)
    return total


def _slowest(took: Sequence[Took]) -> dict[str, float]:
    """Per point, the highest of the cases' mean seconds there."""
    by_point: dict[str, list[Took]] = {}
    for t in took:
        by_point.setdefault(t.point, []).append(t)
    return {point: max(_means(ts, lambda t: t.case).values()) for point, ts in by_point.items()}


def _means(took: Sequence[Took], key: Callable[[Took], str]) -> dict[str, float]:
    groups: dict[str, list[float]] = {}
    for t in took:
        groups.setdefault(key(t), []).append(t.seconds)
    return {k: fmean(v) for k, v in groups.items()}


def duration(seconds: float) -> str:
    """A human span, as precise as an estimate deserves: ``< 1 s``, ``40 s``, ``3 min``, ``1.5 h``."""
    if seconds < 0.5:
        return "< 1 s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def clock(seconds: float) -> str:
    """A span measured, to the second: ``41 s``, ``3 min 12 s``, ``1 h 05 min``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Pace:
    """A run's figures, timed as they finish, and those still to run."""

    def __init__(self, left: Sequence[Work]) -> None:
        self.took: list[Took] = []
        self.left: list[Work] = list(left)

    def ran(self, case: str, seconds: float) -> None:
        """A figure of ``case`` that was still to run has run, in ``seconds``."""
        for i, w in enumerate(self.left):
            if w.case == case:
                self.took.append(Took(case, seconds, w.first, w.point))
                del self.left[i]
                return

    def expect(self, left: Sequence[Work]) -> None:
        """What is still to run, where it turned out other than planned (the second pass)."""
        self.left = list(left)

    def seconds_left(self) -> float | None:
        return seconds_left(self.took, self.left)

    def not_begun(self) -> int:
        """Cases still to run that have no figure measured yet."""
        begun = {t.case for t in self.took}
        return len({w.case for w in self.left} - begun)
