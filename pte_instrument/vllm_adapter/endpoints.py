"""``vllm.endpoint_plugins`` entry point (opt-in: ``VLLM_PLUGINS=pte``): the session
middleware and the ``/pte/*`` HTTP routes.

The middleware reads the session header (default ``X-Session-Id``; or the OpenAI ``user``
field with ``PTE_SESSION_FROM_USER=1``), the tenant (``PTE_TENANT_HEADER``, the API key's
hash), when the server serves LoRA adapters the OpenAI ``model`` field, and, when
OpenTelemetry is on, the route's GenAI operation and the caller's W3C ``traceparent``; makes
sure the request carries an ``X-Request-Id`` (vLLM names its request after it), and remembers
request → tag until the stat logger sees the request finish, in the same process: the tag
goes a grace period after the HTTP exchange ends (``PendingTags.settle``), so every engine
request of one HTTP request (``n > 1``, a list of prompts) carries it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import uuid
from argparse import Namespace
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry.semconv._incubating.attributes.gen_ai_attributes import (
    GenAiOperationNameValues as Operation,
)
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pte_instrument.failpoints import failpoint
from pte_instrument.server.exporters.exposition import exposition
from pte_instrument.server.live_efficiency import FeedbackError
from pte_instrument.server.request_tags import (
    UNTAGGED,
    RequestTag,
    parse_traceparent,
    quoted,
    validate_session_id,
)
from pte_instrument.server.runtime import Runtime, get_runtime
from pte_instrument.settings import BENCHMARK_HEADER
from pte_instrument.vllm_adapter import compat

# Paths whose requests reach the engine and so finish in the stat logger, with the GenAI
# operation (OpenTelemetry's well-known values) each one performs; the Responses API is
# the chat API's successor.
OPERATIONS = {
    "/v1/chat/completions": Operation.CHAT.value,
    "/v1/completions": Operation.TEXT_COMPLETION.value,
    "/v1/responses": Operation.CHAT.value,
}
GENERATION_PATHS = tuple(OPERATIONS)
MAX_PAGE = 1000
MAX_BODY_BYTES = 64 * 1024  # a feedback body is a few ids: anything larger is refused unread
MAX_MODEL_NAME_LEN = (
    256  # a longer "model" is kept for no adapter (its request is accounted to the base model)
)
SORT_KEYS = (
    "pte_served",
    "pte_eviction_tax",
    "pte_reference",
    "prompt_tokens",
    "output_tokens",
    "gpu_seconds",
    "cost_usd",
)


class SessionMiddleware:
    """Tags generation requests with their session and benchmark label, and with their
    route's operation and the caller's trace context when OpenTelemetry takes them. Pure
    ASGI (no per-request task, no body copy unless the ``user`` field is wanted)."""

    def __init__(self, app: ASGIApp, runtime: Runtime | None = None) -> None:
        self.app = app
        self.runtime = runtime or get_runtime()
        self.header = self.runtime.settings.session_header.lower().encode("ascii")
        self.benchmark_header = BENCHMARK_HEADER.lower().encode("ascii")
        self._keys_read = False

    def _authorized(self, scope: Scope, headers: list[tuple[bytes, bytes]]) -> bool:
        """vLLM's API-key check, made here first: added by ``--middleware``, this runs before
        vLLM's own, and the endpoint plugin that tells the runtime the keys may not be loaded."""
        if not self._keys_read:
            self._keys_read = True
            if not self.runtime.api_keys:
                self.runtime.api_keys = compat.api_keys(compat.app_args(scope.get("app")))
        if not self.runtime.api_keys:
            return True
        value = next((v for k, v in headers if k == b"authorization"), b"")
        return authorized(value.decode("latin-1"), self.runtime.api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = None
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].endswith(GENERATION_PATHS):
            try:
                key, receive = await self._tag(scope, receive)
            except Exception as e:  # never fail the request for the plugin's sake
                self.runtime.faults.record("middleware", e)
        if key is None:
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:  # answered, rejected or cut off: what the engine did, it reports within the grace
            self.runtime.pending.settle(key)

    async def _tag(self, scope: Scope, receive: Receive) -> tuple[str | None, Receive]:
        """The request key its tag is kept under (None: nothing to tag), and the receive
        channel to pass on."""
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        if not self._authorized(scope, headers):  # vLLM refuses it; nothing of it is read here
            return None, receive
        raw = next((v for k, v in headers if k == self.header), None)
        want_user = raw is None and self.runtime.settings.session_from_user
        lora = self.runtime.lora_names
        model = None
        if want_user or lora.enabled:  # the body is read only when a field of it is wanted
            fields, receive = await _body_fields(receive)
            if want_user and fields.user is not None:
                raw = str(fields.user).encode("utf-8", "replace")
            if lora.enabled and isinstance(fields.model, str) and len(fields.model) <= MAX_MODEL_NAME_LEN:
                model = fields.model
                if lora.served is None:  # the server's adapters, read when the request finishes
                    lora.served = compat.served_lora_adapters(scope.get("app"))
        tenant = self.runtime.tenants.resolve(headers)
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
        operation = traceparent = None
        if self.runtime.takes_traces:  # spans or OTel metrics: every request's route and trace
            raw_parent = next((v for k, v in headers if k == b"traceparent"), None)
            path = scope["path"]
            operation = next((op for p, op in OPERATIONS.items() if path.endswith(p)), None)
            traceparent = parse_traceparent(raw_parent) if raw_parent is not None else None
        tag = RequestTag(session_id, benchmark, tenant, model, operation, traceparent)
        if tag == UNTAGGED:  # nothing to remember
            return None, receive
        request_id = next((v.decode("latin-1") for k, v in headers if k == b"x-request-id"), None)
        if request_id is None:
            request_id = uuid.uuid4().hex
            scope["headers"] = [*headers, (b"x-request-id", request_id.encode("ascii"))]
        self.runtime.pending.put(request_id, tag)
        return request_id, receive


