"""Random sequences of pool and lender calls keep the block bookkeeping sound.

After every step: each block's refcount is the number of requests holding it; its pins
are the number of leases still holding its memory; a free block is held, pinned,
retained and cached by nobody; a retained block is never free, cached or named (so no
prefix reuse hands it out); a named block is never lent for writing; readiness never
reaches past the request; a block lent for writing is lent for nothing else. Misuse is allowed to raise only the lender's and pool's own
named errors, never a KeyError or a numpy error.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvxfer.contract import CacheKind
from kvxfer.lender import InPlaceLender, Lease, LeaseError, Lender, StagingLender
from kvxfer.pool import LayerGroupSpec, PagedKVPool, PoolExhausted

FULL = LayerGroupSpec("full", 1, 4, 1, 2)
SWA = LayerGroupSpec("swa", 1, 4, 1, 2, window=8, sink_blocks=1)
STATE = LayerGroupSpec("ssm", 1, 1, 1, 2, kind=CacheKind.STATE)
REFUSALS = ("lie in blocks", "holds only", "positions outside")  # the pool's named ValueErrors used here


def check(pool: PagedKVPool, leases: list[Lease]) -> None:
    holders: dict[tuple[str, int], int] = {}
    for r in pool.requests:
        for g in pool.groups:
            for b in pool.block_table(r, g.name).tolist():
                holders[(g.name, b)] = holders.get((g.name, b), 0) + 1
    for g in pool.groups:
        a = pool.allocator(g.name)
        pins = np.zeros(a.num_blocks, dtype=np.int64)
        for lease in leases:
            if not lease.released or lease.id in lease.lender._releasing:
                np.add.at(pins, next(p.blocks for p in lease._parts if p.group == g.name), 1)
        assert (a.pins == pins).all(), f"group {g.name}: pins disagree with the open leases"
        free = a._free[: a._nfree]
        assert np.unique(free).size == free.size and (np.sort(free) == np.flatnonzero(a._is_free)).all()
        held = np.array([holders.get((g.name, b), 0) for b in range(a.num_blocks)])
        assert (a.refcount == held).all(), f"group {g.name}: refcounts disagree with block tables"
        lru = np.fromiter(a._lru, dtype=np.int64, count=len(a._lru))
        assert not (held[free].any() or a.pins[free].any() or a.retained[free].any() or np.isin(free, lru).any())
        assert not (held[lru].any() or a.pins[lru].any() or a.retained[lru].any()) and a.named[lru].all()
        assert not (a.retained & a.named).any(), "a retained block keeps a prefix name"
        assert not (a.named & (a.write_pins > 0)).any(), "a block lent for writing has a prefix name"
        written = a.write_pins > 0
        assert (a.pins[written] == a.write_pins[written]).all(), "a block lent for writing is lent for reading too"
        assert sorted(a._key_of) == np.flatnonzero(a.named).tolist()


def run(seed: int, staging: bool, steps: int = 150) -> None:
    rnd = random.Random(seed)
    pool = PagedKVPool([FULL, SWA, STATE], 40, scope=b"s")

    def new_lender() -> Lender:
        return StagingLender(pool, 16, 3, 1 << 22) if staging else InPlaceLender(pool)

    lender = new_lender()
    vocab = [np.array([rnd.randrange(2) for _ in range(64)]) for _ in range(2)]
    ids: dict[str, np.ndarray] = {}
    leases: list[Lease] = []
    for step in range(steps):
        op = rnd.randrange(13)
        reqs = list(pool.requests)
        r = rnd.choice(reqs) if reqs else ""
        n = pool.length(r) if reqs else 0
        try:
            if op == 0 or not reqs:
                name = f"r{rnd.randrange(6)}"
                if not pool.has(name):
                    ids[name] = vocab[rnd.randrange(2)]
                    pool.allocate(name, rnd.randrange(24), ids[name] if rnd.random() < 0.7 else None)
            elif op == 1:
                pool.grow(r, n + rnd.randrange(12))
            elif op == 2:
                pool.shrink(r, rnd.randrange(n + 1))
            elif op == 3:
                pool.free(r)
            elif op == 4:
                pool.commit(r, rnd.randrange(n + 1), ids[r] if rnd.random() < 0.7 else None)
            elif op in (5, 6):
                start = rnd.randrange(n + 1)
                end = rnd.randrange(start, n + 1) if op == 5 else start + rnd.randrange(16)
                leases.append((lender.lend_read if op == 5 else lender.lend_write)(r, (start, end)))
            elif op == 7 and leases:
                lease = rnd.choice(leases)
                view = lease.view()
                if lease.write and view is not None and not lease.arrived and not lease.released:
                    lease.mark_arrived([np.array([rnd.random() < 0.8 for _ in range(len(g))], dtype=np.bool_)
                                        for g in view.groups])
            elif op == 8 and leases:
                rnd.choice(leases).release()
            elif op == 9 and n:
                at = rnd.randrange(n)
                k = rnd.randrange(1, n - at + 1)
                pool.write_kv(r, "full", 0, at, torch.ones(k, 1, 2), torch.ones(k, 1, 2))
            elif op == 10 and staging and rnd.random() < 0.3:
                lender.inject_copy_faults(1)  # type: ignore[attr-defined]
            elif op == 11 and rnd.random() < 0.1:
                lender.shutdown(force=True)
                lender = new_lender()
            elif op == 12 and rnd.random() < 0.05:
                pool.reset_reuse(b"scope-%d" % step)
                lender.shutdown(force=True)  # lending from this pool is over: only releases remain
                for lease in leases:
                    lease.release()
                return
            for name in pool.requests:
                bounds = lender.readiness(name)
                assert bounds is None or bounds.usable_until <= pool.length(name)
        except (PoolExhausted, LeaseError):
            pass
        except ValueError as exc:
            if not any(text in str(exc) for text in REFUSALS):
                raise
        check(pool, leases)


@pytest.mark.parametrize("staging", [False, True], ids=["in-place", "staging"])
@pytest.mark.parametrize("seed", range(4))
def test_random_call_sequences_keep_blocks_sound(seed: int, staging: bool) -> None:
    run(seed, staging)


def test_blocks_a_read_lease_holds_are_not_lent_for_writing() -> None:
    # A read lease is open on blocks 0-1 (a publish may be sending them); the request shrinks
    # to 8 tokens and grows back, so block 0 is partly empty again. Lending it for writing
    # would let a peer rewrite the whole block under the publish: refused by name, as the
    # pool's own write_kv refuses; once the read lease is released, it is lent.
    pool = PagedKVPool([FULL], 16, scope=b"s")
    lender = InPlaceLender(pool)
    pool.allocate("r", 8)
    pool.commit("r", 8)
    reading = lender.lend_read("r", (0, 8))
    pool.shrink("r", 2)
    pool.grow("r", 8)
    with pytest.raises(LeaseError, match="lent for reading by an open lease"):
        lender.lend_write("r", (2, 8))
    reading.release()
    writing = lender.lend_write("r", (2, 8))
    view = writing.view()
    assert view is not None and view.groups[0].slots.tolist() == pool.block_table("r", "full").tolist()
    writing.release()
