"""Temporary alias while the floor-plan move lands: kvxfer.backends.nixl.agent."""
import sys

import kvxfer.backends.nixl.agent as _moved

sys.modules[__name__] = _moved
