"""PendingTags.claim: the spellings of an engine request's id, tried in order, and no tag
past its grace or its age."""

from pte_instrument.server.request_tags import PendingTags, RequestTag
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
