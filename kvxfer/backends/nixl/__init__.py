"""The NIXL backend (UCX): ``backend`` (NixlBackend), the agent wrapper (``agent``), chunk
plans (``plan``), active jobs and passive waits (``jobs``), the packed path (``packed``) and
its notes (``packed_notes``), agents' metadata in etcd (``etcd_metadata``, ``EtcdSettings``).

Public, for code above the backends: the names below. Besides the backend: ``raw_agent``, a
bare NIXL agent with NIXL's etcd variables hidden and the host's UCX settings, and
``nixl_api``, NIXL's Python API (``nixl._api``) imported as the backend imports it (sparing a
torch without CUDA): what lane probes (a worker's ``/probe``, ``kvxfer doctor``) measure
with. The modules are the backend's own."""

from kvxfer.backends.nixl.agent import raw_agent
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
from kvxfer.backends.nixl.loader import nixl_api

__all__ = ["BACKEND_KIND", "PACKED", "EtcdSettings", "NixlBackend", "NixlStats", "cuda_device_count", "cuda_present",
           "nixl_api", "raw_agent", "unique_agent_name"]
