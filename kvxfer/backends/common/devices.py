"""What this machine offers a backend, asked without importing torch or a transport."""

from __future__ import annotations

import ctypes
import os
import secrets
import socket


def cuda_device_count() -> int:
    """Devices the CUDA driver reports, 0 without a driver."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        return count.value if cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 else 0
    except OSError:
        return 0


def cuda_present() -> bool:
    """True when the CUDA driver reports a device."""
    return cuda_device_count() > 0


def unique_agent_name(prefix: str = "kvxfer") -> str:
    """Host, process and a random suffix: unique across restarts of one process id."""
    return f"{prefix}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
