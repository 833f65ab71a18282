"""The session ledger and session-id handling: bounded, ordered, nothing lost silently."""

import gc
import math
import multiprocessing
import sys
import threading
import tracemalloc
import weakref
from dataclasses import asdict, replace
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest

from pte_instrument import failpoints
from pte_instrument.cost.architecture import load_config, parse_shape
from pte_instrument.cost.devices import PROFILES
from pte_instrument.cost.model import CostModel
from pte_instrument.server.engine_join import with_engine_totals
from pte_instrument.server.live_efficiency import LiveEfficiency
from pte_instrument.server.records import FinishedRequest, RequestRecord, price_request
from pte_instrument.server.request_tags import PendingTags, RequestTag, validate_session_id
from pte_instrument.server.session_store import BatchWriter
from pte_instrument.server.sessions import EXPIRE_PER_COMMIT, SessionLedger, StoreError
from pte_instrument.wire import RequestTotals
from tests.cost.test_architecture import FIX
from tests.helpers import heap_now, in_fresh_process, wait

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
    finish_reason: str = "stop",
    engine_totals: RequestTotals | None = None,
    replica: str | None = None,
):
    """One turn of ``sid``, priced as the pricer does (served by ``replica``), and filed."""
    ctx = ledger.context_for(sid, finished_at - e2e, prompt)
    req = FinishedRequest(
        f"{sid}-{ctx.turn}",
        "m",
        prompt,
        cached,
        output,
        finish_reason,
        session_id=sid,
        e2e_s=e2e,
        engine_totals=engine_totals,
        replica=replica,
        **asdict(ctx),  # turn, reusable prefix, pause, previous replica: as the pricer tags it
    )
    record = price_request(COST, req, finished_at)
    ledger.add(record)
    return record


@pytest.fixture
def ledgers():
    """Session ledgers over private stores, closed (and their files removed) after the test."""
    made: list[SessionLedger] = []

    def make(**kwargs) -> SessionLedger:
        made.append(SessionLedger(**kwargs))
        return made[-1]

    yield make
    for ledger in made:
        ledger.close()


def test_turns_reuse_and_pause(ledgers):
    clock = Clock()
    ledger = ledgers(block_size=16, clock=clock)
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


def aborted_turn(
    ledger: SessionLedger, sid: str, prompt: int, cached: int, prefilled: int, finished_at: float
):
    """A turn aborted before its first token, ``prefilled`` positions of its prompt through
    (none and never scheduled: aborted while queued), as the engine's totals say."""
    totals = RequestTotals(
        "e",
        sid,
        0,
        "abort",
        scheduled=cached + prefilled > 0,
        prompt_tokens=prompt,
        cached_tokens=cached,
        prefill=prefilled,
    )
    return turn(ledger, sid, prompt, 0, cached, finished_at, finish_reason="abort", engine_totals=totals)


def test_the_next_turn_reuses_only_what_an_aborted_prefill_computed(ledgers):
    """A turn aborted in the middle of its prefill leaves in the cache its cached prefix and
    the positions it prefilled, not its whole prompt: the next turn's reusable prefix, and so
    its eviction tax, count only those."""
    ledger = ledgers(block_size=16)
    turn(ledger, "s", prompt=100, output=11, cached=0, finished_at=1000.0)  # 110 computed → 96
    r2 = aborted_turn(ledger, "s", prompt=2000, cached=96, prefilled=64, finished_at=1005.0)
    assert r2.pte_eviction_tax == 0 and r2.computed_prefill_tokens == 64
    # 96 cached + 64 prefilled = 160 computed, 10 whole blocks; 144 of them still cached
    r3 = turn(ledger, "s", prompt=2100, output=5, cached=144, finished_at=1010.0)
    assert r3.pte_eviction_tax == 160 - 144


