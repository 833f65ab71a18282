"""OpenTelemetry against a real vLLM server (the shared one, exporting to the in-process
OTLP receiver): each request's span (operation by route, the caller's trace, its real
finish time, its session), the GenAI server metrics and the ``pte.*`` metrics over OTLP,
and the Prometheus exemplar that names the span's trace."""

from __future__ import annotations

import json
import random
import re
import time

import pytest

from tests.conftest import generation

# The conventions' explicit bucket advice (semantic-conventions-genai, gen-ai-metrics.md),
# written out here rather than imported, so a typo in the package shows.
DURATION_BOUNDS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]
TTFT_BOUNDS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BOUNDS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
OPENMETRICS = {"Accept": "application/openmetrics-text; version=1.0.0; charset=utf-8"}


def words(n: int) -> str:
    rng = random.Random()
    return " ".join(rng.choice(["agent", "tool", "cache", "token", "span", "trace", "row"]) for _ in range(n))


def record_and_span(server, response_id: str) -> tuple[dict, dict]:
    rec = server.log_records({response_id})[response_id][0]
    span = server.otlp.span_for(rec["request_id"])
    assert span is not None, f"no span for {rec['request_id']}"
    return rec, span


def test_span_operation_and_name_follow_the_route(server):
    for response, operation in (
        (server.chat("which operation is this", max_tokens=4), "chat"),
        (server.completion("which operation is that", max_tokens=6), "text_completion"),
    ):
        rec, span = record_and_span(server, response["id"])
        a = span["attributes"]
        assert a["gen_ai.operation.name"] == operation == rec["operation"]
        assert span["name"] == f"{operation} {server.model}"
        assert a["gen_ai.response.model"] == response["model"] == server.model
        assert "error.type" not in a and span["status"] == 0  # UNSET: a request that finished well


def test_span_is_a_child_of_the_callers_traceparent(server):
    trace_id, parent = f"{random.getrandbits(128) | 1:032x}", f"{random.getrandbits(64) | 1:016x}"
    joined = server.chat(
        "part of a caller's trace", max_tokens=4, headers={"traceparent": f"00-{trace_id}-{parent}-01"}
    )
    rec, span = record_and_span(server, joined["id"])
    assert (span["trace_id"], span["parent_span_id"]) == (trace_id, parent)
    assert rec["trace_id"] == trace_id and rec["traceparent"] == f"00-{trace_id}-{parent}-01"
    # without one, the span starts a trace of its own: the one its record names
    alone = server.chat("no caller's trace", max_tokens=4)
    rec, span = record_and_span(server, alone["id"])
    assert span["parent_span_id"] == "" and rec["traceparent"] is None
    assert span["trace_id"] == rec["trace_id"] != trace_id and re.fullmatch("[0-9a-f]{32}", rec["trace_id"])


def test_span_carries_the_session_as_session_id(server):
    sid = f"otel-session-{random.getrandbits(32):x}"
    _, span = record_and_span(
        server, server.chat("a turn", max_tokens=4, headers={"X-Session-Id": sid})["id"]
    )
    assert span["attributes"]["session.id"] == sid == span["attributes"]["gen_ai.conversation.id"]


def test_span_runs_from_vllms_arrival_to_its_finish(server):
    """From the request's arrival to its finish as vLLM saw them. Each bound holds whatever
    a busy host delays: vLLM receives the request after the client sent it and finishes it
    before the answer reaches the client, and the engine's queue, prefill and decode (its own
    clock) lie between its arrival and its finish. A span that ended at the first token would
    be short by the whole decode (95 steps); one that ended at the plugin's pricing would not
    end at the record's finish."""
    t0 = time.time()
    response = server.chat(words(300), max_tokens=96)
    t1 = time.time()
    rec, span = record_and_span(server, response["id"])
    assert rec["output_tokens"] == 96 and rec["decode_s"] > 0.01, rec
    start, end = span["start"] / 1e9, span["end"] / 1e9
    assert t0 - 0.01 <= start < end <= t1 + 0.01, (t0, start, end, t1)
    engine_work = rec["queued_s"] + rec["prefill_s"] + rec["decode_s"]
    assert end - start >= engine_work - 1e-3, (end - start, engine_work)
    assert end == pytest.approx(rec["finished_at"], abs=1e-6)
    assert start == pytest.approx(rec["arrived_at"], abs=1e-6)


