"""``python -m kvxfer.pair``: the same as ``kvxfer pair``."""

import sys

from kvxfer.pair import main

sys.exit(main())