def test_a_turn_aborted_while_queued_leaves_the_previous_turns_context(ledgers):
    """A turn the engine never ran computed nothing: the next turn can still reuse what the
    turn before it computed, no more and no less."""
    ledger = ledgers(block_size=16)
    turn(ledger, "s", prompt=100, output=11, cached=0, finished_at=1000.0)  # 110 computed → 96
    r2 = aborted_turn(ledger, "s", prompt=2000, cached=0, prefilled=0, finished_at=1005.0)
    assert r2.pte_served == 0 and r2.turn == 2
    r3 = turn(ledger, "s", prompt=2100, output=5, cached=80, finished_at=1010.0)
    assert r3.turn == 3 and r3.pause_s == pytest.approx(4.0)  # from the abort
    assert r3.pte_eviction_tax == 96 - 80
    ledger.flush()  # the same from the store, as another process reads it
    r4 = turn(ledger, "s", prompt=2200, output=5, cached=2096, finished_at=1020.0)
    assert r4.pte_eviction_tax == 0  # turn 3: 2100 + 4 computed → 2096 reusable, all cached


def test_two_processes_on_one_store_number_one_session(ledgers, tmp_path):
    """Turns of one session alternating between two API servers' ledgers (one file) are one
    session: numbered in order, each pause and reusable prefix from the turn before, which
    the other process priced; either reads the same session back."""
    path = tmp_path / "sessions.sqlite3"
    a, b = ledgers(path=path, block_size=16), ledgers(path=path, block_size=16)
    r1 = turn(a, "s", prompt=100, output=11, cached=0, finished_at=1000.0)
    assert a.flush()  # committed: the other process's next read sees it
    r2 = turn(b, "s", prompt=180, output=5, cached=0, finished_at=1007.0, e2e=2.0)
    assert b.flush()
    r3 = turn(a, "s", prompt=260, output=5, cached=176, finished_at=1010.0, e2e=1.0)
    assert (r1.turn, r2.turn, r3.turn) == (1, 2, 3)
    assert r2.pause_s == pytest.approx(5.0) and r3.pause_s == pytest.approx(2.0)
    assert r2.pte_eviction_tax == 96  # 110 computed → 96 in whole blocks, none of it cached
    assert r3.pte_eviction_tax == 0  # 184 computed → 176 reusable, all cached
    assert a.get("s") == b.get("s") and [t["turn"] for t in a.get("s")["turn_rows"]] == [1, 2, 3]
    assert a.host_stats()["sessions_opened"] == 1 == b.host_stats()["sessions_opened"]


def parallel_sample(parent: str, index: int, output: int) -> RequestRecord:
    """Sample ``index`` of the parallel-sampling (n > 1) turn ``parent`` of session "s",
    joined with its engine totals and priced as the pricer prices it."""
    req = FinishedRequest(parent, "m", 100, 0, output, "stop", session_id="s", turn=1)
    totals = RequestTotals(f"{index}_{parent}-0123abcd", parent, 0, "stop", child_index=index, scheduled=True)
    return price_request(COST, with_engine_totals(req, totals), 1000.0)


def test_a_parallel_sampling_turn_is_on_its_way_until_every_sample_is_in_the_store(ledgers):
    """vLLM reports each sample of an n > 1 request finished under the parent's id, and each is
    priced and filed under its own (``<index>_<parent>``): the session's turn stays on its way
    (unpriced, not landed) until both samples are in the store, then nothing of it is left."""
    ledger = ledgers()
    ledger.told_finished("chatcmpl-x", "s")  # sample 0 finished
    ledger.told_finished("chatcmpl-x", "s")  # sample 1 finished
    ledger.add(parallel_sample("chatcmpl-x", 0, 10))
    assert ledger.flush()
    assert len(ledger.unlanded) == 1 and ledger.unpriced_since("s") < math.inf  # sample 1 is not
    ledger.add(parallel_sample("chatcmpl-x", 1, 12))
    assert ledger.flush()
    assert len(ledger.unlanded) == 0 and ledger.unpriced_since("s") == math.inf
    assert [r["request_id"] for r in ledger.get("s")["turn_rows"]] == ["0_chatcmpl-x", "1_chatcmpl-x"]


def test_the_store_outlives_the_process(tmp_path):
    """A new ledger on the same file (an API server restarted) continues every session."""
    path = tmp_path / "sessions.sqlite3"
    first = SessionLedger(path, block_size=16)
    turn(first, "s", prompt=100, output=11, cached=0, finished_at=1000.0)
    first.close()  # commits what is queued
    again = SessionLedger(path, block_size=16)
    try:
        r2 = turn(again, "s", prompt=180, output=5, cached=0, finished_at=1100.0)
        assert r2.turn == 2 and r2.pte_eviction_tax == 96 and len(again) == 1
    finally:
        again.close()


