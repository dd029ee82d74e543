"""``python -m kvxfer.launch.guard CMD [ARGS...]``: run CMD and end it when stdin closes.

``kvxfer serve`` and ``kvxfer router`` stop by themselves when their parent goes
(``--parent-watch``); a program of someone else's (etcd) does not. Its actor starts it under
this guard, with a pipe on the guard's stdin: when the actor process ends, killed or not, the
pipe closes and the guard sends CMD SIGTERM, then SIGKILL after ``GRACE_S``. SIGTERM and SIGINT
to the guard are passed on to CMD. The guard exits with CMD's status (``exit_status``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from types import FrameType

from kvxfer.worker.procs import end_process

GRACE_S = 5.0


def _end(child: subprocess.Popen[bytes]) -> None:
    end_process(child, GRACE_S, grace=0.0)  # CMD has no parent watch: SIGTERM at once


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        return 2
    child = subprocess.Popen(args, stdin=subprocess.DEVNULL)
    asked = threading.Event()  # a stop was asked for: CMD ending on our SIGTERM is a clean exit

    def watch() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        asked.set()
        _end(child)

    def forward(signum: int, frame: FrameType | None) -> None:
        asked.set()
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    threading.Thread(target=watch, name="kvxfer-guard-stdin", daemon=True).start()
    return exit_status(child.wait(), asked.is_set())


def exit_status(code: int, asked: bool) -> int:
    """CMD's status as a shell gives it (128 + N for signal N); 0 for a stop that was asked for
    and ended CMD by SIGTERM or SIGINT (etcd, for one, re-raises the signal once it has shut down)."""
    if code < 0:
        return 0 if asked and -code in (signal.SIGTERM, signal.SIGINT) else 128 - code
    return code


if __name__ == "__main__":
    sys.exit(main())
