"""More of the session stores under conditions a deployment meets: a sessions list paged deep
while requests are priced, a server that starts while another process holds its SQLite store
locked, and a real ``redis-server`` where another writer put values of its own into the
store's hashes or keys of another type where the feedback window's are. Pricing and serving go
on, what cannot be applied whole is not applied at all, counted and said."""

import logging
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from pte_instrument.server.session_store import StoreError
from pte_instrument.server.sessions import SessionLedger
from tests.helpers import wait
from tests.server import test_store_hostile as hostile
from tests.server.test_sessions import turn
from tests.server.test_store_hostile import _hold_exclusive, _requests, _store_lines, needs_redis

# the fixtures of the hostile tests: a redis-server of each test alone, a client, ledgers on it
redis_server, client, ledgers = hostile.redis_server, hostile.client, hostile.ledgers


def _fill(path: Path, n: int) -> None:
    """``n`` live sessions written into the store as another API server's writer commits them:
    session ``s<i>`` has ``pte_served`` ``i % 5000``."""
    now = time.time()  # active now: none is closed idle meanwhile
    db = sqlite3.connect(path)
    with db:
        db.executemany(
            "INSERT INTO sessions (id, model, first_seen, last_seen, touched, n_turns, turns_dropped,"
            " last_prompt, last_output, pte_served) VALUES (?, 'm', ?, ?, ?, 1, 0, 10, 2, ?)",
            ((f"s{i:06d}", now, now, i, float(i % 5000)) for i in range(n)),
        )
    db.close()


def test_pricing_reads_go_on_while_a_deep_page_of_the_sessions_list_is_read(tmp_path):
    """``/pte/sessions?offset=99990`` over 100,000 live sessions sorted by a PTE key: the page
    takes a while to read, and a turn's context read (the request path) does not wait for
    it; the page is the one a sort of every session gives."""
    n = 100_000
    path = tmp_path / "s.sqlite3"
    ledger = SessionLedger(path, max_sessions=10**6)
    try:
        _fill(path, n)
        expected = sorted(range(n), key=lambda i: (-(i % 5000), f"s{i:06d}"))[n - 10 :]
        total, rows = ledger.top(50, n - 10, "pte_served")
        assert total == n and [r["session_id"] for r in rows] == [f"s{i:06d}" for i in expected]
        assert [r["pte_served"] for r in rows] == [0] * 10
        pages: list[float] = []
        stop = threading.Event()

        def page() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                ledger.top(50, n - 10, "pte_served")
                pages.append(time.monotonic() - t0)

        pager = threading.Thread(target=page)
        pager.start()
        reads: list[float] = []
        try:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                context = ledger.context_for("s000007", 2000.0, 12)
                reads.append(time.monotonic() - t0)
                assert context.turn == 2
                time.sleep(0.005)
        finally:
            stop.set()
            pager.join()
        assert len(pages) >= 2, pages  # the pricer's reads met pages being read
        assert max(reads) < 0.1, (max(reads), sorted(pages))
    finally:
        ledger.close()


def _runtime(path: Path):
    """A server's runtime on the store at ``path``, and the seconds its start took."""
    from prometheus_client import CollectorRegistry

    from pte_instrument.server.runtime import Runtime
    from pte_instrument.settings import Settings

    t0 = time.monotonic()
    runtime = Runtime(Settings(session_store=str(path)), CollectorRegistry())
    return runtime, time.monotonic() - t0


def test_a_server_starting_on_a_store_another_process_holds_locked_starts_at_once(tmp_path, caplog):
    """A store another process holds the write lock of (``BEGIN EXCLUSIVE``: a maintenance
    shell, a ``VACUUM``): the server starts at once on it, without a fault, and prices with
    what it holds (reads go on); its turns wait for the lock and land once it goes."""
    caplog.set_level(logging.INFO, logger="pte_instrument")
    path = tmp_path / "s.sqlite3"
    before = SessionLedger(path)
    turn(before, "s", 10, 2, 0, 1000.0)
    assert before.flush()
    before.close()
    holder = _hold_exclusive(path)
    try:
        runtime, started = _runtime(path)
        ledger = runtime.sessions
        assert started < 2.0 and ledger.path == path, started
        assert runtime.faults.counts["sessions"] == 0 and _store_lines(caplog, str(path)) == []
        assert turn(ledger, "s", 20, 2, 0, 1001.0).turn == 2  # the store's context
    finally:
        holder.kill()
        holder.wait()
    try:
        assert wait(lambda: ledger.flush(1) and ledger.get("s")["turns"] == 2, timeout_s=40)
        assert ledger.stats.records_lost == 0
    finally:
        ledger.close()


