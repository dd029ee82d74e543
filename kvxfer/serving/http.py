"""HTTP for the workers and the router, on aiohttp: what callers import.

- ``HttpServer`` (``kvxfer.serving.server``): serves one ``Handler`` (a ``Request`` in, a
  ``Response`` out: JSON whole, or NDJSON streamed), HTTP/1.1 keep-alive, chunked bodies both
  ways, HEAD; the limits below; an access log line per request at INFO.
- ``HttpClient`` (``kvxfer.serving.client``): one pooled ``aiohttp.ClientSession``;
  ``request_json``, ``request_text`` and ``stream_json`` use one such client per event loop.
- ``HttpError`` (a failed exchange: refused, cut, timed out, or a status of 400 or more) and
  ``BadRequest`` (a handler's 400), and the limits (``kvxfer.serving.exchange``).
"""

from __future__ import annotations

from kvxfer.serving.client import (
    HttpClient,
    check_url,
    close_default_client,
    default_client,
    request_json,
    request_text,
    stream_json,
)
from kvxfer.serving.exchange import (
    MAX_BODY,
    MAX_CONNECTIONS,
    MAX_HEADER,
    READ_TIMEOUT_S,
    BadRequest,
    Gate,
    Handler,
    HttpError,
    Request,
    Response,
)
from kvxfer.serving.server import HttpServer

__all__ = [
    "MAX_BODY", "MAX_CONNECTIONS", "MAX_HEADER", "READ_TIMEOUT_S", "BadRequest", "Gate", "Handler", "HttpClient", "HttpError",
    "HttpServer", "Request", "Response", "check_url", "close_default_client", "default_client", "request_json", "request_text",
    "stream_json",
]
