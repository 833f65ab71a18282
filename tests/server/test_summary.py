"""``/pte/summary``'s per-model totals, kept in the host's store: PTE and tokens over every
request; seconds and money summed over the requests that had them (None counts as 0),
beside how many did."""

from __future__ import annotations

import sqlite3

import pytest

from pte_instrument.server.records import MODEL_TOTALS, RequestRecord
from pte_instrument.server.sessions import SessionLedger
from tests.server.builders import gpu_split, request_record


@pytest.fixture
def totals():
    ledger = SessionLedger()
    yield ledger
    ledger.close()


def record(model: str = "m", **kw: object) -> RequestRecord:
    """No seconds, no money: what a request priced without the step hook carries."""
    return request_record(0.0, model=model, **kw)


def timed(
    gpu: tuple[float, float, float, float], explained: float, cost: float | None, **kw: object
) -> RequestRecord:
    seconds = gpu_split(*gpu)
    total = seconds["gpu_seconds"]
    return record(
        **seconds,
        predicted_seconds=0.9 * total,
        latency_explained_s=explained,
        interference_s=explained - total,
        cost_usd=cost,
        **kw,
    )


def test_seconds_and_money_are_summed_over_the_requests_that_had_them(totals):
    totals.add(timed((0.5, 0.25, 0.125, 0.125), explained=1.5, cost=0.002))  # 1.0 s, priced
    totals.add(timed((0.25, 0.5, 0.0, 0.25), explained=1.0, cost=None))  # 1.0 s, no price
    totals.add(record())  # no step hook: no seconds, no money
    totals.add(timed((1.0, 0.0, 0.0, 0.0), explained=4.0, cost=0.01, model="other"))
    snap = totals.model_totals()
    assert set(snap) == {"m", "other"}
    m = snap["m"]
    assert set(m) == set(MODEL_TOTALS)
    assert m["requests"] == 3 and m["pte_served"] == 3 * 93.0 and m["prompt_tokens"] == 300
    assert m["requests_timed"] == 2 and m["requests_priced"] == 1
    assert m["gpu_seconds"] == pytest.approx(2.0)
    assert m["gpu_seconds_prefill"] == pytest.approx(0.75)
    assert m["gpu_seconds_kv_read"] == pytest.approx(0.75)
    assert m["gpu_seconds_weights"] == pytest.approx(0.125)
    assert m["gpu_seconds_overhead"] == pytest.approx(0.375)
    assert m["predicted_seconds"] == pytest.approx(1.8)
    assert m["latency_explained_s"] == pytest.approx(2.5)
    assert m["interference_s"] == pytest.approx(0.5)  # 0.5 + 0.0
    assert m["cost_usd"] == pytest.approx(0.002)
    o = snap["other"]
    assert (o["requests"], o["requests_timed"], o["requests_priced"]) == (1, 1, 1)
    assert o["gpu_seconds"] == 1.0 and o["interference_s"] == 3.0 and o["cost_usd"] == 0.01


def test_a_model_without_the_step_hook_shows_zero_seconds_from_zero_requests(totals):
    totals.add(record())
    totals.add(record())
    m = totals.model_totals()["m"]
    assert m["requests"] == 2 and m["requests_timed"] == 0 and m["requests_priced"] == 0
    assert m["gpu_seconds"] == 0 and m["cost_usd"] == 0 and m["latency_explained_s"] == 0


def test_the_snapshot_is_a_copy(totals):
    totals.add(record())
    snap = totals.model_totals()
    snap["m"]["requests"] = 99
    assert totals.model_totals()["m"]["requests"] == 1


def test_two_processes_sharing_the_store_read_the_same_totals(tmp_path):
    """Two API servers' ledgers on one file: each reads the other's requests too."""
    path = tmp_path / "sessions.sqlite3"
    a, b = SessionLedger(path), SessionLedger(path)
    try:
        a.add(record(pte_served=10.0))
        b.add(record(pte_served=5.0))
        assert b.flush()
        assert a.model_totals() == b.model_totals()
        assert a.model_totals()["m"]["requests"] == 2 and a.model_totals()["m"]["pte_served"] == 15.0
    finally:
        a.close()
        b.close()


def test_an_unusable_store_is_one_fault_and_a_private_store(tmp_path):
    from prometheus_client import CollectorRegistry

    from pte_instrument.server.runtime import Runtime
    from pte_instrument.settings import Settings

    runtime = Runtime(Settings(session_store=str(tmp_path)), CollectorRegistry())  # a directory
    try:
        assert runtime.faults.counts["sessions"] == 1
        runtime.sessions.add(record())
        summary = runtime.summary()
        assert summary["models"]["m"]["requests"] == 1  # still accounted, in this process
        assert summary["sessions"]["store"] != str(tmp_path) and summary["sessions"]["live"] == 0
    finally:
        runtime.sessions.close()


