"""Temporary alias while the floor-plan move lands: kvxfer.backends.common.transfers."""
import sys

import kvxfer.backends.common.transfers as _moved

sys.modules[__name__] = _moved
