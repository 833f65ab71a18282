"""The session store a fleet of replicas shares (a real ``redis-server``), and the routing tax:
every replica reads whole sessions and totals, each request is applied once, the bounds hold,
and a store that is down or never answers costs the request path nothing."""

import contextlib
import math
import shutil
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from pte_instrument.devtools.redis_server import RedisServer
from pte_instrument.server import turn_order
from pte_instrument.server.records import FinishedRequest, price_request
from pte_instrument.server.redis_store import RedisSessionLedger, open_ledger, shown_url
from pte_instrument.server.sessions import SessionLedger
from pte_instrument.wire import RequestTotals
from tests.server.test_sessions import COST, Clock, turn

REDIS = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (make test installs it)")


class HoldingProxy:
    """A TCP relay in front of a Redis server that can stop answering (``hold``): it keeps
    accepting connections and reading commands, and relays nothing until ``release``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.holding = threading.Event()
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def hold(self) -> None:
        self.holding.set()

    def release(self) -> None:
        self.holding.clear()

    def close(self) -> None:
        self._stop.set()
        for s in [self.listener, *self._sockets]:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._relay, args=(a, b), daemon=True).start()

    def _relay(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.05)
        while not self._stop.is_set():
            if self.holding.is_set():  # read and drop nothing: what arrives waits in the socket
                time.sleep(0.01)
                continue
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            while self.holding.is_set() and not self._stop.is_set():  # read as the hold began
                time.sleep(0.01)
            try:
                dst.sendall(data)
            except OSError:
                return


def flush(server: RedisServer) -> None:
    import redis

    client = redis.Redis.from_url(server.url)
    deadline = time.monotonic() + 30
    while True:
        try:  # a server just restarted answers "loading" until it has read its append-only file
            client.flushall()
            return
        except redis.BusyLoadingError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"), fsync="always").start()
    yield server
    server.stop()


@pytest.fixture
def fleet(redis_server):
    """Ledgers on the one Redis store, as replicas would open them; closed after the test."""
    flush(redis_server)
    made: list[SessionLedger] = []

    def make(name: str = "a", url: str | None = None, **kwargs) -> RedisSessionLedger:
        ledger = open_ledger(url or redis_server.url, server_id=name, **kwargs)
        assert isinstance(ledger, RedisSessionLedger)
        made.append(ledger)
        return ledger

    yield make
    for ledger in made:
        ledger.close()


def serve(ledger: SessionLedger, replica: str, sid: str, prompt: int, output: int, cached: int, at: float):
    """One turn of ``sid`` served by ``replica``, priced as the pricer does, and filed."""
    return turn(ledger, sid, prompt, output, cached, at, replica=replica)


def test_a_turn_moved_to_another_replica_pays_routing_tax_not_eviction_tax():
    """The reusable prefix a turn prefilled again is routing's doing when the previous turn ran
    elsewhere, the engine's when it ran here; delivered + routing + eviction = reusable."""
    base = FinishedRequest("r", "m", 1000, 200, 10, "stop", reusable_tokens=800, replica="b")
    same = price_request(COST, replace(base, previous_replica="b"), 1.0)
    moved = price_request(COST, replace(base, previous_replica="a"), 1.0)
    first = price_request(COST, replace(base, previous_replica=None), 1.0)
    # 800 reusable, 200 delivered from the cache: 600 prefilled again
    assert (same.pte_eviction_tax, same.pte_routing_tax) == (600.0, 0.0)
    assert (moved.pte_eviction_tax, moved.pte_routing_tax) == (0.0, 600.0)
    assert (first.pte_eviction_tax, first.pte_routing_tax) == (600.0, 0.0)
    assert moved.pte_served == same.pte_served  # the split changes no cost
    assert moved.gpu_seconds_routing_tax is None  # no step hook: no seconds to split
    totals = RequestTotals("r", "r", 0, "stop", scheduled=True, gpu_prefill_s=0.5)
    timed = replace(base, previous_replica="a", engine_totals=totals)
    # 600 of the 1,000 − 200 = 800 positions it prefilled: three quarters of its 0.5 prefill seconds
    assert price_request(COST, timed, 1.0).gpu_seconds_routing_tax == pytest.approx(0.5 * 600 / 800)


