"""transformers' continuous batching disaggregated across two processes over NIXL, for tests.

The parent runs the prefill engine (``TransformersEngine``) and its ``NixlBackend``; a child
(``DecodeChild``, started by ``DecodePeer``) runs the decode engine, its own backend and its
own step loop, and answers the parent over a socket pair (``multiprocessing.connection``
framing; hints cross as ``kvxfer.wire`` bytes, as a router carries them)::

    peer = DecodePeer({"page_size": 16, "num_blocks": 96})           # loads SmolLM2 from its GGUF in the child
    # or {"weights": DIR}: what hf.save_model wrote of the parent's GGUF load (same weights, no
    # second GGUF parse: transformers' GGUF loading takes 13-30 s of CPU)
    run = disaggregate(prefill_engine, backend, peer, prompts, max_new_tokens=8)
    run.completions                                                   # request -> tokens

A request's path is the workers': the decode end reserves blocks and describes them (hint D,
bound to the prefill backend; all requests' in one call before prefill starts), the prefill end lends its prompt's blocks straight out of
transformers' cache, publishes them with hint D and sends hint P; the decode end fetches with
it, adopts the request once the attempt concluded and quiesced, and decodes it in its batch
beside the others.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvxfer.adapters.transformers import TransformersEngine, check_peer_engine, checkpoint_scope
from kvxfer.adapters.transformers import _internals as hf
from kvxfer.adapters.transformers.converted import load_converted
from kvxfer.backends.nixl import NixlBackend
from kvxfer.contract import Attempt, Delivered, KvxferError, Peer, TransferMode
from kvxfer.engine import TEXT_PROMPTS
from kvxfer.modelfiles import SMOLLM2, load_tokenizer, smollm2_path
from kvxfer.wire import decode_hint, encode_hint

START_TIMEOUT = 180.0  # the child loads SmolLM2 through transformers: 13-30 s on a busy 2-core machine


def load_smollm2() -> Any:
    """SmolLM2-135M-Instruct loaded by transformers itself from the packaged GGUF (converted
    once, then from kvxfer's cache)."""
    torch.set_num_threads(1)
    return load_converted(smollm2_path())


def mixed_prompts(count: int) -> list[list[int]]:
    """``count`` text prompts of mixed lengths (one to four of TEXT_PROMPTS joined)."""
    tokenizer = load_tokenizer(SMOLLM2)
    assert tokenizer is not None
    texts = list(TEXT_PROMPTS)
    prompts = []
    for i in range(count):
        parts = 1 + (i * 3) % 4
        prompts.append(tokenizer.encode(" ".join(texts[(i + j) % len(texts)] for j in range(parts))))
    return prompts


def engine_for(model: Any, options: dict[str, Any], name: str) -> TransformersEngine:
    return TransformersEngine(model, page_size=int(options.get("page_size", 16)),
                              num_blocks=int(options.get("num_blocks", 96)),
                              max_batch_tokens=int(options.get("max_batch_tokens", 256)),
                              scope=checkpoint_scope(smollm2_path()), name=name)


# --- the parent ------------------------------------------------------------------------------
@dataclass
class PairRun:
    completions: dict[str, list[int]] = field(default_factory=dict)
    outcomes: dict[str, str] = field(default_factory=dict)   # the decode end's fetch outcome per request
    held: dict[str, int] = field(default_factory=dict)       # prompt tokens the decode end already held
    transfer_s: dict[str, float] = field(default_factory=dict)  # publish submitted -> its last wake (concluded)
    first_token_s: dict[str, float] = field(default_factory=dict)  # from the start of the run
    wall_s: float = 0.0


class DecodePeer:
    """The decode engine in a child process."""

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        """Starts the child and returns at once: ``wait_ready`` waits for its model and backend."""
        parent, child = socket.socketpair()
        env = {**os.environ, "NIXL_LOG_LEVEL": "WARN"}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvxfer.testing.transformers_pair", str(child.fileno()),
                 json.dumps(options or {})],
                pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL)
        finally:
            child.close()
        self._conn = Connection(parent.detach())
        self.info: dict[str, Any] = {}

    def wait_ready(self) -> None:
        if not self.info:
            self.info = self._call(timeout=START_TIMEOUT)

    @property
    def peer(self) -> Peer:
        return self.info["peer"]  # type: ignore[no-any-return]

    def _call(self, *request: Any, timeout: float = 60.0) -> Any:
        if request:
            self._conn.send(request)
        if not self._conn.poll(timeout):
            raise TimeoutError(f"decode child {self.process.pid} did not answer {request[:1]} within {timeout:g}s")
        reply = self._conn.recv()
        if reply[0] != "ok":
            raise RuntimeError(f"decode child: {reply[1]}: {reply[2]}")
        return reply[1]

    def reserve(self, requests: list[tuple[str, list[int]]], publisher: Peer) -> list[tuple[bytes, int]]:
        """Reservations for ``(request, prompt)`` pairs: hint D (bound to ``publisher``) and the
        prompt tokens already held, each."""
        return self._call("reserve", requests, publisher)  # type: ignore[no-any-return]

    def fetch(self, fetches: list[tuple[str, bytes, int, int]]) -> None:
        """Start fetches: ``(request, hint P, first token, max new tokens)`` each."""
        self._call("fetch", fetches)

    def results(self) -> tuple[dict[str, list[int]], dict[str, str]]:
        return self._call("results")  # type: ignore[no-any-return]

    def close(self, timeout: float = 30.0) -> int:
        """Shut the child's backend and engine down; the attempts its backend reports unquiesced."""
        left = -1
        if self.process.poll() is None:
            try:
                left = int(self._call("exit", timeout=timeout))
            except (OSError, EOFError, TimeoutError, RuntimeError):
                os.kill(self.process.pid, signal.SIGKILL)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self._conn.close()
        return left


