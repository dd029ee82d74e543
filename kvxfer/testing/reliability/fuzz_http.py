"""Experiment 4b: fuzzed HTTP against one real prefill and one real decode worker process.

JSON bodies for /prefill, /publish, /reserve, /generate and /abort, built from valid ones
and then broken (wrong types, huge numbers, deep nesting, unknown fields, bad base64 and
mutated real hints, bad token ids, bad ids, whole bodies that are not objects), sent to the
right worker and sometimes to the wrong one; and malformed raw HTTP (request lines,
methods, paths, Content-Length values, oversized headers, truncated and pipelined
requests). Each answer's status is counted (every request says ``Connection: close``, so the
server's close ends its answer). A 500, or a connection closed without a status after a
complete request, or no answer at all, is a finding. Afterwards every id this run
got a prefill or a reservation for is aborted, and both workers must still answer /health
and hold nothing.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvxfer.engine import ModelConfig
from kvxfer.serving.http import MAX_BODY, request_json
from kvxfer.testing.reliability.common import Progress, WorkerLeftovers, start_workers, worker_leftovers
from kvxfer.testing.reliability.fuzz_wire import MUTATIONS, Seed, any_value
from kvxfer.worker.procs import Child, ProcessGroup

HUGE = "<an integer of 5000 digits>"  # json.dumps cannot write one: put into the text afterwards
ANSWER_S = 30.0   # the longest an exchange may take before it counts as a hang
RAW_SHARE = 0.2   # of the cases, malformed raw HTTP rather than a JSON body
ROLE_OF = {"prefill": "prefill", "publish": "prefill", "reserve": "decode", "generate": "decode", "abort": ""}
JSON_ODDITIES: tuple[Any, ...] = (
    None, True, False, 0, 1, -1, 1.5, "x", "", [], {}, [1, [2]], {"a": {"b": None}}, 10**40, -(10**40),
    1e308, float("nan"), float("inf"), -float("inf"), 2**63, 2**64, -(2**63) - 1)


@dataclass(frozen=True)
class HttpCase:
    label: str      # what kind of case, for the tally
    worker: str     # "prefill" | "decode"
    data: bytes
    complete: bool  # fully framed: an answer is owed (else the client half-closes mid-request)
    half_close: bool = False  # the client says it is done sending (never for a request that streams)


@dataclass(frozen=True)
class HttpFuzzSummary:
    cases: int
    statuses: dict[str, int]       # "200", "400", ... and "none" (closed without a status)
    by_label: dict[str, dict[str, int]]
    server_errors: int             # answers of 500: a finding
    server_error_kinds: dict[str, int]  # "case label -> the answer's error, cut short": what the 500s were
    dropped: int                   # complete requests closed without a status: a finding
    hangs: int                     # no answer within ANSWER_S: a finding
    streams_cut: int               # 200 NDJSON streams without their final event: a finding
    incomplete_unanswered: int     # truncated requests closed without a status: expected
    finding_samples: tuple[str, ...]
    aborted_after: int             # ids of prefills and reservations this run made, aborted at the end
    workers_alive: bool
    workers_after: tuple[WorkerLeftovers, ...]


# --- cases ---------------------------------------------------------------------------------

def _frame(method: str, path: str, body: bytes, extra: str = "", length: str | None = None) -> bytes:
    cl = str(len(body)) if length is None else length
    head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\n{extra}Content-Length: {cl}\r\n\r\n")
    return head.encode("latin-1") + body


class CaseMaker:
    def __init__(self, seed: int, publisher: dict[str, str], hints: list[Seed]) -> None:
        self.r = random.Random(seed)
        self.vocab = ModelConfig().vocab_size
        self.publisher = publisher
        self.hints = hints
        self.recent: list[str] = []
        self.count = 0

    def rid(self) -> str:
        if self.recent and self.r.random() < 0.3:  # ids that may be held or reserved: later calls meet them
            return self.r.choice(self.recent)
        self.count += 1
        rid = f"fz-{self.count}"
        self.recent = (self.recent + [rid])[-32:]
        return rid

    def prompt(self) -> list[int]:
        return [self.r.randrange(self.vocab) for _ in range(self.r.randint(1, 40))]

    def hint_text(self) -> Any:
        r = self.r
        pick = r.randrange(8)
        if pick == 0:
            return "%%% not base64 %%%"
        if pick == 1:
            return base64.b64encode(r.randbytes(r.randrange(64))).decode()
        if pick in (2, 3, 4):  # a real hint of a backend of this run's fuzz, mutated
            seed = r.choice(self.hints)
            how = r.choice(sorted(MUTATIONS))
            return base64.b64encode(MUTATIONS[how](r, seed, self.hints)).decode()
        if pick == 5:  # a real hint, intact: of another agent, for another request
            return base64.b64encode(r.choice(self.hints).data).decode()
        if pick == 6:
            text = base64.b64encode(r.choice(self.hints).data).decode()
            return text[: len(text) // 2] + "\n" + text[len(text) // 2:]
        return r.choice(["", "A" * (1 << 20), "====", None, 12, ["AAAA"]])

    def body(self, endpoint: str) -> dict[str, Any]:
        r = self.r
        if endpoint == "prefill":
            return {"request": self.rid(), "prompt": self.prompt()}
        if endpoint == "reserve":
            return {"request": self.rid(), "prompt": self.prompt(), "max_new_tokens": r.randint(1, 4),
                    "publisher": dict(self.publisher)}
        if endpoint == "publish":
            return {"request": self.rid(), "hint": self.hint_text()}
        if endpoint == "abort":
            return {"request": self.rid(), "rows_safe": r.random() < 0.5}
        policy = r.choice(["fail", "recompute"])
        if r.random() < 0.5:  # a local generation: no reservation, no hint
            return {"request": self.rid(), "prompt": self.prompt(), "max_new_tokens": r.randint(1, 4),
                    "on_failure": policy, "timeout_s": 5}
        return {"request": self.rid(), "hint": self.hint_text(), "first_token": r.randrange(self.vocab),
                "on_failure": policy, "timeout_s": 5}

    def break_body(self, body: dict[str, Any]) -> str:
        r = self.r
        how = r.choice(["wrong-type", "huge-number", "delete", "unknown-field", "prompt", "request-id", "hint",
                        "publisher", "flags", "numbers"])
        name = r.choice(sorted(body)) if body else "request"
        if how == "wrong-type":
            body[name] = r.choice(JSON_ODDITIES) if r.random() < 0.7 else _plain(any_value(r))
        elif how == "huge-number":
            body[name] = r.choice([10**30, 2**63, 2**64, -(2**63) - 1, 1e308, -1e308, 10**4000, HUGE])
        elif how == "delete":
            body.pop(name, None)
        elif how == "unknown-field":
            body[r.choice(["x", "prompt_ids", "Request", "hint2", "__proto__", "é"])] = _plain(any_value(r))
        elif how == "prompt":
            body["prompt"] = r.choice([[], [-1], [self.vocab], [True], [1.5], ["1"], [[1]], list(range(5000)),
                                       [2**63], None, "1 2 3", [0] * 4097])
        elif how == "request-id":
            body["request"] = r.choice(["", "#", "a#b", "x" * 201, 5, None, ["a"], "\u0000", "é" * 200, True])
        elif how == "hint":
            body["hint"] = self.hint_text()
        elif how == "publisher":
            body["publisher"] = r.choice([None, {}, {"agent": ""}, {"agent": "a", "run": 5}, "x",
                                          {"agent": "a" * 2000, "run": "r"},
                                          {"agent": self.publisher["agent"], "run": "another-run"}])
        elif how == "flags":
            body[r.choice(["rows_safe", "on_failure"])] = r.choice(["false", "true", 1, 0, None, "sometimes"])
        else:
            body[r.choice(["max_new_tokens", "timeout_s", "first_token"])] = r.choice(
                [0, -1, 10**6, 2**63, True, 1.5, "4", None, 1e-9, float("nan"), float("inf"), self.vocab])
        return how

    def json_case(self) -> HttpCase:
        r = self.r
        endpoint = r.choice(sorted(ROLE_OF))
        worker = ROLE_OF[endpoint] or r.choice(["prefill", "decode"])
        if r.random() < 0.15:
            worker = "decode" if worker == "prefill" else "prefill"
        if r.random() < 0.12:
            raw, how = self.whole_body()
            return HttpCase(f"{endpoint}:{how}", worker, _frame("POST", f"/{endpoint}", raw), True)
        body = self.body(endpoint)
        hows = {self.break_body(body) for _ in range(r.choice([0, 1, 1, 1, 2, 3]))}
        label = f"{endpoint}:{'valid' if not hows else hows.pop() if len(hows) == 1 else 'several'}"
        text = json.dumps(body).replace(json.dumps(HUGE), "9" * 5000)  # past Python's int parsing limit
        return HttpCase(label, worker, _frame("POST", f"/{endpoint}", text.encode()), True)

    def whole_body(self) -> tuple[bytes, str]:
        deep = self.r.choice([100, 5000, 100_000])
        return self.r.choice([
            (b"", "empty"), (b"null", "null"), (b"[]", "array"), (b"1", "number"), (b'"x"', "string"),
            (b"{", "truncated-json"), (b'{"request": }', "bad-json"), (b"\xff\xfe\x00{}", "not-utf8"),
            (b"[" * deep + b"]" * deep, "deep-arrays"), (b'{"a":' * deep + b"1" + b"}" * deep, "deep-objects"),
            (b'{"request": "a", "request": 5}', "duplicate-keys"), (b"NaN", "nan"),
            (b" " * (2 << 20) + b"{}", "2MiB-of-spaces"),
        ])

    def raw_case(self) -> HttpCase:
        r = self.r
        worker = r.choice(["prefill", "decode"])
        endpoint = r.choice(["/reserve", "/prefill", "/publish", "/generate", "/abort", "/health", "/metrics"])
        body = b'{"request": "raw"}'
        cases: list[tuple[str, Callable[[], bytes], bool, bool]] = [
            ("request-line", lambda: r.choice([b"GARBAGE\r\n\r\n", b"GET\r\n\r\n",
                                               b"GET /health\r\n\r\n", r.randbytes(40) + b"\r\n\r\n"]), True, True),
            # Empty lines before a request line are skipped (RFC 9112, 2.2): no request came, none is answered.
            ("empty-lines", lambda: b"\r\n\r\n", False, True),
            ("method", lambda: _frame(r.choice(["PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "G\x00T", "post",
                                                "GET"]), endpoint, body), True, True),
            ("path", lambda: _frame("POST", r.choice(["/", "//reserve", "/reserve/", "/../etc/passwd", "/%00",
                                                      "/" + "a" * 10000, "/reserve?x=1", "*"]), body), True, True),
            ("content-length", lambda: _frame("POST", endpoint, body, length=r.choice(
                ["abc", "-1", "1e3", " 5", "", "99999999999999999999999", str(MAX_BODY + 1), "0",
                 "\u00b2", "\u00b3", "\u00b9"])), True, True),
            ("big-header", lambda: _frame("POST", endpoint, body, extra="X-Big: " + "a" * 70_000 + "\r\n"), True, True),
            ("odd-headers", lambda: _frame("POST", endpoint, body, extra=r.choice(
                ["no colon here\r\n", "X-\u00ff: \u00e9\r\n", "Content-Length: 3\r\n", ": empty\r\n",
                 "Transfer-Encoding: chunked\r\n"])), True, True),
            ("version", lambda: f"POST {endpoint} HTTP/{r.choice(['1.0', '9.9', 'x'])}\r\nContent-Length: "
                                f"{len(body)}\r\n\r\n".encode() + body, True, True),
            ("pipelined", lambda: _frame("GET", "/health", b"") + _frame("POST", endpoint, body), True, True),
            ("truncated-body", lambda: _frame("POST", endpoint, body, length="100"), False, True),
            ("truncated-head", lambda: f"POST {endpoint} HTTP/1.1\r\nContent-Len".encode(), False, True),
        ]
        label, make, complete, half_close = r.choice(cases)
        return HttpCase(f"raw:{label}", worker, make(), complete, half_close)

    def case(self) -> HttpCase:
        return self.raw_case() if self.r.random() < RAW_SHARE else self.json_case()


def _plain(value: Any) -> Any:
    """A msgpack value as JSON can carry it (bytes become text)."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


