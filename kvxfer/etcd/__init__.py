"""etcd for kvxfer: a client with bounded calls, leases kept alive by a thread, prefix watches.

Used below the serving layer by the NIXL backend (agents' metadata, ``kvxfer.backends.nixl.etcd_metadata``)
and above it by worker registration and the router's discovery (``kvxfer.serving.discovery``).
It imports nothing of kvxfer but the contract's error tree.
"""

from kvxfer.etcd.client import (
    DEFAULT_NAMESPACE,
    ETCD_ENV,
    NAMESPACE_ENV,
    EtcdClient,
    EtcdUnavailable,
    etcd_endpoints,
    etcd_namespace,
)
from kvxfer.etcd.lease import MIN_TTL_S, KeptLease, check_ttl
from kvxfer.etcd.watch import PrefixWatch, WatchEvent

__all__ = ["DEFAULT_NAMESPACE", "ETCD_ENV", "MIN_TTL_S", "NAMESPACE_ENV", "EtcdClient", "EtcdUnavailable", "KeptLease",
           "PrefixWatch", "WatchEvent", "check_ttl", "etcd_endpoints", "etcd_namespace"]