def test_a_server_starting_on_a_new_store_another_process_holds_locked_opens_it_in_the_background(
    tmp_path, caplog
):
    """A store file that cannot even be read yet (another process holds a new file locked):
    the server's start waits a second at most, not ``OPEN_TIMEOUT_S``; one line says so,
    counted; the store is opened in the background and used once the lock goes (not a private
    store for the rest of the server's life); the turns priced meanwhile land, once."""
    caplog.set_level(logging.INFO, logger="pte_instrument")
    path = tmp_path / "s.sqlite3"
    holder = _hold_exclusive(path)
    try:
        runtime, started = _runtime(path)
        ledger = runtime.sessions
        assert started < 3.0 and ledger.path == path, started
        t0 = time.monotonic()
        assert turn(ledger, "s", 10, 2, 0, 1000.0).turn == 1
        assert time.monotonic() - t0 < 1.0  # pricing does not wait for the lock
        assert runtime.faults.counts["sessions"] >= 1
        lines = _store_lines(caplog, str(path))
        assert len(lines) == 1 and "locked" in lines[0] and "background" in lines[0], lines
    finally:
        holder.kill()
        holder.wait()
    try:
        assert wait(lambda: ledger.flush(1) and (ledger.get("s") or {}).get("turns") == 1, timeout_s=40)
        assert turn(ledger, "s", 20, 2, 0, 1001.0).turn == 2 and ledger.flush()
        assert ledger.get("s")["turns"] == 2 and ledger.model_totals()["m"]["requests"] == 2
        assert ledger.stats.records_lost == 0 and len(_store_lines(caplog, str(path))) == 1
    finally:
        ledger.close()


@needs_redis
@pytest.mark.parametrize(
    ("field", "value"),
    [("pte_served", "x"), ("pte_served", "inf"), ("n_turns", "1.5"), ("turns_dropped", "x")],
)
def test_a_value_another_writer_put_into_a_session_hash_costs_that_turn_whole(
    ledgers, redis_server, client, caplog, field, value
):
    """Another writer put a value the turn's increment cannot add to into a session's hash:
    that turn is not applied at all (not its request marked applied, its model's totals added
    and its session half-written, and a retry that skips it), it is counted lost once, said
    in one line, the store is not left alone and the batch's other turns land."""
    caplog.set_level(logging.INFO, logger="pte_instrument")
    faults: list[Exception] = []
    a = ledgers(redis_server.url, on_error=faults.append, max_turns=1)
    turn(a, "s", 10, 2, 0, 1000.0)
    assert a.flush() and _requests(a) == 1
    client.hset("pte:s:s", field, value)
    stored = client.hgetall("pte:s:s"), client.lrange("pte:t:s", 0, -1)
    counters = client.hgetall("pte:counters")
    turn(a, "s", 20, 2, 0, 1001.0)
    turn(a, "ok", 10, 2, 0, 1001.0)
    assert a.flush(5)
    assert a.store.available and _store_lines(caplog, "failed (") == []
    assert a.stats.records_lost == 1 and _requests(a) == 2 and a.get("ok")["turns"] == 1
    assert client.hgetall("pte:s:s") == stored[0] and client.lrange("pte:t:s", 0, -1) == stored[1]
    assert {k: v for k, v in client.hgetall("pte:counters").items() if k != "sessions_opened"} == {
        k: v for k, v in counters.items() if k != "sessions_opened"
    }
    why = [str(e) for e in faults if "not stored" in str(e)]  # (n_turns: its context read is a fault too)
    assert len(why) == 1 and f"pte:s:s field {field} holds {value!r}" in why[0], faults
    time.sleep(1.5)  # nothing is kept to be sent again
    assert a.flush(5) and a.stats.records_lost == 1 and not a._kept and _requests(a) == 2
    assert client.hgetall("pte:totals:model:m")["requests"] == "2"


