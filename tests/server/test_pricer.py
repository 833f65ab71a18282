"""A failing exporter is counted and isolated; the others still get every record."""

import json
import math
import sqlite3

import pytest
from prometheus_client import CollectorRegistry

from pte_instrument.cost.architecture import load_config, parse_shape
from pte_instrument.cost.devices import PROFILES
from pte_instrument.cost.model import CostModel
from pte_instrument.faults import FaultTracker
from pte_instrument.server.exporters.prometheus import PrometheusExporter, metrics_for
from pte_instrument.server.exporters.request_log import RequestLogWriter
from pte_instrument.server.pricer import FIRST_RETRY_S, MAX_CONSECUTIVE_FAULTS, MAX_RETRY_S, RequestPricer
from pte_instrument.server.records import FinishedRequest
from pte_instrument.server.sessions import SessionLedger
from tests.cost.test_architecture import FIX


class Boom:
    def export(self, record):
        raise RuntimeError("exporter down")


def make(tmp_path, extra=(), sessions=None):
    registry = CollectorRegistry()
    metrics = metrics_for(registry)
    faults = FaultTracker(on_fault=lambda s: metrics.faults.labels(s).inc())
    cost = CostModel(parse_shape(load_config(FIX / "dense_mha.json")), PROFILES["h200"])
    log = RequestLogWriter(tmp_path / "log.jsonl")
    acc = RequestPricer(
        cost,
        [*extra, ("prometheus", PrometheusExporter("m", 0, metrics)), ("request_log", log)],
        faults,
        sessions,
    )
    return acc, registry, tmp_path / "log.jsonl"


def req(i: int, **kw) -> FinishedRequest:
    return FinishedRequest(
        request_id=f"r{i}",
        model="m",
        prompt_tokens=100,
        cached_tokens=0,
        output_tokens=10,
        finish_reason="length",
        **kw,
    )


def test_failing_exporter_is_isolated(tmp_path):
    acc, registry, log = make(tmp_path, extra=[("boom", Boom())])
    for i in range(3):
        assert acc.on_finished(req(i)) is not None
    assert registry.get_sample_value("pte_plugin_faults_total", {"stage": "boom"}) == 3
    assert (
        registry.get_sample_value(
            "pte_requests_total",
            {"model_name": "m", "engine": "0", "tenant": "", "lora_name": "", "finish_reason": "length"},
        )
        == 3
    )
    assert len(log.read_text().splitlines()) == 3


def test_accounting_fault_is_counted(tmp_path):
    acc, registry, log = make(tmp_path)
    assert acc.on_finished(req(0, recomputed_tokens=-5)) is None  # impossible counts
    assert registry.get_sample_value("pte_plugin_faults_total", {"stage": "accounting"}) == 1
    assert not log.exists()


def test_a_number_that_is_not_finite_reaches_no_exporter_and_is_counted(tmp_path):
    """One NaN added to a Prometheus counter or histogram stays in it for good: a record with
    one (here vLLM's timings) is exported with the field's stand-in, as the session stores
    keep it, and counted as an accounting fault."""
    acc, registry, log = make(tmp_path)
    record = acc.on_finished(req(0, e2e_s=math.nan, queued_s=math.inf, decode_s=0.5))
    assert record is not None and (record.e2e_s, record.queued_s, record.decode_s) == (0.0, 0.0, 0.5)
    assert registry.get_sample_value("pte_plugin_faults_total", {"stage": "accounting"}) == 1
    sums = [s.value for m in registry.collect() for s in m.samples if s.name.endswith(("_sum", "_total"))]
    assert sums and all(math.isfinite(v) for v in sums)
    (line,) = log.read_text().splitlines()
    assert json.loads(line)["e2e_s"] == 0.0


def refuse_session_reads(action: int, table: str | None, *_: object) -> int:
    """A SQLite authorizer under which the session store's ``sessions`` table cannot be read."""
    return sqlite3.SQLITE_DENY if action == sqlite3.SQLITE_READ and table == "sessions" else sqlite3.SQLITE_OK


def test_a_session_store_read_fault_costs_the_turn_its_context_not_its_record(tmp_path):
    """The session's latest turn cannot be read from the store (SQLite refuses this process's
    reads of it): one sessions fault, and the request is still priced, as a session the store
    holds nothing of (turn 1, no pause), delivered to every exporter and in the host's totals."""
    ledger = SessionLedger(tmp_path / "sessions.sqlite3")
    try:
        acc, registry, log = make(tmp_path, sessions=ledger)
        ledger.on_error = lambda e: acc.faults.record("sessions", e)  # as the runtime wires it
        with ledger.store.reading() as db:
            db.set_authorizer(refuse_session_reads)
        record = acc.on_finished(req(0, session_id="s", finished_at=1000.0))
        assert record is not None and (record.turn, record.pause_s) == (1, None)
        assert acc.faults.counts == {"sessions": 1}
        assert acc.delivered == {"prometheus": 1, "request_log": 1}
        assert len(log.read_text().splitlines()) == 1
        labels = {"model_name": "m", "engine": "0", "tenant": "", "lora_name": "", "finish_reason": "length"}
        assert registry.get_sample_value("pte_requests_total", labels) == 1
        assert ledger.model_totals()["m"]["requests"] == 1
        with ledger.store.reading() as db:
            db.set_authorizer(None)
        assert ledger.get("s")["turns"] == 1  # the turn landed too
    finally:
        ledger.close()


