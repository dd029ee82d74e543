"""The UCX settings kvxfer gives the UCX contexts it makes, and checks of the user's.

Nothing here changes the process when imported: settings are put in the environment only
while a context is made (``ucx_settings``), and taken out again.

UCX's InfiniBand module, where it cannot be used: UCX loads it wherever libibverbs is
installed. On a host that has the library but no RDMA device (a CPU machine where a package
brought libibverbs1 in: the Mooncake store's wheel links it, even over TCP), the UCX inside
NIXL 1.x crashes the process with SIGSEGV at exit, once it has made an agent (measured here:
a process that made one NIXL agent and returned exited -11; with the module skipped, 0). Such
a host has nothing the module could reach, so kvxfer skips it there (``UCX_MODULES=^ib``,
``ib_settings``) for each UCX it loads: NIXL's when an agent is made, ucxx's when the ucx
backend loads it. UCX reads the variable when its library loads, so it applies to every
later context in the process too. A host with an RDMA device is left as it is, and so is a
``UCX_MODULES`` the user set.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

RDMA_DEVICES = "/sys/class/infiniband"


def ib_settings(devices: str = RDMA_DEVICES) -> dict[str, str]:
    """``{"UCX_MODULES": "^ib"}`` on a host without an RDMA device, else nothing."""
    try:
        if os.listdir(devices):
            return {}
    except OSError:
        pass  # no such class: no RDMA device
    return {"UCX_MODULES": "^ib"}


NET_DEVICES = "/sys/class/net"


def net_devices_problem(value: str | None = None, *, net: str = NET_DEVICES, rdma: str = RDMA_DEVICES) -> str | None:
    """What is wrong with ``UCX_NET_DEVICES`` (default: the environment's) on this host, or None.

    UCX takes a comma-separated list of network interfaces (``eth0``) and RDMA ports
    (``mlx5_0:1``), or ``all``; a name it does not find is only a warning there, and NIXL's
    agent then fails to start with ``NIXL_ERR_BACKEND`` and a traceback. Names with a
    wildcard are left to UCX."""
    value = os.environ.get("UCX_NET_DEVICES", "") if value is None else value
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names or "all" in names:
        return None
    have = set(_listdir(net)) | set(_listdir(rdma))
    missing = [n for n in names if "*" not in n and n.split(":")[0] not in have]
    if not missing:
        return None
    return (f"UCX_NET_DEVICES names {', '.join(repr(n) for n in missing)}, which this host does not have "
            f"(its network devices: {', '.join(sorted(have)) or 'none'}): fix or unset it")


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


# --- a silent peer is seen within a bound ----------------------------------------------------
# Over TCP, UCX learns that a peer vanished without a FIN or RST (a host that died, a cut
# cable, a blackholed route) only when its socket fails: with data unacknowledged, after the
# kernel's retry limit (tcp_retries2, about 15 minutes); with nothing in flight, never. A NIXL
# request to such a peer stayed in progress that long (161 s seen before it was given up), so
# its attempt could not quiesce. UCX can bound both on its TCP sockets: TCP_USER_TIMEOUT for
# unacknowledged data and keepalive probes for an idle connection. Measured between two
# network namespaces with the peer blackholed mid-WRITE of 256 MiB: with the defaults the WRITE
# stayed in progress past 30 s; with UCX_TCP_USER_TIMEOUT=5s and keepalive 2+3x1 s, NIXL
# reported NIXL_ERR_REMOTE_DISCONNECT after 5.4 s (a READ: 6.9 s).
TCP_LIVENESS_VARS = ("UCX_TCP_USER_TIMEOUT", "UCX_TCP_KEEPIDLE", "UCX_TCP_KEEPINTVL", "UCX_TCP_KEEPCNT",
                     "UCX_TCP_SYN_CNT")


def tcp_liveness(deadline_s: float) -> dict[str, str]:
    """UCX's TCP timeouts for a transfer deadline of ``deadline_s``: a peer silent for half the
    deadline (at least 5 s, at most 60 s) is declared gone, so an attempt on it settles within
    twice its deadline, or its deadline and 8 s if that is longer (docs/configuration.md)."""
    # Not under 5 s: a loaded host can leave a live peer's data unacknowledged for a second or two.
    half = min(max(deadline_s / 2, 5.0), 60.0)
    idle = max(1, int(half / 3))
    interval = max(1, int(half / 6))
    # A new connection to a peer that is gone: the user timeout does not cover the SYNs, which
    # the kernel retries 1+2+4+... s (6 times by default: about 2 minutes).
    syn = 1 if half <= 8 else 2 if half <= 16 else 3
    return {"UCX_TCP_USER_TIMEOUT": f"{int(half * 1000)}ms", "UCX_TCP_KEEPIDLE": str(idle),
            "UCX_TCP_KEEPINTVL": str(interval), "UCX_TCP_KEEPCNT": "3", "UCX_TCP_SYN_CNT": str(syn)}


_ENV_LOCK = threading.Lock()


@contextmanager
def ucx_settings(settings: dict[str, str] | None = None) -> Iterator[dict[str, str]]:
    """Set the host's UCX settings (``ib_settings``) and each of ``settings``, where the user
    has not set them, for as long as the block runs: wrap the making of each UCX context
    (a NIXL agent, ucxx's import) in it. Yields what was applied. Child processes started
    meanwhile would inherit them, so keep the block to the context's creation."""
    wanted = {**ib_settings(), **(settings or {})}
    with _ENV_LOCK:
        applied = {key: value for key, value in wanted.items() if key not in os.environ}
        os.environ.update(applied)
        try:
            yield applied
        finally:
            for key in applied:
                os.environ.pop(key, None)
