"""The /pte/* routes and the session middleware against hostile input, in process (an ASGI
app around the plugin's router and middleware, no engine)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Iterator
from urllib.parse import quote

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from starlette.requests import Request

from pte_instrument.devtools.serving import free_port
from pte_instrument.server.middleware import MAX_UNTAGGED_BODY_BYTES, TaggingMiddleware
from pte_instrument.server.request_tags import PendingTags, RequestTag
from pte_instrument.server.routes import build_router
from pte_instrument.server.runtime import Runtime
from pte_instrument.settings import Settings
from tests.server.test_sessions import Clock, turn

KEY = "route-key"
MAX_BODY_BYTES = 64 * 1024
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def runtime() -> Runtime:
    rt = Runtime(Settings(), registry=CollectorRegistry())
    rt.api_keys = [KEY]
    return rt


@pytest.fixture
def client(runtime: Runtime) -> TestClient:
    app = FastAPI()
    app.include_router(build_router(runtime))
    return TestClient(app, raise_server_exceptions=False)


def nested(depth: int) -> bytes:
    return b'{"correct": true, "request_id": ' + b"[" * depth + b"]" * depth + b"}"


# --- POST /pte/feedback: key first, bounded body, 400 for malformed input ---------------


def call(app, path: str, headers: list[tuple[bytes, bytes]], chunks: list[bytes]):
    """One raw ASGI POST; returns (status, body, how many body chunks the app read). The
    client hangs up once its chunks are read."""
    return asyncio.run(asyncio.wait_for(_call(app, path, headers, chunks), timeout=30))


async def _call(app, path: str, headers: list[tuple[bytes, bytes]], chunks: list[bytes]):
    read = 0
    sent: list[dict] = []

    async def receive():
        nonlocal read
        if read < len(chunks):
            read += 1
            return {"type": "http.request", "body": chunks[read - 1], "more_body": read < len(chunks)}
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body, read


def feedback_app(runtime: Runtime) -> FastAPI:
    app = FastAPI()
    app.include_router(build_router(runtime))
    return app


def test_unauthenticated_feedback_is_refused_before_its_body_is_read(runtime):
    chunks = [b"x" * 65536] * 8  # never read: the key is checked first
    status, _, read = call(feedback_app(runtime), "/pte/feedback", [], chunks)
    assert status == 401 and read == 0


def test_unauthenticated_deeply_nested_feedback_is_a_401(client):
    assert client.post("/pte/feedback", content=nested(20_000)).status_code == 401


@pytest.mark.parametrize("depth", [5_000, 30_000])
def test_deeply_nested_feedback_is_a_400(client, depth):
    r = client.post("/pte/feedback", content=nested(depth), headers=AUTH)
    assert r.status_code == 400, r.text
    assert "nested" in r.json()["error"]


def test_a_body_over_the_cap_is_a_413_from_its_content_length(client):
    big = b'{"correct": true, "request_id": "' + b"x" * MAX_BODY_BYTES + b'"}'
    r = client.post("/pte/feedback", content=big, headers=AUTH)
    assert r.status_code == 413 and "error" in r.json()


def test_a_chunked_body_over_the_cap_is_a_413_read_no_further(runtime):
    headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"transfer-encoding", b"chunked")]
    chunks = [b"x" * 16384] * 64  # 1 MiB, no Content-Length
    status, body, read = call(feedback_app(runtime), "/pte/feedback", headers, chunks)
    assert status == 413 and "error" in json.loads(body)
    assert read <= MAX_BODY_BYTES // 16384 + 1  # stopped at the cap


def test_behind_the_middleware_a_chunked_body_over_the_cap_is_still_read_no_further(runtime):
    """The middleware reads a request's body for vLLM's ``request_id`` field, but never the
    plugin's own routes', which bound theirs."""
    headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"transfer-encoding", b"chunked")]
    chunks = [b"x" * 16384] * 64
    status, _, read = call(
        TaggingMiddleware(feedback_app(runtime), runtime), "/pte/feedback", headers, chunks
    )
    assert status == 413 and read <= MAX_BODY_BYTES // 16384 + 1


def test_the_middleware_reads_no_body_of_a_path_the_server_does_not_serve(runtime):
    """vLLM answers a path it does not serve with a 404 and never reads the body: the
    middleware, looking for a ``request_id`` in it, must not either (no bound on what it would
    hold otherwise)."""
    app = FastAPI()

    @app.post("/v1/embeddings")
    async def embeddings() -> dict:
        return {}

    app.add_middleware(TaggingMiddleware, runtime=runtime)
    headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"transfer-encoding", b"chunked")]
    chunks = [b'{"request_id": "' + b"x" * 16384] + [b"x" * 16384] * 62 + [b'"}']
    status, _, read = call(app, "/v1/no-such-route", headers, chunks)
    assert (status, read) == (404, 0)
    status, _, read = call(app, "/v1/embeddings", headers, chunks)
    assert (status, read) == (200, len(chunks))  # a path it serves: read, for the id


def test_the_middleware_reads_at_most_a_mebibyte_of_a_body_for_a_route_it_does_not_tag(runtime):
    """A served route the plugin does not tag may never read its body (vLLM's ``/ping``): the
    middleware looks for vLLM's ``request_id`` in the first mebibyte at most — by its
    Content-Length, none — and passes the rest on as sent."""
    app = FastAPI()
    received: list[int] = []

    @app.post("/ping")
    async def ping() -> dict:
        return {}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict:
        received.append(len(await request.body()))
        return {}

    app.add_middleware(TaggingMiddleware, runtime=runtime)
    chunked = [(b"authorization", f"Bearer {KEY}".encode()), (b"transfer-encoding", b"chunked")]
    chunks = [b"x" * 65536] * 100  # 6.25 MiB
    status, _, read = call(app, "/ping", chunked, chunks)
    assert status == 200 and read == MAX_UNTAGGED_BODY_BYTES // 65536
    sized = [(b"authorization", f"Bearer {KEY}".encode()), (b"content-length", str(100 * 65536).encode())]
    assert call(app, "/ping", sized, chunks)[::2] == (200, 0)
    status, _, read = call(app, "/v1/embeddings", chunked, chunks)
    assert (status, read, received) == (200, 100, [100 * 65536])  # every byte passed on


def test_a_lying_content_length_is_a_400(runtime):
    headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"content-length", b"lots")]
    status, _, _ = call(feedback_app(runtime), "/pte/feedback", headers, [b"{}"])
    assert status == 400


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"\xff\xfe\x00garbage",
        b"[1, 2]",
        b"null",
        b'"a string"',
        b"",
        b'{"correct": "yes", "request_id": "r"}',
        b'{"correct": 1, "request_id": "r"}',
        b'{"correct": true, "request_id": ["r"]}',
        b'{"correct": true, "request_id": {"a": 1}}',
        b'{"correct": true, "session_id": 5}',
        b'{"correct": true, "request_id": ""}',
        b'{"correct": true, "request_id": "r", "session_id": "s"}',
        b'{"correct": true}',
        b'{"correct": true, "request_id": 1' + b"0" * 5000 + b"}",
    ],
)
def test_malformed_feedback_is_a_400(client, body):
    r = client.post("/pte/feedback", content=body, headers=AUTH)
    assert r.status_code == 400, (body[:60], r.status_code, r.text[:200])
    assert isinstance(r.json()["error"], str)


def test_echoed_ids_are_cut_short(client, runtime):
    long_id = "x" * 60_000
    r = client.post("/pte/feedback", json={"request_id": long_id, "correct": True}, headers=AUTH)
    assert r.status_code == 404 and len(r.content) < 400, len(r.content)
    assert "…" in r.json()["error"]
    runtime.efficiency.observe(long_id, None, "m", "none", 3, "stop")
    assert (
        client.post("/pte/feedback", json={"request_id": long_id, "correct": True}, headers=AUTH).status_code
        == 200
    )
    r = client.post("/pte/feedback", json={"request_id": long_id, "correct": True}, headers=AUTH)
    assert r.status_code == 409 and len(r.content) < 400, len(r.content)
    for params in ({"sort": "s" * 20_000}, {"limit": "9" * 20_000}, {"offset": "o" * 20_000}):
        r = client.get("/pte/sessions", params=params, headers=AUTH)
        assert r.status_code == 400 and len(r.content) < 400, (list(params), len(r.content))


def test_feedback_for_an_unknown_id_says_whether_it_looked_for_a_request_or_a_session(client):
    r = client.post("/pte/feedback", json={"session_id": "agent-7", "correct": True}, headers=AUTH)
    assert r.status_code == 404
    assert r.json() == {"error": "no recent finished request of session 'agent-7'"}
    r = client.post("/pte/feedback", json={"request_id": "chatcmpl-1", "correct": True}, headers=AUTH)
    assert r.status_code == 404
    assert r.json() == {"error": "no recent finished request for 'chatcmpl-1'"}


# --- the session store down: the routes degrade, they do not fail -----------------------


@pytest.fixture(params=["redis", "sqlite"])
def store_down(request, tmp_path) -> Iterator[Runtime]:
    """A runtime whose session store cannot be read: a Redis server that cannot be reached
    (nothing listens at its port), or a SQLite file that refuses this process's reads."""
    if request.param == "redis":
        pytest.importorskip("redis")
        store = f"redis://127.0.0.1:{free_port()}/0"
    else:
        store = str(tmp_path / "sessions.sqlite3")
    rt = Runtime(Settings(session_store=store), registry=CollectorRegistry())
    if request.param == "sqlite":
        for route in (False, True):  # the pricer's connection and the routes'
            with rt.sessions.store.reading(route) as db:
                db.set_authorizer(lambda *_: sqlite3.SQLITE_DENY)
    yield rt
    rt.sessions.close()


def test_with_the_session_store_down_the_summary_answers_with_its_sections_unknown(store_down):
    client = TestClient(feedback_app(store_down), raise_server_exceptions=False)
    r = client.get("/pte/summary")
    assert r.status_code == 200, r.text[:200]
    body = r.json()
    assert body["efficiency"] is None and body["models"] == {} and body["sessions"]["live"] is None
    assert body["api_server"]["index"] == 0  # what the process knows itself is there
    assert store_down.faults.counts["routes"] == 0 and store_down.faults.counts["sessions"] > 0


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/pte/sessions", None),
        ("GET", "/pte/sessions/agent-7", None),
        ("POST", "/pte/feedback", {"request_id": "r", "correct": True}),
    ],
)
def test_with_the_session_store_down_its_routes_answer_503_saying_so(store_down, method, path, body):
    client = TestClient(feedback_app(store_down), raise_server_exceptions=False)
    r = client.request(method, path, json=body)
    assert r.status_code == 503, r.text[:200]
    assert r.json() == {"error": "the session store is unavailable; try again shortly"}
    assert store_down.faults.counts["routes"] == 0 and store_down.faults.counts["sessions"] > 0


