"""A client's ``X-Request-Id``, or without one the body's ``request_id`` (vLLM's extension),
of any length: vLLM names its request after the one the middleware passes on, and the
session store keeps that name in its turn rows and feedback window, so an over-long one
goes on as its SHA-256; the session tag still joins vLLM's request, and an id of usual
length goes on as sent."""

from __future__ import annotations

import hashlib
import json
import sqlite3

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from starlette.requests import Request

from pte_instrument.server.middleware import TaggingMiddleware
from pte_instrument.server.records import FinishedRequest, price_request
from pte_instrument.server.request_tags import RequestTag
from pte_instrument.server.runtime import Runtime
from pte_instrument.server.sessions import SessionLedger
from pte_instrument.settings import Settings
from pte_instrument.vllm_adapter.compat import request_keys
from tests.server.test_sessions import COST

LONG = "r" * 16384
# printf %s "$ID" | sha256sum
LONG_DIGEST = "23a92a391c7e2d8244524cee85b0aa559034e7adb2bd7396c99adc5ad0040b90"
JUST_OVER_DIGEST = "0ec9eb33e74510bcdd1f2ea55206e82f21649c5c2becbf2b433eb475b34c01bd"  # 129 × "x"


def vllm_request_id(
    path: str, headers: dict[str, str], session: str | None = None, body: dict | None = None
) -> tuple[str, Runtime]:
    """POST ``path`` through the middleware; the id vLLM gives the request it gets, as its
    ``BaseServing._base_request_id`` reads it (the chat route's ``chatcmpl-<X-Request-Id>``,
    else ``chatcmpl-<the body's request_id>``), and the runtime holding the request's tag."""
    runtime = Runtime(Settings(), registry=CollectorRegistry())
    named: list[str] = []
    vllm = FastAPI()

    @vllm.post("/{route:path}")  # a route the server serves, as vLLM's own are
    async def serve(request: Request) -> dict:
        fields = await request.json()
        named.append(f"chatcmpl-{request.headers.get('X-Request-Id', fields.get('request_id', 'random'))}")
        return {}

    vllm.add_middleware(TaggingMiddleware, runtime=runtime)
    if session is not None:
        headers = {**headers, "X-Session-Id": session}
    TestClient(vllm).post(path, json=body or {}, headers=headers)
    assert runtime.faults.counts.get("middleware", 0) == 0
    return named[0], runtime


@pytest.mark.parametrize(
    ("sent", "passed_on"),
    [
        ("req-42", "req-42"),
        ("x" * 128, "x" * 128),  # the longest passed on as sent
        ("x" * 129, JUST_OVER_DIGEST),
        (LONG, LONG_DIGEST),
    ],
    ids=["usual", "128-bytes", "129-bytes", "16-KiB"],
)
def test_an_over_long_x_request_id_reaches_vllm_and_the_session_store_as_its_digest(
    tmp_path, sent, passed_on
):
    engine_id, runtime = vllm_request_id("/v1/chat/completions", {"X-Request-Id": sent}, session="s")
    tag = runtime.pending.claim(*request_keys(engine_id))  # the join of the tag to vLLM's request
    ledger = SessionLedger(tmp_path / "sessions.sqlite3")
    try:
        request = FinishedRequest(engine_id, "m", 100, 0, 10, "stop", session_id="s", turn=1)
        record = price_request(COST, request, 1000.0)
        ledger.add(record)
        ledger.observe(record.request_id, "s", "m", "none", 10, False)
        assert ledger.flush()
        rows = ledger.get("s")["turn_rows"]
        labeled = ledger.label(True, [engine_id], None)  # by the id vLLM answered with
    finally:
        ledger.close()
    db = sqlite3.connect(tmp_path / "sessions.sqlite3")
    try:
        (row_bytes,) = db.execute("SELECT length(row) FROM turns").fetchone()
        (recent,) = db.execute("SELECT request_id FROM recent").fetchone()
    finally:
        db.close()
    assert row_bytes < 1024  # a turn row of about 0.5 KB, whatever the client sent
    assert engine_id == f"chatcmpl-{passed_on}"
    assert tag == RequestTag("s", "none")
    assert [row["request_id"] for row in rows] == [engine_id] and recent == engine_id
    assert labeled is not None


def test_an_over_long_x_request_id_of_a_request_without_a_session_goes_on_as_its_digest_too():
    """Untagged, its record still reaches the feedback window and the request log under
    vLLM's name for it."""
    engine_id, runtime = vllm_request_id("/v1/chat/completions", {"X-Request-Id": LONG})
    assert engine_id == f"chatcmpl-{LONG_DIGEST}" and len(runtime.pending) == 0
    engine_id, _ = vllm_request_id("/v1/embeddings", {"X-Request-Id": LONG})  # any route of the engine
    assert engine_id == f"chatcmpl-{LONG_DIGEST}"


