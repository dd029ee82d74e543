"""Temporary alias while the floor-plan move lands: kvxfer.backends.common.matching."""
import sys

import kvxfer.backends.common.matching as _moved

sys.modules[__name__] = _moved
