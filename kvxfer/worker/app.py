"""The worker's HTTP control API (JSON in and out; hints as base64 of msgpack bytes).

    GET  /health                      -> {"status": "ok", "role": ..., ...}
    GET  /metrics                     -> Prometheus text (prometheus_client's, of ``Worker.metrics``)
    HEAD on either                    -> the GET's status and headers, no body
    POST /prefill  {request, prompt, sampling?}  -> {"token": first, "compute_s": ...}   (prefill)
    POST /publish  {request, hint}    -> NDJSON: published {hint}, transfer {...}     (prefill)
    POST /reserve  {request, prompt, max_new_tokens, publisher} -> {"hint": ...}    (decode)
                                      (publisher: the prefill worker's {agent, run}, from its /health or /prefill;
                                       hint D is bound to it, and expires after hold_s)
    POST /generate {request, hint?, first_token?, max_new_tokens?, prompt?, generated?, sampling?, on_failure,
                    timeout_s, rows_safe?}
                                      -> NDJSON: resume {...}, token {index, token}..., done | error   (decode)
    POST /withdraw {hint}             -> {"withdrawn": bool}   (the worker holding a hint D: true when it
                                      can reach those rows no more, now or later; it refuses the hint from then on)
    POST /abort    {request, rows_safe?} -> {"dropped": "held" | "reserved" | "quarantined" | "starting" | null}
                                      ("quarantined", with rows_safe: a reservation set aside earlier is given back;
                                       "starting": its /prefill or /reserve still runs, and drops what it makes;
                                       null: nothing here yet, and a /prefill or /reserve of it within hold_s is refused)
    GET    /doctor/probe              -> {"active": {id, memory, bytes, age_s, expires_in_s} | null, "max_bytes", ...}
    POST   /doctor/probe {bytes, memory?} -> a NIXL target for ``kvxfer doctor --peer``: {id, metadata, address,
                                      device, host, versions, idle_s, ...}; 409 while another probe is open
    POST   /doctor/probe/ID           -> renews it (the doctor, while it measures); 404 once freed or expired
    DELETE /doctor/probe/ID           -> frees it (kvxfer.worker.probe: its own agent, never the backend's)

With a cluster key (``make_handler(worker, cluster_key=)``, ``kvxfer serve --cluster-key-file``
or ``KVXFER_CLUSTER_KEY``), every route but /health and /metrics wants
``Authorization: Bearer <key>``: 401 in OpenAI's error shape otherwise, before the body is read
(``kvxfer.serving.keys``; the handler's ``gate``, which ``HttpServer`` asks on the head alone).

``sampling`` (both ends of a request get the same): ``SamplingParams.to_json()``, e.g.
``{"temperature": 0.8, "top_p": 0.9, "seed": 7}``; absent, greedy; sampling needs its seed.
``generated``: the prompt's last tokens that are the completion's own (a recompute going on).

The worker (``kvxfer.worker.core``) knows no HTTP: this module parses each body into a typed
call (``kvxfer.worker.http_bodies``, BadRequest for what is malformed) and maps the worker's
errors to statuses: Refused and BadRequest 400, the "nothing escaped" refusals 409.

Streams end with an event holding ``"final": true``; a stream cut before it means the
worker went away. Status 400 (malformed) and 409 (refused: a contract rejection, a lease or
pool refusal, or a /prefill or /reserve aborted while it ran) promise that nothing was submitted; 500 promises nothing (rule 3 of the
backend contract: memory access may have escaped). ``rows_safe`` tells the decode worker
that the prefill side cannot write into a reservation, so its rows may be reused.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any

from kvxfer.contract import InvalidSubmission, SubmissionRejected
from kvxfer.lender import LeaseError
from kvxfer.pool import PoolExhausted, UnknownRequest
from kvxfer.serving.http import BadRequest, Request, Response
from kvxfer.serving.keys import CLUSTER_KEY, BearerKey, refusal
from kvxfer.serving.metrics import CONTENT_TYPE
from kvxfer.wire import WireError
from kvxfer.worker import http_bodies
from kvxfer.worker.core import Aborted, Refused, Worker
from kvxfer.worker.probe import ProbeBusy, ProbeHost, ProbeInvalid, ProbeUnknown, parse_open

log = logging.getLogger(__name__)
NOTHING_ESCAPED = (InvalidSubmission, SubmissionRejected, LeaseError, PoolExhausted, UnknownRequest, Aborted)
"""Refusals that promise no submission happened (answered 409); anything else is 500."""


ENDPOINTS = frozenset({"health", "metrics", "prefill", "publish", "reserve", "generate", "abort", "withdraw",
                       "doctor_probe"})
PROBE_STATUS = {ProbeInvalid: 400, ProbeUnknown: 404, ProbeBusy: 409}
STATUS_RESULT = {400: "bad_request", 409: "refused"}  # a status a route answered itself, as a metric label


def make_handler(worker: Worker, *, cluster_key: BearerKey | None = None):  # type: ignore[no-untyped-def]
    """The worker's handler; ``handler.probes`` is its ProbeHost (``close()`` frees an open
    probe; one still open when the event loop ends is freed then). With ``cluster_key``, every
    route but /health and /metrics wants it (``kvxfer.serving.keys``): 401 otherwise, from
    ``handler.gate``, which an ``HttpServer`` asks before it reads the body."""
    probes = ProbeHost(worker.name, worker.device)

    def gate(request: Request) -> Response | None:
        refused = refusal(cluster_key, request, CLUSTER_KEY)
        if refused is not None:
            worker.m_requests.inc(endpoint=_endpoint(request)[1], result="unauthorized")
        return refused

    async def handle(request: Request) -> Response:
        path, endpoint = _endpoint(request)
        probe = endpoint == "doctor_probe"
        refused = gate(request)  # HttpServer asked it before the body: this is for other callers
        if refused is not None:
            return refused
        try:
            response = await (_probe(worker, probes, path, request) if probe else _route(worker, path, request))
            worker.m_requests.inc(endpoint=endpoint, result="ok" if response.status < 400 else
                                  STATUS_RESULT.get(response.status, "not_found"))
            return response
        except (BadRequest, Refused, WireError) as exc:
            worker.m_requests.inc(endpoint=endpoint, result="bad_request")
            return Response.json({"error": f"{type(exc).__name__}: {exc}"}, 400)
        except NOTHING_ESCAPED as exc:
            worker.m_requests.inc(endpoint=endpoint, result="refused")
            return Response.json({"error": f"{type(exc).__name__}: {exc}"}, 409)
        except Exception as exc:  # answer, log and keep serving: one bad request must not kill the worker
            log.exception("worker %s: %s failed", worker.name, endpoint)
            worker.m_requests.inc(endpoint=endpoint, result="error")
            return Response.json({"error": f"{type(exc).__name__}: {exc}"}, 500)
    handle.probes = probes  # type: ignore[attr-defined]
    handle.gate = gate  # type: ignore[attr-defined]
    return handle


def _endpoint(request: Request) -> tuple[str, str]:
    """The request's path (no slashes around it) and its endpoint, as a metric label."""
    path = request.path.strip("/") or "health"
    probe = path == "doctor/probe" or path.startswith("doctor/probe/")
    # The label is bounded: any path a client invents would otherwise be a new series.
    return path, "doctor_probe" if probe else path if path in ENDPOINTS else "other"


