"""Live outcome-layer statistics from finished requests and posted labels (hand-computed)."""

import tracemalloc

import pytest

from pte_instrument.server.live_efficiency import FeedbackError, LiveEfficiency
from tests.helpers import heap_now, in_fresh_process


def test_rates_labels_and_sessions():
    e = LiveEfficiency()
    e.observe("r1", None, "m", "gsm8k", 100, "stop")
    e.observe("r2", None, "m", "gsm8k", 300, "length")  # truncated
    e.observe("r3", "s", "m", "gsm8k", 50, "stop")
    e.observe("r4", "s", "m", "gsm8k", 150, "stop")
    assert e.label(True, request_ids=["r1"])["correct"] is True
    # a truncated answer is never correct, whatever the label says
    assert e.label(True, request_ids=["x", "r2"])["correct"] is False
    # a session is one instance: 50 + 150 output tokens
    assert e.label(True, session_id="s")["output_tokens"] == 200
    (cell,) = e.snapshot()
    assert cell["requests"] == 4 and cell["truncated"] == 1
    assert cell["truncation_rate"] == 0.25 and cell["mean_output_tokens"] == 150  # 600 / 4
    assert cell["labeled"] == 3 and cell["correct"] == 2
    assert cell["r_logic"] == 1.0  # 2 correct of 2 completed labeled instances
    assert cell["e0"] == pytest.approx(1000 * 2 / 600)  # labeled tokens: 100 + 300 + 200


def test_label_errors():
    e = LiveEfficiency(window=2)
    for i in range(3):
        e.observe(f"r{i}", None, "m", "none", 10, "stop")
    with pytest.raises(FeedbackError) as err:
        e.label(True, request_ids=["r0"])  # fell out of the window
    assert err.value.status == 404
    e.label(False, request_ids=["r2"])
    with pytest.raises(FeedbackError) as err:
        e.label(True, request_ids=["r2"])
    assert err.value.status == 409


def _one_long_session(window: int) -> tuple[float, dict, int]:
    """Run in a fresh process: one session of 40,000 requests through a window of ``window``;
    (MiB the heap grew, the session's label, requests the store keeps)."""
    e = LiveEfficiency(window=window)
    tracemalloc.start()
    for i in range(window):
        e.observe(f"warm-{i:07d}", "agent", "m", "none", 2, "stop")
    assert e.store.flush()
    base = heap_now()
    for i in range(40_000):  # one session, far more turns than the window holds
        e.observe(f"request-{i:07d}", "agent", "m", "none", 2, "stop")
        if i % 5000 == 4999:  # the writer keeps pace, as with requests that take time to run
            assert e.store.flush(timeout=120)
    grown = (heap_now() - base) / 2**20
    tracemalloc.stop()
    label = e.label(True, session_id="agent")
    with e.store.store.reading() as db:
        kept = db.execute("SELECT COUNT(*) FROM recent").fetchone()[0]
    e.close()
    return grown, label, kept


def test_one_long_session_stays_bounded_by_the_window():
    window = 1000
    grown, label, kept = in_fresh_process(_one_long_session, window)
    assert grown < 0.5, f"grew {grown:.2f} MiB"
    # the label covers the session's turns still in the window, as before
    assert label["requests"] == window and label["output_tokens"] == 2 * window
    assert kept == window  # the window is the store's bound too


def test_a_label_reaches_a_request_another_api_server_observed(tmp_path):
    from pte_instrument.server.sessions import SessionLedger

    a, b = SessionLedger(tmp_path / "s.sqlite3"), SessionLedger(tmp_path / "s.sqlite3")
    served_by_a, labels_on_b = LiveEfficiency(store=a), LiveEfficiency(store=b)
    try:
        served_by_a.observe("r1", "s", "m", "gsm8k", 40, "stop")
        served_by_a.observe("r2", "s", "m", "gsm8k", 60, "stop")
        assert a.flush()
        out = labels_on_b.label(True, session_id="s")
        assert out == {
            "model": "m",
            "benchmark": "gsm8k",
            "requests": 2,
            "output_tokens": 100,
            "truncated": False,
            "correct": True,
        }
        with pytest.raises(FeedbackError) as err:  # once, host-wide
            served_by_a.label(True, request_ids=["r1"])
        assert err.value.status == 409
        assert served_by_a.snapshot() == labels_on_b.snapshot()
        assert served_by_a.snapshot()[0]["labeled"] == 1 and served_by_a.snapshot()[0]["correct"] == 1
    finally:
        a.close()
        b.close()


def test_sessions_lose_only_the_requests_that_leave_the_window():
    e = LiveEfficiency(window=3)
    e.observe("a1", "a", "m", "none", 1, "stop")
    e.observe("b1", "b", "m", "none", 10, "stop")
    e.observe("a2", "a", "m", "none", 100, "stop")
    e.observe("c1", "c", "m", "none", 1000, "stop")  # a1 leaves the window
    assert e.label(True, session_id="a")["output_tokens"] == 100
    e.observe("b1", "c", "m", "none", 10_000, "stop")  # an id seen again replaces the old one
    with pytest.raises(FeedbackError) as err:
        e.label(True, session_id="b")
    assert err.value.status == 404
    assert e.label(False, session_id="c")["output_tokens"] == 11_000


def test_feedback_errors_cut_long_ids_short():
    e = LiveEfficiency()
    with pytest.raises(FeedbackError) as err:
        e.label(True, request_ids=["x" * 1_000_000])
    assert len(str(err.value)) < 200 and "…" in str(err.value)
    e.observe("y" * 1_000_000, None, "m", "none", 1, "stop")
    e.label(True, request_ids=["y" * 1_000_000])
    with pytest.raises(FeedbackError) as err:
        e.label(True, request_ids=["y" * 1_000_000])
    assert err.value.status == 409 and len(str(err.value)) < 200