def test_replicas_alternating_read_whole_sessions_and_charge_routing_where_it_moved(fleet):
    a, b = fleet("a"), fleet("b")
    clock = 1000.0
    served = []
    for i, (ledger, name) in enumerate([(a, "a"), (b, "b"), (b, "b"), (a, "a")]):
        clock += 10
        prompt = 100 * (i + 1)
        cached = 0 if i in (0, 1) else 96  # turn 2 moved and found nothing; turn 3 stayed
        served.append(serve(ledger, name, "s1", prompt, 5, cached, clock))
        assert ledger.flush()
    assert [r.turn for r in served] == [1, 2, 3, 4]
    assert [r.replica for r in served] == ["a", "b", "b", "a"]
    assert served[1].pte_routing_tax > 0 and served[1].pte_eviction_tax == 0
    assert served[2].pte_routing_tax == 0  # same replica: what it missed is eviction tax
    assert served[3].pte_routing_tax > 0
    for ledger in (a, b):
        whole = ledger.get("s1")
        assert whole["turns"] == 4
        assert [t["replica"] for t in whole["turn_rows"]] == ["a", "b", "b", "a"]
        assert whole["pte_routing_tax"] == pytest.approx(sum(r.pte_routing_tax for r in served))
        assert whole["pte_eviction_tax"] == pytest.approx(sum(r.pte_eviction_tax for r in served))
        assert whole["pte_served"] == pytest.approx(sum(r.pte_served for r in served))
        totals = ledger.model_totals()["m"]
        assert totals["requests"] == 4
        assert totals["pte_routing_tax"] == pytest.approx(whole["pte_routing_tax"])
        assert ledger.top()[0] == 1


def test_a_request_sent_twice_is_applied_once(fleet):
    a, b = fleet("a"), fleet("b")
    record = serve(a, "a", "s", 50, 5, 0, 1000.0)
    b.add(record)  # the same request id, from another replica
    a.add(record)
    assert a.flush() and b.flush()
    assert a.get("s")["turns"] == 1
    assert b.model_totals()["m"]["requests"] == 1


def test_bounds_turn_rows_live_sessions_and_idle_expiry(fleet):
    clock = Clock()
    closed: list[tuple[dict, str]] = []
    a = fleet(
        "a",
        max_turns=2,
        max_sessions=2,
        idle_ttl_s=60,
        clock=clock,
        on_close=lambda s, r: closed.append((s, r)),
    )
    for t in range(3):
        serve(a, "a", "long", 10 * (t + 1), 2, 0, clock.t + t)
    a.flush()
    long = a.get("long")
    assert (long["turns"], long["turns_dropped"], len(long["turn_rows"])) == (3, 1, 2)
    assert [row["turn"] for row in long["turn_rows"]] == [2, 3]
    serve(a, "a", "x", 10, 2, 0, clock.t)
    serve(a, "a", "y", 10, 2, 0, clock.t)  # a third live session: the least recently active closes
    a.flush()
    assert [(s["session_id"], r) for s, r in closed] == [("long", "evicted")]
    assert closed[0][0]["turns"] == 3
    clock.t += 61
    a.expire()
    a.flush()
    assert sorted((s["session_id"], r) for s, r in closed[1:]) == [("x", "idle"), ("y", "idle")]
    assert a.host_stats() == {
        "live": 0,
        "sessions_opened": 3,
        "sessions_expired": 2,
        "sessions_evicted": 1,
        "turns_dropped": 1,
    }
    assert len(a) == 0


def test_feedback_labels_an_instance_once_from_any_replica(fleet):
    a, b = fleet("a"), fleet("b")
    a.observe("r1", "s", "m", "gsm8k", 10, False)
    assert a.flush()  # the session's first request is in the window before its second
    b.observe("r2", "s", "m", "gsm8k", 30, True)
    b.observe("r3", None, "m", "gsm8k", 7, False)
    assert b.flush()
    assert b.label(True, [], "s") == {
        "model": "m",
        "benchmark": "gsm8k",
        "requests": 2,
        "output_tokens": 40,
        "truncated": True,
        "correct": False,  # its last answer was truncated
    }
    assert a.label(True, [], "s") == []  # already labeled, from the other replica too
    assert a.label(True, ["nope", "r3"], None)["correct"] is True
    assert a.label(False, ["gone"], None) is None
    assert a.outcomes()[("m", "gsm8k")] == {
        "requests": 3,
        "truncated": 1,
        "output_tokens": 47,
        "labeled": 2,
        "labeled_truncated": 1,
        "labeled_output_tokens": 47,
        "correct": 1,
    }