class _BodyFields(msgspec.Struct):
    """The OpenAI request fields the tags need; the decoder skips every other field unbuilt."""

    model: Any = None
    user: Any = None


_BODY_FIELDS = msgspec.json.Decoder(_BodyFields)


async def _body_fields(receive: Receive) -> tuple[_BodyFields, Receive]:
    """Read the whole body for the OpenAI ``user`` and ``model`` fields, then replay it downstream."""
    messages: list[Message] = []
    chunks: list[bytes] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break

    async def replay() -> Message:
        return messages.pop(0) if messages else await receive()

    try:
        fields = _BODY_FIELDS.decode(b"".join(chunks))
    except (msgspec.DecodeError, RecursionError):  # not a JSON object: vLLM answers the bad body itself
        fields = _BodyFields()
    return fields, replay


class RouteError(Exception):
    """A client error a route answers with ``status`` and a JSON ``error``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


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
        raise ValueError(f"query parameter {name!r} must be an integer, got {quoted(raw)}") from None
    if not lo <= value <= hi:
        raise ValueError(f"query parameter {name!r} must be between {lo} and {hi}, got {quoted(raw)}")
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


def build_router(runtime: Runtime) -> APIRouter:
    router = APIRouter(prefix="/pte", tags=["pte-instrument"])

    async def guarded(request: Request, handler: Callable[[], Awaitable[JSONResponse]]) -> JSONResponse:
        response = await _answer(request, handler)
        response.headers[API_SERVER_HEADER] = str(runtime.api_server)  # which process answered
        return response

    async def _answer(request: Request, handler: Callable[[], Awaitable[JSONResponse]]) -> JSONResponse:
        if not _authorized(request, runtime):  # before anything of the request is read
            return _error(401, "Unauthorized: send Authorization: Bearer <api key>")
        try:
            failpoint("routes")
            return await handler()
        except (RouteError, FeedbackError) as e:
            return _error(e.status, str(e))
        except ValueError as e:
            return _error(400, str(e))
        except ClientDisconnect:  # nobody to answer
            return _error(400, "client disconnected")
        except Exception as e:
            runtime.faults.record("routes", e)
            return _error(500, "pte-instrument route failed; see the server log")

    @router.get("/summary")
    async def summary(request: Request) -> JSONResponse:
        async def handler() -> JSONResponse:
            return JSONResponse(await asyncio.to_thread(runtime.summary))  # reads the shared store

        return await guarded(request, handler)

    @router.post("/feedback")
    async def feedback(request: Request) -> JSONResponse:
        """A correctness label from an evaluation harness:
        ``{"request_id": "…", "correct": true}`` or ``{"session_id": "…", "correct": false}``."""

        async def handler() -> JSONResponse:
            correct, rid, sid = _feedback_target(_json_object(await _read_body(request)))
            # the completions API's response id lacks the "-<prompt index>" vLLM appends
            ids = (rid, f"{rid}-0") if rid is not None else ()
            outcome = await asyncio.to_thread(runtime.efficiency.label, correct, ids, sid)  # the shared store
            runtime.metrics.feedback(outcome)
            return JSONResponse(outcome)

        return await guarded(request, handler)

    @router.get("/sessions")
    async def sessions(request: Request) -> JSONResponse:
        async def handler() -> JSONResponse:
            limit = _int_param(request, "limit", 50, 1, MAX_PAGE)
            offset = _int_param(request, "offset", 0, 0, 10**9)
            sort = request.query_params.get("sort", "pte_served")
            if sort not in SORT_KEYS:
                raise ValueError(f"query parameter 'sort' cannot be {quoted(sort)}")
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
            return _error(401, "Unauthorized: send Authorization: Bearer <key>")
        try:
            body, content_type = await asyncio.to_thread(exposition, request.headers.get("accept"))
        except Exception as e:
            runtime.faults.record("routes", e)
            return _error(500, "pte-instrument route failed; see the server log")
        return Response(body, media_type=content_type, headers={API_SERVER_HEADER: str(runtime.api_server)})

    # ":path": session ids may contain "/" (sent as-is or as %2F; the server decodes the path)
    @router.get("/sessions/{session_id:path}")
    async def session(request: Request, session_id: str) -> JSONResponse:
        async def handler() -> JSONResponse:
            sid, reason = validate_session_id(session_id)
            if sid is None:
                raise ValueError(f"malformed session id ({reason})")
            found = await asyncio.to_thread(runtime.sessions.get, sid)
            return _error(404, f"no live session {quoted(sid)}") if found is None else JSONResponse(found)

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
        get_runtime().api_keys = compat.api_keys(args)
