"""The session ledger and session-id handling: bounded, ordered, nothing lost silently."""

import tracemalloc
from dataclasses import replace

import pytest

from pte_instrument.cost.architecture import load_config, parse_shape
from pte_instrument.cost.devices import PROFILES
from pte_instrument.cost.model import CostModel
from pte_instrument.server.ledger import FinishedRequest, price_request
from pte_instrument.server.live_efficiency import LiveEfficiency
from pte_instrument.server.request_tags import PendingTags, RequestTag, validate_session_id
from pte_instrument.server.sessions import SessionLedger
from tests.cost.test_architecture import FIX

COST = CostModel(parse_shape(load_config(FIX / "dense_mha.json")), PROFILES["h200"])


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def turn(
    ledger: SessionLedger,
    sid: str,
    prompt: int,
    output: int,
    cached: int,
    finished_at: float,
    e2e: float = 1.0,
):
    ctx = ledger.context_for(sid, finished_at - e2e, prompt)
    req = FinishedRequest(f"{sid}-{ctx.turn}", "m", prompt, cached, output, "stop", session_id=sid, turn=ctx.turn,
                          reusable_tokens=ctx.reusable_tokens, pause_s=ctx.pause_s, e2e_s=e2e)  # fmt: skip
    record = price_request(COST, req, finished_at)
    ledger.add(record)
    return record


def test_turns_reuse_and_pause():
    clock = Clock()
    ledger = SessionLedger(block_size=16, clock=clock)
    r1 = turn(ledger, "s", prompt=100, output=11, cached=0, finished_at=1000.0)
    # turn 2 arrives 5 s after turn 1 ended (finished 1007, took 2 s)
    r2 = turn(ledger, "s", prompt=180, output=5, cached=96, finished_at=1007.0, e2e=2.0)
    assert (r1.turn, r2.turn) == (1, 2)
    assert r1.pause_s is None and r2.pause_s == pytest.approx(5.0)
    # turn 1 computed 100 + 10 = 110 tokens → 96 in whole 16-token blocks; all cached
    assert r2.pte_eviction_tax == 0 and r2.pte_ideal == pytest.approx(180 - 96 + r2.pte_decode)
    s = ledger.get("s")
    assert s["turns"] == 2 and [t["turn"] for t in s["turn_rows"]] == [1, 2]
    assert s["pte_served"] == pytest.approx(r1.pte_served + r2.pte_served)
    assert s["pause_s"] == pytest.approx(5.0)


def test_max_turns_keeps_totals():
    ledger = SessionLedger(max_turns=3)
    records = [turn(ledger, "s", 10 * (i + 1), 2, 0, 1000.0 + i) for i in range(5)]
    s = ledger.get("s")
    assert [t["turn"] for t in s["turn_rows"]] == [3, 4, 5]
    assert s["turns"] == 5 and s["turns_dropped"] == 2 and ledger.stats.turns_dropped == 2
    assert s["pte_served"] == pytest.approx(sum(r.pte_served for r in records))


def test_cap_and_ttl_close_sessions_with_a_reason():
    clock = Clock()
    closed = []
    ledger = SessionLedger(
        max_sessions=2, idle_ttl_s=60, clock=clock, on_close=lambda s, why: closed.append((s.session_id, why))
    )
    for sid in ("a", "b", "c"):
        turn(ledger, sid, 10, 1, 0, clock.t)
    assert closed == [("a", "evicted")] and len(ledger) == 2
    clock.t += 30
    turn(ledger, "b", 20, 1, 0, clock.t)  # b active again
    clock.t += 45  # c idle 75 s, b 45 s
    assert ledger.expire() == 1
    assert closed[-1] == ("c", "idle") and ledger.get("b") is not None
    assert (ledger.stats.sessions_opened, ledger.stats.sessions_evicted, ledger.stats.sessions_expired) == (
        3,
        1,
        1,
    )