# --- GET /pte/sessions/{id}: every tracked id is reachable --------------------------------


@pytest.mark.parametrize("sid", ["team/agent-7", "a/b/c", "trailing/", "/leading", "50%off", "q?x#y"])
def test_session_ids_with_slashes_and_reserved_characters_are_reachable(client, runtime, sid):
    turn(runtime.sessions, sid, 10, 2, 0, 1000.0)
    listed = client.get("/pte/sessions", headers=AUTH).json()["sessions"]
    assert [s["session_id"] for s in listed] == [sid]

    for path in (quote(sid, safe="/"), quote(sid, safe="")):  # '/' as-is and as %2F
        r = client.get(f"/pte/sessions/{path}", headers=AUTH)
        assert r.status_code == 200, (path, r.status_code, r.text)
        assert r.json()["session_id"] == sid


def test_a_fault_of_the_servers_own_data_is_a_500_and_counted_not_the_clients_400(client, runtime):
    """A turn row the store cannot read (written garbled by a disk fault or another program)
    raises a ``ValueError`` while the route reads it: the client's request was fine."""
    turn(runtime.sessions, "s", 10, 2, 0, 1000.0)
    assert runtime.sessions.flush()
    db = sqlite3.connect(runtime.sessions.store.path)
    with db:
        db.execute("UPDATE turns SET row = 'garbled'")
    db.close()
    r = client.get("/pte/sessions/s", headers=AUTH)
    assert r.status_code == 500 and "see the server log" in r.json()["error"]
    assert runtime.faults.counts.get("routes") == 1