# --- the exchange ----------------------------------------------------------------------------

async def exchange(port: int, case: HttpCase) -> tuple[str, bytes]:
    """("200" or another status, body), ("none", what came) when closed without a status, or
    ("hang", ...) when nothing ended within ANSWER_S."""
    got = b""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=MAX_BODY)
    except OSError as exc:
        return "none", f"connect failed: {exc!r}".encode()
    try:
        writer.write(case.data)
        await writer.drain()
        if case.half_close and writer.can_write_eof():
            writer.write_eof()
        deadline = asyncio.get_running_loop().time() + ANSWER_S
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return "hang", got[:200]
            chunk = await asyncio.wait_for(reader.read(1 << 20), left)
            if not chunk:
                break
            got += chunk
    except asyncio.TimeoutError:
        return "hang", got[:200]
    except (ConnectionError, OSError):
        pass  # a reset after (or instead of) the answer: what arrived decides
    finally:
        writer.close()
    # Any version: HTTP/1.0 answers an HTTP/1.0 request and one refused before its version
    # was read, HTTP/0.9 a request line without one.
    status = re.match(rb"HTTP/\d\.\d (\d{3}) ", got)
    if status is not None:
        return status.group(1).decode(), got
    return "none", got[:200]


def _body(answer: bytes) -> bytes:
    """An answer's body, its chunks joined when it came chunked (a stream does)."""
    head, _, body = answer.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        return body
    out = bytearray()
    while True:
        size_line, sep, rest = body.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            return bytes(out)  # cut mid-chunk: what arrived
        if not sep or size == 0:
            return bytes(out)
        out += rest[:size]
        body = rest[size + 2:]


