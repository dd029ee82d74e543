"""UCX's InfiniBand module, where it cannot be used.

UCX loads its InfiniBand transport module wherever libibverbs is installed. On a host that
has the library but no RDMA device (a CPU machine where a package brought libibverbs1 in:
the Mooncake store's wheel links it, even over TCP), the UCX inside NIXL 1.x crashes the
process with SIGSEGV at exit, once it has made an agent (measured here: a process that made
one NIXL agent and returned exited -11; with the module skipped, 0). Such a host has nothing
the module could reach, so ``kvxfer`` skips it there (``UCX_MODULES=^ib``) when the package
is imported, and its child processes inherit that. A host with an RDMA device is left as it
is, and so is a ``UCX_MODULES`` the user set.
"""

from __future__ import annotations

import os

RDMA_DEVICES = "/sys/class/infiniband"


def skip_unusable_ib(devices: str = RDMA_DEVICES) -> bool:
    """Set ``UCX_MODULES=^ib`` when the host has no RDMA device and the user set nothing;
    True when it did."""
    if "UCX_MODULES" in os.environ:
        return False
    try:
        if os.listdir(devices):
            return False
    except OSError:
        pass  # no such class: no RDMA device
    os.environ["UCX_MODULES"] = "^ib"
    return True


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
