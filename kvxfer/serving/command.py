"""The argument parser of every kvxfer command: a usage error is one line, and a flag is
taken only as spelled in full.

argparse's own prints the whole usage (twenty lines for ``kvxfer serve``) before the error,
which then scrolls out of sight in a log, and takes ``--rol prefill`` for ``--role prefill``,
so that a typo in a launch script silently starts something. Here the error is the line
``PROG: error: WHAT (PROG --help lists the flags)`` with exit status 2, and an abbreviation
is an unknown flag.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn


class CommandParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")