def test_the_feedback_window_forgets_the_oldest(fleet):
    a = fleet("a", feedback_window=2)
    for i in range(3):
        a.observe(f"r{i}", None, "m", "none", 1, False)
    a.flush()
    assert a.label(True, ["r0"], None) is None
    assert a.label(True, ["r2"], None) is not None


def test_an_unreachable_store_costs_nothing_and_its_turns_land_once_it_is_back(fleet, redis_server):
    faults: list[Exception] = []
    a = fleet("a", on_error=faults.append)
    serve(a, "a", "s", 10, 2, 0, 1000.0)
    assert a.flush()
    redis_server.stop()
    try:
        t0 = time.monotonic()
        rec = serve(a, "a", "s", 20, 2, 0, 1010.0)  # its context: this process's own last turn
        assert rec.turn == 2
        assert time.monotonic() - t0 < 1.0
        assert a.flush(5)
        assert faults and a.stats.records_lost == 0  # said, and kept for the store's return
        t0 = time.monotonic()
        for i in range(50):  # left alone: no connection attempt per request
            serve(a, "a", f"other-{i}", 10, 2, 0, 1020.0)
        assert time.monotonic() - t0 < 1.0
    finally:
        redis_server.start()
    # the back-off (at most 30 s) ends; the kept turns land, in order, before later ones
    assert wait_for(lambda: _stored(a, "other-49") == 1, timeout_s=40)
    assert a.get("s")["turns"] == 2 and a.stats.records_lost == 0
    assert serve(a, "a", "s", 30, 2, 0, 1040.0).turn == 3
    a.flush()
    assert [row["prompt_tokens"] for row in a.get("s")["turn_rows"]] == [10, 20, 30]
    assert [row["turn"] for row in a.get("s")["turn_rows"]] == [1, 2, 3]


def test_a_batch_whose_reply_was_lost_is_sent_again_and_applied_once(fleet, monkeypatch):
    """The store applied a batch but its reply never came (a timeout after the write): the
    batch is kept and sent again, and its turns and observations count once."""
    from pte_instrument import failpoints

    a = fleet("a")
    monkeypatch.setitem(failpoints.points, "session_store", 1.0)  # every reply "lost"
    serve(a, "a", "s", 10, 2, 0, 1000.0)
    a.observe("r1", "s", "m", "gsm8k", 10, False)
    assert a.flush(5)
    monkeypatch.delitem(failpoints.points, "session_store")
    assert wait_for(lambda: a.flush(5) and not a._kept and not a._kept_observed, timeout_s=40)
    assert a.get("s")["turns"] == 1 and a.stats.records_lost == 0
    assert a.outcomes()[("m", "gsm8k")]["requests"] == 1
    assert a.outcomes()[("m", "gsm8k")]["output_tokens"] == 10


def test_sessions_expiring_together_are_each_told_closed_once_and_no_close_holds_redis(fleet, redis_server):
    """20,000 sessions idle past the TTL at once: each is closed and told closed once (its
    summary feeds the session histograms), no close script holds Redis for the other replicas
    long enough to time out a client, and the store is never left alone for it."""
    import redis

    r = redis.Redis.from_url(redis_server.url)
    clock = Clock()
    closed: list[tuple[str, str]] = []
    faults: list[Exception] = []
    a = fleet(
        "a",
        clock=clock,
        idle_ttl_s=60,
        max_sessions=10**6,
        on_close=lambda s, reason: closed.append((s["session_id"], reason)),
        on_error=faults.append,
    )
    n = 20_000
    one = FinishedRequest("r", "m", 100, 0, 10, "stop", session_id="s", turn=1, replica="a")
    priced = price_request(COST, one, 1000.0)
    for i in range(n):
        a.add(replace(priced, request_id=f"r{i}", session_id=f"s{i}"))
        if i % 5000 == 4999:  # within the writer's queue
            assert a.flush(60)
    assert a.flush(60) and len(a) == n
    slower_than = r.config_get("slowlog-log-slower-than")["slowlog-log-slower-than"]
    r.config_set("slowlog-log-slower-than", 50_000)  # µs: a script holding Redis for 50 ms
    r.slowlog_reset()
    try:
        clock.t += 61
        a.expire()
        assert wait_for(lambda: len(closed) >= n, timeout_s=30)
        assert a.flush(5)
        held = [e for e in r.slowlog_get(128) if a.store.scripts["close"].sha.encode() in e["command"]]
    finally:
        r.config_set("slowlog-log-slower-than", slower_than)
    assert sorted(closed) == sorted((f"s{i}", "idle") for i in range(n))  # each once
    assert held == []
    assert a.store.available and faults == []
    assert a.stats.sessions_expired == n and len(a) == 0
    assert a.host_stats() == {
        "live": 0,
        "sessions_opened": n,
        "sessions_expired": n,
        "sessions_evicted": 0,
        "turns_dropped": 0,
    }