@needs_redis
def test_a_value_another_writer_put_into_a_store_counter_costs_the_turns_it_would_count(
    ledgers, redis_server, client
):
    """The host's counter of opened sessions, or the activity counter, holding another
    writer's text: the turns that would add to it are refused whole, counted; the rest land."""
    faults: list[Exception] = []
    a = ledgers(redis_server.url, on_error=faults.append)
    turn(a, "s", 10, 2, 0, 1000.0)
    assert a.flush() and _requests(a) == 1
    client.hset("pte:counters", "sessions_opened", "many")
    turn(a, "new", 10, 2, 0, 1001.0)  # would open a session
    turn(a, "s", 20, 2, 0, 1001.0)  # would not
    assert a.flush(5) and a.store.available
    assert a.stats.records_lost == 1 and a.get("new") is None and a.get("s")["turns"] == 2
    assert _requests(a) == 2 and client.hget("pte:counters", "sessions_opened") == "many"
    client.set("pte:touched", "later")
    turn(a, "s", 30, 2, 0, 1002.0)
    assert a.flush(5) and a.stats.records_lost == 2 and a.get("s")["turns"] == 2 and _requests(a) == 2
    assert any("pte:touched" in str(e) for e in faults)


def _observed(ledger: SessionLedger, rid: str, sid: str | None) -> None:
    ledger.observe(rid, sid, "m", "none", 5, False)


@needs_redis
def test_a_session_index_of_another_type_in_the_feedback_window_stops_no_observation(
    ledgers, redis_server, client, caplog
):
    """A session's request index (``rs:``) replaced by a key of another type after its
    requests were observed: the requests leaving the window (and one observed again under
    another session) leave the key alone; every later group is applied whole, once, and the
    store is not left alone."""
    caplog.set_level(logging.INFO, logger="pte_instrument")
    a = ledgers(redis_server.url, feedback_window=2)
    _observed(a, "r1", "a")
    _observed(a, "r2", "b")
    assert a.flush() and a.outcomes()[("m", "none")]["requests"] == 2
    for sid in ("a", "b"):
        client.delete(f"pte:rs:{sid}")
        client.set(f"pte:rs:{sid}", "someone else's")
    _observed(a, "r2", "c")  # r2 again, under another session: out of b's index
    assert a.flush(5)
    _observed(a, "r3", None)  # pushes r1 out of the window: out of a's index
    assert a.flush(5)
    assert a.store.available and _store_lines(caplog, "failed (") == []
    time.sleep(1.5)
    assert a.flush(5) and not a._kept_observed and a.stats.records_lost == 0
    assert a.outcomes()[("m", "none")]["requests"] == 4
    assert client.zrange("pte:recent", 0, -1) == ["r2", "r3"] and not client.exists("pte:r:r1")
    assert client.zrange("pte:rs:c", 0, -1) == ["r2"]
    assert client.get("pte:rs:a") == client.get("pte:rs:b") == "someone else's"
    assert a.label(True, [], "c") == {
        "model": "m",
        "benchmark": "none",
        "requests": 1,
        "output_tokens": 5,
        "truncated": False,
        "correct": True,
    }


@needs_redis
def test_a_value_another_writer_put_into_the_observation_counts_costs_that_group_whole(
    ledgers, redis_server, client
):
    faults: list[Exception] = []
    a = ledgers(redis_server.url, on_error=faults.append)
    _observed(a, "r1", None)
    assert a.flush() and a.outcomes()[("m", "none")]["requests"] == 1
    client.hset("pte:outcomes", "m\x1fnone\x1foutput_tokens", "x")
    _observed(a, "r2", "s")
    assert a.flush(5) and a.store.available
    time.sleep(1.5)
    assert a.flush(5) and not a._kept_observed and a.stats.records_lost == 1
    assert [str(e).count("pte:outcomes field m/none/output_tokens holds 'x'") for e in faults] == [1]
    assert client.hget("pte:outcomes", "m\x1fnone\x1frequests") == "1"
    assert not client.exists("pte:r:r2") and not client.exists("pte:rs:s")
    assert client.zrange("pte:recent", 0, -1) == ["r1"]