@pytest.mark.parametrize(
    ("sent", "passed_on"),
    [("req-42", "req-42"), ("x" * 128, "x" * 128), ("x" * 129, JUST_OVER_DIGEST), (LONG, LONG_DIGEST)],
    ids=["usual", "128-bytes", "129-bytes", "16-KiB"],
)
@pytest.mark.parametrize("session", ["s", None], ids=["session", "no-session"])
def test_an_over_long_request_id_in_the_body_goes_on_as_its_digest(sent, passed_on, session):
    """Without an ``X-Request-Id``, vLLM names the request after the body's ``request_id``:
    the same bound, on any route of the engine."""
    for path in ("/v1/chat/completions", "/v1/embeddings"):
        engine_id, runtime = vllm_request_id(path, {}, session=session, body={"request_id": sent})
        assert engine_id == f"chatcmpl-{passed_on}"
        if session is not None and path == "/v1/chat/completions":
            assert runtime.pending.claim(*request_keys(engine_id)) == RequestTag(session, "none")


def test_a_header_names_the_request_whatever_the_body_says():
    """vLLM takes the header before the body: a long body id beside a header changes nothing."""
    engine_id, _ = vllm_request_id(
        "/v1/chat/completions", {"X-Request-Id": "req-7"}, body={"request_id": LONG}
    )
    assert engine_id == "chatcmpl-req-7"


def post_raw(body: bytes) -> tuple[Runtime, list[tuple[bytes, str | None]]]:
    """POST ``body`` as it is to the chat route through the middleware; what vLLM got (the
    body, the X-Request-Id)."""
    runtime = Runtime(Settings(), registry=CollectorRegistry())
    got: list[tuple[bytes, str | None]] = []

    async def vllm(scope, receive, send):
        request = Request(scope, receive)
        got.append((await request.body(), request.headers.get("X-Request-Id")))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    TestClient(TaggingMiddleware(vllm, runtime)).post("/v1/chat/completions", content=body)
    return runtime, got


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[1, 2]", b'{"request_id": 42}', b'{"request_id": null}', b""],
    ids=["not-json", "not-an-object", "a-number", "null", "empty"],
)
def test_bodies_without_a_readable_request_id_reach_vllm_as_sent(body):
    """vLLM answers what it cannot parse; the middleware passes every byte on and counts no
    fault of its own."""
    runtime, got = post_raw(body)
    assert got == [(body, None)]
    assert runtime.faults.counts.get("middleware", 0) == 0


def test_a_request_id_spelled_with_json_escapes_is_bounded_as_vllm_reads_it():
    body = b'{"\\u0072equest_id": "\\u00e9' + b"e" * 200 + b'"}'
    _, got = post_raw(body)
    assert got == [(body, hashlib.sha256(("\u00e9" + "e" * 200).encode()).hexdigest())]


def _digest(request_id: str) -> str:
    return hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()


@pytest.mark.parametrize(
    ("body", "request_id"),
    [
        (b'\xef\xbb\xbf{"request_id": "' + LONG.encode() + b'"}', LONG),
        (f'{{"request_id": "{LONG}"}}'.encode("utf-16"), LONG),
        (f'{{"request_id": "{LONG}"}}'.encode("utf-32-le"), LONG),
        (b'{"request_id": "' + LONG.encode() + b'", "temperature": NaN}', LONG),
        (b'{"request_id": "' + LONG.encode() + b'", "top_p": Infinity}', LONG),
        (
            b'{"messages": [{"role": "user", "content": "\\ud800"}], "request_id": "' + LONG.encode() + b'"}',
            LONG,
        ),
        (b'{"request_id": "' + LONG.encode() + b'\\udc80"}', LONG + "\udc80"),
        (b'{"request_id": "\\ud800"}', "\ud800"),
        (b'{"request_id": "r-\\udc80-7"}', "r-\udc80-7"),
    ],
    ids=[
        "utf-8-bom",
        "utf-16",
        "utf-32",
        "nan",
        "infinity",
        "lone-surrogate-elsewhere",
        "lone-surrogate-in-it",
        "short-lone-surrogate",
        "short-with-a-lone-surrogate",
    ],
)
def test_a_long_request_id_in_a_body_only_pythons_json_reads_is_bounded_too(body, request_id):
    """vLLM reads a body with Python's ``json`` (FastAPI's ``request.json()``), which takes a
    byte-order mark, UTF-16 and -32, ``NaN`` and lone surrogates; the middleware's fast
    decoder refuses them all, so the long id reached vLLM as sent. An id of any length with
    a lone surrogate goes on as its digest too: no store, log or exporter could write it."""
    assert json.loads(body)["request_id"] == request_id  # what vLLM names the request after
    runtime, got = post_raw(body)
    assert got == [(body, _digest(request_id))]
    assert runtime.faults.counts.get("middleware", 0) == 0
