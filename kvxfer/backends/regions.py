"""Temporary alias while the floor-plan move lands: kvxfer.backends.common.regions."""
import sys

import kvxfer.backends.common.regions as _moved

sys.modules[__name__] = _moved