def test_an_empty_or_malformed_session_path_is_a_400(client):
    assert client.get("/pte/sessions/", headers=AUTH, follow_redirects=False).status_code == 400
    assert client.get("/pte/sessions/" + "x" * 129, headers=AUTH).status_code == 400
    assert client.get("/pte/sessions/caf%C3%A9", headers=AUTH).status_code == 400
    r = client.get("/pte/sessions/no/such/session", headers=AUTH)
    assert r.status_code == 404 and "no/such/session" in r.json()["error"]


# --- the session middleware: tags of requests the engine never sees do not linger ---------


def generation_app(status: int, complete: bool = True):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": not complete})

    return app


def tagged_client(runtime: Runtime, status: int, complete: bool = True) -> TestClient:
    # with the key: the middleware tags only what vLLM's key check lets through
    return TestClient(TaggingMiddleware(generation_app(status, complete), runtime), headers=AUTH)


@pytest.mark.parametrize("status", [400, 401, 404, 422, 500, 503])
def test_tags_of_rejected_requests_expire_promptly_and_are_counted(runtime, status):
    clock = Clock()
    runtime.pending = PendingTags(clock=clock)
    c = tagged_client(runtime, status)
    for i in range(50):
        c.post("/v1/chat/completions", json={"model": "wrong"}, headers={"X-Session-Id": f"s{i}"})
    clock.t += runtime.pending.grace_s + 0.1
    assert len(runtime.pending) == 0 and runtime.pending.dropped == 50