def test_sessions_closed_by_a_call_whose_reply_was_lost_are_told_closed_by_the_next(fleet, monkeypatch):
    """The store closed idle sessions but its reply never came (a timeout after the script
    ran): the writer's next close call hands them over, and each is told closed once, with
    its summary as the store held it."""
    from pte_instrument import failpoints

    clock = Clock()
    closed: list[tuple[dict, str]] = []
    a = fleet("a", clock=clock, idle_ttl_s=60, on_close=lambda s, reason: closed.append((s, reason)))
    serve(a, "a", "s0", 10, 2, 0, 1000.0)
    serve(a, "a", "s0", 20, 2, 0, 1001.0)
    serve(a, "a", "s1", 10, 2, 0, 1000.0)
    assert a.flush()
    before = {sid: {k: v for k, v in a.get(sid).items() if k != "turn_rows"} for sid in ("s0", "s1")}
    assert (before["s0"]["turns"], before["s1"]["turns"]) == (2, 1)
    clock.t += 61
    monkeypatch.setitem(failpoints.points, "session_store", 1.0)  # every reply "lost"
    a.expire()
    assert a.flush(5)
    assert a.get("s0") is None and a.get("s1") is None and closed == []  # closed in Redis, untold
    monkeypatch.delitem(failpoints.points, "session_store")
    assert wait_for(lambda: a.flush(5) and len(closed) >= 2, timeout_s=10)
    a.expire()  # a later call hands over nothing again
    assert a.flush(5)
    assert sorted(closed, key=lambda c: c[0]["session_id"]) == [
        (before["s0"], "idle"),
        (before["s1"], "idle"),
    ]
    assert a.stats.sessions_expired == 2 and a.host_stats()["sessions_expired"] == 2


def test_observations_made_while_the_store_is_down_are_counted_once_it_is_back(fleet, redis_server):
    a = fleet("a")
    a.observe("r0", None, "m", "none", 5, False)
    assert a.flush()
    redis_server.stop()
    try:
        a.observe("r1", None, "m", "none", 7, True)
        assert a.flush(5) and a.stats.records_lost == 0
    finally:
        redis_server.start()
    assert wait_for(lambda: _requests(a) == 2, timeout_s=40)
    assert a.outcomes()[("m", "none")]["truncated"] == 1 and a.stats.records_lost == 0
    assert a.label(True, ["r1"], None) is not None  # in the window


def _requests(ledger: SessionLedger) -> int:
    try:
        return ledger.outcomes().get(("m", "none"), {}).get("requests", 0)
    except Exception:
        return -1


def test_a_store_that_never_answers_does_not_hold_the_pricing_path(fleet, redis_server):
    """A store that accepts connections and stops replying: each call gives up after the
    timeout, the store is then left alone, and the turns priced meanwhile land once it
    answers again."""
    proxy = HoldingProxy(redis_server.port)
    try:
        a = fleet("a", url=proxy.url)
        serve(a, "a", "s", 10, 2, 0, 1000.0)
        assert a.flush() and a.get("s")["turns"] == 1
        proxy.hold()
        t0 = time.monotonic()
        for i in range(20):
            serve(a, "a", f"held-{i}", 10, 2, 0, 1000.0 + i)
        assert time.monotonic() - t0 < 2.0
        assert a.flush(5)
        proxy.release()
        assert wait_for(lambda: all(_stored(a, f"held-{i}") == 1 for i in range(20)), timeout_s=40)
        assert a.stats.records_lost == 0
    finally:
        proxy.close()