def test_ttft_and_tpot_are_what_a_streaming_client_sees(server):
    """vLLM's view of the first token and of the decode against the client's. The client
    sees each chunk later than vLLM sent it, by as much as a busy host delays it: each bound
    either holds whatever that delay (vLLM's first token before the client's; the engine's
    queue, prefill and decode inside the client's wait) or needs the last chunk delayed by a
    decode's length more than the first to fail."""
    body = generation(server.model, 256, prompt=words(1500), stream=True)
    # A starved API server can hold the chunks back and deliver them in one burst (on two
    # cores, beside another server's busy engine, for seconds), and then the client cannot tell
    # its first token from its last: measured again, up to five times, then said and skipped
    for _ in range(5):
        t0 = time.perf_counter()
        chunk_times, rid = [], None
        with server.client.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk_times.append(time.perf_counter() - t0)
                    rid = json.loads(line[6:])["id"]
        client_ttft, client_decode = chunk_times[0], chunk_times[-1] - chunk_times[0]
        if client_decode > 0.1:
            break
    if client_decode <= 0.1:
        pytest.skip(f"the host delivered every answer's chunks in one burst ({client_decode:.3f} s apart)")
    rec = server.log_records({rid})[rid][0]
    assert rec["output_tokens"] == 256
    # vLLM's arrival follows the HTTP exchange and tokenisation the client's clock includes;
    # its queue and prefill (engine clock) lie between its arrival and its first token
    engine_first = rec["queued_s"] + rec["prefill_s"]
    assert engine_first <= rec["ttft_s"] <= client_ttft + 0.01, (engine_first, rec["ttft_s"], client_ttft)
    assert rec["ttft_s"] < rec["e2e_s"]
    decode = rec["tpot_s"] * 255
    assert decode == pytest.approx(rec["decode_s"], rel=1e-9)
    assert 0.5 * client_decode <= decode <= chunk_times[-1] - engine_first, (decode, client_decode)


def _wait_for_count(otlp, name: str, attrs: dict, count: int, timeout_s: float = 15.0) -> dict | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        point = otlp.latest_point(name, **attrs)
        if point is not None and point["count"] >= count:
            return point
        time.sleep(0.1)
    return otlp.latest_point(name, **attrs)


def _settled(otlp, name: str, attrs: dict) -> dict | None:
    """The latest point exported after everything recorded so far (one export interval)."""
    mark = time.time_ns() + 100_000_000
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        point = otlp.latest_point(name)
        if point is not None and point["time"] > mark:
            return otlp.latest_point(name, **attrs)
        time.sleep(0.1)
    raise AssertionError(f"no {name} exported in 10 s")