def _open_store_at(path: str, start: Barrier) -> None:
    start.wait()
    SessionLedger(Path(path)).close()  # a StoreError ends the process with exit code 1


def test_api_servers_that_open_a_new_store_at_once_all_share_it(tmp_path):
    """The API servers of one server start together and open its store at the same moment:
    each must share it, not give up on a store another is still creating (SQLite answers
    "database is locked" at once to a second process turning a new file to WAL, whatever
    the busy timeout)."""
    # Forked from a process without threads: a child forked from this one could inherit a lock
    # (SQLite's) another writer thread held at that moment, and hang on it.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    for trial in range(20):
        start = ctx.Barrier(3)
        path = str(tmp_path / f"sessions-{trial}.sqlite3")
        openers = [ctx.Process(target=_open_store_at, args=(path, start)) for _ in range(3)]
        for p in openers:
            p.start()
        for p in openers:
            p.join(60)
        assert [p.exitcode for p in openers] == [0, 0, 0], f"trial {trial}: a process could not open {path}"


def test_a_file_that_is_not_a_store_is_refused_by_name(tmp_path):
    bad = tmp_path / "not-a-store.sqlite3"
    bad.write_bytes(b"this is not SQLite" * 100)
    with pytest.raises(StoreError, match=r"not-a-store\.sqlite3"):
        SessionLedger(bad)
    with pytest.raises(StoreError, match="cannot open"):
        SessionLedger(tmp_path)  # a directory


def test_max_turns_keeps_totals(ledgers):
    ledger = ledgers(max_turns=3)
    records = [turn(ledger, "s", 10 * (i + 1), 2, 0, 1000.0 + i) for i in range(5)]
    s = ledger.get("s")  # reads flush this process's queued turns first
    assert [t["turn"] for t in s["turn_rows"]] == [3, 4, 5]
    assert s["turns"] == 5 and s["turns_dropped"] == 2 and ledger.stats.turns_dropped == 2
    assert s["pte_served"] == pytest.approx(sum(r.pte_served for r in records))


def test_cap_and_ttl_close_sessions_with_a_reason(ledgers):
    clock = Clock()
    closed = []
    ledger = ledgers(
        max_sessions=2,
        idle_ttl_s=60,
        clock=clock,
        on_close=lambda s, why: closed.append((s["session_id"], why)),
    )
    for sid in ("a", "b", "c"):
        turn(ledger, sid, 10, 1, 0, clock.t)
    assert ledger.flush()
    assert closed == [("a", "evicted")] and len(ledger) == 2
    clock.t += 30
    turn(ledger, "b", 20, 1, 0, clock.t)  # b active again
    clock.t += 45  # c idle 75 s, b 45 s
    ledger.expire()
    assert ledger.flush()
    assert closed[-1] == ("c", "idle") and len(closed) == 2 and ledger.get("b") is not None
    assert (ledger.stats.sessions_opened, ledger.stats.sessions_evicted, ledger.stats.sessions_expired) == (
        3,
        1,
        1,
    )


def test_sessions_expiring_together_close_in_bounded_transactions_each_told_once(ledgers):
    """5,000 sessions idle past the TTL at once: each is closed and told closed once, and no
    one transaction closes more than ``EXPIRE_PER_COMMIT`` of them (one transaction holds the
    store's write lock for every API server on the host, and its summaries are held until it
    commits)."""
    clock = Clock()
    events: list[str | None] = []  # a session closed, or None: a transaction committed
    ledger = ledgers(
        idle_ttl_s=60,
        max_sessions=10**6,
        clock=clock,
        on_close=lambda s, why: events.append(s["session_id"]),
    )
    ledger.on_live = lambda live: events.append(None)
    n = 5_000
    template = turn(ledger, "template", 50, 2, 0, clock.t)
    for i in range(n - 1):
        ledger.add(replace(template, request_id=f"r{i}", session_id=f"s{i}"))
    assert ledger.flush() and len(ledger) == n
    clock.t += 61
    events.clear()
    ledger.expire()
    assert wait(lambda: ledger.flush() and len(ledger) == 0, timeout_s=60)
    closed = [e for e in events if e is not None]
    assert len(closed) == len(set(closed)) == n and ledger.stats.sessions_expired == n
    per_commit, run = [], 0
    for e in events:
        if e is None:
            per_commit.append(run)
            run = 0
        else:
            run += 1
    assert max([*per_commit, run]) <= EXPIRE_PER_COMMIT


