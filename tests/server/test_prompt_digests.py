"""The request log's ``prompt_digest``: taken from the body by the middleware, one per prompt,
given to the request that served that prompt; not taken when off or without a request log."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from prometheus_client import CollectorRegistry

from pte_instrument.prompt_digest import chat_digest, completion_digest
from pte_instrument.server.records import FinishedRequest
from pte_instrument.server.request_tags import PendingTags
from pte_instrument.server.runtime import Runtime
from pte_instrument.settings import Settings
from pte_instrument.vllm_adapter.compat import prompt_index
from tests.server.test_lora import post_all
from tests.server.test_sessions import Clock


@pytest.fixture
def make_runtime(tmp_path):
    made: list[Runtime] = []

    def make(**settings) -> Runtime:
        settings.setdefault("request_log", str(tmp_path / "requests.jsonl"))
        rt = Runtime(Settings(session_store=None, **settings), registry=CollectorRegistry())
        rt.pending = PendingTags(clock=Clock())
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.sessions.close()


def finished(request_id: str) -> FinishedRequest:
    return FinishedRequest(request_id, "m", 8, 0, 2, "length", prompt_index=prompt_index(request_id))


def tag_of(rt: Runtime, request_id: str, key: str) -> FinishedRequest:
    return rt.tagged(finished(request_id), rt.pending.claim(key))


def test_each_prompt_of_a_completions_request_gets_its_own_digest_and_a_chat_request_its_messages(
    make_runtime,
):
    rt = make_runtime()
    messages = [{"role": "user", "content": "Say a letter:"}]
    bodies = [
        json.dumps({"prompt": ["first", "second"], "model": "m"}).encode(),
        json.dumps({"messages": messages, "model": "m"}).encode(),
        json.dumps({"prompt": [1, 2, 3], "model": "m"}).encode(),
    ]
    assert asyncio.run(post_all(rt, bodies)) == bodies  # the body reaches vLLM whole
    tag = rt.pending.claim("r0")
    assert tag is not None
    first = rt.tagged(finished("cmpl-r0-0"), tag)
    second = rt.tagged(finished("cmpl-r0-1"), tag)
    assert (first.prompt_digest, second.prompt_digest) == (
        completion_digest("first"),
        completion_digest("second"),
    )
    assert tag_of(rt, "chatcmpl-r1", "r1").prompt_digest == chat_digest(messages)
    assert tag_of(rt, "cmpl-r2-0", "r2").prompt_digest == completion_digest([1, 2, 3])


def test_a_key_turns_the_digest_into_an_hmac(make_runtime):
    rt = make_runtime(prompt_digest_key="k")
    asyncio.run(post_all(rt, [b'{"prompt": "x"}']))
    assert (
        tag_of(rt, "cmpl-r0-0", "r0").prompt_digest == completion_digest("x", b"k") != completion_digest("x")
    )


def test_a_key_the_environment_holds_as_bytes_that_are_not_utf8_is_used_as_those_bytes(make_runtime):
    key = os.fsdecode(b"k\xff")  # how Python reads such a variable
    rt = make_runtime(prompt_digest_key=key)
    asyncio.run(post_all(rt, [b'{"prompt": "x"}']))
    assert tag_of(rt, "cmpl-r0-0", "r0").prompt_digest == completion_digest("x", b"k\xff")


@pytest.mark.parametrize("settings", [{"prompt_digest": False}, {"request_log": None}])
def test_no_digest_when_off_or_without_a_request_log(make_runtime, settings):
    rt = make_runtime(**settings)
    asyncio.run(post_all(rt, [b'{"prompt": "x"}']))
    assert rt.pending.claim("r0") is None  # nothing else to tag: the request went through untouched


def test_the_prompt_index_is_read_only_from_a_completions_id():
    assert [
        prompt_index(i) for i in ("cmpl-abc-0", "cmpl-a-b-12", "chatcmpl-abc-1", "cmpl-abc", "cmpl--3")
    ] == [
        0,
        12,
        None,
        None,
        None,
    ]
