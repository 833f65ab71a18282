"""The prompt digest: what a harness reader recomputes from its log must equal what the server
logged, from the documented canonical text alone."""

from __future__ import annotations

import hashlib
import hmac

from pte_instrument.prompt_digest import chat_digest, completion_digest, request_digests


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_a_chat_digest_is_the_sha256_of_the_documented_compact_json():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Naïve? 2+2"}]
    assert chat_digest(messages) == sha('["chat",[["system","Be brief."],["user","Naïve? 2+2"]]]')


def test_text_parts_are_joined_by_newlines_and_other_parts_and_fields_do_not_count():
    parts = [
        {"type": "text", "text": "a"},
        {"type": "image_url", "image_url": {"url": "http://x"}},
        {"type": "text", "text": "b"},
    ]
    messages = [{"role": "user", "content": parts, "name": "n"}, {"role": "assistant", "content": None}]
    assert chat_digest(messages) == sha('["chat",[["user","a\\nb"],["assistant",""]]]')


def test_a_completion_prompt_is_digested_as_text_or_token_ids():
    assert completion_digest("The sky is") == sha('["completion","The sky is"]')
    assert completion_digest([1, 2, 3]) == sha('["completion",[1,2,3]]')


def test_a_key_makes_it_an_hmac():
    key = b"secret"
    want = hmac.new(key, b'["completion","x"]', hashlib.sha256).hexdigest()
    assert completion_digest("x", key) == want != completion_digest("x")


def test_a_request_body_gives_one_digest_per_prompt_it_asks_for():
    assert request_digests([{"role": "user", "content": "hi"}], None) == (
        chat_digest([{"role": "user", "content": "hi"}]),
    )
    assert request_digests(None, "one") == (completion_digest("one"),)
    assert request_digests(None, ["a", "b"]) == (completion_digest("a"), completion_digest("b"))
    assert request_digests(None, [5, 6]) == (completion_digest([5, 6]),)
    assert request_digests(None, [[5], [6, 7]]) == (completion_digest([5]), completion_digest([6, 7]))
    # what no OpenAI server accepts as a prompt: nothing to digest
    for messages, prompt in ((None, None), ("text", None), (None, []), (None, [1, "a"]), (None, {"a": 1})):
        assert request_digests(messages, prompt) == ()