def test_turns_kept_past_the_bound_or_when_the_server_stops_are_lost_and_counted(fleet, redis_server):
    """Kept for a store that is down: at most the writer queue's bound (the oldest go first),
    and nothing once the server stops; every turn and observation lost is counted."""
    a = fleet("a", max_queued=5)
    serve(a, "a", "s", 10, 2, 0, 1000.0)
    assert a.flush()
    redis_server.stop()
    try:
        for i in range(8):
            serve(a, "a", f"down-{i}", 10, 2, 0, 1010.0 + i)
            assert a.flush(5)
        assert a.stats.records_lost == 3
        a.observe("r-down", None, "m", "none", 1, False)
        assert a.flush(5) and a.stats.records_lost == 3
        a.close()
        assert a.stats.records_lost == 9
    finally:
        redis_server.start()


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _stored(ledger: SessionLedger, sid: str) -> int:
    try:
        found = ledger.get(sid)
    except Exception:
        return -1
    return 0 if found is None else found["turns"]


def test_the_store_url_is_shown_without_its_password():
    assert shown_url("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert shown_url("rediss://host:6380") == "rediss://host:6380"


@contextlib.contextmanager
def two_replicas(store: str, fleet, tmp_path) -> Iterator[tuple[SessionLedger, SessionLedger]]:
    """Replicas "a" and "b" on one store: a SQLite file (closed here), or the fleet's Redis."""
    if store == "redis":
        yield fleet("a"), fleet("b")
        return
    path = str(tmp_path / "sessions.sqlite3")
    a, b = SessionLedger(path, server_id="a"), SessionLedger(path, server_id="b")
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_a_turn_priced_before_the_previous_turns_write_landed_is_numbered_by_the_store(
    store, fleet, tmp_path
):
    """Replica b reads the session before a's turn 1 is in the store (its context says turn 1),
    and its turn lands second: the store numbers the turns in the order they landed."""
    with two_replicas(store, fleet, tmp_path) as (a, b):
        stale = b.context_for("s", 1009.0, 60)
        assert stale.turn == 1
        serve(a, "a", "s", 50, 5, 0, 1000.0)
        assert a.flush()
        late = FinishedRequest("s-late", "m", 60, 0, 5, "stop", session_id="s", turn=stale.turn, replica="b")
        b.add(price_request(COST, late, 1010.0))
        assert b.flush()
        rows = a.get("s")["turn_rows"]
        assert [(r["turn"], r["request_id"]) for r in rows] == [(1, "s-1"), (2, "s-late")]
        assert a.get("s")["turns"] == 2


def test_replicas_sharing_the_store_on_purpose_are_not_warned_about(fleet, caplog):
    """Two servers on one SQLite file are told so (a shared file is usually a mistake); a
    fleet's replicas share their Redis store by design."""
    from pte_instrument.server.runtime import Runtime

    a, b = fleet("a"), fleet("b")
    serve(a, "a", "s", 10, 2, 0, 1000.0)
    assert a.flush()
    assert b.other_servers() == ["a"]
    with caplog.at_level("WARNING", logger="pte_instrument"):
        Runtime._say_if_shared(b)
    assert not [r for r in caplog.records if "is shared with" in r.getMessage()]


def test_requests_that_reuse_a_client_request_id_are_each_applied(fleet):
    """Without the step hook a record's id is the client's (X-Request-Id), which clients reuse:
    two requests under one id are two turns; the same record sent again is one."""
    a = fleet("a")
    first = serve(a, "a", "s", 50, 5, 0, 1000.0)
    again = price_request(
        COST,
        FinishedRequest(first.request_id, "m", 60, 0, 5, "stop", session_id="s", turn=2, replica="a"),
        1010.0,
    )
    a.add(again)
    a.add(again)
    assert a.flush()
    assert a.get("s")["turns"] == 2
    assert a.model_totals()["m"]["requests"] == 2


def test_a_pricing_pass_reads_its_sessions_from_the_store_at_once(fleet, redis_server):
    """The pass's sessions are read in one round trip before it prices them: after it, the
    context reads need the store no more (here it stops answering in between)."""
    proxy = HoldingProxy(redis_server.port)
    try:
        faults: list[Exception] = []
        a, b = fleet("a"), fleet("b", url=proxy.url, on_error=faults.append)
        serve(a, "a", "s", 50, 5, 0, 1000.0)
        serve(a, "a", "s", 80, 5, 0, 1010.0)
        assert a.flush()
        b.prefetch(["s", "new", "s"])
        proxy.hold()
        ctx = b.context_for("s", 1020.0, 120)
        assert faults == []  # no round trip: one to the held store would time out, a fault
        # turn 2 computed its 80 prompt tokens and 4 of its 5 outputs; it finished at 1010
        assert (ctx.turn, ctx.previous_replica, ctx.reusable_tokens, ctx.pause_s) == (3, "a", 84, 10.0)
        assert b.context_for("new", 1020.0, 10).turn == 1
    finally:
        proxy.close()


def test_a_stores_commands_time_out_after_the_timeout_it_is_given(fleet):
    """``PTE_SESSION_STORE_TIMEOUT_S`` reaches the client: both its socket timeouts."""
    kwargs = fleet("a", timeout_s=3.0).store.client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 3.0
    kwargs = fleet("b").store.client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 0.25  # the default


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_each_writer_publishes_where_its_turns_stand_and_one_that_closed_is_not_waited_for(
    store, fleet, tmp_path
):
    """A writer's watermark stays at the earliest turn it was told finished until that turn is
    in the store; the other writer reads it, publishes often while it has company, and stops
    waiting for a writer that closed."""
    with two_replicas(store, fleet, tmp_path) as (a, b):
        assert b.others_caught_up_to() == math.inf  # a has written nothing: nothing to wait for
        told_at = time.time()
        a.told_finished("s-1", "s")
        assert a.flush() and b.flush()
        assert told_at <= b.others_caught_up_to() < told_at + 1  # a's turn 1 is not in the store
        assert b.store.heartbeat_s == turn_order.HEARTBEAT_S
        serve(a, "a", "s", 50, 5, 0, time.time())  # turn 1 (request "s-1") priced and filed
        assert a.unpriced_since("s") == math.inf
        landing = time.time()
        assert a.flush()
        assert b.others_caught_up_to() >= landing  # nothing of a's on its way: as of its commit
        a.close()
        assert b.others_caught_up_to() == math.inf
        assert b.flush() and b.store.heartbeat_s > turn_order.HEARTBEAT_S  # alone again


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_a_request_of_no_session_holds_the_requests_watermark_and_not_the_turns(store, fleet, tmp_path):
    """A request of no session that a writer was told finished holds back its published
    watermark of requests (what a label sent to another API server waits for) until it is in
    the store, and never its watermark of turns (what the other writers' turns wait for)."""
    with two_replicas(store, fleet, tmp_path) as (a, b):
        told_at = time.time()
        a.told_finished("r-1", None)
        assert a.flush() and b.flush()
        assert told_at <= b.others_caught_up_to(every_request=True) < told_at + 1
        assert b.others_caught_up_to() >= told_at  # no turn of a's is on its way
        a.add(price_request(COST, FinishedRequest("r-1", "m", 100, 0, 10, "stop"), time.time()))
        landing = time.time()
        assert a.flush()
        assert b.others_caught_up_to(every_request=True) >= landing


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_a_writer_of_an_older_release_is_waited_for_at_its_turns_watermark(store, fleet, tmp_path):
    """A replica of a release that publishes only the turns' watermark (a fleet upgraded one
    at a time): a label waits for that one in place of the requests' it does not publish."""
    with two_replicas(store, fleet, tmp_path) as (_, b):
        assert b.flush()
        now = time.time()
        if store == "redis":
            b.store.client.hset(b.store.prefix + "writers", "old/1", f"{now - 5!r} {now!r}")
        else:
            db = sqlite3.connect(b.path)
            with db:
                db.execute("INSERT INTO writers VALUES ('old/1', ?, ?)", (now - 5, now))
            db.close()
        assert b.others_caught_up_to(every_request=True) == pytest.approx(now - 5)


def test_a_number_that_is_not_finite_costs_its_record_that_number_not_the_turn(fleet):
    """A record whose GPU seconds are NaN (Redis's float increments refuse it): its turn lands,
    its GPU seconds unknown, with one sessions fault naming the field; the turn beside it too."""
    errors: list[Exception] = []
    a = fleet("a", on_error=errors.append)
    bad = price_request(
        COST, FinishedRequest("bad", "m", 100, 0, 10, "stop", session_id="bad", turn=1), 1000.0
    )
    a.add(replace(bad, gpu_seconds=math.nan))
    serve(a, "a", "ok", 100, 10, 0, 1000.0)
    assert a.flush()
    assert len(errors) == 1 and "gpu_seconds" in str(errors[0]) and "not a finite number" in str(errors[0])
    assert sorted(s["session_id"] for s in a.top()[1]) == ["bad", "ok"]
    [row] = a.get("bad")["turn_rows"]
    assert row["gpu_seconds"] is None and row["request_id"] == "bad"
    assert a.model_totals()["m"]["requests"] == 2 and a.stats.records_lost == 0