def disaggregate(engine: TransformersEngine, backend: NixlBackend, peer: DecodePeer, prompts: list[list[int]],
                 max_new_tokens: int, timeout_s: float = 120.0) -> PairRun:
    """Every prompt prefilled in ``engine``'s batch (all queued at once), moved to the decode
    child as soon as its first token came, and decoded there; the completions."""
    peer.wait_ready()
    check_peer_engine(engine.engine, str(peer.info["engine"]))
    run, start = PairRun(), time.perf_counter()
    ids = [f"req-{i}" for i in range(len(prompts))]
    # As a router does: the decode end reserves (hint D) while, or here before, prefill runs.
    hints = dict(zip(ids, peer.reserve(list(zip(ids, prompts)), backend.peer)))
    for request, prompt in zip(ids, prompts):
        engine.prefill(request, prompt)
    publishing: dict[str, tuple[Attempt, float]] = {}
    woken: dict[str, float] = {}  # written by the backend's thread: the time of each attempt's latest wake
    end = start + timeout_s
    while len(run.completions) < len(prompts):
        if time.perf_counter() > end:
            raise TimeoutError(f"{len(run.completions)} of {len(prompts)} completions after {timeout_s:g}s")
        engine.step()
        now, fetches = time.perf_counter(), []
        for request in [r for r in ids if r in engine.prefilled]:
            done = engine.prefilled[request]
            run.first_token_s[request] = now - start  # a prefill worker would answer the first token now
            hint_d, run.held[request] = hints.pop(request)
            lease = engine.lend_prefill(request)
            hint_p = backend.describe(lease.view(), peer.peer)
            attempt = backend.publish(lease.view(), decode_hint(hint_d), wake=_stamp(woken, request))
            publishing[request] = attempt, time.perf_counter()
            lease.track(attempt)
            lease.release()
            engine.finish_prefill(request)  # its blocks go back to transformers once the attempt quiesced
            fetches.append((request, encode_hint(hint_p), done.first, max_new_tokens))
        if fetches:
            peer.fetch(fetches)
        for request, (published, sent) in list(publishing.items()):
            if published.poll() is not None and published.quiesced():
                run.transfer_s[request] = woken.get(request, time.perf_counter()) - sent
                del publishing[request]
        if engine.idle():
            completions, outcomes = peer.results()
            run.completions.update(completions)
            run.outcomes.update(outcomes)
            if len(run.completions) < len(prompts) and not publishing:
                time.sleep(0.005)  # the child decodes; nothing to do here meanwhile
    run.wall_s = time.perf_counter() - start
    return run