def _error_of(answer: bytes) -> str:
    """The "error" text of a JSON answer ('' when there is none)."""
    try:
        error = json.loads(_body(answer)).get("error", "")
    except (ValueError, AttributeError):
        return ""
    return error if isinstance(error, str) else ""


def _stream_complete(answer: bytes) -> bool:
    head = answer.partition(b"\r\n\r\n")[0]
    if b"application/x-ndjson" not in head:
        return True
    lines = [line for line in _body(answer).split(b"\n") if line.strip()]
    try:
        return bool(lines) and bool(json.loads(lines[-1]).get("final"))
    except (ValueError, AttributeError):  # not JSON, or JSON but not an object
        return False


async def _fuzz(children: dict[str, Child], maker: CaseMaker, cases: int, concurrency: int,
                shown: Progress) -> tuple[HttpFuzzSummary, list[tuple[str, str]]]:
    statuses: dict[str, int] = {}
    by_label: dict[str, dict[str, int]] = {}
    findings: list[str] = []
    counts = {"500": 0, "dropped": 0, "hang": 0, "cut": 0, "incomplete": 0, "done": 0}
    kinds: dict[str, int] = {}
    made: set[tuple[str, str]] = set()  # (worker, id) of a prefill or reservation this run made
    todo = iter(maker.case() for _ in range(cases))

    def finding(kind: str, case: HttpCase, what: bytes) -> None:
        if len(findings) < 20:
            findings.append(f"{kind}: {case.label} to {case.worker}: sent {case.data[:160]!r} got {what[:200]!r}")

    async def lane() -> None:
        for case in todo:
            status, answer = await exchange(children[case.worker].port, case)
            statuses[status] = statuses.get(status, 0) + 1
            tally = by_label.setdefault(case.label, {})
            tally[status] = tally.get(status, 0) + 1
            if status == "500":
                counts["500"] += 1
                kind = f"{case.label} -> {_error_of(answer)[:60]}"
                kinds[kind] = kinds.get(kind, 0) + 1
                finding("HTTP 500", case, answer)
            elif status == "hang":
                counts["hang"] += 1
                finding(f"no answer within {ANSWER_S:g}s", case, answer)
            elif status == "none":
                key = "dropped" if case.complete else "incomplete"
                counts[key] += 1
                if case.complete:
                    finding("closed without a status", case, answer)
            elif status == "200" and not _stream_complete(answer):
                counts["cut"] += 1
                finding("stream without its final event", case, answer)
            if status == "200" and case.label.split(":")[0] in ("prefill", "reserve"):
                try:
                    rid = json.loads(_body(answer)).get("request")
                except ValueError:
                    rid = None
                if isinstance(rid, str):
                    made.add((case.worker, rid))
            counts["done"] += 1
            shown.tick(counts["done"], f"{counts['500']} answered 500, {counts['dropped']} dropped")

    await asyncio.gather(*(lane() for _ in range(concurrency)))
    summary = HttpFuzzSummary(
        cases=counts["done"], statuses=dict(sorted(statuses.items())), by_label=dict(sorted(by_label.items())),
        server_errors=counts["500"], server_error_kinds=dict(sorted(kinds.items())), dropped=counts["dropped"],
        hangs=counts["hang"], streams_cut=counts["cut"],
        incomplete_unanswered=counts["incomplete"], finding_samples=tuple(findings), aborted_after=len(made),
        workers_alive=False, workers_after=())
    return summary, sorted(made)


