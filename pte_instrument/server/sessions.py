"""Per-session (multi-turn agent) accounting, in one store per host that every API-server
process of the server shares (``session_store``): a session's turns are numbered, its pauses
and eviction tax computed, whichever process each turn reaches, and the ledger outlives a
restart. The same transactions carry the host's totals (``totals``) and the feedback window
(``feedback_window``).

Readers see every committed batch of every process; a process's own queued turns are seen at
once by ``context_for`` (a small overlay of them) and by the reads that flush first (``get``,
``top``, ``summary``). Each commit also says how far this process's turns have landed (its
watermark, ``turn_order``), so that a turn on another process is priced after them.

Bounded as before: at most ``max_sessions`` live sessions (the least recently active closes
first), each closed after ``idle_ttl_s`` without a turn, at most ``max_turns`` turn rows per
session (totals keep counting). Whatever is dropped is counted.
"""

from __future__ import annotations

import contextlib
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from pte_instrument.cost.model import reusable_prefix
from pte_instrument.failpoints import failpoint
from pte_instrument.server import feedback_window, totals
from pte_instrument.server.records import (
    FinishedRequest,
    RequestRecord,
    reported_request_id,
    with_finite_numbers,
)
from pte_instrument.server.session_store import (
    COUNTED,
    MAX_QUEUED,
    SUMMARY_COLUMNS,
    SUMMED,
    TURN_FIELDS,
    Store,
    StoreError,
    session_summary,
)
from pte_instrument.server.turn_order import Unlanded


@dataclass(frozen=True)
class TurnContext:
    """What a new turn inherits from its session."""

    turn: int
    reusable_tokens: int  # context the previous turn already paid for
    pause_s: float | None  # tool pause since the previous turn finished
    previous_replica: str | None = None  # the replica that served the previous turn (None: unknown)


@dataclass(frozen=True)
class Tail:
    """The latest turn of a session: all the next turn's context depends on."""

    n_turns: int
    last_prompt: int
    last_output: int
    last_finished_at: float | None
    last_replica: str | None = None


@dataclass
class LedgerStats:
    """What this process's writer did (the Prometheus counters of this process); the
    host-wide counts are ``SessionLedger.host_stats()``."""

    sessions_opened: int = 0
    sessions_expired: int = 0  # idle longer than the TTL
    sessions_evicted: int = 0  # pushed out by the max_sessions cap
    turns_dropped: int = 0  # rows beyond max_turns (their totals are kept)
    records_lost: int = 0  # not stored: the queue was full or the batch failed


