"""Live outcome-layer statistics from finished requests and posted labels (hand-computed)."""

import pytest

from pte_instrument.server.live_efficiency import FeedbackError, LiveEfficiency


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