async def _clean_up(children: dict[str, Child], made: list[tuple[str, str]]) -> list[WorkerLeftovers]:
    # rows_safe: no hint D of this run ever went to a prefill worker, so no peer can write those rows.
    for worker, rid in made:
        try:
            await request_json(children[worker].url, "POST", "/abort", {"request": rid, "rows_safe": True}, 10.0)
        except Exception:  # noqa: BLE001 - the state check below says what is left
            pass
    return [await worker_leftovers(c) for c in children.values()]


def run_http_fuzz(cases: int, *, seed: int = 0, concurrency: int = 4, hints: list[Seed], log_dir: Path,
                  progress: bool = True) -> HttpFuzzSummary:
    shown = Progress("fuzz (http)", cases, enabled=progress)
    with ProcessGroup(log_dir) as group:
        prefill, decode = start_workers(group, [("prefill", "fuzz-prefill"), ("decode", "fuzz-decode")])
        children = {"prefill": prefill, "decode": decode}
        shown.note("2 workers ready")

        async def main() -> HttpFuzzSummary:
            publisher = (await request_json(prefill.url, "GET", "/health"))["publisher"]
            maker = CaseMaker(seed, publisher, [h for h in hints if h.kind == "hint"])
            summary, made = await _fuzz(children, maker, cases, concurrency, shown)
            after = await _clean_up(children, made)
            alive = all(c.alive() for c in children.values()) and all(s.answered for s in after)
            return HttpFuzzSummary(**{**summary.__dict__, "workers_alive": alive, "workers_after": tuple(after)})

        summary = asyncio.run(main())
    shown.finish(f"{summary.server_errors} answered 500, {summary.dropped} dropped, {summary.hangs} hung")
    return summary