@needs_redis
@pytest.mark.parametrize(
    "foreign",
    [
        ("hset", "pte:outcomes", "m\x1fnone\x1fcorrect", "x"),
        ("hset", "pte:r:r2", "output_tokens", "many"),
        ("set", "pte:r:r2", "someone else's"),
        ("set", "pte:rs:s", "someone else's"),
        ("set", "pte:outcomes", "someone else's"),
        ("hdel", "pte:r:r1", "output_tokens"),
    ],
)
def test_a_label_meeting_what_another_writer_put_in_the_window_is_refused_whole(
    ledgers, redis_server, client, caplog, foreign
):
    """A label whose requests or counts hold another writer's values (or keys of another
    type): nothing of it is applied (not the first counts, with its requests left unlabeled
    for a retry to count again), the refusal names the key, and the store is not left alone
    (every replica's pricing reads would fail meanwhile)."""
    caplog.set_level(logging.INFO, logger="pte_instrument")
    a = ledgers(redis_server.url)
    _observed(a, "r1", "s")
    _observed(a, "r2", "s")
    assert a.flush()
    command, *args = foreign
    if command == "set":
        client.delete(args[0])
    getattr(client, command)(*args)
    outcomes = client.hgetall("pte:outcomes") if client.type("pte:outcomes") == "hash" else None
    flags = {rid: client.hget(f"pte:r:{rid}", "labeled") for rid in ("r1",)}
    with pytest.raises(StoreError) as refused:
        a.label(True, [], "s")
    assert "pte:" in str(refused.value)
    assert a.store.available and _store_lines(caplog, "failed (") == []
    if outcomes is not None:
        assert client.hgetall("pte:outcomes") == outcomes
    assert {rid: client.hget(f"pte:r:{rid}", "labeled") for rid in ("r1",)} == flags
    if args[0] != "pte:outcomes":  # the store goes on
        _observed(a, "r3", None)
        assert a.flush(5) and a.label(True, ["r3"], None)["requests"] == 1


@needs_redis
def test_a_value_another_writer_put_into_a_closing_counter_closes_the_sessions_all_the_same(
    ledgers, redis_server, client
):
    """The host's count of sessions closed idle holding another writer's text: the sessions
    due close and are told closed once (not taken out of the store untold, with every batch
    failing after them), the counter is left as it is, and that is said."""
    faults: list[Exception] = []
    a, clock, closed = hostile.two_sessions_to_close(ledgers, redis_server.url, on_error=faults.append)
    client.hset("pte:counters", "sessions_expired", "x")
    clock.t += 120
    a.expire()
    assert a.flush(5) and a.store.available
    assert sorted(closed) == ["x", "y"] and len(a) == 0 and a.stats.sessions_expired == 2
    assert client.hget("pte:counters", "sessions_expired") == "x"
    assert len([e for e in faults if "sessions_expired" in str(e)]) == 1, faults
    turn(a, "z", 10, 2, 0, 1200.0)
    assert a.flush(5) and a.get("z")["turns"] == 1 and a.stats.records_lost == 0


@needs_redis
def test_reads_of_a_store_where_another_writer_put_values_of_its_own_answer_around_them(
    ledgers, redis_server, client
):
    """Another writer's text in a session's numbers, a model's totals, the host's counters and
    the outcome counts: ``/pte/sessions``, ``/pte/sessions/<id>`` and the summary's host-wide
    sections still answer (not a 500 for every reader), the unreadable values as null (not a
    guess), the session's unreadable turn rows left out, and everything else as stored."""
    a = ledgers(redis_server.url)
    for sid, pte in (("bad", 10), ("ok", 20)):
        turn(a, sid, pte, 2, 0, 1000.0)
    assert a.flush()
    client.hset("pte:s:bad", mapping={"n_turns": "many", "pte_served": "x", "first_seen": ""})
    client.rpush("pte:t:bad", "{not json")
    client.hset("pte:totals:model:m", "requests", "lots")
    client.hset("pte:counters", "sessions_opened", "x")
    client.hset(
        "pte:outcomes",
        mapping={
            "m\x1fb\x1frequests": "3",
            "m\x1fb\x1fcorrect": "1",
            "m\x1fb\x1fnot a count": "1",
            "m\x1fc\x1frequests": "y",  # a cell whose ratios cannot be read: left out whole
            "no separators": "1",
        },
    )

    bad = a.get("bad")
    assert bad["turns"] is None and bad["pte_served"] is None and bad["first_seen"] is None
    assert bad["model"] == "m" and len(bad["turn_rows"]) == 1 and bad["turn_rows"][0]["turn"] == 1
    total, rows = a.top(10, 0, "pte_served")
    assert total == 2 and {r["session_id"]: r["turns"] for r in rows} == {"bad": None, "ok": 1}
    assert a.get("ok")["turns"] == 1 and a.get("ok")["pte_served"] == pytest.approx(
        next(r["pte_served"] for r in rows if r["session_id"] == "ok")
    )
    totals = a.model_totals()["m"]
    assert totals["requests"] is None and totals["output_tokens"] == 4
    stats = a.host_stats()
    assert stats["sessions_opened"] is None and stats["live"] == 2
    cells = a.outcomes()
    assert list(cells) == [("m", "b")] and (cells["m", "b"]["requests"], cells["m", "b"]["correct"]) == (3, 1)
    assert sum(cells["m", "b"].values()) == 4


