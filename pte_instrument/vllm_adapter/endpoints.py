"""``vllm.endpoint_plugins`` entry point (opt-in: ``VLLM_PLUGINS=pte``): the session
middleware and the ``/pte/*`` HTTP routes.

The middleware reads the session header (default ``X-Session-Id``; or the OpenAI ``user``
field with ``PTE_SESSION_FROM_USER=1``), makes sure the request carries an
``X-Request-Id`` (vLLM names its request after it), and remembers request → session
until the stat logger sees the request finish, in the same process.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import uuid
from argparse import Namespace
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pte_instrument.failpoints import failpoint
from pte_instrument.server.live_efficiency import FeedbackError
from pte_instrument.server.request_tags import RequestTag, validate_session_id
from pte_instrument.server.runtime import Runtime, get_runtime

# Paths whose requests reach the engine and so finish in the stat logger.
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MAX_PAGE = 1000


class SessionMiddleware:
    """Tags generation requests with their session and benchmark label. Pure ASGI (no
    per-request task, no body copy unless the ``user`` field is wanted)."""

    def __init__(self, app: ASGIApp, runtime: Runtime | None = None) -> None:
        self.app = app
        self.runtime = runtime or get_runtime()
        self.header = self.runtime.settings.session_header.lower().encode("ascii")
        self.benchmark_header = self.runtime.settings.benchmark_header.lower().encode("ascii")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].endswith(GENERATION_PATHS):
            try:
                receive = await self._tag(scope, receive)
            except Exception as e:  # never fail the request for the plugin's sake
                self.runtime.faults.record("middleware", e)
        await self.app(scope, receive, send)

    async def _tag(self, scope: Scope, receive: Receive) -> Receive:
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        raw = next((v for k, v in headers if k == self.header), None)
        if raw is None and self.runtime.settings.session_from_user:
            raw, receive = await _user_field(receive)
        session_id = None
        if raw is not None:
            session_id, reason = validate_session_id(raw)
            if session_id is None:
                self.runtime.metrics.session_ids_rejected.labels(reason).inc()
        label = next((v for k, v in headers if k == self.benchmark_header), None)
        benchmark = "none"
        if label is not None:  # only allow-listed labels: they become metric labels
            text = label.decode("latin-1")
            benchmark = text if text in self.runtime.settings.benchmark_labels else "other"
        if session_id is None and benchmark == "none":
            return receive
        request_id = next((v.decode("latin-1") for k, v in headers if k == b"x-request-id"), None)
        if request_id is None:
            request_id = uuid.uuid4().hex
            scope["headers"] = [*headers, (b"x-request-id", request_id.encode("ascii"))]
        self.runtime.pending.put(request_id, RequestTag(session_id, benchmark))
        return receive


async def _user_field(receive: Receive) -> tuple[bytes | None, Receive]:
    """Read the whole body to find the OpenAI ``user`` field, then replay it downstream."""
    messages: list[Message] = []
    body = b""
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break

    async def replay() -> Message:
        return messages.pop(0) if messages else await receive()

    try:
        user = json.loads(body).get("user")
    except (ValueError, AttributeError):
        user = None
    return (str(user).encode("utf-8", "replace") if user is not None else None), replay


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _authorized(request: Request, runtime: Runtime) -> bool:
    """Same rule as vLLM's ``--api-key``: ``Authorization: Bearer <key>``."""
    if not runtime.api_keys:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(token.encode()).digest()
    return any(secrets.compare_digest(digest, hashlib.sha256(k.encode()).digest()) for k in runtime.api_keys)


def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"query parameter {name!r} must be an integer, got {raw!r}") from None
    if not lo <= value <= hi:
        raise ValueError(f"query parameter {name!r} must be between {lo} and {hi}, got {value}")
    return value


def build_router(runtime: Runtime) -> APIRouter:
    router = APIRouter(prefix="/pte", tags=["pte-instrument"])

    async def guarded(request: Request, handler: Any) -> JSONResponse:
        if not _authorized(request, runtime):
            return _error(401, "Unauthorized: send Authorization: Bearer <api key>")
        try:
            failpoint("routes")
            return handler()
        except ValueError as e:
            return _error(400, str(e))
        except Exception as e:
            runtime.faults.record("routes", e)
            return _error(500, "pte-instrument route failed; see the server log")

    @router.get("/summary")
    async def summary(request: Request) -> JSONResponse:
        return await guarded(request, lambda: JSONResponse(runtime.summary()))

    @router.post("/feedback")
    async def feedback(request: Request) -> JSONResponse:
        """A correctness label from an evaluation harness:
        ``{"request_id": "…", "correct": true}`` or ``{"session_id": "…", "correct": false}``."""
        try:
            body = await request.json()
        except ValueError:
            body = None

        def handler() -> JSONResponse:
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
            correct = body.get("correct")
            if not isinstance(correct, bool):
                raise ValueError("'correct' must be true or false")
            rid, sid = body.get("request_id"), body.get("session_id")
            if (rid is None) == (sid is None) or not isinstance(rid or sid, str):
                raise ValueError("give exactly one of 'request_id' or 'session_id', as a string")
            try:
                # the completions API's response id lacks the "-<prompt index>" vLLM appends
                ids = (rid, f"{rid}-0") if rid is not None else ()
                outcome = runtime.efficiency.label(correct, request_ids=ids, session_id=sid)
            except FeedbackError as e:
                return _error(e.status, str(e))
            runtime.metrics.feedback(outcome)
            return JSONResponse(outcome)

        return await guarded(request, handler)

    @router.get("/sessions")
    async def sessions(request: Request) -> JSONResponse:
        def handler() -> JSONResponse:
            limit = _int_param(request, "limit", 50, 1, MAX_PAGE)
            offset = _int_param(request, "offset", 0, 0, 10**9)
            sort = request.query_params.get("sort", "pte_served")
            if sort not in (
                "pte_served",
                "pte_eviction_tax",
                "pte_reference",
                "prompt_tokens",
                "output_tokens",
            ):
                raise ValueError(f"query parameter 'sort' cannot be {sort!r}")
            total, rows = runtime.sessions.top(limit, offset, key=sort)
            return JSONResponse(
                {"total": total, "limit": limit, "offset": offset, "sort": sort, "sessions": rows}
            )

        return await guarded(request, handler)

    @router.get("/sessions/{session_id}")
    async def session(request: Request, session_id: str) -> JSONResponse:
        def handler() -> JSONResponse:
            sid, reason = validate_session_id(session_id)
            if sid is None:
                raise ValueError(f"malformed session id ({reason})")
            found = runtime.sessions.get(sid)
            return _error(404, f"no live session {sid!r}") if found is None else JSONResponse(found)

        return await guarded(request, handler)

    return router


class PteEndpoints:
    """The ``EndpointPlugin`` vLLM instantiates from the entry point."""

    name = "pte"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        runtime = get_runtime()
        app.include_router(build_router(runtime))
        app.add_middleware(SessionMiddleware, runtime=runtime)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        keys = getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY", "")]
        get_runtime().api_keys = [k for k in keys if k]