@pytest.mark.parametrize(
    "url",
    [
        "redis://[::1",  # an unclosed IPv6 host
        "redis://user:secret@redis.internal:port",  # a password, and a port that is none
        "redis://redis.internal:6379/0?no_such_option=1",
        "rediss://redis.internal:6379/0?ssl_cert_reqs=bogus",
        "redis://" + "a" * 64 + ".internal:6379",  # a host name label longer than DNS allows
        "redis://r\udcffs.internal",  # non-UTF-8 bytes in the environment
    ],
    ids=["ipv6-unclosed", "port-not-a-number", "unknown-option", "bad-ssl-option", "long-label", "not-utf8"],
)
def test_a_redis_url_that_cannot_work_is_one_fault_and_a_private_store(url, caplog):
    from prometheus_client import CollectorRegistry

    from pte_instrument.server.runtime import Runtime
    from pte_instrument.settings import Settings

    runtime = Runtime(Settings(session_store=url), CollectorRegistry())
    try:
        assert runtime.faults.counts == {"sessions": 1}
        [line] = [r.getMessage() for r in caplog.records if "PTE_SESSION_STORE" in r.getMessage()]
        assert "private store" in line and "secret" not in line
        line.encode("utf-8")  # a log file's strict UTF-8 writer takes it: no lone surrogate
        runtime.sessions.add(record())
        assert runtime.summary()["models"]["m"]["requests"] == 1  # still accounted, in this process
    finally:
        runtime.sessions.close()


def test_records_the_store_lost_are_in_the_summary(tmp_path, monkeypatch):
    from prometheus_client import CollectorRegistry

    from pte_instrument import failpoints
    from pte_instrument.server.runtime import Runtime
    from pte_instrument.settings import Settings

    runtime = Runtime(Settings(session_store=str(tmp_path / "s.sqlite3")), CollectorRegistry())
    try:
        monkeypatch.setattr(failpoints, "points", {"session_store": 1.0})
        runtime.sessions.add(record(session_id="s"))
        runtime.sessions.add(record(session_id="t"))
        assert runtime.sessions.flush()
        monkeypatch.setattr(failpoints, "points", {})
        assert runtime.summary()["sessions"]["records_lost"] == 2
    finally:
        runtime.sessions.close()


def test_tenant_and_adapter_totals_are_host_wide(tmp_path):
    """Two API servers' ledgers on one file: per-tenant and per-adapter sums over both, a
    request without a tenant or an adapter in neither; an adapter's requests count for its
    base model too."""
    path = tmp_path / "sessions.sqlite3"
    a, b = SessionLedger(path), SessionLedger(path)
    try:
        a.add(timed((1.0, 0.0, 0.0, 0.0), explained=1.0, cost=0.5, tenant="team-a", pte_served=10.0))
        b.add(
            timed(
                (2.0, 0.0, 0.0, 0.0),
                explained=2.0,
                cost=1.0,
                tenant="team-a",
                lora_name="ad",
                pte_served=20.0,
            )
        )
        b.add(record(tenant="other", lora_name="ad", pte_served=40.0))
        a.add(record(pte_served=80.0))  # tenants off: no tenant
        assert a.flush() and b.flush()
        tenants, adapters = a.tenant_totals(), b.lora_totals()
        assert set(tenants) == {"team-a", "other"} and set(adapters) == {"ad"}
        t = tenants["team-a"]
        assert (t["requests"], t["pte_served"], t["gpu_seconds"], t["cost_usd"]) == (2, 30.0, 3.0, 1.5)
        assert tenants["other"]["requests"] == 1 and tenants["other"]["requests_priced"] == 0
        ad = adapters["ad"]
        assert (ad["model"], ad["requests"], ad["pte_served"], ad["requests_timed"]) == ("m", 2, 60.0, 1)
        assert a.model_totals()["m"]["requests"] == 4 and a.model_totals()["m"]["pte_served"] == 150.0
    finally:
        a.close()
        b.close()


def test_a_store_written_before_tenants_gains_their_tables(tmp_path):
    """A store from a version without tenant and adapter totals opens as it is, and keeps them from then on."""
    path = tmp_path / "sessions.sqlite3"
    SessionLedger(path).close()
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE tenant_totals")
        db.execute("DROP TABLE lora_totals")
    ledger = SessionLedger(path)
    try:
        ledger.add(record(tenant="team-a", lora_name="ad"))
        assert (
            ledger.tenant_totals()["team-a"]["requests"] == 1 and ledger.lora_totals()["ad"]["requests"] == 1
        )
    finally:
        ledger.close()
