"""PendingTags.claim: the spellings of an engine request's id, tried in order, and no tag
past its grace or its age; which drops are counted; reading a caller's ``traceparent``."""

import pytest

from pte_instrument.server.request_tags import PendingTags, RequestTag, parse_traceparent
from tests.server.test_sessions import Clock


def test_claim_tries_each_spelling_and_leaves_the_tag():
    p = PendingTags(capacity=2)
    p.put("abc", RequestTag("s1", "gsm8k"))
    p.put("chatcmpl-xyz", RequestTag("s2", "none"))
    assert p.claim("chatcmpl-abc", "abc") == RequestTag("s1", "gsm8k")  # the second spelling
    assert p.claim("chatcmpl-xyz", "xyz") == RequestTag("s2", "none")  # the first present wins
    assert p.claim("chatcmpl-abc") is None and p.claim() is None  # no spelling present
    assert p.claim("abc") == RequestTag("s1", "gsm8k")  # another engine request of the same HTTP one
    assert len(p) == 2 and p.dropped == 0


def test_two_open_exchanges_under_one_id_with_different_tags_tag_neither_request():
    """Two clients send one X-Request-Id at once, each for its own session: which engine
    request is whose cannot be told, so neither is given a session (not both the later
    one's); the tags count as dropped. Once both ended, the id can be used again."""
    clock = Clock()
    p = PendingTags(clock=clock)
    p.put("job", RequestTag("alice", "none"))
    p.put("job", RequestTag("bob", "none"))
    assert p.claim("job") is None
    p.settle("job")
    p.settle("job")
    clock.t += p.grace_s + 0.1
    assert len(p) == 0 and p.dropped == 1
    p.put("job", RequestTag("alice", "none", traceparent=None))
    later = RequestTag("alice", "none", traceparent=f"00-{TRACE}-{PARENT}-01")
    p.put("job", later)  # the same session's two requests at once, traced apart: still its own
    assert p.claim("job") == later


def test_claim_finds_no_tag_past_its_grace():
    clock = Clock()
    p = PendingTags(clock=clock)
    p.put("abc", RequestTag("s1", "none"))
    p.settle("abc")
    clock.t += p.grace_s + 0.1
    assert p.claim("abc") is None  # gone, though nothing else swept since
    assert len(p) == 0 and p.dropped == 1  # unclaimed: a drop


def test_claim_finds_no_tag_past_its_age():
    clock = Clock()
    p = PendingTags(clock=clock, max_age_s=100.0)
    p.put("abc", RequestTag("s1", "none"))  # an exchange that never ends
    clock.t += 101
    assert p.claim("abc") is None
    assert len(p) == 0 and p.dropped == 1


def test_only_tags_with_a_session_or_a_benchmark_count_as_dropped():
    clock = Clock()
    p = PendingTags(capacity=2, clock=clock)
    p.put("route-only", RequestTag(None, "none", operation="chat", traceparent=None))  # OpenTelemetry's alone
    p.put("session", RequestTag("s", "none", operation="chat"))
    p.put("benchmark", RequestTag(None, "gsm8k"))  # past the capacity: "route-only" goes, uncounted
    assert len(p) == 2 and p.dropped == 0
    p.settle("session")
    p.settle("benchmark")
    clock.t += p.grace_s + 0.1
    assert len(p) == 0 and p.dropped == 2


TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.mark.parametrize(
    ("raw", "parsed"),
    [
        (f"00-{TRACE}-{PARENT}-01", f"00-{TRACE}-{PARENT}-01"),
        (f"00-{TRACE}-{PARENT}-00".encode(), f"00-{TRACE}-{PARENT}-00"),  # not sampled: kept as sent
        (f"  00-{TRACE}-{PARENT}-01  ", f"00-{TRACE}-{PARENT}-01"),
        (f"cc-{TRACE}-{PARENT}-01-future-fields", f"00-{TRACE}-{PARENT}-01"),  # a later version, read as 00
        (f"00-{TRACE}-{PARENT}-01-extra", None),  # version 00 has exactly four fields
        (f"ff-{TRACE}-{PARENT}-01", None),  # version ff is invalid
        (f"00-{'0' * 32}-{PARENT}-01", None),  # all-zero trace id
        (f"00-{TRACE}-{'0' * 16}-01", None),  # all-zero parent id
        (f"00-{TRACE.upper()}-{PARENT}-01", None),  # lowercase hex only
        (f"00-{TRACE[:-1]}-{PARENT}-01", None),
        ("", None),
        ("not a traceparent", None),
        (f"cc-{TRACE}-{PARENT}-01-" + "x" * 10_000, None),  # bounded, whatever clients send
    ],
)
def test_parse_traceparent(raw, parsed):
    assert parse_traceparent(raw) == parsed
