"""Same-node GPU-to-GPU backend over CUDA IPC: ``backend`` (IpcBackend), the row copies on
its stream (``copies``) and their row check (``rowcheck``), the layout-transform path between
engine geometries (``geometry``), completion frames and done-tokens (``frames``), the passive
end's waits (``waits``), one attempt's bookkeeping (``jobs``), the Unix-socket record channel
(``channel``), peer allocation mappings (``mappings``), doorbells (``doorbells``) and
shared-memory maps (``shm_map``). README.md gives the reading order."""

from kvxfer.backends.ipc.backend import BACKEND_KIND, IpcBackend, IpcUnavailable, node_identity

__all__ = ["BACKEND_KIND", "IpcBackend", "IpcUnavailable", "node_identity"]