def test_request_log_recovers_after_a_failing_path(tmp_path):
    blocker = tmp_path / "blocked"
    blocker.write_text("a file where a directory should be")
    w = RequestLogWriter(blocker / "log.jsonl")
    acc, *_ = make(tmp_path)
    record = acc.on_finished(req(0))
    with pytest.raises(OSError):
        w.export(record)
    blocker.unlink()
    w.export(record)
    assert json.loads((blocker / "log.jsonl").read_text())["request_id"] == "r0"


def test_fault_log_is_rate_limited(caplog):
    f = FaultTracker(log_interval_s=3600)
    with caplog.at_level("ERROR", logger="pte_instrument"):
        for _ in range(50):
            f.record("x", RuntimeError("again"))
    assert f.counts["x"] == 50
    assert len(caplog.records) == 1


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_an_exporter_that_keeps_failing_is_suspended_once_and_its_records_counted_lost(tmp_path, caplog):
    calls = []

    class Flaky:
        def export(self, record):
            calls.append(record.request_id)
            raise RuntimeError("still down")

    acc, registry, log = make(tmp_path, extra=[("flaky", Flaky())])
    acc.monotonic = Clock()
    with caplog.at_level("ERROR", logger="pte_instrument"):
        for i in range(MAX_CONSECUTIVE_FAULTS + 50):
            acc.on_finished(req(i))
    assert len(calls) == MAX_CONSECUTIVE_FAULTS  # not called while suspended (the clock stood still)
    assert acc.suspended == ["flaky"]
    assert sum("suspended" in r.getMessage() for r in caplog.records) == 1
    assert len(log.read_text().splitlines()) == MAX_CONSECUTIVE_FAULTS + 50  # others kept going
    assert registry.get_sample_value("pte_plugin_faults_total", {"stage": "flaky"}) == MAX_CONSECUTIVE_FAULTS
    assert acc.lost["flaky"] == MAX_CONSECUTIVE_FAULTS + 50  # every record it did not get
    assert acc.delivered["flaky"] == 0 and acc.delivered["request_log"] == MAX_CONSECUTIVE_FAULTS + 50


def test_a_suspended_exporter_is_retried_with_back_off_and_resumes_when_it_recovers(tmp_path, caplog):
    state = {"down": True, "calls": 0}

    class Transient:
        def export(self, record):
            state["calls"] += 1
            if state["down"]:
                raise OSError(28, "No space left on device")

    acc, *_ = make(tmp_path, extra=[("transient", Transient())])
    clock = acc.monotonic = Clock()
    events: list[tuple[str, bool]] = []
    acc.on_state = lambda stage, on: events.append((stage, on))
    priced = 0

    def finish(n: int) -> None:
        nonlocal priced
        for _ in range(n):
            assert acc.on_finished(req(priced)) is not None
            priced += 1

    finish(MAX_CONSECUTIVE_FAULTS)
    assert events == [("transient", False)] and state["calls"] == MAX_CONSECUTIVE_FAULTS
    clock.t += FIRST_RETRY_S - 0.01
    finish(5)
    assert state["calls"] == MAX_CONSECUTIVE_FAULTS  # not yet due
    clock.t += 0.02
    finish(3)  # one retry, failed: the next in twice the time
    assert state["calls"] == MAX_CONSECUTIVE_FAULTS + 1
    clock.t += 2 * FIRST_RETRY_S - 0.01
    finish(2)
    assert state["calls"] == MAX_CONSECUTIVE_FAULTS + 1
    state["down"] = False
    clock.t += 0.02
    with caplog.at_level("INFO", logger="pte_instrument"):
        finish(10)
    assert state["calls"] == MAX_CONSECUTIVE_FAULTS + 1 + 10  # resumed: every record again
    assert events == [("transient", False), ("transient", True)]
    assert acc.suspended == []
    assert sum("resumed" in r.getMessage() for r in caplog.records) == 1
    assert acc.delivered["transient"] == 10
    assert acc.delivered["transient"] + acc.lost["transient"] == priced


def test_the_back_off_doubles_up_to_its_cap():
    acc = RequestPricer(None, [], FaultTracker())  # type: ignore[arg-type]
    waits = [acc._next_wait(n) for n in range(12)]
    assert waits[:3] == [FIRST_RETRY_S, 2 * FIRST_RETRY_S, 4 * FIRST_RETRY_S]
    assert max(waits) == MAX_RETRY_S and waits[-1] == MAX_RETRY_S