def _stamp(woken: dict[str, float], request: str) -> Callable[[], None]:
    def wake() -> None:  # on the backend's thread: one dict store
        woken[request] = time.perf_counter()
    return wake


# --- the child ---------------------------------------------------------------------------------
class DecodeChild:
    """The decode end: its engine, its backend, and the fetches it waits on."""

    def __init__(self, options: dict[str, Any]) -> None:
        torch.set_num_threads(1)
        saved = options.get("weights")
        model = hf.load_saved_model(Path(saved)) if saved else load_smollm2()
        self.engine = engine_for(model, options, "decode-kv")
        self.backend = NixlBackend(mode=TransferMode.PUSH, deadline_s=30.0)
        self.backend.register(self.engine.regions)
        self.reserved: dict[str, Any] = {}
        self.waiting: dict[str, tuple[Attempt, Any, int, int]] = {}
        self.done: dict[str, list[int]] = {}
        self.outcomes: dict[str, str] = {}

    def info(self) -> dict[str, Any]:
        return {"peer": self.backend.peer, "engine": self.engine.engine}

    def reserve(self, requests: list[tuple[str, list[int]]], publisher: Peer) -> list[tuple[bytes, int]]:
        hints = []
        for request, prompt in requests:
            reservation = self.engine.reserve(request, prompt)
            if reservation is None or reservation.lease is None:
                raise KvxferError(f"no room for {request!r} in the decode cache" if reservation is None
                                  else f"{request!r}: the whole prompt is held; nothing to fetch")
            self.reserved[request] = reservation
            hints.append((encode_hint(self.backend.describe(reservation.lease.view(), publisher)),
                          reservation.held))
        return hints

    def fetch(self, fetches: list[tuple[str, bytes, int, int]]) -> None:
        for request, hint, first, max_new_tokens in fetches:
            reservation = self.reserved.pop(request)
            attempt = self.backend.fetch(reservation.lease.view(), decode_hint(hint))
            reservation.lease.track(attempt)
            self.waiting[request] = attempt, reservation, first, max_new_tokens

    def results(self) -> tuple[dict[str, list[int]], dict[str, str]]:
        done, self.done = self.done, {}
        return done, dict(self.outcomes)

    def work(self) -> bool:
        """Adopt what arrived, step the batch; False when there was nothing to do."""
        for request, (attempt, reservation, first, max_new) in list(self.waiting.items()):
            outcome = attempt.poll()
            if outcome is None or not attempt.quiesced():
                continue
            del self.waiting[request]
            reservation.lease.mark_arrived(outcome.masks)
            reservation.lease.release()
            self.outcomes[request] = "delivered" if isinstance(outcome, Delivered) else type(outcome).__name__
            self.engine.adopt(request, first, max_new)
        ran = self.engine.step()
        self.done.update(self.engine.results())
        return ran or bool(self.waiting)

    def shutdown(self) -> int:
        left = len(self.backend.shutdown())
        self.engine.shutdown()
        return left


def _serve(conn: Connection, options: dict[str, Any]) -> None:
    try:
        child = DecodeChild(options)
    except Exception as exc:
        conn.send(("err", type(exc).__name__, str(exc)))
        return
    conn.send(("ok", child.info()))
    ops: dict[str, Callable[..., Any]] = {"reserve": child.reserve, "fetch": child.fetch, "results": child.results}
    busy = False
    while True:
        if conn.poll(0 if busy else 0.01):
            try:
                request = conn.recv()
            except (EOFError, OSError):
                break
            if request[0] == "exit":
                conn.send(("ok", child.shutdown()))
                return
            try:
                conn.send(("ok", ops[request[0]](*request[1:])))
            except (KvxferError, KeyError, ValueError) as exc:
                conn.send(("err", type(exc).__name__, str(exc)))
        busy = child.work()
    child.shutdown()


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[0]))
    try:
        _serve(conn, json.loads(argv[1]))
    finally:
        conn.close()
    return 0


def transfer_p50_ms(run: PairRun) -> float:
    return float(np.median(list(run.transfer_s.values()))) * 1e3 if run.transfer_s else 0.0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