@needs_redis
def test_watermarks_another_writer_published_in_a_form_of_its_own_are_passed_over(
    ledgers, redis_server, client
):
    """Entries of the writers' hashes that are not ``<watermark> <time>`` (and a requests'
    watermark that is not a number) are no writer's: the store's writer goes on writing
    through its heartbeats and batches, and the peers' watermark reads the readable ones."""
    a = ledgers(redis_server.url)
    turn(a, "s", 10, 2, 0, 1000.0)
    assert a.flush() and _requests(a) == 1
    now = time.time()
    client.hset(
        "pte:writers",
        mapping={"peer/x": "garbage", "peer/y": "1.5", "peer/z": f"7.0 {now!r}", "peer/w": f"9.0 {now!r}"},
    )
    client.hset("pte:writers:requests", mapping={"peer/z": "many", "peer/w": "8.0"})
    time.sleep(1.5)  # heartbeats, each reading the writers' hash
    turn(a, "s", 20, 2, 0, 1001.0)
    assert a.flush(5) and a.store._writer.is_alive()
    assert a.get("s")["turns"] == 2 and _requests(a) == 2
    assert a.store.peer_watermark() == 7.0
    assert a.store.peer_watermark(every_request=True) == 7.0  # z's requests' unreadable: its turns'


def _sorts(client) -> int:
    """SORT commands the redis-server ran so far."""
    return int(client.info("commandstats").get("cmdstat_sort", {}).get("calls", 0))


@needs_redis
def test_a_sessions_page_past_the_end_or_next_to_a_session_someone_else_replaced_sorts_nothing(
    ledgers, redis_server, client
):
    """A page past the last live session is empty from the index, not a SORT of every live
    shares); a live session whose hash someone else replaced is left out of the pages, which
    need no SORT for it either."""
    a = ledgers(redis_server.url)
    for sid, pte in (("a", 10), ("b", 20), ("c", 30)):
        turn(a, sid, pte, 2, 0, 1000.0)
    assert a.flush()
    sorts = _sorts(client)
    assert a.top(10, 10**9, "pte_served") == (3, [])
    assert _sorts(client) == sorts
    client.delete("pte:s:b")
    client.set("pte:s:b", "someone else's")
    total, rows = a.top(10, 0, "pte_served")
    assert total == 3 and [r["session_id"] for r in rows] == ["c", "a"]
    assert a.top(10, 5, "pte_served") == (3, [])
    assert _sorts(client) == sorts and a.store.available


@needs_redis
def test_a_sessions_page_sorted_whole_over_another_writers_text_costs_that_page_only(
    ledgers, redis_server, client
):
    """The page must be sorted whole (a replica of an older release left the index short)
    and a session's sort key holds another writer's text, which Redis cannot sort by: that
    page fails, and the store is not taken for down — its other reads and the writes go on."""
    a = ledgers(redis_server.url)
    for sid, pte in (("a", 10), ("b", 20)):
        turn(a, sid, pte, 2, 0, 1000.0)
    assert a.flush()
    client.zrem("pte:by:pte_served", "a")
    client.hset("pte:s:b", "pte_served", "x")
    with pytest.raises(StoreError):
        a.top(10, 0, "pte_served")
    assert a.store.available
    assert a.get("a")["turns"] == 1
    turn(a, "c", 10, 2, 0, 1001.0)
    assert a.flush(5) and a.get("c")["turns"] == 1


@needs_redis
def test_a_models_totals_key_of_another_type_leaves_out_that_model_only(ledgers, redis_server, client):
    """Another writer's key of another type where one model's totals go: the summary's model
    totals still list every other model (not none at all, which reads as nothing priced)."""
    a = ledgers(redis_server.url)
    turn(a, "s", 10, 2, 0, 1000.0)
    assert a.flush()
    client.sadd("pte:models", "other")
    client.set("pte:totals:model:other", "someone else's")
    totals = a.model_totals()
    assert list(totals) == ["m"] and totals["m"]["requests"] == 1
    assert a.store.available
