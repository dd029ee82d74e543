"""The NIXL backend (UCX): ``backend`` (NixlBackend), the agent wrapper (``agent``), chunk
plans (``plan``), active jobs and passive waits (``jobs``), the packed path (``packed``) and
its notes (``notes``), agents' metadata in etcd (``etcd_metadata``, ``EtcdSettings``)."""

from kvxfer.backends.nixl.backend import (
    BACKEND_KIND,
    PACKED,
    EtcdSettings,
    NixlBackend,
    NixlStats,
    cuda_device_count,
    cuda_present,
    unique_agent_name,
)

__all__ = ["BACKEND_KIND", "PACKED", "EtcdSettings", "NixlBackend", "NixlStats", "cuda_device_count", "cuda_present",
           "unique_agent_name"]