def test_top_sessions_sorted_and_paginated(ledgers):
    ledger = ledgers()
    for sid, prompt in (("small", 10), ("big", 1000), ("mid", 100)):
        turn(ledger, sid, prompt, 1, 0, 1000.0)
    total, rows = ledger.top(limit=2)
    assert total == 3 and [r["session_id"] for r in rows] == ["big", "mid"]
    assert [r["session_id"] for r in ledger.top(limit=2, offset=2)[1]] == ["small"]


def _grow_a_hundred_thousand_ids(cap: int) -> tuple[float, int, int, int, int]:
    """Run in a fresh process: a hundred thousand session and request ids through stores of
    ``cap`` entries; (MiB the heap grew, sessions and tags held, sessions evicted, tags
    dropped)."""
    ledger = SessionLedger(max_sessions=cap, max_turns=4)
    pending = PendingTags(capacity=cap)
    recent = LiveEfficiency(window=cap)  # the feedback window: the other per-request store
    tracemalloc.start()
    for i in range(cap):
        turn(ledger, f"warm-{i}", 50, 2, 0, 1000.0)
        recent.observe(f"warm-req-{i}", f"warm-{i}", "m", "none", 2, "stop")
    # Both measurements once both writers have caught up: what is still queued is not what
    # the stores keep (measured with the queue full, the base hid 1.5 MiB of growth, and
    # a busy host moved the result by as much).
    assert ledger.flush() and recent.store.flush()
    base = heap_now()
    template = turn(ledger, "template", 50, 2, 0, 1000.0)
    for i in range(100_000):
        pending.put(f"req-{i}", RequestTag(f"sid-{i}", "none"))
        recent.observe(f"req-{i}", f"sid-{i}", "m", "none", 2, "stop")
        if i % 5 == 0:  # the store is on disk: 20,000 new sessions show its bound in memory
            ledger.add(replace(template, session_id=f"sid-{i}"))
        if i % 5000 == 4999:  # the writer keeps pace, as with requests that take time to run
            assert ledger.flush(timeout=120) and recent.store.flush(timeout=120)
    grown = (heap_now() - base) / 2**20
    tracemalloc.stop()
    ledger.close()
    recent.close()
    return grown, len(ledger), len(pending), ledger.stats.sessions_evicted, pending.dropped


def test_hundred_thousand_session_ids_stay_bounded():
    cap = 1000
    grown, sessions, tags, evicted, dropped = in_fresh_process(_grow_a_hundred_thousand_ids, cap)
    assert sessions == cap and tags == cap
    assert evicted == 21_001 - cap and dropped == 100_000 - cap
    assert grown < 1, f"grew {grown:.2f} MiB"


class _Record:
    """A queued record that can be watched (``weakref``)."""


class _HeldWriter(BatchWriter):
    def _connection(self, conn):
        return None


def test_a_batch_whose_commit_raises_is_said_and_the_writer_goes_on():
    """A commit that raises what it should have caught (a store's value no writer of this
    release would leave, say) is a fault said once; the writer thread goes on to the next
    batches, and flushes return, rather than dying with every later record queued for ever."""
    committed: list[list] = []
    errors: list[Exception] = []

    def commit(conn, items, expire):
        if any(item == ("turn", "bad") for item in items):
            raise IndexError("list index out of range")
        committed.append(items)

    writer = _HeldWriter(commit, errors.append, "s", 100)
    try:
        writer.put(("turn", "bad"))
        assert writer.flush(5)
        writer.put(("turn", "good"))
        assert writer.flush(5)
        assert ("turn", "good") in [item for items in committed for item in items]
        assert len(errors) == 1 and "IndexError: list index out of range" in str(errors[0])
    finally:
        writer.stop_writer()


