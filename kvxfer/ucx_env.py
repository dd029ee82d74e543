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