def test_genai_server_metrics_and_pte_metrics_over_otlp(server):
    otlp = server.otlp
    model = {"gen_ai.request.model": server.model}
    op = {"gen_ai.operation.name": "text_completion", **model}
    names = (
        "gen_ai.server.request.duration",
        "gen_ai.server.time_to_first_token",
        "gen_ai.server.time_per_output_token",
    )
    server.chat("so that a point exists", max_tokens=4)  # a chat point: every metric has been exported once
    before = {n: _settled(otlp, n, op) for n in names}
    served_before = {
        ph: _settled(otlp, "pte.served", {**model, "pte.phase": ph}) for ph in ("prefill", "decode")
    }
    reference_before = {
        ph: _settled(otlp, "pte.reference", {**model, "pte.phase": ph}) for ph in ("prefill", "decode")
    }
    ids = [server.completion(words(40 * (i + 1)), max_tokens=3 + 4 * i)["id"] for i in range(3)]
    recs = [v[0] for v in server.log_records(set(ids)).values()]
    assert len(recs) == 3

    def delta(name: str, field: str) -> float:
        after = _wait_for_count(otlp, name, op, (before[name] or {"count": 0})["count"] + 3)
        assert after is not None, name
        return after[field] - (before[name] or {field: 0})[field]

    for name, bounds, field in zip(
        names, (DURATION_BOUNDS, TTFT_BOUNDS, TPOT_BOUNDS), ("e2e_s", "ttft_s", "tpot_s"), strict=True
    ):
        point = _wait_for_count(otlp, name, op, (before[name] or {"count": 0})["count"] + 3)
        assert point["unit"] == "s" and point["kind"] == "histogram" and point["bounds"] == bounds, name
        assert point["attributes"]["gen_ai.provider.name"] == "vllm"
        assert point["attributes"]["gen_ai.response.model"] == server.model
        assert "error.type" not in point["attributes"]
        assert delta(name, "count") == 3, name
        assert delta(name, "sum") == pytest.approx(sum(r[field] for r in recs), rel=1e-9, abs=1e-9), name
    assert point["resource"]["service.name"] == "vllm"

    def counter_delta(name: str, attrs: dict, old: dict | None, expected: float) -> float:
        deadline = time.monotonic() + 10
        while True:
            point = otlp.latest_point(name, **attrs)
            got = point["value"] - (old or {"value": 0})["value"]
            if got == pytest.approx(expected, rel=1e-9) or time.monotonic() > deadline:
                return got
            time.sleep(0.1)

    for ph, field in (("prefill", "pte_prefill"), ("decode", "pte_decode")):
        expected = sum(r[field] for r in recs)
        got = counter_delta("pte.served", {**model, "pte.phase": ph}, served_before[ph], expected)
        assert got == pytest.approx(expected, rel=1e-9), ph
    # reference: each prompt whole as prefill, the rest decode
    expected = {"prefill": sum(r["prompt_tokens"] for r in recs)}
    expected["decode"] = sum(r["pte_reference"] for r in recs) - expected["prefill"]
    for ph, want in expected.items():
        got = counter_delta("pte.reference", {**model, "pte.phase": ph}, reference_before[ph], want)
        assert got == pytest.approx(want, rel=1e-9), ph
    assert otlp.latest_point("pte.served", **model)["unit"] == "{pte}"


def exemplars(text: str, family: str) -> list[tuple[str, str, float]]:
    """(le, trace_id, value) of each exemplar on ``family``'s buckets in an OpenMetrics text."""
    pattern = re.compile(
        rf'^{family}_bucket\{{[^}}]*le="([^"]+)"[^}}]*\}} \S+ # \{{trace_id="([0-9a-f]+)"\}} (\S+)', re.M
    )
    return [(le, tid, float(v)) for le, tid, v in pattern.findall(text)]


def test_prometheus_exemplar_names_the_requests_trace(server):
    rec, span = record_and_span(server, server.chat("an exemplar, please", max_tokens=5)["id"])
    # vLLM's /metrics answers the Prometheus text format whatever is asked: no exemplars there
    plain = server.client.get("/metrics", headers=OPENMETRICS)
    assert plain.headers["content-type"].startswith("text/plain") and "# {trace_id=" not in plain.text
    r = server.client.get("/pte/metrics", headers=OPENMETRICS)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/openmetrics-text")
    found = [e for e in exemplars(r.text, "pte_request_served_pte") if e[1] == span["trace_id"]]
    assert len(found) == 1, exemplars(r.text, "pte_request_served_pte")
    le, _, value = found[0]
    assert value == pytest.approx(rec["pte_served"], rel=1e-9)
    bounds = {
        float(b) for b in re.findall(r'^pte_request_served_pte_bucket\{[^}]*le="([^"]+)"', r.text, re.M)
    }
    assert float(le) == min(b for b in bounds if b >= value)  # on the bucket it fell in
    # the same registry as /metrics: vLLM's own series are there too
    assert "vllm:num_requests_running" in r.text and "pte_requests_total" in r.text
    assert "# {trace_id=" not in server.client.get("/pte/metrics").text  # text format: no exemplars
    assert server.client.get("/pte/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