def test_tags_of_answered_requests_serve_every_engine_request_then_go(runtime):
    clock = Clock()
    runtime.pending = PendingTags(clock=clock)
    c = tagged_client(runtime, 200)
    c.post("/v1/completions", json={}, headers={"X-Session-Id": "s", "X-Request-Id": "r1"})
    # n = 2 or a list of prompts: several engine requests claim the one HTTP request's tag
    assert runtime.pending.claim("0_cmpl-r1-0", "r1-0", "r1") == RequestTag("s", "none")
    assert runtime.pending.claim("cmpl-r1-1", "r1-1", "r1") == RequestTag("s", "none")
    clock.t += runtime.pending.grace_s + 0.1
    assert len(runtime.pending) == 0 and runtime.pending.dropped == 0  # claimed: not a drop


def test_a_reused_request_id_keeps_its_tag_while_any_exchange_is_open():
    clock = Clock()
    pending = PendingTags(clock=clock)
    pending.put("same", RequestTag("s", "none"))
    pending.put("same", RequestTag("s", "none"))  # a second request, same X-Request-Id
    pending.settle("same")  # the first ends
    clock.t += pending.grace_s + 1
    assert pending.claim("same") == RequestTag("s", "none")  # the second still runs
    pending.settle("same")
    clock.t += pending.grace_s + 1
    assert len(pending) == 0 and pending.dropped == 0


def test_a_rejected_tag_claimed_within_the_grace_is_not_dropped(runtime):
    clock = Clock()
    runtime.pending = PendingTags(clock=clock)
    tagged_client(runtime, 500).post(
        "/v1/completions", json={}, headers={"X-Session-Id": "s", "X-Request-Id": "r"}
    )
    # the engine's report raced the error
    assert runtime.pending.claim("cmpl-r-0", "r-0", "r") == RequestTag("s", "none")
    clock.t += 60
    assert len(runtime.pending) == 0 and runtime.pending.dropped == 0


def test_tags_of_cut_off_responses_expire_promptly(runtime):
    clock = Clock()
    runtime.pending = PendingTags(clock=clock)
    c = tagged_client(runtime, 200, complete=False)  # a stream the client hung up on
    c.post("/v1/chat/completions", json={}, headers={"X-Session-Id": "s"})
    clock.t += runtime.pending.grace_s + 0.1
    assert len(runtime.pending) == 0 and runtime.pending.dropped == 1


def test_tags_expire_past_the_age_limit():
    clock = Clock()
    pending = PendingTags(clock=clock, max_age_s=100.0)
    pending.put("r", RequestTag("s", "none"))  # an exchange that never ends
    clock.t += 99
    assert len(pending) == 1
    clock.t += 2
    assert len(pending) == 0 and pending.dropped == 1


def test_pending_tags_count_every_drop_once():
    clock = Clock()
    pending = PendingTags(capacity=2, clock=clock)
    pending.settle("never-put")  # nothing to drop
    for key in ("a", "b", "c"):  # "a" past the capacity
        pending.put(key, RequestTag("s", "none"))
    pending.settle("b")
    pending.settle("a")  # already gone
    clock.t += pending.grace_s + 0.1
    assert len(pending) == 1 and pending.dropped == 2
    pending.put("b", RequestTag("s", "none"))  # an id used again: a new request
    clock.t += pending.grace_s + 0.1
    assert len(pending) == 2 and pending.dropped == 2