class SessionLedger:
    def __init__(
        self,
        path: str | Path | None = None,
        max_sessions: int = 5000,
        idle_ttl_s: float = 3600.0,
        max_turns: int = 64,
        block_size: int = 1,
        on_close: Callable[[dict[str, Any], str], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
        clock: Callable[[], float] = time.time,
        max_queued: int = MAX_QUEUED,
        feedback_window: int = 50_000,
        server_id: str | None = None,
    ) -> None:
        """``path``: the store (None: a private file, deleted at ``close``). ``on_close(summary,
        reason)`` runs for each session this process closes; ``on_error`` for each failed write.
        ``server_id``: the server this process serves for (``Store``)."""
        if max_sessions < 1 or max_turns < 1 or idle_ttl_s <= 0:
            raise ValueError("max_sessions and max_turns must be ≥ 1, idle_ttl_s > 0")
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self.max_turns = max_turns
        self.block_size = block_size  # the server's KV block: prefix caching is per block
        self.feedback_window = feedback_window  # finished requests a correctness label can still reach
        self.on_close = on_close
        self.on_error = on_error
        self.clock = clock
        self.stats = LedgerStats()
        self.server_id = server_id or f"pid-{os.getpid()}"
        self.unlanded = Unlanded()  # this process's turns on their way to the store (``turn_order``)
        self.store = self._open(path, max_queued)
        self._overlay: dict[str, Tail] = {}  # this process's turns not yet committed
        self._overlay_lock = threading.Lock()
        self._live = self._count_live()
        # Told the live count as each commit reads it (the writer's thread): the Prometheus
        # gauge several API servers share keeps the value set last, so it must be the latest.
        self.on_live: Callable[[int], None] | None = None
        if not self.store.opened:
            self.start()  # the writer opens it once the other process's lock goes

    def _open(self, path: str | Path | None, max_queued: int) -> Any:
        return Store(path, self._commit, self._error, self.server_id, max_queued)

    def _count_live(self) -> int:
        """The live count at start; 0 where the store cannot tell yet (its first commit sets it)."""
        if not self.store.opened:  # it said why when it could not open
            return 0
        try:
            return self.store.live()
        except StoreError as e:  # unreachable
            self._error(e)
            return 0

    @property
    def path(self) -> Path | str:
        """Where the store is (shown in log lines)."""
        return self.store.path

    def __len__(self) -> int:
        """Live sessions on the host, as of this process's latest commit (no query)."""
        return self._live

    # --- the pricing path: one indexed read, no write ---

    def context_for(self, session_id: str, arrived_at: float, prompt_tokens: int) -> TurnContext:
        """Turn number, reusable prefix and pause for the next turn of ``session_id``."""
        tail = self._tail(session_id)
        if tail is None:
            return TurnContext(turn=1, reusable_tokens=0, pause_s=None)
        pause = None if tail.last_finished_at is None else max(0.0, arrived_at - tail.last_finished_at)
        reusable = reusable_prefix(tail.last_prompt, tail.last_output, prompt_tokens, self.block_size)
        return TurnContext(tail.n_turns + 1, reusable, pause, tail.last_replica)

    def start(self) -> None:
        """Start the writer, so that the other writers hear from this one from now on (it
        starts with the first write otherwise)."""
        self.store.start()

    def told_finished(self, request_id: str, session_id: str | None) -> None:
        """A request (a turn of ``session_id``; None: of no session) finished, under the id
        vLLM reported (a parallel-sampling request's, once per sample): it is priced, then
        lands in the store, later."""
        self.unlanded.told(request_id, session_id)

    def gave_up(self, request: FinishedRequest) -> None:
        """A request told finished that will not be priced (its pricing failed)."""
        self.unlanded.landed([reported_request_id(request.request_id, request.child_index)])

    def others_caught_up_to(self, every_request: bool = False) -> float:
        """A time before which every turn (``every_request``: every request, with its
        feedback-window entry) the other writers were told finished is in the store (inf: no
        other writer)."""
        try:
            return self.store.peer_watermark(every_request)
        except Exception as e:  # a store that cannot be read: nothing to wait for
            self._error(e)
            return math.inf

    def unpriced_since(self, session_id: str) -> float:
        """When the earliest turn of ``session_id`` this process has not priced yet finished
        (inf: none)."""
        return self.unlanded.unpriced_since(session_id)

    def prefetch(self, session_ids: Iterable[str]) -> None:
        """Read these sessions' latest turns at once, for the context reads that follow (the
        requests one pricing pass prices). Nothing to do where a read is local (SQLite)."""

    def add(self, record: RequestRecord) -> None:
        """Queue a priced request (its model's totals; a turn, if it has a session) for the
        writer; never blocks. A number in it that is not finite is stored as unknown (or 0),
        counted as a fault: it would cost the whole batch otherwise."""
        record, not_finite = with_finite_numbers(record)  # the pricer's are already
        if not_finite is not None:
            self._error(not_finite)
        if record.session_id is None:
            self._queue_record(("add", record, None))
            return
        prompt, output = computed_context(record), record.output_tokens
        if prompt == output == 0:  # it computed nothing: the cache holds what the turn before left
            before = self._tail(record.session_id)
            if before is not None:
                prompt, output = before.last_prompt, before.last_output
        tail = Tail(record.turn or 1, prompt, output, record.finished_at, record.replica)
        with self._overlay_lock:  # before the writer can see it, so that its commit settles it
            self._overlay[record.session_id] = tail
        self.unlanded.priced(reported_request_id(record.request_id, record.child_index))
        if not self._queue_record(("add", record, tail)):
            self._settle([("add", record, tail)])

    def observe(
        self,
        request_id: str,
        session_id: str | None,
        model: str,
        benchmark: str,
        output_tokens: int,
        truncated: bool,
    ) -> None:
        """Queue a finished request for the feedback window and its cell's counts."""
        self._queue_record(
            ("observe", (request_id, session_id, model, benchmark, output_tokens, int(truncated)))
        )

    def label(
        self, correct: bool, request_ids: list[str], session_id: str | None
    ) -> dict[str, Any] | list | None:
        """Label the first of ``request_ids`` in the window, or all of ``session_id``'s
        requests in it, as one instance: its outcome; None if none is in the window; [] if
        already labeled. One transaction, so two API servers cannot label one instance twice."""
        self._caught_up()
        return self.store.label(correct, request_ids, session_id)

    def outcomes(self) -> dict[tuple[str, str], dict[str, int]]:
        """The live efficiency's counts per (model, benchmark), host-wide."""
        self._caught_up()
        return self.store.outcomes()

    def expire(self) -> None:
        """Ask the writer to close sessions idle for longer than the TTL now (it also does so
        on its own every second)."""
        self.store.expire()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued before now is committed (or failed); False on timeout."""
        return self.store.flush(timeout)

    def close(self) -> None:
        """Commit what is queued, stop the writer and close the store."""
        self.store.close()

    def _caught_up(self) -> None:
        """Before a read: this process's queued writes committed. A writer that is not there
        within ``READ_WAIT_S`` (another process holds the store locked, the disk is slow) is a
        fault, said once for the stall, and the reads answer what is committed until it ends."""
        stalled = self.store.stalled
        if not self.flush(READ_WAIT_S) and not stalled:
            self._error(
                StoreError(
                    f"session store {self.path}: this process's writes have not committed within "
                    f"{READ_WAIT_S:g} s (the store locked by another process, or slow); reads answer "
                    "what is committed meanwhile"
                )
            )

    # --- reads for the routes: this process's queued turns first, then the host's store ---

    def other_servers(self) -> list[str]:
        return self.store.other_servers()

    def get(self, session_id: str) -> dict[str, Any] | None:
        """The session's summary and its turn rows; None if it is not live."""
        self._caught_up()
        return self.store.session(session_id)

    def top(
        self, limit: int = 50, offset: int = 0, key: str = "pte_served"
    ) -> tuple[int, list[dict[str, Any]]]:
        """Live sessions by descending ``key`` (a summed field), paginated; also the total count."""
        if key not in SUMMED:
            raise ValueError(f"cannot sort sessions by {key!r}")
        self._caught_up()
        return self.store.top(limit, offset, key)

    def model_totals(self) -> dict[str, dict[str, float]]:
        """Per-model sums over every request the host priced (``MODEL_TOTALS``)."""
        self._caught_up()
        return self.store.totals("model")

    def tenant_totals(self) -> dict[str, dict[str, float]]:
        """Per-tenant sums (``MODEL_TOTALS``) over every request the host priced with tenants on."""
        self._caught_up()
        return self.store.totals("tenant")

    def lora_totals(self) -> dict[str, dict[str, Any]]:
        """Per-adapter sums (``MODEL_TOTALS``, and the base ``model``) over every request the
        host priced for a LoRA adapter; they are part of their base model's totals too."""
        self._caught_up()
        return self.store.totals("lora")

    def host_stats(self) -> dict[str, int | None]:
        """Counts over every process of the host since the store was created."""
        self._caught_up()
        return self.store.host_stats()

    # --- the writer's transactions ---

    def _tail(self, session_id: str) -> Tail | None:
        """The session's latest turn: this process's, queued, or else the store's."""
        with self._overlay_lock:
            tail = self._overlay.get(session_id)
        return tail if tail is not None else self._stored_tail(session_id)

    def _stored_tail(self, session_id: str) -> Tail | None:
        """The store's latest turn of the session; None (said, counted) when the store cannot
        be read: the turn is priced as the first the store holds of it, and still lands."""
        try:
            found = self.store.tail(session_id)
        except StoreError as e:
            self._error(e)
            return None
        return None if found is None else Tail(*found)

    def _queue_record(self, item: tuple[Any, ...]) -> bool:
        """Queue a record for the writer; a full queue loses it, counted."""
        if self.store.put(item):
            return True
        self.stats.records_lost += 1
        self._error(
            StoreError(f"session store {self.path}: {self.store.max_queued} records waiting; one lost")
        )
        return False

    def _commit(self, db: sqlite3.Connection | None, items: list[tuple[Any, ...]], expire: bool) -> None:
        """One batch of the writer, in one transaction: all of it or none of it."""
        now = self.clock()
        adds = [item for item in items if item[0] == "add"]
        observed = [item[1] for item in items if item[0] == "observe"]
        watermarks = self.unlanded.watermarks(told_ids(adds))
        if not items and not expire:
            if db is not None:
                with contextlib.suppress(sqlite3.Error), db:  # the next batch says what is wrong
                    db.execute("BEGIN IMMEDIATE")
                    self.store.publish(db, watermarks)
            return
        more = False  # idle sessions left for the next transaction
        try:
            if db is None:  # the writer could not open the store (said once, when it tried)
                raise StoreError("not open")
            with db:
                db.execute("BEGIN IMMEDIATE")
                batch = _Batch(db, self.max_turns)
                for _, record, _ in adds:
                    totals.add(db, record)
                    if record.session_id is None:
                        continue
                    if batch.apply(record, now) and batch.live > self.max_sessions:
                        batch.close("ORDER BY touched LIMIT ?", (batch.live - self.max_sessions,), "evicted")
                if observed:
                    feedback_window.observe(db, observed, self.feedback_window)
                if expire:  # the longest idle first; the rest in the writer's next transaction
                    idle = "WHERE last_seen < ? ORDER BY last_seen LIMIT ?"
                    more = (
                        batch.close(idle, (now - self.idle_ttl_s, EXPIRE_PER_COMMIT), "idle")
                        == EXPIRE_PER_COMMIT
                    )
                batch.count()
                self.store.mark_alive(db)
                self.store.publish(db, watermarks)
                failpoint("session_store")
        except Exception as e:
            self._lost(len(adds) + len(observed), e)
            self._settle(adds)
            return
        self._set_live(batch.live)
        for name in COUNTED:
            setattr(self.stats, name, getattr(self.stats, name) + getattr(batch.delta, name))
        self._settle(adds)
        self._notify(batch.closed)
        if more:
            self.store.expire()

    def _set_live(self, live: int) -> None:
        self._live = live
        if self.on_live is not None:
            try:
                self.on_live(live)
            except Exception as e:
                self._error(e)

    def _lost(self, n: int, e: Exception) -> None:
        """A batch of ``n`` records the store did not take: counted, and said."""
        self.stats.records_lost += n
        self._error(StoreError(f"session store {self.path}: a batch of {n} records was lost ({e})"))

    def _settle(self, adds: Iterable[tuple[Any, ...]]) -> None:
        """The batch's turns landed (or were lost): drop their overlay entries (unless a later
        turn replaced them)."""
        self.unlanded.landed(told_ids(adds))
        with self._overlay_lock:
            for _, record, tail in adds:
                if tail is not None and self._overlay.get(record.session_id) is tail:
                    del self._overlay[record.session_id]
            if not self._overlay:  # a dict keeps its largest table: start a small one
                self._overlay = {}

    def _notify(self, closed: list[tuple[dict[str, Any], str]]) -> None:
        if self.on_close is not None:
            for summary, reason in closed:
                try:
                    self.on_close(summary, reason)
                except Exception as e:
                    self._error(e)

    def _error(self, e: Exception) -> None:
        if self.on_error is not None:
            with contextlib.suppress(Exception):  # the fault counter must not raise either
                self.on_error(e)


def told_ids(adds: Iterable[tuple[Any, ...]]) -> list[str]:
    """The ids a batch's requests (``("add", record, tail)`` items) were told finished under:
    a parallel-sampling sample's is its parent's (``told_finished``)."""
    return [reported_request_id(r.request_id, r.child_index) for _, r, _ in adds]


def turn_row(r: RequestRecord, seq: int | None) -> dict[str, Any]:
    """A turn's row in the store, numbered by the store (``seq``: its place among the session's
    turns as they landed; None: the store's script puts it first). The record's own ``turn``
    is the number its context read gave at pricing, which a turn priced on another process
    before the previous turn's write landed has too low."""
    row = {k: getattr(r, k) for k in TURN_FIELDS if k != "turn"}
    return row if seq is None else {"turn": seq, **row}


def computed_context(r: RequestRecord) -> int:
    """The prompt positions the engine computed for ``r``, which a prefix cache can hold for
    the next turn: its whole prompt, but for a request aborted before its prompt was through
    only its cached prefix and the part it prefilled (none for one never run)."""
    return min(r.prompt_tokens, r.cached_tokens + r.computed_prefill_tokens)


READ_WAIT_S = 10.0  # how long a read waits for this process's queued writes to commit

# Idle sessions closed per transaction: the transaction holds the store's write lock for every
# API server on the host, and the closed sessions' summaries until it commits.
EXPIRE_PER_COMMIT = 1000

_UPSERT = (
    "INSERT INTO sessions (id, model, first_seen, last_seen, touched, n_turns, turns_dropped, last_prompt,"
    f" last_output, last_finished_at, last_replica, {', '.join(SUMMED)}) VALUES (?, ?, ?, ?, ?, 1, 0, ?, ?, ?, ?,"
    f" {', '.join('?' * len(SUMMED))}) ON CONFLICT (id) DO UPDATE SET last_seen = excluded.last_seen,"
    " touched = excluded.touched, n_turns = n_turns + 1,"
    # a turn that computed nothing (aborted while queued) leaves the context the turn before left
    " last_prompt = CASE WHEN excluded.last_prompt + excluded.last_output > 0 THEN excluded.last_prompt"
    " ELSE last_prompt END, last_output = CASE WHEN excluded.last_prompt + excluded.last_output > 0"
    " THEN excluded.last_output ELSE last_output END,"
    " last_finished_at = excluded.last_finished_at, last_replica = excluded.last_replica, "
    + ", ".join(f"{k} = {k} + excluded.{k}" for k in SUMMED)
    + " RETURNING n_turns"
)
_TURN_ROW = msgspec.json.Encoder()
_CLOSE = f"DELETE FROM sessions WHERE id = ? RETURNING {', '.join(SUMMARY_COLUMNS)}"


class _Batch:
    """One transaction of the writer: the turns it applies and the sessions it closes."""

    def __init__(self, db: sqlite3.Connection, max_turns: int) -> None:
        self.db = db
        self.max_turns = max_turns
        self.delta = LedgerStats()
        self.closed: list[tuple[dict[str, Any], str]] = []
        self.live = db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]
        # Least recently active first: one counter for the host, read once under the write lock.
        self.touched = db.execute("SELECT COALESCE(MAX(touched), 0) FROM sessions").fetchone()[0]

    def apply(self, r: RequestRecord, now: float) -> bool:
        """One turn into the store; True if it opened its session."""
        self.touched += 1
        sums = [getattr(r, k) or 0.0 for k in SUMMED]
        seq = self.db.execute(
            _UPSERT,
            (
                r.session_id,
                r.model,
                now,
                now,
                self.touched,
                computed_context(r),
                r.output_tokens,
                r.finished_at,
                r.replica,
                *sums,
            ),
        ).fetchone()[0]
        row = _TURN_ROW.encode(turn_row(r, seq))
        self.db.execute("INSERT OR REPLACE INTO turns VALUES (?, ?, ?)", (r.session_id, seq, row))
        if seq > self.max_turns:
            cur = self.db.execute(
                "DELETE FROM turns WHERE session_id = ? AND seq <= ?", (r.session_id, seq - self.max_turns)
            )
            if cur.rowcount > 0:
                self.db.execute(
                    "UPDATE sessions SET turns_dropped = turns_dropped + ? WHERE id = ?",
                    (cur.rowcount, r.session_id),
                )
                self.delta.turns_dropped += cur.rowcount
        if seq == 1:
            self.delta.sessions_opened += 1
            self.live += 1
        return seq == 1

    def close(self, where: str, args: tuple[Any, ...], reason: str) -> int:
        """Close the sessions ``where`` selects, with their turn rows; how many."""
        ids = self.db.execute(f"SELECT id FROM sessions {where}", args).fetchall()
        for (sid,) in ids:
            row = self.db.execute(_CLOSE, (sid,)).fetchone()
            self.db.execute("DELETE FROM turns WHERE session_id = ?", (sid,))
            self.closed.append((session_summary(row), reason))
            self.live -= 1
            if reason == "evicted":
                self.delta.sessions_evicted += 1
            else:
                self.delta.sessions_expired += 1
        return len(ids)

    def count(self) -> None:
        """The host-wide counters, by what this batch did."""
        for name in COUNTED:
            if n := getattr(self.delta, name):
                self.db.execute(
                    "INSERT INTO counters VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET value = value + ?",
                    (name, n, n),
                )