def test_a_flush_returns_once_the_writer_holds_nothing_it_committed():
    """What a flush waited for is let go before the flush returns: a writer that signalled
    first and dropped its batch after kept a whole batch alive past the flush (on a busy
    host, the bounded-memory measurement above read 2 MiB of records already committed)."""
    release = threading.Event()
    writer = _HeldWriter(lambda conn, items, expire: release.wait(), lambda e: None, "s", 10_000)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the flushing thread takes the GIL back as soon as it can
    try:
        held = 0
        for _ in range(30):
            release.clear()
            writer.put(("beat",))  # the writer takes it alone and waits in the commit
            refs = []
            for _ in range(1000):  # the next batch: the flush comes last in it
                record = _Record()
                refs.append(weakref.ref(record))
                writer.put(("turn", record))
                del record
            threading.Timer(0.005, release.set).start()
            assert writer.flush()
            held += any(r() is not None for r in refs)
    finally:
        sys.setswitchinterval(interval)
        release.set()
        writer.stop_writer()
    assert held == 0, f"{held} of 30 flushes returned with committed records still held"


def test_a_full_write_queue_loses_records_counted(ledgers, monkeypatch):
    errors: list[Exception] = []
    ledger = ledgers(max_queued=50, on_error=errors.append)
    template = turn(ledger, "template", 50, 2, 0, 1000.0)
    assert ledger.flush()
    release = threading.Event()
    commit = ledger.store.commit

    def stalled(*args):  # a store that has stopped taking writes (a disk that hangs)
        release.wait(60)
        return commit(*args)

    monkeypatch.setattr(ledger.store, "commit", stalled)
    for i in range(100):
        ledger.add(replace(template, session_id=f"s-{i}"))
    release.set()
    assert ledger.flush(timeout=60)
    stored = ledger.host_stats()["sessions_opened"] - 1
    assert 0 < ledger.stats.records_lost == 100 - stored
    assert len(errors) == ledger.stats.records_lost and "50 records waiting" in str(errors[0])


def test_a_failed_batch_is_lost_whole_and_counted(ledgers, monkeypatch):
    errors: list[Exception] = []
    ledger = ledgers(on_error=errors.append)
    turn(ledger, "kept", 50, 2, 0, 1000.0)
    assert ledger.flush()
    monkeypatch.setattr(failpoints, "points", {"session_store": 1.0})
    turn(ledger, "kept", 60, 2, 0, 1001.0)
    turn(ledger, "lost", 50, 2, 0, 1001.0)
    assert ledger.flush()
    monkeypatch.setattr(failpoints, "points", {})
    assert ledger.stats.records_lost == 2 and "injected fault" in str(errors[-1])
    assert ledger.get("lost") is None and ledger.get("kept")["turns"] == 1  # nothing half-written
    assert ledger.host_stats()["sessions_opened"] == 1


def test_a_number_that_is_not_finite_costs_its_record_that_number_and_no_record_is_lost(ledgers, monkeypatch):
    """One record of a batch has a NaN (its GPU seconds) and an infinity (its served PTE): the
    store takes the whole batch, that record's GPU seconds as unknown and its served PTE as 0,
    with one sessions fault naming both; the other records land as they are."""
    errors: list[Exception] = []
    ledger = ledgers(on_error=errors.append)
    busy, release = threading.Event(), threading.Event()
    commit = ledger.store.commit

    def stalled(*args):  # the writer waits while the records queue: they are its next batch
        busy.set()
        release.wait(60)
        return commit(*args)

    monkeypatch.setattr(ledger.store, "commit", stalled)
    ledger.expire()
    assert busy.wait(10)
    good = [turn(ledger, f"ok-{i}", 100, 10, 0, 1000.0) for i in range(3)]
    bad = price_request(
        COST, FinishedRequest("bad", "m", 100, 0, 10, "stop", session_id="bad", turn=1), 1000.0
    )
    ledger.add(replace(bad, gpu_seconds=math.nan, pte_served=math.inf))
    release.set()
    assert ledger.flush(timeout=60)
    assert ledger.stats.records_lost == 0
    assert [e for e in errors if "not a finite number" in str(e)] == errors and len(errors) == 1
    assert "gpu_seconds" in str(errors[0]) and "pte_served" in str(errors[0])
    [row] = ledger.get("bad")["turn_rows"]
    assert row["gpu_seconds"] is None and row["pte_served"] == 0.0
    assert ledger.get("bad")["pte_served"] == 0.0
    assert [ledger.get(f"ok-{i}")["pte_served"] for i in range(3)] == [r.pte_served for r in good]
    m = ledger.model_totals()["m"]
    assert m["requests"] == 4 and m["requests_timed"] == 0
    assert m["pte_served"] == pytest.approx(3 * good[0].pte_served)


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