async def _probe(worker: Worker, probes: ProbeHost, path: str, request: Request) -> Response:
    """``/doctor/probe`` (kvxfer.worker.probe): its refusals answered with their own statuses."""
    probe_id = path.removeprefix("doctor/probe").strip("/")
    try:
        if not probe_id and request.method == "GET":
            return Response.json(probes.status())
        if not probe_id and request.method == "POST":
            body = request.json()
            if not isinstance(body, dict):
                raise BadRequest("body must be a JSON object")
            if worker.health()["status"] != "ok":
                raise ProbeBusy("the worker is shutting down: it opens no probe")
            return Response.json(await probes.open(*parse_open(body)))
        if probe_id and request.method == "POST":
            return Response.json(probes.renew(probe_id))
        if probe_id and request.method == "DELETE":
            return Response.json(await probes.free(probe_id))
    except tuple(PROBE_STATUS) as exc:
        return Response.json({"error": f"{type(exc).__name__}: {exc}"}, PROBE_STATUS[type(exc)])
    return Response.json({"error": f"method {request.method} not allowed on /{path}"}, 405)


async def _route(worker: Worker, endpoint: str, request: Request) -> Response:
    if request.method == "GET":
        if endpoint == "health":
            return Response.json(worker.health())
        if endpoint == "metrics":
            return Response(200, (await worker.metrics_text()).encode(), CONTENT_TYPE)
        return Response.json({"error": f"no GET /{endpoint}"}, 404)
    if request.method != "POST":
        return Response.json({"error": f"method {request.method} not allowed"}, 405)
    body = request.json()
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    # The role first, as the worker would: a body for the other role's endpoint is refused by
    # what the worker is, not by how the body fails to parse for this one.
    model = worker.config.model
    if endpoint == "prefill":
        worker.need("prefill")
        return Response.json(await worker.prefill(http_bodies.prefill_call(body, model)))
    if endpoint == "reserve":
        worker.need("decode")
        return Response.json(await worker.reserve(http_bodies.reserve_call(body, model)))
    if endpoint == "abort":
        return Response.json(await worker.abort(http_bodies.abort_call(body)))
    if endpoint == "withdraw":
        return Response.json(await worker.withdraw(http_bodies.withdraw_call(body)))
    if endpoint == "publish":
        worker.need("prefill")
        return Response.ndjson(_guard(worker, await worker.publish(http_bodies.publish_call(body))))
    if endpoint == "generate":
        worker.need("decode")
        return Response.ndjson(_guard(worker, await worker.generate(http_bodies.generate_call(body, model), request.gone)))
    return Response.json({"error": f"no POST /{endpoint}"}, 404)


async def _guard(worker: Worker, events: AsyncGenerator[dict[str, Any], None]
                 ) -> AsyncGenerator[dict[str, Any], None]:
    """Once streaming, an error becomes a final error event (the status line is already sent)."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        log.exception("worker %s: stream failed", worker.name)
        yield {"event": "error", "final": True, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        await events.aclose()  # frees the request's pool blocks and leases now