def test_user_field_with_deep_nesting_still_reaches_the_server(runtime):
    """The ``user`` field read must not eat a body it cannot parse."""
    runtime.settings = Settings(session_from_user=True)
    seen: list[bytes] = []

    async def app(scope, receive, send):
        message = await receive()
        seen.append(message.get("body", b""))
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    body = b'{"user": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    call(TaggingMiddleware(app, runtime), "/v1/chat/completions", [], [body])
    assert seen == [body]
    assert runtime.faults.counts.get("middleware", 0) == 0


def test_a_fault_after_the_middleware_read_the_body_still_passes_every_byte_on(runtime):
    """The middleware reads a LoRA server's body for its ``model`` field; a fault of its own
    past that point (here the server's adapter list cannot be read) is counted, and vLLM
    still gets the body it had already taken from the client."""
    seen: list[bytes] = []

    async def app(scope, receive, send):
        seen.append(await Request(scope, receive).body())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    def adapters_of(_app):
        raise RuntimeError("the adapter list cannot be read")

    runtime.lora_names.enabled = True
    middleware = TaggingMiddleware(app, runtime, adapters_of=adapters_of)
    body = b'{"model": "adapter-1", "prompt": "hi"}'
    headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"x-request-id", b"r")]
    status, _, _ = call(middleware, "/v1/completions", headers, [body[:10], body[10:]])
    assert status == 200 and seen == [body]
    assert runtime.faults.counts.get("middleware") == 1


def test_a_body_sent_in_many_tiny_chunks_is_held_once_not_per_chunk(runtime):
    """The middleware keeps the body it read to pass it on: a client that sends it a byte
    at a time (an ASGI message each) must not make it hold a message per byte."""
    import tracemalloc

    size = 100_000
    runtime.settings = Settings(session_from_user=True)
    held: list[int] = []
    seen: list[bytes] = []

    async def app(scope, receive, send):
        held.append(tracemalloc.get_traced_memory()[0])  # the body read, nothing passed on yet
        seen.append(await Request(scope, receive).body())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    body = b'{"user": "agent-1", "prompt": "' + b"x" * (size - 32) + b'"}'
    chunks = [body[i : i + 1] for i in range(len(body))]
    middleware = TaggingMiddleware(app, runtime)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        call(middleware, "/v1/completions", [(b"authorization", f"Bearer {KEY}".encode())], chunks)
    finally:
        tracemalloc.stop()
    assert seen == [body]
    assert held[0] - before < 4 * size, held[0] - before  # the body and a copy, not 100,000 messages


