"""Requests of the routes that name them their own way (the Responses API, the chat batch
API), joined to their tags and engine totals by hand: one record each, under vLLM's name."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from pte_instrument.server.engine_join import ORPHAN_AFTER_S
from pte_instrument.server.middleware import TaggingMiddleware
from pte_instrument.server.records import FinishedRequest
from pte_instrument.server.request_tags import PendingTags, RequestTag
from pte_instrument.server.runtime import Runtime
from pte_instrument.settings import Settings
from pte_instrument.vllm_adapter.compat import external_request_id, request_keys
from tests.server.builders import finished_request
from tests.server.test_engine_join import make_join, totals


def test_a_responses_api_request_is_known_by_its_body_request_id():
    # vLLM names the engine requests of one response <request_id>_<n>
    assert request_keys("resp_4f2a_0")[:2] == ("resp_4f2a_0", "resp_4f2a")
    assert "my-id" in request_keys("my-id_1")


def test_a_completions_request_is_not_known_by_its_id_with_the_prompt_index():
    """vLLM names a completions request ``cmpl-<X-Request-Id>-<prompt index>``: ``job-0`` is no
    spelling of ``cmpl-job-0`` (another client's ``job-0`` would take its tag)."""
    assert request_keys("cmpl-job-0") == ("cmpl-job-0", "job")
    assert request_keys("cmpl-job-0-3") == ("cmpl-job-0-3", "job-0")
    assert request_keys("chatcmpl-job-0")[:2] == ("chatcmpl-job-0", "job-0")  # the chat route: as sent


def test_a_chat_batch_conversation_is_known_by_the_x_request_id():
    assert request_keys("chatcmpl-r9_1") == ("chatcmpl-r9_1", "r9_1", "chatcmpl-r9", "r9")


def test_an_id_that_reads_like_a_child_is_also_known_by_the_engine_hooks_reading():
    # the engine hook reads <index>_<parent> as a parallel-sampling child, whatever named it
    assert external_request_id("7_ab_0-0123abcd") == ("ab_0", 7)
    assert request_keys("7_ab_0") == ("7_ab_0", "7_ab", "ab_0")


def test_a_response_whose_id_reads_like_a_child_is_priced_once_under_its_own_id():
    inbox, join, priced, faults = make_join()
    # the hook's totals: the id "7_ab_0" read as child 7 of "ab_0"
    inbox.on_messages([totals("ab_0", 3, child=7)])
    now = time.monotonic()
    join.finished(finished_request("7_ab_0", 3), now)  # vLLM's stat logger: its own id
    priced.extend(join.ready(now))
    assert [(r.request_id, r.child_index, r.engine_totals is not None) for r in priced] == [
        ("7_ab_0", None, True)
    ]
    priced.extend(join.ready(now + ORPHAN_AFTER_S + 1))  # nothing left to price a second time
    assert len(priced) == 1 and len(inbox) == 0 and faults.counts["engine_join"] == 0


def test_an_aborted_response_whose_id_reads_like_a_child_keeps_its_session():
    pending = PendingTags()
    pending.put("7_ab", RequestTag("s1", "none"))
    inbox, join, priced, _ = make_join()
    join.tag = lambda r: r if (t := pending.claim(*request_keys(r.request_id))) is None else _in(r, t)
    inbox.on_messages([totals("ab_0", 2, child=7, reason="abort", arrival_time=50.0, finished_at=50.5)])
    priced.extend(join.ready(time.monotonic() + 1))
    assert [(r.request_id, r.session_id) for r in priced] == [("7_ab_0", "s1")]


def test_an_aborted_parallel_sampling_child_keeps_its_session():
    pending = PendingTags()
    pending.put("x", RequestTag("s1", "none"))  # the X-Request-Id of the parent
    inbox, join, priced, _ = make_join()
    join.tag = lambda r: r if (t := pending.claim(*request_keys(r.request_id))) is None else _in(r, t)
    inbox.on_messages([totals("cmpl-x-0", 2, child=1, reason="abort", arrival_time=50.0, finished_at=50.5)])
    priced.extend(join.ready(time.monotonic() + 1))
    assert [(r.request_id, r.child_index, r.session_id) for r in priced] == [("1_cmpl-x-0", 1, "s1")]


def _in(request: FinishedRequest, tag: RequestTag) -> FinishedRequest:
    return replace(request, session_id=tag.session_id)


def body_seen(
    runtime: Runtime, path: str, body: bytes, headers: dict[str, str], status: int = 200
) -> tuple[bytes, dict[str, str]]:
    """What the app behind the middleware (answering ``status``) receives: the body and the
    headers."""
    seen: dict[str, Any] = {}

    async def app(scope, receive, send):
        data = b""
        while True:
            message = await receive()
            data += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen["body"], seen["headers"] = data, {k.decode(): v.decode() for k, v in scope["headers"]}
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    TestClient(TaggingMiddleware(app, runtime)).post(path, content=body, headers=headers)
    return seen["body"], seen["headers"]


def test_a_responses_api_request_without_a_request_id_gets_one_written_into_its_body():
    runtime = Runtime(Settings(), registry=CollectorRegistry())
    sent = b' { "model": "m", "input": "hi" }'
    body, headers = body_seen(
        runtime, "/v1/responses", sent, {"X-Session-Id": "s1", "X-Request-Id": "ignored"}
    )
    name = json.loads(body)["request_id"]
    assert name.startswith("resp_") and len(name) == 5 + 32
    assert json.loads(body) == {"request_id": name, "model": "m", "input": "hi"}
    assert headers["content-length"] == str(len(body))
    assert runtime.pending.claim(*request_keys(f"{name}_0")) == RequestTag("s1", "none")
    assert runtime.pending.claim("ignored") is None  # vLLM reads no X-Request-Id there


def test_a_responses_api_request_id_past_the_bound_goes_on_as_its_digest():
    """vLLM names a response after its body's request_id alone, and the request log, the
    session store and the feedback window keep that name: a client's id of any length would
    be kept whole, so it is replaced by its digest, as an over-long X-Request-Id is."""
    runtime = Runtime(Settings(), registry=CollectorRegistry())
    long_id = "x" * 100_000
    sent = json.dumps({"request_id": long_id, "input": "hi"}).encode()
    body, headers = body_seen(runtime, "/v1/responses", sent, {"X-Session-Id": "s1"})
    digest = hashlib.sha256(long_id.encode()).hexdigest()
    assert json.loads(body) == {"request_id": digest, "input": "hi"}  # the last member counts
    assert headers["content-length"] == str(len(body))
    assert runtime.pending.claim(*request_keys(f"{digest}_0")) == RequestTag("s1", "none")


@pytest.mark.parametrize(
    ("sent", "key"),
    [
        (b'{"request_id": "mine-1", "input": "hi"}', "mine-1"),  # the client's, as sent
        (b"{}", None),  # an empty object: one written in
        (b"[1, 2]", False),  # no object: vLLM answers it
    ],
)
def test_a_responses_api_body_is_passed_on_whole_and_tagged_under_vllms_name(sent, key):
    runtime = Runtime(Settings(), registry=CollectorRegistry())
    body, _ = body_seen(runtime, "/v1/responses", sent, {"X-Session-Id": "s1"})
    if key is None:
        key = json.loads(body)["request_id"]
        assert json.loads(body) == {"request_id": key}
    else:
        assert body == sent
    found = runtime.pending.claim(f"{key}") if key else None
    assert (found is not None) == bool(key) and len(runtime.pending) == int(bool(key))


def test_an_anthropic_messages_request_is_named_after_its_header_alone():
    runtime = Runtime(Settings(), registry=CollectorRegistry())
    sent = b'{"request_id": "body-id", "messages": []}'  # vLLM's Messages API has no such field
    body, headers = body_seen(runtime, "/v1/messages", sent, {"X-Session-Id": "s1"})
    assert body == sent and headers["x-request-id"] != "body-id"
    assert runtime.pending.claim(*request_keys(f"chatcmpl-{headers['x-request-id']}")) == RequestTag(
        "s1", "none"
    )


@pytest.mark.parametrize(
    ("background", "status", "kept"), [(True, 200, True), (False, 200, False), (True, 400, False)]
)
def test_a_background_response_keeps_its_tag_while_the_engine_may_still_run_it(background, status, kept):
    """A background response is answered at once and generated afterwards, for as long as it
    takes: its tag must outlive the grace that follows an answered request (one refused goes
    with the grace, counted)."""
    clock = [0.0]
    runtime = Runtime(Settings(), registry=CollectorRegistry())
    runtime.pending = PendingTags(clock=lambda: clock[0])
    sent = json.dumps({"request_id": "resp_bg", "input": "hi", "background": background}).encode()
    body_seen(runtime, "/v1/responses", sent, {"X-Session-Id": "s1"}, status)
    clock[0] += 10 * runtime.pending.grace_s
    assert runtime.pending.dropped == int(not kept)
    found = runtime.pending.claim(*request_keys("resp_bg_0"))
    assert found == (RequestTag("s1", "none") if kept else None)
    clock[0] += runtime.pending.max_age_s  # bounded all the same
    assert len(runtime.pending) == 0


@pytest.mark.parametrize(
    ("flag", "kept"), [(1, True), ("true", True), ("On", True), (0, False), ("no", False)]
)
def test_a_background_flag_is_read_as_vllm_reads_it(flag, kept):
    """vLLM's request model reads a boolean leniently (1, "true", "on"…): so must the tag."""
    clock = [0.0]
    runtime = Runtime(Settings(), registry=CollectorRegistry())
    runtime.pending = PendingTags(clock=lambda: clock[0])
    sent = json.dumps({"request_id": "resp_bg", "input": "hi", "background": flag}).encode()
    body_seen(runtime, "/v1/responses", sent, {"X-Session-Id": "s1"})
    clock[0] += 10 * runtime.pending.grace_s
    assert (runtime.pending.claim("resp_bg") is not None) == kept
