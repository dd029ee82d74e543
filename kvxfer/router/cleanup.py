"""What a request that went wrong leaves at its workers, taken back in the background.

A worker's handler runs on after its caller gave up, so a prefill or a reservation may be
made after the router stopped waiting: ``abort`` drops it there. After a publish failed in
an unknown way, the decode rows are safe to reuse only once the prefill worker took hint D
back (``withdrawn``): ``reclaim_later`` keeps asking, then tells the decode worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from kvxfer.serving.http import HttpClient, HttpError

log = logging.getLogger("kvxfer.router")

RECLAIM_S = 600.0
"""How long the router keeps asking a prefill worker to take back a hint D whose publish
failed in an unknown way (a timeout, a 500), so the decode worker can reuse its rows."""
RECLAIM_POLL_S = 1.0


class _Worker(Protocol):
    url: str
    role: str


class Cleanup:
    """The router's background aborts and reclaims; ``close`` bounds how long they may run on."""

    def __init__(self, http: HttpClient, timeout_s: float, connect_timeout_s: float) -> None:
        self._http = http
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._background: set[asyncio.Task[None]] = set()

    async def abort(self, e: _Worker, body: dict[str, Any]) -> None:
        """POST /abort to ``e``; a failure is a warning, not an error: the worker may be down,
        and then its sweeper (or its restart) drops what the abort would have."""
        try:
            await self._http.request_json(e.url, "POST", "/abort", body, self.timeout_s)
        except HttpError as exc:
            log.warning("%s worker %s: abort of %s failed: %s", e.role, e.url, body.get("request"), exc)

    def abort_later(self, e: _Worker, body: dict[str, Any]) -> None:
        """``abort`` in the background, for a caller that can await nothing more."""
        self._keep(self.abort(e, body))

    async def withdrawn(self, p: _Worker, hint: str) -> bool:
        """The prefill worker took hint D back: it can reach the decode rows no more."""
        try:
            answer = await self._http.request_json(p.url, "POST", "/withdraw", {"hint": hint}, self.connect_timeout_s)
        except HttpError as exc:
            # Gone (refused or cut): a dead process writes nothing more either.
            return exc.unreachable and exc.status == 0
        return isinstance(answer, dict) and answer.get("withdrawn") is True

    async def withdrawn_or_later(self, p: _Worker, d: _Worker, key: str, hint: str) -> bool:
        """Whether the prefill worker took hint D back now; if not, keep asking in the
        background (``reclaim_later``) until the decode worker may reuse the rows."""
        safe = await self.withdrawn(p, hint)
        if not safe:
            self.reclaim_later(p, d, key, hint)
        return safe

    def reclaim_later(self, p: _Worker, d: _Worker, key: str, hint: str) -> None:
        """Until the prefill worker takes hint D back (or is gone), then tell the decode
        worker its set-aside reservation may be reused; gives up after RECLAIM_S."""
        async def run() -> None:
            end = time.monotonic() + RECLAIM_S
            withdrawn = False
            while time.monotonic() < end:
                await asyncio.sleep(RECLAIM_POLL_S)
                withdrawn = withdrawn or await self.withdrawn(p, hint)
                if not withdrawn:
                    continue
                try:
                    answer = await self._http.request_json(d.url, "POST", "/abort", {"request": key, "rows_safe": True},
                                                           self.timeout_s)
                except HttpError as exc:  # the decode worker is gone or refuses: nothing to give back there
                    log.warning("decode worker %s: abort of %s failed: %s", d.url, key, exc)
                    return
                if isinstance(answer, dict) and answer.get("dropped") in ("quarantined", "reserved"):
                    return
        self._keep(run())

    def _keep(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Give the background work ``connect_timeout_s`` to land, then cancel the rest (a
        worker's sweeper drops what it did not reach)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=self.connect_timeout_s)
        left = list(self._background)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
