"""The middleware that tags generation requests for the stat logger, which sees them finish
in the same process.

It reads the session header (default ``X-Session-Id``; or the OpenAI ``user`` field with
``PTE_SESSION_FROM_USER=1``), the tenant (``PTE_TENANT_HEADER``, the API key's hash), when
the server serves LoRA adapters the OpenAI ``model`` field, and, when OpenTelemetry is on,
the route's GenAI operation and the caller's W3C ``traceparent``; makes sure the request
carries an ``X-Request-Id`` (vLLM names its request after it), and remembers request → tag
until the request finishes: the tag goes a grace period after the HTTP exchange ends
(``PendingTags.settle``), so every engine request of one HTTP request (``n > 1``, a list of
prompts) carries it. An ``X-Request-Id`` longer than ``MAX_REQUEST_ID_LEN`` bytes, on any
POST, goes on as its digest (``bounded_request_id``), and so does the body's ``request_id``
(vLLM's name for a request sent without the header): the request log and the session store
keep vLLM's name for each request, and a client's id would otherwise be of any length. The
Responses API names a request after its body's ``request_id`` alone: an over-long one is
replaced in the body by its digest, and one sent without it gets one written in, as vLLM
would have drawn it, so that its tag can be found."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from opentelemetry.semconv._incubating.attributes.gen_ai_attributes import (
    GenAiOperationNameValues as Operation,
)
from pydantic import TypeAdapter, ValidationError
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pte_instrument.faults import log
from pte_instrument.prompt_digest import key_bytes, request_digests
from pte_instrument.server.request_tags import (
    MAX_REQUEST_ID_LEN,
    UNTAGGED,
    RequestTag,
    bounded_request_id,
    parse_traceparent,
    validate_session_id,
)
from pte_instrument.server.routes import authorized
from pte_instrument.server.runtime import Runtime
from pte_instrument.settings import BENCHMARK_HEADER

# How vLLM names a route's requests (the spelling the tag is kept under): after the
# X-Request-Id, else the body's request_id; after the body's request_id alone (the Responses
# API, which reads no header and names a request ``resp_<uuid>`` without one); after the
# X-Request-Id alone (the Anthropic Messages API, whose body has no request_id).
HEADER_OR_BODY, BODY, HEADER = "header_or_body", "body", "header"


@dataclass(frozen=True)
class Route:
    """A route whose requests reach the engine, and so finish in the stat logger."""

    # the GenAI operation it performs (OpenTelemetry's well-known values); None: by its body
    operation: str | None
    names: str  # HEADER_OR_BODY, BODY or HEADER


# Every route of vLLM's that generates, with its operation: the Responses and Messages APIs
# are chat APIs; the chat batch API runs one chat per conversation; SageMaker's /invocations
# runs a chat or a completion, by its body.
ROUTES = {
    "/v1/chat/completions": Route(Operation.CHAT.value, HEADER_OR_BODY),
    "/v1/chat/completions/batch": Route(Operation.CHAT.value, HEADER_OR_BODY),
    "/v1/completions": Route(Operation.TEXT_COMPLETION.value, HEADER_OR_BODY),
    "/v1/responses": Route(Operation.CHAT.value, BODY),
    "/v1/messages": Route(Operation.CHAT.value, HEADER),
    "/invocations": Route(None, HEADER_OR_BODY),
}
PLUGIN_ROUTES = "/pte/"
# The path prefixes vLLM's --api-key guards (its GUARDED_PREFIX): it serves every other
# route, /invocations among them, without the key.
API_KEY_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
# A served route the plugin does not tag (embeddings, scoring, but also routes that never
# read their body) has its body looked at for vLLM's request_id up to this size; a larger one
# goes on unread by the plugin, its request_id as sent.
MAX_UNTAGGED_BODY_BYTES = 1 << 20
MAX_MODEL_NAME_LEN = 256  # a longer "model" is kept for no adapter (accounted to the base model)


class TaggingMiddleware:
    """Tags generation requests with their session and benchmark label, and with their
    route's operation and the caller's trace context when OpenTelemetry takes them, and with
    their prompt's digest when the request log takes it. Pure ASGI (no per-request task; the
    body is copied only for a field of it wanted: ``request_id`` when no ``X-Request-Id`` is
    sent, the ``user`` field, the model of a LoRA server, the prompt for the request log's
    digest)."""

    def __init__(
        self,
        app: ASGIApp,
        runtime: Runtime,
        keys_of: Callable[[Any], list[str]] | None = None,
        adapters_of: Callable[[Any], Container[str] | None] | None = None,
    ) -> None:
        self.app = app
        self.runtime = runtime
        self.keys_of = keys_of
        self.adapters_of = adapters_of
        self.header = self.runtime.settings.session_header.lower().encode("ascii")
        self.benchmark_header = BENCHMARK_HEADER.lower().encode("ascii")
        self._keys_read = False
        self._said_long_id = False
        settings = self.runtime.settings
        # the digest joins an evaluation harness's samples to the request log: wanted only with one
        self.digests = settings.prompt_digest and settings.request_log is not None
        self.digest_key = key_bytes(settings.prompt_digest_key)

    def _authorized(self, scope: Scope, headers: list[tuple[bytes, bytes]]) -> bool:
        """vLLM's API-key check, made here first: added by ``--middleware``, this runs before
        vLLM's own, and the endpoint plugin that tells the runtime the keys may not be loaded."""
        if not self._keys_read:
            if not self.runtime.api_keys and self.keys_of is not None:
                self.runtime.api_keys = self.keys_of(scope.get("app"))
            self._keys_read = True  # once read: a read that raised is tried again
        if not self.runtime.api_keys:
            return True
        if not scope["path"].removeprefix(scope.get("root_path", "")).startswith(API_KEY_PREFIXES):
            return True  # vLLM serves it to anyone
        value = next((v for k, v in headers if k == b"authorization"), b"")
        return authorized(value.decode("latin-1"), self.runtime.api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key, background = None, False
        if scope["type"] == "http" and scope["method"] == "POST":
            try:
                # every route that reaches the engine: vLLM names the request after the
                # X-Request-Id, else after the body's request_id (a route may read one alone)
                name = self._bound_request_id(scope)
                # vLLM refuses a request without the API key before it reads the body: so here.
                # Each body is read once; receive is its replay from then on, so that a fault
                # after it still passes the body on.
                if self._authorized(scope, scope["headers"]):
                    route = _route(scope["path"])
                    wanted = None
                    if route is not None and route.names == BODY:
                        wanted, receive, name = await self._named_by_body(scope, receive)
                    else:
                        if route is not None and self._wants_body(scope["headers"]):
                            wanted, receive = await _body_fields(receive, _BODY_FIELDS)
                        after_body = route is None or route.names == HEADER_OR_BODY
                        if name is None and after_body and _names_after_body(scope, route is not None):
                            fields: _RequestId | None = wanted
                            limit = None if route is not None else MAX_UNTAGGED_BODY_BYTES
                            if fields is None and (limit is None or _content_length(scope) <= limit):
                                fields, receive = await _body_fields(receive, _REQUEST_ID, limit)
                            if fields is not None:
                                name = self._bound_body_request_id(scope, fields.request_id)
                    if route is not None:
                        key = self._tag(scope, route, wanted, name)
                        # a background response runs on after its answer, as long as it takes:
                        # accepted, its tag stays to the tags' age limit
                        background = route.names == BODY and wanted is not None and _true(wanted.background)
            except Exception as e:  # never fail the request for the plugin's sake
                self.runtime.faults.record("middleware", e)
        if key is None:
            await self.app(scope, receive, send)
            return
        accepted = False

        async def send_seen(message: Message) -> None:
            nonlocal accepted
            if message["type"] == "http.response.start":
                accepted = message["status"] < 300
            await send(message)

        try:
            await self.app(scope, receive, send_seen if background else send)
        finally:  # answered, rejected or cut off: what the engine did, it reports within the grace
            if not (background and accepted):
                self.runtime.pending.settle(key)

    def _bound_request_id(self, scope: Scope) -> str | None:
        """The ``X-Request-Id`` vLLM is to read (None: none sent), an over-long one replaced
        by its digest first."""
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        raw = next((v for k, v in headers if k == b"x-request-id"), None)
        if raw is None or len(raw) <= MAX_REQUEST_ID_LEN:
            return None if raw is None else raw.decode("latin-1")
        scope["headers"] = [(k, bounded_request_id(v) if k == b"x-request-id" else v) for k, v in headers]
        self._say_long_id("An X-Request-Id")
        return bounded_request_id(raw).decode("ascii")

    def _bound_body_request_id(self, scope: Scope, request_id: Any) -> str | None:
        """The body's ``request_id`` vLLM is to read (None: none that vLLM takes); an
        over-long one goes on as an ``X-Request-Id`` of its digest, which vLLM reads first."""
        if not isinstance(request_id, str):
            return None
        if _as_sent(request_id):
            return request_id
        digest = bounded_request_id(request_id.encode("utf-8", "surrogatepass"), as_sent=False)
        scope["headers"] = [*scope["headers"], (b"x-request-id", digest)]
        self._say_long_id("A request_id in the body")
        return digest.decode("ascii")

    async def _named_by_body(self, scope: Scope, receive: Receive) -> tuple[_BodyFields, Receive, str | None]:
        """The body's fields, its replay, and the name vLLM gives a request of a route that names
        it after its body alone (the Responses API): the body's ``request_id``; its digest,
        written in as the body's last member (which the JSON reader keeps), for one over
        ``MAX_REQUEST_ID_LEN`` bytes; or, when it has none, one written in as vLLM would have
        drawn it (``resp_<uuid>``). None: none to tag it under (a body that is no JSON object
        in UTF-8, which nothing can be written into)."""
        data, end, _ = await _read_body(receive)
        fields, name = _BodyFields(), None
        try:
            try:  # a JSON object in UTF-8: a member can be written into it
                fields, writable = _BODY_FIELDS.decode(data), True
            except (msgspec.DecodeError, RecursionError):
                fields, writable = _decode(data, _BODY_FIELDS), False
            written = None
            if isinstance(fields.request_id, str):
                if _as_sent(fields.request_id):
                    name = fields.request_id
                elif writable:
                    raw = fields.request_id.encode("utf-8", "surrogatepass")
                    name = bounded_request_id(raw, as_sent=False).decode("ascii")
                    written = data.rstrip(b" \t\r\n")[:-1] + b',"request_id":"' + name.encode("ascii") + b'"}'
                    self._say_long_id("A request_id in a Responses API body")
            elif fields.request_id is None and writable:
                name, written = _with_request_id(data)
            if written is not None:
                scope["headers"] = [
                    (k, str(len(written)).encode("ascii") if k == b"content-length" else v)
                    for k, v in scope["headers"]
                ]
                data = written
        except Exception as e:  # the body still goes on, as sent, and untagged
            self.runtime.faults.record("middleware", e)
            name = None
        return fields, _replayed(data, end, receive), name

    def _say_long_id(self, what: str) -> None:
        if not self._said_long_id:
            self._said_long_id = True
            log.warning(
                "pte-instrument: %s longer than %d bytes reaches vLLM as its SHA-256 in hex "
                '(printf %%s "$ID" | sha256sum), this one and every later one; said once',
                what,
                MAX_REQUEST_ID_LEN,
            )

    def _wants_body(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether ``_tag`` needs a field of the body: the body is read only then."""
        user = self.runtime.settings.session_from_user and not any(k == self.header for k, _ in headers)
        return user or self.runtime.lora_names.enabled or self.digests

    def _tag(self, scope: Scope, route: Route, fields: _BodyFields | None, name: str | None) -> str | None:
        """The request key its tag is kept under (None: nothing to tag). ``fields``: the
        body's (None: not read, ``_wants_body``); ``name``: what vLLM is to name the request
        after (None: vLLM's own choice)."""
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        raw = next((v for k, v in headers if k == self.header), None)
        lora = self.runtime.lora_names
        model = None
        digests: tuple[str, ...] = ()
        if fields is not None:
            if self.digests:
                digests = request_digests(fields.messages, fields.prompt, self.digest_key)
            if raw is None and self.runtime.settings.session_from_user and fields.user is not None:
                raw = str(fields.user).encode("utf-8", "replace")
            if lora.enabled and isinstance(fields.model, str) and len(fields.model) <= MAX_MODEL_NAME_LEN:
                model = fields.model
                if lora.served is None and self.adapters_of is not None:  # read when the request finishes
                    lora.served = self.adapters_of(scope.get("app"))
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
            operation = route.operation
            traceparent = parse_traceparent(raw_parent) if raw_parent is not None else None
        tag = RequestTag(session_id, benchmark, tenant, model, operation, traceparent, digests)
        if tag == UNTAGGED:  # nothing to remember
            return None
        if name is None:  # named here, so that the tag can be found under vLLM's name
            if route.names == BODY:  # a body no name could be written into
                return None
            name = uuid.uuid4().hex
            scope["headers"] = [*headers, (b"x-request-id", name.encode("ascii"))]
        self.runtime.pending.put(name, tag)
        return name


class _RequestId(msgspec.Struct):
    """The body's ``request_id`` alone (vLLM's extension): the decoder skips every other
    field unbuilt."""

    request_id: Any = None


class _BodyFields(_RequestId):
    """The OpenAI request fields the tags need."""

    model: Any = None
    user: Any = None
    messages: Any = None  # chat: digested
    prompt: Any = None  # completions: digested
    background: Any = None  # Responses API: answered at once, generated afterwards


_REQUEST_ID = msgspec.json.Decoder(_RequestId)
_BODY_FIELDS = msgspec.json.Decoder(_BodyFields)
Fields = TypeVar("Fields", bound=_RequestId)


def _as_sent(request_id: str) -> bool:
    """Whether a body's ``request_id`` goes on to vLLM as sent: up to ``MAX_REQUEST_ID_LEN``
    bytes of UTF-8. One with a lone surrogate (Python's JSON reads ``"\ud800"``; no store,
    log or exporter can write it) goes on as its digest, as a longer one does."""
    try:
        return len(request_id.encode("utf-8")) <= MAX_REQUEST_ID_LEN
    except UnicodeEncodeError:
        return False


def _content_length(scope: Scope) -> int:
    """The body's size as its Content-Length says (0: none, or none readable)."""
    value = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
    return int(value) if value.isdigit() else 0


def _json_body(scope: Scope) -> bool:
    """Whether vLLM reads the body as JSON: no content type, or a JSON one (a form upload's
    fields are its own)."""
    content_type = next((v for k, v in scope["headers"] if k == b"content-type"), None)
    return content_type is None or b"json" in content_type.lower()


def _names_after_body(scope: Scope, generation: bool) -> bool:
    """Whether vLLM takes the request's name from its body's ``request_id``: a JSON body, on a
    path it serves (it answers any other 404 unread), not one of the plugin's routes (they
    bound their bodies)."""
    return _json_body(scope) and PLUGIN_ROUTES not in scope["path"] and (generation or _served(scope))


def _served(scope: Scope) -> bool:
    """Whether the app has a route for the request (whose handler reads its body)."""
    routes = getattr(getattr(scope.get("app"), "router", None), "routes", ())
    return any(route.matches(scope)[0] is Match.FULL for route in routes)


_BOOL = TypeAdapter(bool)


def _true(value: Any) -> bool:
    """Whether vLLM's request model reads ``value`` as true (pydantic's lenient booleans:
    ``1``, ``"true"``, ``"on"``…)."""
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        return False


def _route(path: str) -> Route | None:
    """The generation route ``path`` is (None: none; a prefix before it is a root path)."""
    return next((route for p, route in ROUTES.items() if path.endswith(p)), None)


async def _read_body(receive: Receive, limit: int | None = None) -> tuple[bytes, Message | None, bool]:
    """The body, what cut it short (a disconnect), if anything did, and whether all of it was
    read: reading stops once it holds ``limit`` bytes or more."""
    body = bytearray()
    end: Message | None = None
    while limit is None or len(body) < limit:
        message = await receive()
        if message["type"] != "http.request":
            end = message
            break
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return bytes(body), None, True
    return bytes(body), end, end is not None


def _replayed(data: bytes, end: Message | None, receive: Receive, whole: bool = True) -> Receive:
    """``receive`` with a body read given back first, as one message (a body sent a few bytes
    per message is held once, not as a message per few bytes), followed by what cut it short,
    if anything did, or by the rest of the body (``whole`` False: read only in part)."""
    messages: list[Message] = []
    if data or (end is None and whole):
        messages.append({"type": "http.request", "body": data, "more_body": end is not None or not whole})
    if end is not None:
        messages.append(end)

    async def replay() -> Message:
        return messages.pop(0) if messages else await receive()

    return replay


async def _body_fields(
    receive: Receive, decoder: msgspec.json.Decoder[Fields], limit: int | None = None
) -> tuple[Fields, Receive]:
    """Read the body for the fields ``decoder`` takes, then replay it downstream, every byte
    as sent (``_replayed``). A body over ``limit`` bytes has none of its fields read."""
    data, end, whole = await _read_body(receive, limit)
    return _decode(data, decoder) if whole else decoder.type(), _replayed(data, end, receive, whole)


def _with_request_id(data: bytes) -> tuple[str, bytes]:
    """A fresh ``request_id`` (vLLM's own spelling, ``resp_<uuid>``) and the JSON object
    ``data`` (in UTF-8) with it written in as its first member."""
    name = f"resp_{uuid.uuid4().hex}"
    rest = data.lstrip(b" \t\r\n")[1:]  # after the opening brace
    comma = b"" if rest.lstrip(b" \t\r\n").startswith(b"}") else b","
    return name, b'{"request_id":"' + name.encode("ascii") + b'"' + comma + rest


def _decode(data: bytes, decoder: msgspec.json.Decoder[Fields]) -> Fields:
    """The fields of a body as vLLM reads it (FastAPI's ``json.loads``); empty for a body
    that is not a JSON object (vLLM answers it itself)."""
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, RecursionError):
        pass
    # Python's json also takes what msgspec refuses (a byte-order mark, UTF-16 and -32, NaN,
    # lone surrogates): vLLM would read such a body, so its fields are read the same way
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError):
        return decoder.type()
    if not isinstance(parsed, dict):
        return decoder.type()
    return decoder.type(**{f: parsed[f] for f in decoder.type.__struct_fields__ if f in parsed})
