"""The ``/pte/*`` HTTP routes: the summary, sessions, feedback and the metrics with exemplars.

Every answer carries ``X-PTE-API-Server`` (which process answered), every route checks
vLLM's API keys before it reads anything of the request, a route whose session store cannot
be read answers 503 (the store's fault, counted; the client may try again), and a route that
fails otherwise answers 500 and counts a fault: the server goes on."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from pte_instrument.failpoints import failpoint
from pte_instrument.server.exporters.exposition import AcceptError, exposition
from pte_instrument.server.live_efficiency import FeedbackError
from pte_instrument.server.request_tags import quoted, validate_session_id
from pte_instrument.server.runtime import Runtime
from pte_instrument.server.session_store import SORT_KEYS, StoreError
from pte_instrument.server.turn_order import HEARTBEAT_S

HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
MAX_PAGE = 1000
MAX_BODY_BYTES = 64 * 1024  # a feedback body is a few ids: anything larger is refused unread


class RouteError(Exception):
    """A client error a route answers with ``status`` and a JSON ``error``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class _PeersStored:
    """The other API servers' watermark of stored requests, read from the shared store at most
    every ``PEERS_READ_S`` whatever number of labels wait on it (what it was, meanwhile: it
    only moves on, so a label waits a little longer at worst)."""

    def __init__(self, read: Callable[[], float]) -> None:
        self._read = read
        self._read_at = -math.inf  # monotonic
        self._value = -math.inf

    async def __call__(self) -> float:
        now = time.monotonic()
        if now - self._read_at >= PEERS_READ_S:
            self._read_at = now  # before the read: the labels waiting meanwhile do not read too
            self._value = await asyncio.to_thread(self._read)
        return self._value


async def _stored(priced_through: Callable[[], float], peers: _PeersStored, arrived: float) -> bool:
    """Whether every request seen finish before ``arrived`` came to be priced here
    (``priced_through``) and stored by the other API servers sharing the store (``peers``)
    within ``LABEL_WAIT_S``."""
    deadline = time.monotonic() + LABEL_WAIT_S
    while priced_through() < arrived or await peers() < arrived:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(LABEL_POLL_S)
    return True


def _unauthorized() -> JSONResponse:
    return _error(401, "Unauthorized: send Authorization: Bearer <api key>")


def _authorized(request: Request, runtime: Runtime) -> bool:
    return authorized(request.headers.get("authorization", ""), runtime.api_keys)


def authorized(authorization: str, keys: list[str]) -> bool:
    """Same rule as vLLM's ``--api-key``: ``Authorization: Bearer <key>`` (no keys: anyone)."""
    if not keys:
        return True
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(token.encode()).digest()
    return any(secrets.compare_digest(digest, hashlib.sha256(k.encode()).digest()) for k in keys)


def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise RouteError(400, f"query parameter {name!r} must be an integer, got {quoted(raw)}") from None
    if not lo <= value <= hi:
        raise RouteError(400, f"query parameter {name!r} must be between {lo} and {hi}, got {quoted(raw)}")
    return value


