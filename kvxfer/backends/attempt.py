"""Temporary alias while the floor-plan move lands: kvxfer.backends.common.attempt."""
import sys

import kvxfer.backends.common.attempt as _moved

sys.modules[__name__] = _moved