def test_top_sessions_sorted_and_paginated():
    ledger = SessionLedger()
    for sid, prompt in (("small", 10), ("big", 1000), ("mid", 100)):
        turn(ledger, sid, prompt, 1, 0, 1000.0)
    total, rows = ledger.top(limit=2)
    assert total == 3 and [r["session_id"] for r in rows] == ["big", "mid"]
    assert [r["session_id"] for r in ledger.top(limit=2, offset=2)[1]] == ["small"]


def test_hundred_thousand_session_ids_stay_bounded():
    cap = 1000
    ledger = SessionLedger(max_sessions=cap, max_turns=4)
    pending = PendingTags(capacity=cap)
    recent = LiveEfficiency(window=cap)  # the feedback window: the other per-request store
    tracemalloc.start()
    for i in range(cap):
        turn(ledger, f"warm-{i}", 50, 2, 0, 1000.0)
        recent.observe(f"warm-req-{i}", f"warm-{i}", "m", "none", 2, "stop")
    base, _ = tracemalloc.get_traced_memory()
    template = turn(ledger, "template", 50, 2, 0, 1000.0)
    for i in range(100_000):
        pending.put(f"req-{i}", RequestTag(f"sid-{i}", "none"))
        ledger.add(replace(template, session_id=f"sid-{i}"))
        recent.observe(f"req-{i}", f"sid-{i}", "m", "none", 2, "stop")
    now, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(ledger) == cap and len(pending) == cap
    assert ledger.stats.sessions_evicted == 101_001 - cap and pending.dropped == 100_000 - cap
    assert (now - base) / 2**20 < 2, f"grew {(now - base) / 2**20:.2f} MiB"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("agent-7", ("agent-7", None)),
        (b"agent-7", ("agent-7", None)),
        ("", (None, "empty")),
        ("   ", (None, "empty")),
        ("x" * 129, (None, "too_long")),
        ("x" * 128, ("x" * 128, None)),
        ("café", (None, "invalid_chars")),
        (b"\xff\xfe", (None, "invalid_chars")),
        ("a b", (None, "invalid_chars")),
    ],
)
def test_validate_session_id(raw, expected):
    assert validate_session_id(raw) == expected


def test_pending_tags_pop_tries_each_spelling():
    p = PendingTags(capacity=2)
    p.put("abc", RequestTag("s1", "gsm8k"))
    assert p.pop("chatcmpl-abc", "abc") == RequestTag("s1", "gsm8k")
    assert p.pop("abc") is None


def test_ledger_metrics_publish_state_and_count_drops_once():
    from prometheus_client import CollectorRegistry

    from pte_instrument.server.exporters.prometheus import LedgerMetrics, PteMetrics

    registry = CollectorRegistry()
    ledger, pending = SessionLedger(max_sessions=2, max_turns=1), PendingTags(capacity=1)
    published = LedgerMetrics(PteMetrics(registry), ledger, pending)

    def value(name: str) -> float:
        return registry.get_sample_value(name)

    for sid in ("a", "b", "c"):  # "a" evicted by the cap of 2
        turn(ledger, sid, 10, 1, 0, 1000.0)
    turn(ledger, "c", 20, 1, 0, 1001.0)  # c's first row dropped by max_turns=1
    pending.put("x", RequestTag("s1", "none"))
    pending.put("y", RequestTag("s2", "none"))  # "x" dropped by the capacity of 1
    published.sync()
    published.sync()  # a second sync with nothing new adds nothing
    assert value("pte_sessions_live") == 2
    assert value("pte_sessions_opened_total") == 3
    assert value("pte_session_turn_rows_dropped_total") == 1
    assert value("pte_session_tags_dropped_total") == 1
    turn(ledger, "d", 10, 1, 0, 1002.0)
    published.sync()
    assert (value("pte_sessions_live"), value("pte_sessions_opened_total")) == (2, 4)