def test_ledger_metrics_publish_state_and_count_drops_once(ledgers):
    from prometheus_client import CollectorRegistry

    from pte_instrument.server.exporters.prometheus import LedgerMetrics, PteMetrics

    registry = CollectorRegistry()
    ledger, pending = ledgers(max_sessions=2, max_turns=1), PendingTags(capacity=1)
    published = LedgerMetrics(PteMetrics(registry), ledger, pending)

    def value(name: str) -> float:
        return registry.get_sample_value(name)

    for sid in ("a", "b", "c"):  # "a" evicted by the cap of 2
        turn(ledger, sid, 10, 1, 0, 1000.0)
    turn(ledger, "c", 20, 1, 0, 1001.0)  # c's first row dropped by max_turns=1
    pending.put("x", RequestTag("s1", "none"))
    pending.put("y", RequestTag("s2", "none"))  # "x" dropped by the capacity of 1
    assert ledger.flush()
    published.sync()
    published.sync()  # a second sync with nothing new adds nothing
    assert value("pte_sessions_live") == 2
    assert value("pte_sessions_opened_total") == 3
    assert value("pte_session_turn_rows_dropped_total") == 1
    assert value("pte_session_tags_dropped_total") == 1
    turn(ledger, "d", 10, 1, 0, 1002.0)
    assert ledger.flush()
    published.sync()
    assert (value("pte_sessions_live"), value("pte_sessions_opened_total")) == (2, 4)


def test_live_sessions_are_published_by_each_commit_from_the_count_it_read(ledgers):
    """Several API servers publish the gauge and the latest value set wins ("mostrecent"):
    each must set it when its writer reads the store's count, not later from a count its
    writer read a second before (a server that published 0 after another had published 2
    left the gauge at 0)."""
    from prometheus_client import CollectorRegistry

    from pte_instrument.server.exporters.prometheus import LedgerMetrics, PteMetrics

    registry = CollectorRegistry()
    ledger = ledgers()
    LedgerMetrics(PteMetrics(registry), ledger, PendingTags(capacity=4))
    assert registry.get_sample_value("pte_sessions_live") == 0
    turn(ledger, "a", 10, 1, 0, 1000.0)
    assert ledger.flush()
    assert registry.get_sample_value("pte_sessions_live") == 1  # no tick in between


def test_records_the_store_lost_are_published_once(ledgers, monkeypatch):
    """A record the store did not take is a turn missing from the sessions a user reads: the
    count is a Prometheus counter, not only a fault line."""
    from prometheus_client import CollectorRegistry

    from pte_instrument.server.exporters.prometheus import LedgerMetrics, PteMetrics

    registry = CollectorRegistry()
    ledger = ledgers()
    published = LedgerMetrics(PteMetrics(registry), ledger, PendingTags(capacity=4))
    monkeypatch.setattr(failpoints, "points", {"session_store": 1.0})
    for sid in ("a", "b", "c"):
        turn(ledger, sid, 10, 1, 0, 1000.0)
    assert ledger.flush()
    monkeypatch.setattr(failpoints, "points", {})
    published.sync()
    published.sync()  # nothing new: nothing added
    assert registry.get_sample_value("pte_session_records_lost_total") == ledger.stats.records_lost == 3