def test_a_recovering_exporter_stays_on(tmp_path):
    state = {"n": 0}

    class Sometimes:
        def export(self, record):
            state["n"] += 1
            if state["n"] % 2:
                raise RuntimeError("every other time")

    acc, *_ = make(tmp_path, extra=[("sometimes", Sometimes())])
    for i in range(3 * MAX_CONSECUTIVE_FAULTS):
        acc.on_finished(req(i))
    assert acc.suspended == []


def test_the_suspension_is_reported_once_with_its_stage(tmp_path):
    switched: list[tuple[str, bool]] = []

    class Down:
        def export(self, record):
            raise RuntimeError("down")

    acc, *_ = make(tmp_path, extra=[("down", Down())])
    acc.monotonic = Clock()
    acc.on_state = lambda stage, on: switched.append((stage, on))
    for i in range(MAX_CONSECUTIVE_FAULTS - 1):
        acc.on_finished(req(i))
    assert switched == []  # one fault short of the suspension
    for i in range(MAX_CONSECUTIVE_FAULTS, MAX_CONSECUTIVE_FAULTS + 20):
        acc.on_finished(req(i))
    assert switched == [("down", False)]


def test_failing_callbacks_do_not_stop_the_other_exporters(tmp_path):
    def broken(*args) -> None:
        raise RuntimeError("callback down")

    acc, _, log = make(tmp_path, extra=[("boom", Boom())])
    acc.on_state = broken
    acc.on_lost = broken
    for i in range(MAX_CONSECUTIVE_FAULTS + 5):
        assert acc.on_finished(req(i)) is not None
    assert acc.suspended == ["boom"]
    assert len(log.read_text().splitlines()) == MAX_CONSECUTIVE_FAULTS + 5
    assert acc.lost["boom"] == MAX_CONSECUTIVE_FAULTS + 5


def test_the_exporter_gauges_follow_what_the_runtime_hears(tmp_path):
    from pte_instrument.server.runtime import Runtime
    from pte_instrument.settings import Settings

    registry = CollectorRegistry()
    runtime = Runtime(
        Settings(session_store=str(tmp_path / "s.sqlite3"), request_log=str(tmp_path / "r.jsonl")), registry
    )
    try:
        cost = CostModel(parse_shape(load_config(FIX / "dense_mha.json")), PROFILES["h200"])
        stages = [stage for stage, _ in runtime.exporters_for("m", 1, cost)]

        def enabled(stage: str) -> float | None:
            return registry.get_sample_value(
                "pte_exporter_enabled", {"model_name": "m", "engine": "1", "stage": stage}
            )

        assert stages == ["prometheus", "efficiency", "request_log"]
        assert [enabled(s) for s in stages] == [1, 1, 1]
        runtime.exporter_state("m", 1, "request_log", False)
        assert [enabled(s) for s in stages] == [1, 1, 0]
        runtime.exporter_state("m", 1, "request_log", True)
        assert [enabled(s) for s in stages] == [1, 1, 1]
        runtime.exporter_lost("m", 1, "request_log")
        runtime.exporter_lost("m", 1, "request_log")
        lost = {"model_name": "m", "engine": "1", "stage": "request_log"}
        assert registry.get_sample_value("pte_exporter_records_lost_total", lost) == 2
        assert runtime.summary()["request_log"]["lost"] == 2
        assert enabled("otel") is None  # not configured: no series
    finally:
        runtime.sessions.close()


def test_the_gauge_help_states_the_suspension_threshold_and_back_off():
    from pte_instrument.server.exporters.families import FAMILIES

    spec = next(s for s in FAMILIES if s.name == "pte_exporter_enabled")
    assert f"failed {MAX_CONSECUTIVE_FAULTS} times in a row" in spec.help
    assert f"{MAX_RETRY_S:g} s" in spec.help


def test_a_record_an_exporter_has_no_room_for_is_lost_without_a_fault_or_a_suspension(tmp_path):
    """A full queue in front of a collector that is slower than a burst is back pressure,
    not a failing exporter: each record it refuses is counted lost, and the exporter is
    neither suspended (it would lose every record while its queue drains) nor a fault."""
    from pte_instrument.server.pricer import RecordRefused

    state = {"full": True}

    class Queued:
        def export(self, record):
            if state["full"]:
                raise RecordRefused("the queue is full")

    acc, registry, _ = make(tmp_path, extra=[("queued", Queued())])
    for i in range(MAX_CONSECUTIVE_FAULTS + 10):
        acc.on_finished(req(i))
    state["full"] = False
    acc.on_finished(req(10_000))
    assert acc.suspended == [] and acc.lost["queued"] == MAX_CONSECUTIVE_FAULTS + 10
    assert acc.delivered["queued"] == 1
    assert registry.get_sample_value("pte_plugin_faults_total", {"stage": "queued"}) in (None, 0.0)
