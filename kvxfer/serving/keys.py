"""Keys on the HTTP doors: a bearer key a server requires and its clients send.

Two keys, each its own secret:

- **The API key** (``kvxfer router --api-key KEY``, ``--api-key-file PATH`` or
  ``KVXFER_API_KEY``): the router's OpenAI routes and ``/generate`` want
  ``Authorization: Bearer KEY``, as vLLM's and SGLang's servers do.
- **The cluster key** (``--cluster-key-file PATH`` or ``KVXFER_CLUSTER_KEY``): a worker with
  one wants it on every control route (``/prefill``, ``/publish``, ``/reserve``,
  ``/generate``, ``/abort``, ``/withdraw``, ``/doctor/probe``); the router, ``kvxfer pair``,
  ``kvxfer launch`` and ``kvxfer doctor --peer`` send it.

``/health`` and ``/metrics`` (and ``/``) stay open on both: load balancers and Prometheus
read them without a key. The cluster key is not the hint key (``KVXFER_HINT_KEY``): a bearer
key travels in every request's head, in clear over plain HTTP, and whoever read one would
then hold the key that signs hints; the router, which needs the cluster key, needs no hint
key. A missing or wrong key is answered 401 in OpenAI's error shape, compared in constant
time; neither the key nor what a client sent in its place is ever logged or answered.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvxfer.contract import KvxferError
from kvxfer.serving.exchange import MAX_HEADER, Request, Response

API_KEY_ENV = "KVXFER_API_KEY"
CLUSTER_KEY_ENV = "KVXFER_CLUSTER_KEY"
OPEN_PATHS = frozenset({"/", "/health", "/metrics"})
"""Paths answered without a key (a trailing slash aside), whatever the method."""
API_KEY = "the API key (--api-key, --api-key-file or KVXFER_API_KEY)"
CLUSTER_KEY = "the cluster key (--cluster-key-file or KVXFER_CLUSTER_KEY)"


class InvalidKey(KvxferError, ValueError):
    """A key that cannot be used (empty, unreadable, or not sendable in a header); the message
    names where it came from, never the key."""


@dataclass(frozen=True)
class BearerKey:
    """A shared secret sent as ``Authorization: Bearer <secret>``. ``source`` says where it
    came from (a flag, a file, a variable), for messages; the secret is in no repr."""

    secret: str = field(repr=False)
    source: str = "a key"

    def __post_init__(self) -> None:
        if not self.secret:
            raise InvalidKey(f"{self.source} is empty")
        # A header carries visible ASCII: a space, a control character or a non-ASCII one
        # would be cut or refused on the way, and the two ends would never agree.
        if not all("!" <= c <= "~" for c in self.secret):
            raise InvalidKey(f"{self.source} holds a space, a control or a non-ASCII character: a key is "
                             "printable ASCII (openssl rand -hex 32 makes one)")
        if len(self.secret) > MAX_HEADER // 16:
            raise InvalidKey(f"{self.source} is over {MAX_HEADER // 16} characters")

    @classmethod
    def from_file(cls, path: str, flag: str) -> BearerKey:
        """The key in ``path`` (whitespace around it, a final newline say, dropped)."""
        try:
            text = Path(path).read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidKey(f"{flag} {path}: cannot read a key there: "
                             f"{getattr(exc, 'strerror', None) or type(exc).__name__}") from None
        return cls(text.strip(), f"{flag} {path}")

    @classmethod
    def from_env(cls, name: str, environ: Mapping[str, str] | None = None) -> BearerKey | None:
        """The key in the variable ``name``; None when it is unset or empty."""
        value = (os.environ if environ is None else environ).get(name, "").strip()
        return cls(value, name) if value else None

    def accepts(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header's value carries this key (in constant time)."""
        scheme, _, given = (authorization or "").strip().partition(" ")
        given = given.strip()
        # A key is ASCII: anything else is wrong, and never mapped onto one ('?' for each
        # other character would let a key holding '?' take them all).
        if scheme.lower() != "bearer" or not given.isascii():
            return False
        return hmac.compare_digest(given.encode("ascii"), self.secret.encode("ascii"))

    def headers(self) -> dict[str, str]:
        """The header a client sends."""
        return {"Authorization": f"Bearer {self.secret}"}


def headers(key: BearerKey | None) -> dict[str, str]:
    """``key``'s header, or none."""
    return key.headers() if key is not None else {}


def refusal(key: BearerKey | None, request: Request, what: str) -> Response | None:
    """The 401 that ``request`` gets when ``key`` is set and the request does not carry it on
    a route that is not open; None when it may go on. ``what`` names the key in the answer."""
    if key is None or (request.path.rstrip("/") or "/") in OPEN_PATHS:
        return None
    authorization = request.headers.get("authorization")
    if key.accepts(authorization):
        return None
    if authorization is None:
        message = f"no key: this server wants {what}, sent as 'Authorization: Bearer <key>'"
    else:
        message = f"wrong key: this server wants {what}, sent as 'Authorization: Bearer <key>'"
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    out = Response.json(body, 401)
    out.headers["WWW-Authenticate"] = 'Bearer realm="kvxfer"'
    return out


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address or a name) reaches this machine only."""
    if not host:
        return False  # every interface
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def open_door_warning(prog: str, host: str, key: BearerKey | None, what: str, exposes: str) -> str | None:
    """The one line a server prints at start when it listens beyond this machine with no key."""
    if key is not None or is_loopback(host):
        return None
    return (f"{prog}: warning: listening on {host or 'every interface'} with no {what}: anyone who reaches this "
            f"port can {exposes}")


# --- command lines ------------------------------------------------------------------------------

def add_key_args(parser: argparse.ArgumentParser, *, api: bool = False, cluster: bool = True) -> None:
    """``--api-key``/``--api-key-file`` (a server's own door) and ``--cluster-key-file``."""
    if api:
        parser.add_argument("--api-key", default=None, metavar="KEY",
                            help="clients must send 'Authorization: Bearer KEY' on the OpenAI routes and /generate "
                                 f"(also {API_KEY_ENV}; a command line shows in ps: prefer --api-key-file)")
        parser.add_argument("--api-key-file", default=None, metavar="PATH", help="the API key, read from a file")
    if cluster:
        parser.add_argument("--cluster-key-file", default=None, metavar="PATH",
                            help=f"the workers' cluster key, read from a file (else {CLUSTER_KEY_ENV}; "
                                 "unset: none)")


def keys_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Replace the key flags in ``args`` by what they name: ``args.api_key`` and
    ``args.cluster_key`` become BearerKeys (or None), read from the flags, else the
    environment; a key that cannot be used is a usage error (exit 2) naming its source."""
    try:
        if hasattr(args, "api_key_file"):
            if args.api_key is not None and args.api_key_file is not None:
                parser.error("--api-key and --api-key-file both give the API key: give one")
            if args.api_key is not None:
                args.api_key = BearerKey(args.api_key.strip(), "--api-key")
            elif args.api_key_file is not None:
                args.api_key = BearerKey.from_file(args.api_key_file, "--api-key-file")
            else:
                args.api_key = BearerKey.from_env(API_KEY_ENV)
        if hasattr(args, "cluster_key_file"):
            args.cluster_key = (BearerKey.from_file(args.cluster_key_file, "--cluster-key-file")
                                if args.cluster_key_file is not None else BearerKey.from_env(CLUSTER_KEY_ENV))
    except InvalidKey as exc:
        parser.error(str(exc))
