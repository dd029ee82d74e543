"""The one error the wire codec raises: every refusal, encode or decode, is a WireError."""

from __future__ import annotations

from kvxfer.contract import KvxferError


class WireError(KvxferError):
    """A message (or a key, or a value to encode) the codec refuses.

    The message names the field and the problem. Decoding raises nothing else, whatever
    the bytes: no KeyError, TypeError, ValueError, numpy or msgpack error escapes.
    """
