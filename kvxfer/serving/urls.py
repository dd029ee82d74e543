"""A server's URL checked without the HTTP client (which imports aiohttp): a command line
refuses a bad one before anything heavy loads."""

from __future__ import annotations

import urllib.parse


def check_url(url: str) -> str:
    """``url`` without its trailing slash, when it names a server as ``http://host:port``;
    ValueError otherwise (one without a port would be taken as port 80 and fail every call)."""
    problem = ValueError(f"{url!r} is not a server's URL: give http://HOST:PORT")
    try:
        parts = urllib.parse.urlsplit(url.rstrip("/"))
        port = parts.port
    except ValueError:
        raise problem from None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path or parts.query:
        raise problem
    return url.rstrip("/")
