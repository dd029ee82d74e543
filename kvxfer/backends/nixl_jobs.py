"""Temporary alias while the floor-plan move lands: kvxfer.backends.nixl.jobs."""
import sys

import kvxfer.backends.nixl.jobs as _moved

sys.modules[__name__] = _moved
