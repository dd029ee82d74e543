"""Temporary alias while the floor-plan move lands: kvxfer.backends.nixl.plan."""
import sys

import kvxfer.backends.nixl.plan as _moved

sys.modules[__name__] = _moved
