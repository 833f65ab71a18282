"""Agent sessions against a real vLLM server: per-turn PTE, eviction tax, the /pte routes
and the OTLP export."""

from __future__ import annotations

import itertools
import random

import pytest

from pte_instrument.devtools.workload import AgentSession, WorkloadConfig
from tests.conftest import API_KEY
from tests.exposition import metric_sum

BLOCK = 128  # vLLM's KV block on the CPU build: the prefix cache holds whole blocks


def run_session(server, sid: str, turns: int, reset_between: bool = False):
    rng = random.Random()
    cfg = WorkloadConfig(turns=turns, max_tokens=9, task_words=40, tool_result_words=70)
    system = "You are an agent. " + " ".join(
        rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(220)
    )
    session = AgentSession(sid, cfg, system, rng)
    results = []
    for t in range(turns):
        if reset_between and t:
            assert server.client.post("/reset_prefix_cache").status_code == 200
        results.append(session.step(server.client, server.model))
    return results


def reusable(prev) -> int:
    """Written out independently of the package: what turn i−1 computed, in whole blocks."""
    computed = prev.prompt_tokens + prev.output_tokens - 1
    return computed - computed % BLOCK


def session_rows(server, sid):
    r = server.client.get(f"/pte/sessions/{sid}")
    assert r.status_code == 200, r.text
    return r.json()


def test_cached_session_has_no_eviction_tax_and_totals_match_the_log(server):
    sid = f"cached-{random.getrandbits(32):x}"
    results = run_session(server, sid, turns=3)
    records = server.log_records({r.request_id for r in results})
    assert len(records) == 3
    s = session_rows(server, sid)
    assert s["turns"] == 3 and [row["turn"] for row in s["turn_rows"]] == [1, 2, 3]
    for prev, cur in itertools.pairwise(results):
        assert cur.cached_tokens >= reusable(prev) > 0  # later turns hit the cache …
        rec = records[cur.request_id][0]
        assert rec["session_id"] == sid
        assert rec["pte_eviction_tax"] == 0.0  # … so nothing is paid twice
        assert rec["pte_ideal"] == pytest.approx(
            cur.prompt_tokens - reusable(prev) + rec["pte_decode"], rel=1e-12
        )
    # per-session totals = Σ of the session's request-log entries
    for key in (
        "pte_served",
        "pte_ideal",
        "pte_reference",
        "pte_eviction_tax",
        "prompt_tokens",
        "cached_tokens",
        "output_tokens",
    ):
        assert s[key] == pytest.approx(sum(records[r.request_id][0][key] for r in results), rel=1e-12), key
    assert s["turn_rows"][1]["pause_s"] >= 0


def test_dropped_cache_between_turns_is_an_eviction_tax(server):
    before = server.metrics()
    sid = f"evicted-{random.getrandbits(32):x}"
    results = run_session(server, sid, turns=2, reset_between=True)
    first, second = results
    assert second.cached_tokens == 0  # the reset dropped the whole prefix
    rec = server.log_records({second.request_id})[second.request_id][0]
    expected_tax = reusable(first)  # every reusable token was prefilled again, 1 PTE each
    assert expected_tax >= BLOCK
    assert rec["pte_eviction_tax"] == expected_tax
    assert rec["pte_served"] - rec["pte_ideal"] == pytest.approx(expected_tax, rel=1e-12)
    after = server.metrics()
    delta = metric_sum(after, "pte_eviction_tax_pte_total") - metric_sum(before, "pte_eviction_tax_pte_total")
    assert delta == expected_tax
    assert session_rows(server, sid)["pte_eviction_tax"] == expected_tax


def test_otlp_span_carries_genai_and_pte_attributes(server):
    sid = f"otel-{random.getrandbits(32):x}"
    results = run_session(server, sid, turns=2)
    turn = results[1]
    rec = server.log_records({turn.request_id})[turn.request_id][0]
    span = server.otlp.span_for(rec["request_id"])
    assert span is not None, "no span received by the OTLP receiver"
    a = span["attributes"]
    assert a["gen_ai.conversation.id"] == sid
    assert a["gen_ai.usage.input_tokens"] == turn.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == turn.output_tokens
    assert a["gen_ai.usage.cache_read.input_tokens"] == turn.cached_tokens
    assert a["gen_ai.request.model"] == server.model
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["pte.turn"] == 2
    assert a["pte.served"] == pytest.approx(rec["pte_served"], rel=1e-12)
    assert a["pte.eviction_tax"] == rec["pte_eviction_tax"]
    assert span["end"] - span["start"] == pytest.approx(rec["e2e_s"] * 1e9, abs=1e3)


