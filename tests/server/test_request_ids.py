"""A client's ``X-Request-Id``, of any length: vLLM names its request after the one the
middleware passes on, and the session store keeps that name in its turn rows and feedback
window, so an over-long one goes on as its SHA-256; the session tag still joins vLLM's
request, and an id of usual length goes on as sent."""

from __future__ import annotations

import sqlite3

import pytest
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


def vllm_request_id(path: str, headers: dict[str, str], session: str | None = None) -> tuple[str, Runtime]:
    """POST ``path`` through the middleware; the id vLLM gives the request it gets, as its
    ``BaseServing._base_request_id`` reads it (the chat route's ``chatcmpl-<X-Request-Id>``),
    and the runtime holding the request's tag."""
    runtime = Runtime(Settings(), registry=CollectorRegistry())
    named: list[str] = []

    async def vllm(scope, receive, send):
        named.append(f"chatcmpl-{Request(scope).headers.get('X-Request-Id')}")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    if session is not None:
        headers = {**headers, "X-Session-Id": session}
    TestClient(TaggingMiddleware(vllm, runtime)).post(path, json={}, headers=headers)
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