def test_a_writer_that_cannot_open_the_store_counts_every_record_lost(tmp_path):
    path = tmp_path / "sessions.sqlite3"
    errors: list[Exception] = []
    ledger = SessionLedger(path, on_error=errors.append)
    try:
        for suffix in ("", "-wal", "-shm"):  # the file goes before the writer first opens it
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        path.mkdir()
        turn(ledger, "s", 50, 2, 0, 1000.0)
        assert ledger.flush()
        assert ledger.stats.records_lost == 1
        assert any("cannot open" in str(e) for e in errors) and any("lost" in str(e) for e in errors)
    finally:
        ledger.close()


def test_the_writer_keeps_no_record_once_it_is_committed(ledgers):
    """Memory between bursts is the queue's, not the writer's: once a flush returns, no
    committed record is still held (the last batch used to stay alive while the writer
    waited for the next one: up to a batch of records, which the 100,000-id test saw as
    a growth between 0 and 3 MiB from run to run)."""
    ledger = ledgers()
    template = turn(ledger, "template", 50, 2, 0, 1000.0)
    assert ledger.flush()
    refs = []
    for i in range(200):
        record = replace(template, session_id=f"s-{i}")
        refs.append(weakref.ref(record))
        ledger.add(record)
    del record
    assert ledger.flush()
    gc.collect()
    alive = sum(ref() is not None for ref in refs)
    assert alive == 0, f"{alive} committed records still held"


def test_a_store_deleted_while_the_server_runs_is_created_again_and_the_loss_counted(tmp_path):
    path = tmp_path / "store" / "sessions.sqlite3"
    errors: list[Exception] = []
    ledger = SessionLedger(path, on_error=errors.append)
    try:
        turn(ledger, "before", 100, 10, 0, 1001.0)
        ledger.flush()
        assert ledger.get("before")["turns"] == 1
        for suffix in ("", "-wal", "-shm"):  # what an operator's rm does
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        turn(ledger, "after", 100, 10, 0, 1002.0)
        ledger.flush()
        assert path.exists()  # a store again, at the configured path
        assert ledger.get("after")["turns"] == 1  # what came after is in it, read back
        assert ledger.get("before") is None  # what was in the deleted file is gone with it
        assert ledger.store.reopened == 1
        assert [str(e) for e in errors if "deleted or replaced" in str(e)], errors
        turn(ledger, "later", 100, 10, 0, 1003.0)
        ledger.flush()
        assert ledger.store.reopened == 1  # once: the new file is the store now
    finally:
        ledger.close()
    reopened = SessionLedger(path)  # and a restart finds it
    try:
        assert reopened.get("after")["turns"] == 1 and reopened.get("later")["turns"] == 1
    finally:
        reopened.close()


def test_a_store_knows_the_other_servers_writing_to_it(tmp_path):
    path = tmp_path / "shared.sqlite3"
    one = SessionLedger(path, server_id="server-a")
    two = SessionLedger(path, server_id="server-b")
    try:
        assert two.other_servers() == []
        turn(one, "s", 100, 10, 0, 1001.0)
        one.flush()  # a commit says it is alive
        assert two.other_servers() == ["server-a"] and one.other_servers() == []
        one.close()  # shutting down: no longer a server of the store
        assert two.other_servers() == []
    finally:
        one.close()
        two.close()


def test_the_default_store_is_private_to_the_servers_port():
    from pte_instrument.settings import default_session_store
    from pte_instrument.vllm_adapter.plugin import serve_port

    assert serve_port(["vllm", "serve", "m", "--port", "8011"]) == 8011
    assert serve_port(["vllm", "serve", "m", "--port=8012", "--host", "0.0.0.0"]) == 8012
    assert serve_port(["vllm", "serve", "m"]) == 8000  # vLLM's default
    assert serve_port(["vllm", "serve", "m", "--port", "nope"]) is None
    assert serve_port(["/v/lib/vllm/entrypoints/openai/api_server.py", "--model", "m", "--port", "9"]) == 9
    assert serve_port(["/v/lib/pte_instrument/vllm_adapter/serve.py", "m"]) == 8000
    assert serve_port(["python", "-c", "pass"]) is None  # not a server
    a, b = default_session_store(8011), default_session_store(8012)
    assert a != b and a.endswith("sessions-8011.sqlite3") and Path(a).parent == Path(b).parent
