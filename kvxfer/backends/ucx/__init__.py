"""The ucx backend over ucxx (UCX tag messages): ``backend`` (UcxBackend), the ucxx worker
(``transport``), the runs both ends number alike (``runs``) and the two sides of a transfer
(``jobs``). ucxx is optional: ``pip install 'kvxfer[ucx]'``; without it UcxBackend()
raises UcxUnavailable, and this package still imports."""

from kvxfer.backends.ucx.backend import BACKEND_KIND, UcxBackend
from kvxfer.backends.ucx.transport import UcxPeerGone, UcxUnavailable

__all__ = ["BACKEND_KIND", "UcxBackend", "UcxPeerGone", "UcxUnavailable"]
