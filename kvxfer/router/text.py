"""Token ids in, text out as it becomes final: what a streamed completion sends.

Two things make text lag its tokens. A byte-level BPE token may end inside a UTF-8
character: its text waits for the token that completes it (the window of ids decoded
again each step is the one vLLM's incremental detokenizer uses, so the cost per token
stays flat). And a stop string may begin in text already decoded: text that could still
be the start of one is held back until it cannot, and the text ends before the first stop
string found, which is never sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_PARTIAL = "\ufffd"
"""What a decoder gives for the bytes of a character that is not complete yet."""


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str: ...


class TextStream:
    """Feed the completion's tokens one at a time (not its stop ids); each ``feed`` and the
    closing ``finish`` give the text that became final since the last call. Once a stop
    string is found, ``stopped`` is True and nothing more comes."""

    def __init__(self, decoder: Decoder, stop: Sequence[str] = ()) -> None:
        self._decoder = decoder
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] decoded already: the context the next token's text needs
        self._read = 0
        self._text = ""  # the final text so far
        self._sent = 0  # how much of it was given out
        self.stopped = False

    @property
    def text(self) -> str:
        """The text given out so far."""
        return self._text[: self._sent]

    def feed(self, token: int) -> str:
        if self.stopped:
            return ""
        self._ids.append(int(token))
        before = self._decoder.decode(self._ids[self._prefix: self._read])
        after = self._decoder.decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith(_PARTIAL):
            self._text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest: what was held back for a stop string, and the text of trailing ids that
        never made a whole character (as the decoder renders them)."""
        if not self.stopped and self._read < len(self._ids):
            before = self._decoder.decode(self._ids[self._prefix: self._read])
            self._text += self._decoder.decode(self._ids[self._prefix:])[len(before):]
            self._prefix = self._read = len(self._ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        if self._stop:
            start = max(0, self._sent - self._hold)  # a stop string ending in new text starts here at the earliest
            found = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
            if found:
                cut = min(found)
                out = self._text[self._sent: cut]
                self._text, self._sent, self.stopped = self._text[:cut], cut, True
                return out
        end = len(self._text) if final else max(self._sent, len(self._text) - self._hold)
        out = self._text[self._sent: end]
        self._sent = end
        return out
