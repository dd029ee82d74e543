"""Temporary alias while the floor-plan move lands: kvxfer.backends.ipc.channel."""
import sys

import kvxfer.backends.ipc.channel as _moved

sys.modules[__name__] = _moved
