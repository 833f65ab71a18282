"""The /pte/* routes and the session middleware against hostile clients, on a real vLLM
server: bounded bodies, 400 (never 500) for malformed input, short error messages, session
ids with '/', and no session tag left behind by requests the engine never ran."""

from __future__ import annotations

import hashlib
import random
import socket
import time
from urllib.parse import quote, urlsplit

import httpx

from tests.conftest import API_KEY

MAX_BODY = 64 * 1024


def log_offset(server) -> int:
    return server.vllm.log_path.stat().st_size


def log_since(server, offset: int) -> str:
    with server.vllm.log_path.open("rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", "replace")


def raw_post(server, path: str, head: dict[str, str], chunks: list[bytes], timeout_s: float = 10.0):
    """POST over a bare socket (a body larger than what is sent, or chunked); returns the
    status and how long the answer took. The server may answer and close before the body
    is all sent."""
    url = urlsplit(server.url)
    start = time.monotonic()
    with socket.create_connection((url.hostname, url.port), timeout=timeout_s) as s:
        lines = [f"POST {path} HTTP/1.1", f"Host: {url.netloc}", *(f"{k}: {v}" for k, v in head.items())]
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        try:
            for chunk in chunks:
                s.sendall(chunk)
        except OSError:  # answered and closed early: what a bounded reader does
            pass
        answer = b""
        while b"\r\n" not in answer:
            data = s.recv(4096)
            if not data:
                break
            answer += data
    return int(answer.split(b" ", 2)[1]), time.monotonic() - start


def nested(depth: int) -> bytes:
    return b'{"correct": true, "request_id": ' + b"[" * depth + b"]" * depth + b"}"


def test_feedback_refuses_hostile_bodies_with_4xx_and_no_traceback(server):
    offset = log_offset(server)
    c = server.client
    bare = httpx.Client(base_url=server.url, timeout=30)
    # the key comes first: no body is parsed, however it is built
    assert bare.post("/pte/feedback", content=nested(20_000)).status_code == 401
    status, took = raw_post(server, "/pte/feedback", {"Content-Length": str(100 * 2**20)}, [b"[" * MAX_BODY])
    assert status == 401 and took < 5, (status, took)
    # with the key: nesting, size and types are client errors
    for depth in (2_000, 20_000):
        r = c.post("/pte/feedback", content=nested(depth))
        assert r.status_code == 400 and "nested" in r.json()["error"], r.text[:200]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    status, took = raw_post(
        server, "/pte/feedback", {**auth, "Content-Length": str(100 * 2**20)}, [b"x" * MAX_BODY]
    )
    assert status == 413 and took < 5, (status, took)
    chunk = b"4000\r\n" + b"x" * 0x4000 + b"\r\n"
    status, _ = raw_post(server, "/pte/feedback", {**auth, "Transfer-Encoding": "chunked"}, [chunk] * 64)
    assert status == 413
    for bad in (
        b"{not json",
        b"\xff\xfe",
        b"[1]",
        b"null",
        b'{"correct": "yes", "request_id": "r"}',
        b'{"correct": true, "request_id": ["r"]}',
        b'{"correct": true, "session_id": {}}',
    ):
        r = c.post("/pte/feedback", content=bad)
        assert r.status_code == 400 and "error" in r.json(), (bad, r.status_code)
    # ids are echoed cut short
    r = c.post("/pte/feedback", json={"request_id": "x" * 60_000, "correct": True})
    assert r.status_code == 404 and len(r.content) < 400, len(r.content)
    r = c.get("/pte/sessions", params={"sort": "s" * 8_000})
    assert r.status_code == 400 and len(r.content) < 400, len(r.content)
    time.sleep(0.5)  # let the log catch up
    text = log_since(server, offset)
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-3000:]


def wait_for_session(server, path: str, timeout_s: float = 20.0) -> httpx.Response:
    """The stat logger records a request just after its response: poll briefly."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = server.client.get(path)
        if r.status_code != 404 or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def test_session_ids_with_slashes_are_reachable(server):
    sid = f"team/agent-{random.getrandbits(32):x}/run"
    body = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert (
        server.client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": sid}).status_code
        == 200
    )
    for path in (quote(sid, safe="/"), quote(sid, safe="")):  # '/' as-is and as %2F
        r = wait_for_session(server, f"/pte/sessions/{path}")
        assert r.status_code == 200, (path, r.status_code, r.text)
        assert r.json()["session_id"] == sid and r.json()["turns"] == 1
    listed = server.client.get("/pte/sessions", params={"limit": 1000}).json()["sessions"]
    assert sid in {s["session_id"] for s in listed}


def test_an_over_long_request_id_in_the_body_is_named_by_its_digest_everywhere(server):
    """Without an X-Request-Id, vLLM names a request after the body's ``request_id``, of any
    length: one of 16 KiB goes on as its SHA-256, in the response, the request log and the
    session's turn rows, as a long header does."""
    long = f"body-id-{random.getrandbits(32):x}-" + "b" * 16384
    name = f"chatcmpl-{hashlib.sha256(long.encode()).hexdigest()}"
    sid = f"long-body-id-{random.getrandbits(32):x}"
    answer = server.chat("hi", 3, headers={"X-Session-Id": sid}, request_id=long)
    assert answer["id"] == name
    assert [r["request_id"] for r in server.log_records({name})[name]] == [name]
    session = wait_for_session(server, f"/pte/sessions/{sid}").json()
    assert [t["request_id"] for t in session["turn_rows"]] == [name]


def pending(server) -> tuple[int, int]:
    s = server.client.get("/pte/summary").json()["sessions"]
    return s["pending_requests"], s["pending_dropped"]


def test_requests_vllm_rejects_leave_no_session_tag(server):
    _, dropped_before = pending(server)
    bare = httpx.Client(base_url=server.url, timeout=30)
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for i in range(50):
        stream = {"stream": True} if i % 5 == 0 else {}
        r = server.client.post(
            "/v1/chat/completions", json={**body, **stream}, headers={"X-Session-Id": f"bad-{i}"}
        )
        assert r.status_code == 404, r.text
    for i in range(10):  # no key: vLLM answers 401
        r = bare.post(
            "/v1/completions",
            json={"model": server.model, "prompt": "x"},
            headers={"X-Session-Id": f"nokey-{i}"},
        )
        assert r.status_code == 401
    deadline = time.monotonic() + 15
    while (now := pending(server))[0] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert now[0] == 0, now
    # the 50 were tagged, and dropped; the 10 only if the plugin's middleware saw them
    # before vLLM's key check
    assert 50 <= now[1] - dropped_before <= 60, now


def test_a_wrong_method_or_path_under_pte_is_answered_by_the_plugin_with_its_header(server):
    """vLLM's app answers what no route of it takes with its own 404/405; under /pte the
    plugin answers, naming its API server like every other /pte answer."""
    c = server.client
    r = c.post("/pte/summary")
    assert r.status_code == 405 and r.headers["Allow"] == "GET" and r.headers["X-PTE-API-Server"] == "0"
    r = c.get("/pte/" + "x" * 5000)
    assert r.status_code == 404 and r.headers["X-PTE-API-Server"] == "0" and len(r.content) < 400
    assert c.get("/v1/no-such-route").status_code == 404  # vLLM's own paths are still vLLM's
    assert c.get("/pte/summary").status_code == 200