def test_otlp_log_record_is_the_request_log_line(server):
    """A collector gathering every replica's log records holds every replica's request log."""
    sid = f"otel-log-{random.getrandbits(32):x}"
    (turn,) = run_session(server, sid, turns=1)
    rec = server.log_records({turn.request_id})[turn.request_id][0]
    log = server.otlp.log_for(rec["request_id"])
    assert log is not None, "no log record received by the OTLP receiver"
    assert log["event_name"] == "pte.request" and log["severity"] == "INFO"
    assert log["attributes"] == {k: v for k, v in rec.items() if v is not None}
    assert log["time"] == int(rec["finished_at"] * 1e9)
    assert log["resource"]["service.name"] == "vllm"
    assert rec["session_id"] == sid and rec["request_id"] in log["body"]


def test_routes_paginate_validate_and_require_the_key(server):
    for sid in (f"route-a-{random.getrandbits(16)}", f"route-b-{random.getrandbits(16)}"):
        run_session(server, sid, turns=1)
    c = server.client
    page = c.get("/pte/sessions", params={"limit": 1}).json()
    assert page["total"] >= 2 and len(page["sessions"]) == 1
    full = c.get("/pte/sessions", params={"limit": 1000}).json()["sessions"]
    served = [s["pte_served"] for s in full]
    assert served == sorted(served, reverse=True)
    assert c.get("/pte/sessions", params={"limit": 1, "offset": 1}).json()["sessions"][0] == full[1]
    for params in ({"limit": 0}, {"limit": "many"}, {"offset": -1}, {"sort": "bogus"}):
        r = c.get("/pte/sessions", params=params)
        assert r.status_code == 400 and "error" in r.json(), params
    assert c.get("/pte/sessions/" + "x" * 200).status_code == 400
    assert c.get("/pte/sessions/no-such-session").status_code == 404
    summary = c.get("/pte/summary").json()
    assert summary["models"][server.model]["requests"] >= 2
    assert summary["cost_models"][0]["device"] == "h100-sxm"
    import httpx

    for path in ("/pte/summary", "/pte/sessions", f"/pte/sessions/{full[0]['session_id']}"):
        assert httpx.get(server.url + path).status_code == 401
        assert httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(server.url + path, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_feedback_labels_feed_live_efficiency(server):
    c = server.client
    before = server.metrics()
    sid = f"feedback-{random.getrandbits(32):x}"
    results = run_session(server, sid, turns=2)
    loose = server.chat("a question without a session", max_tokens=5)
    server.log_records({loose["id"], *(r.request_id for r in results)})
    r = c.post("/pte/feedback", json={"session_id": sid, "correct": True})
    assert r.status_code == 200, r.text
    assert r.json()["requests"] == 2 and r.json()["output_tokens"] == sum(t.output_tokens for t in results)
    # max_tokens was hit: the session's last turn is truncated, so it cannot count as correct
    assert r.json()["correct"] is False and r.json()["truncated"] is True
    assert c.post("/pte/feedback", json={"request_id": loose["id"], "correct": False}).status_code == 200
    assert c.post("/pte/feedback", json={"request_id": loose["id"], "correct": True}).status_code == 409
    assert c.post("/pte/feedback", json={"request_id": "nope", "correct": True}).status_code == 404
    for bad in ({"request_id": loose["id"]}, {"correct": True}, [1], {"request_id": 5, "correct": True}):
        assert c.post("/pte/feedback", json=bad).status_code == 400, bad
    assert c.post("/pte/feedback", content=b"{not json").status_code == 400
    after = server.metrics()

    def delta(name):
        return metric_sum(after, name, model_name=server.model) - metric_sum(
            before, name, model_name=server.model
        )

    assert delta("pte_eval_labeled_total") == 2
    assert delta("pte_correct_answers_total") == 0
    assert delta("pte_eval_labeled_output_tokens_total") == sum(t.output_tokens for t in results) + 5
    assert delta("pte_eval_requests_total") == 3 and delta("pte_eval_truncated_total") == 3