async def _read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refused past ``limit`` bytes: at once from Content-Length, else
    (chunked) as soon as the stream passes it, without reading the rest."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise RouteError(400, "Content-Length must be a whole number")
        if len(declared) > 18 or int(declared) > limit:
            raise RouteError(413, f"request body over {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RouteError(413, f"request body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except RecursionError:  # the decoder's own depth limit
        raise RouteError(400, "request body is nested too deeply") from None
    except ValueError as e:  # bad JSON or bad UTF-8; neither message echoes the body
        raise RouteError(400, f"request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise RouteError(400, "request body must be a JSON object")
    return body


def _feedback_target(body: dict[str, Any]) -> tuple[bool, str | None, str | None]:
    """``(correct, request_id, session_id)`` of a feedback body, exactly one id given."""
    correct = body.get("correct")
    if not isinstance(correct, bool):
        raise RouteError(400, "'correct' must be true or false")
    rid, sid = body.get("request_id"), body.get("session_id")
    given = [v for v in (rid, sid) if v is not None]
    if len(given) != 1 or not isinstance(given[0], str) or not given[0]:
        raise RouteError(400, "give exactly one of 'request_id' or 'session_id', as a non-empty string")
    try:  # JSON admits "\ud800"; no store, header or log line can hold it
        given[0].encode("utf-8")
    except UnicodeEncodeError:
        field = "request_id" if rid is not None else "session_id"
        raise RouteError(400, f"'{field}' must be valid Unicode (it holds a lone surrogate)") from None
    return correct, rid, sid


API_SERVER_HEADER = "X-PTE-API-Server"  # on every /pte/* answer: the index of the API server
# How long a label for a request not in the window yet waits for the requests this process saw
# finish before the label came to be priced (the engine join's longest wait for totals, and more).
LABEL_WAIT_S = 10.0
LABEL_POLL_S = 0.01
PEERS_READ_S = HEARTBEAT_S  # how often the other writers publish their watermarks


def build_router(runtime: Runtime, priced_through: Callable[[], float] | None = None) -> APIRouter:
    """``priced_through()``: unix time before which every request this process saw finish is
    priced; a label that finds no request waits for it, and for the other API servers'
    watermark of stored requests, to pass the label's arrival."""
    router = APIRouter(prefix="/pte", tags=["pte-instrument"])
    peers = _PeersStored(lambda: runtime.sessions.others_caught_up_to(every_request=True))

    def named(response: Response) -> Response:
        response.headers[API_SERVER_HEADER] = str(runtime.api_server)  # which process answered
        return response

    async def guarded(request: Request, handler: Callable[[], Awaitable[JSONResponse]]) -> Response:
        return named(await _answer(request, handler))

    async def _answer(request: Request, handler: Callable[[], Awaitable[JSONResponse]]) -> JSONResponse:
        if not _authorized(request, runtime):  # before anything of the request is read
            return _unauthorized()
        try:
            failpoint("routes")
            return await handler()
        except (RouteError, FeedbackError) as e:  # the client's request; any other error is the server's
            return _error(e.status, str(e))
        except ClientDisconnect:  # nobody to answer
            return _error(400, "client disconnected")
        except StoreError as e:  # down, or backing off: the details (its URL) stay in the log
            runtime.faults.record("sessions", e)
            return _error(503, "the session store is unavailable; try again shortly")
        except Exception as e:
            runtime.faults.record("routes", e)
            return _error(500, "pte-instrument route failed; see the server log")

    @router.get("/summary")
    async def summary(request: Request) -> Response:
        async def handler() -> JSONResponse:
            return JSONResponse(await asyncio.to_thread(runtime.summary))  # reads the shared store

        return await guarded(request, handler)

    @router.post("/feedback")
    async def feedback(request: Request) -> Response:
        """A correctness label from an evaluation harness:
        ``{"request_id": "…", "correct": true}`` or ``{"session_id": "…", "correct": false}``."""

        async def handler() -> JSONResponse:
            arrived = time.time()
            correct, rid, sid = _feedback_target(_json_object(await _read_body(request)))
            # an answer's id lacks what vLLM appends to name its first engine request: the
            # completions API's "-<prompt index>", the Responses and chat batch APIs' "_<n>"
            ids = (rid, f"{rid}-0", f"{rid}_0") if rid is not None else ()
            # the shared store, read on a worker thread
            label = partial(asyncio.to_thread, runtime.efficiency.label, correct, ids, sid)
            through = priced_through or (lambda: math.inf)
            priced = through()
            try:
                outcome = await label()
            except FeedbackError as e:
                # A harness that scores an answer at once labels it while its request may
                # still wait for its engine's totals, here or on the API server that served
                # it: once what finished before the label is priced and stored, look again.
                if e.status != 404:
                    raise
                if priced >= arrived and await peers() == math.inf:
                    raise  # it looked after everything that finished before: no such request
                if not await _stored(through, peers, arrived):
                    raise
                outcome = await label()
            runtime.metrics.feedback(outcome)
            return JSONResponse(outcome)

        return await guarded(request, handler)

    @router.get("/sessions")
    async def sessions(request: Request) -> Response:
        async def handler() -> JSONResponse:
            limit = _int_param(request, "limit", 50, 1, MAX_PAGE)
            offset = _int_param(request, "offset", 0, 0, 10**9)
            sort = request.query_params.get("sort", "pte_served")
            if sort not in SORT_KEYS:
                raise RouteError(400, f"query parameter 'sort' cannot be {quoted(sort)}")
            total, rows = await asyncio.to_thread(runtime.sessions.top, limit, offset, sort)
            return JSONResponse(
                {"total": total, "limit": limit, "offset": offset, "sort": sort, "sessions": rows}
            )

        return await guarded(request, handler)

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        """The process's Prometheus registry, in OpenMetrics when the scraper asks for it
        (with exemplars), else in the text format: vLLM's ``/metrics`` answers the text
        format whatever is asked, which has no exemplars."""
        if not _authorized(request, runtime):
            return named(_unauthorized())
        try:
            body, content_type = await asyncio.to_thread(exposition, request.headers.get("accept"))
        except AcceptError as e:
            return named(_error(400, str(e)))
        except Exception as e:
            runtime.faults.record("routes", e)
            return named(_error(500, "pte-instrument route failed; see the server log"))
        return named(Response(body, media_type=content_type))

    # ":path": session ids may contain "/" (sent as-is or as %2F; the server decodes the path)
    @router.get("/sessions/{session_id:path}")
    async def session(request: Request, session_id: str) -> Response:
        async def handler() -> JSONResponse:
            sid, reason = validate_session_id(session_id)
            if sid is None:
                raise RouteError(400, f"malformed session id ({reason})")
            found = await asyncio.to_thread(runtime.sessions.get, sid)
            return _error(404, f"no live session {quoted(sid)}") if found is None else JSONResponse(found)

        return await guarded(request, handler)

    # Last: any other method or path under /pte, answered here rather than by vLLM's app, so
    # that it too names its API server (and says what it takes, in the routes' error shape).
    @router.api_route("/{path:path}", methods=list(HTTP_METHODS), include_in_schema=False)
    async def elsewhere(request: Request, path: str) -> Response:
        scope = request.scope
        routes = [r for r in router.routes if getattr(r, "endpoint", None) is not elsewhere]
        allow = sorted(
            {m for r in routes if r.matches(scope)[0] is Match.PARTIAL for m in getattr(r, "methods", ())}
        )
        where = quoted(scope["path"])
        if not allow:
            return named(_error(404, f"no pte-instrument route {where}"))
        message = f"method {quoted(request.method)} is not allowed on {where}; it takes {', '.join(allow)}"
        return named(JSONResponse({"error": message}, status_code=405, headers={"Allow": ", ".join(allow)}))

    return router
