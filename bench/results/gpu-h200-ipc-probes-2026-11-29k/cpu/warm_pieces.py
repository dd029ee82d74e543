"""The same steps of publish() as to_native.py, each repeated 20,000 times in a loop (warm), in us per call.

    .venv/bin/python warm_pieces.py
"""
import timeit

import numpy as np

import kvxfer.backends.ipc as ipc
import kvxfer.backends.ipc_pair as pair
from kvxfer.backends.attempt import TrackedAttempt
from kvxfer.backends.matching import check_submission, match_rows


def main(rows=32, row=65536):
    slots = rows + rows // 4
    with pair.push_pair(row, slots, True, True, (0, 0)) as (peer, memory, local):
        rng = np.random.default_rng(1)
        lv = pair.one_group_view(memory.regions[0], rng.permutation(slots)[:rows].astype(np.int64), "r")
        pv = pair.one_group_view(peer.regions[0], rng.permutation(slots)[:rows].astype(np.int64), "r")
        hint = peer.describe(pv)
        local.describe(lv)
        b = local
        print("extras", [k for k, v in hint.extras], "groups", len(hint.groups))
        matches = match_rows(lv, hint)
        exports = b._peer_exports(hint, matches)
        att = TrackedAttempt(None, b._on_cancel, "x")
        tests = {
          "refuse_if_closed": lambda: b._refuse_if_closed(),
          "check_submission": lambda: check_submission(lv, hint, b._regions, ipc.BACKEND_KIND, b.mode, fetching=False),
          "check_view": lambda: b._regions.check_view(lv, for_fetch=False),
          "check_agreement": lambda: ipc.check_agreement(lv, hint, ipc.BACKEND_KIND, b.mode) if hasattr(ipc,'check_agreement') else None,
          "extra_node": lambda: hint.extra(ipc.EXTRA_NODE) != b._node,
          "own_lookup": lambda: b._own.lookup(lv),
          "label": lambda: f"{b.name}:{'publish'}:{lv.request}",
          "TrackedAttempt": lambda: TrackedAttempt(None, b._on_cancel, "x"),
          "match_rows": lambda: match_rows(lv, hint),
          "peer_exports": lambda: b._peer_exports(hint, matches),
          "peer_bell": lambda: b._peer_bell(hint),
          "_Active": lambda: ipc._Active(att, lv, hint, matches, exports, writes_peer=True, bell=None),
          "take_event": lambda: (b._events.append(b._take_event()[0])),
          "set_masks": lambda: b._set_masks(ipc._Active(att, lv, hint, matches, exports, writes_peer=True), [(0, matches[0], rows)]),
        }
        for k, f in tests.items():
            n = 20000
            t = min(timeit.repeat(f, number=n, repeat=5)) / n * 1e6
            print(f"{k:18s} {t:6.2f} us")
if __name__ == "__main__":
    main()