# --- OpenTelemetry: the route's operation and the caller's trace context ------------------

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def traced(runtime: Runtime) -> Runtime:
    """OpenTelemetry metrics on (to an in-memory reader): the middleware tags every request."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from pte_instrument.server.exporters.otel import OtelMetricsExporter

    runtime.otel_metrics = OtelMetricsExporter(InMemoryMetricReader())
    yield runtime
    runtime.otel_metrics.shutdown()


@pytest.mark.parametrize(
    ("path", "operation"),
    [("/v1/chat/completions", "chat"), ("/v1/completions", "text_completion"), ("/v1/responses", "chat")],
)
def test_with_opentelemetry_every_request_carries_its_route_and_trace(traced, path, operation):
    c = tagged_client(traced, 200)
    # the id in both places: the Responses API names a request after its body's alone
    c.post(path, json={"request_id": "r1"}, headers={"X-Request-Id": "r1", "traceparent": TRACEPARENT})
    assert traced.pending.claim("r1") == RequestTag(
        None, "none", operation=operation, traceparent=TRACEPARENT
    )
    headers = {"X-Request-Id": "r2", "X-Session-Id": "s", "traceparent": "garbage"}
    c.post(path, json={"request_id": "r2"}, headers=headers)
    assert traced.pending.claim("r2") == RequestTag("s", "none", operation=operation)  # served, not joined


def test_without_opentelemetry_only_sessions_and_benchmarks_are_tagged(runtime):
    c = tagged_client(runtime, 200)
    c.post("/v1/completions", json={}, headers={"X-Request-Id": "r1", "traceparent": TRACEPARENT})
    assert runtime.pending.claim("r1") is None and len(runtime.pending) == 0
    c.post("/v1/completions", json={}, headers={"X-Request-Id": "r2", "X-Session-Id": "s"})
    assert runtime.pending.claim("r2") == RequestTag("s", "none")


def test_rejected_requests_tagged_for_opentelemetry_alone_are_not_counted_as_drops(traced):
    clock = Clock()
    traced.pending = PendingTags(clock=clock)
    c = tagged_client(traced, 404)
    for _ in range(20):
        c.post("/v1/chat/completions", json={"model": "wrong"}, headers={"traceparent": TRACEPARENT})
    c.post("/v1/chat/completions", json={"model": "wrong"}, headers={"X-Session-Id": "s"})
    assert len(traced.pending) == 21
    clock.t += traced.pending.grace_s + 0.1
    assert len(traced.pending) == 0 and traced.pending.dropped == 1  # the session's tag only


# --- GET /pte/metrics: the registry in the format asked for ------------------------------


def test_pte_metrics_answers_openmetrics_when_asked_and_needs_the_key(client, runtime):
    om = {**AUTH, "Accept": "application/openmetrics-text; version=1.0.0"}
    r = client.get("/pte/metrics", headers=om)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.endswith("# EOF\n") and r.headers["X-PTE-API-Server"] == "0"
    plain = client.get("/pte/metrics", headers=AUTH)
    assert plain.status_code == 200 and plain.headers["content-type"].startswith("text/plain")
    assert "# EOF" not in plain.text
    assert client.get("/pte/metrics").status_code == 401


@pytest.mark.parametrize(
    "accept",
    [
        "application/openmetrics-text; version=abc",
        "application/openmetrics-text; version=1.x",
        "text/plain; version=0.0.4x",
        "text/plain, application/openmetrics-text; version=1." + "0" * 10_000,
    ],
    ids=["letters", "mixed", "text-format", "10-kb"],
)
def test_a_scrape_with_a_malformed_accept_version_is_a_400_not_a_fault_of_the_server(client, runtime, accept):
    """prometheus_client compares the ``version`` parameter as numbers, and echoes it into
    the answer's Content-Type: a version that is not one is the client's mistake."""
    r = client.get("/pte/metrics", headers={**AUTH, "Accept": accept})
    assert r.status_code == 400, (r.status_code, r.headers.get("content-type", "")[:80])
    assert r.json()["error"].startswith("malformed Accept header") and len(r.content) < 400
    assert r.headers.get("X-PTE-API-Server") == "0"
    assert runtime.faults.counts.get("routes", 0) == 0
    ok = client.get("/pte/metrics", headers={**AUTH, "Accept": "application/openmetrics-text; version=1.0.0"})
    assert ok.status_code == 200 and ok.text.endswith("# EOF\n")


def test_every_pte_answer_names_its_api_server_a_refused_or_failed_scrape_too(client, runtime, monkeypatch):
    r = client.get("/pte/metrics")
    assert r.status_code == 401 and r.headers.get("X-PTE-API-Server") == "0"
    assert r.json() == client.get("/pte/summary").json()  # the same refusal as the other routes

    def broken(accept):
        raise RuntimeError("the registry cannot be read")

    monkeypatch.setattr("pte_instrument.server.routes.exposition", broken)
    r = client.get("/pte/metrics", headers=AUTH)
    assert r.status_code == 500 and r.headers.get("X-PTE-API-Server") == "0"
    assert runtime.faults.counts.get("routes") == 1


@pytest.mark.parametrize("field", ["request_id", "session_id"])
@pytest.mark.parametrize("escape", [b"\\ud800", b"x\\udfff", b"\\udc80y"])
def test_a_lone_surrogate_in_a_feedback_id_is_a_400_that_says_so(client, field, escape):
    body = b'{"correct": true, "' + field.encode() + b'": "' + escape + b'"}'
    r = client.post("/pte/feedback", content=body, headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error == f"'{field}' must be valid Unicode (it holds a lone surrogate)", error


def test_the_api_keys_are_read_again_after_a_read_that_failed():
    """Reading vLLM's keys can fail (a fault counted): the next request reads them again, rather
    than the middleware taking the server as keyless from then on and reading the bodies of
    requests vLLM refuses."""
    runtime = Runtime(Settings(session_from_user=True), registry=CollectorRegistry())
    reads: list[int] = []

    def keys_of(app) -> list[str]:
        reads.append(1)
        if len(reads) == 1:
            raise RuntimeError("the app's arguments are not set yet")
        return [KEY]

    async def vllm(scope, receive, send):
        await send({"type": "http.response.start", "status": 401, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    middleware = TaggingMiddleware(vllm, runtime, keys_of=keys_of)
    chunks = [b'{"user": "agent-1", "prompt": "x"}']
    call(middleware, "/v1/completions", [], chunks)
    assert runtime.faults.counts.get("middleware") == 1
    _, _, read = call(middleware, "/v1/completions", [], chunks)
    assert (len(reads), runtime.api_keys, read) == (2, [KEY], 0)


def test_the_middleware_form_reads_no_body_of_a_request_vllms_api_key_check_refuses():
    """``--middleware``: vLLM adds the class after its own ``AuthenticationMiddleware``, so it
    runs first; with no endpoint plugin the runtime never heard of the keys."""
    from argparse import Namespace

    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    from pte_instrument.server.api_server import ApiServer
    from pte_instrument.vllm_adapter.endpoints import SessionMiddleware

    runtime = Runtime(Settings(session_from_user=True), registry=CollectorRegistry())
    assert runtime.api_keys == []
    app = FastAPI()
    app.state.args = Namespace(api_key=[KEY])

    @app.post("/v1/completions")
    async def completions() -> dict:
        return {"ok": True}

    app.add_middleware(AuthenticationMiddleware, tokens=[KEY])  # as vLLM's server does, in its order
    app.add_middleware(SessionMiddleware, server=ApiServer(runtime))
    chunks = [b'{"user": "agent-1", "prompt": "' + b"x" * 16384] + [b"x" * 16384] * 30 + [b'"}']
    status, _, read = call(app, "/v1/completions", [(b"transfer-encoding", b"chunked")], chunks)
    assert (status, read) == (401, 0)
    status, _, read = call(app, "/v1/completions", [(b"authorization", f"Bearer {KEY}".encode())], chunks)
    assert status == 200 and read == len(chunks)  # with the key: read, once, and passed on


def test_a_route_vllms_api_key_does_not_guard_is_tagged_without_the_key():
    """vLLM's ``--api-key`` guards ``/v1`` and a few other prefixes only: it serves SageMaker's
    ``/invocations`` to anyone, so the middleware tags such a request's session without a key
    too (it was left untagged, and counted nowhere)."""
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    runtime = Runtime(Settings(), registry=CollectorRegistry())
    runtime.api_keys = [KEY]
    app = FastAPI()

    @app.post("/invocations")
    async def invocations() -> dict:
        return {"ok": True}

    app.add_middleware(AuthenticationMiddleware, tokens=[KEY])
    app.add_middleware(TaggingMiddleware, runtime=runtime)
    session = [(b"x-session-id", b"agent-1"), (b"x-request-id", b"inv-1")]
    status, _, _ = call(app, "/invocations", session, [b'{"prompt": "x"}'])
    assert status == 200 and runtime.pending.claim("inv-1") == RequestTag("agent-1", "none")
    status, _, _ = call(app, "/v1/completions", [*session[:1], (b"x-request-id", b"v1-1")], [b"{}"])
    assert status == 401 and runtime.pending.claim("v1-1") is None


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("POST", "/pte/summary", "GET"),
        ("DELETE", "/pte/sessions", "GET"),
        ("PUT", "/pte/sessions/a/b", "GET"),
        ("GET", "/pte/feedback", "POST"),
        ("PATCH", "/pte/metrics", "GET"),
    ],
)
def test_a_method_a_pte_route_does_not_take_is_a_405_that_names_the_api_server(client, method, path, allow):
    r = client.request(method, path, headers=AUTH)
    assert r.status_code == 405, r.text
    assert r.headers.get("Allow") == allow and r.headers.get("X-PTE-API-Server") == "0"
    assert r.json() == {"error": f"method '{method}' is not allowed on '{path}'; it takes {allow}"}


@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
def test_a_path_under_pte_that_is_no_route_is_a_404_that_names_the_api_server(client, method):
    r = client.request(method, "/pte/no/such/route", headers=AUTH)
    assert r.status_code == 404 and r.headers.get("X-PTE-API-Server") == "0"
    assert r.json() == {"error": "no pte-instrument route '/pte/no/such/route'"}
