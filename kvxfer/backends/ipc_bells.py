"""Temporary alias while the floor-plan move lands: kvxfer.backends.ipc.bells."""
import sys

import kvxfer.backends.ipc.bells as _moved

sys.modules[__name__] = _moved
