"""The session store's file: one SQLite database (WAL) per server, shared by its API-server
processes: the schema, opening it, the columns its tables and routes share, and one
process's use of it (``Store``: a connection for the pricer's reads, one for the routes',
a writer thread for writes). What is written to it is the business of the session ledger
(``sessions``), the totals (``totals``) and the feedback window (``feedback_window``).

Writes leave the request path: they queue, and the writer commits what has queued in one
transaction. A crash loses at most the batch being written; SQLite's journal keeps the file
whole."""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import re
import sqlite3
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pte_instrument.server import feedback_window, totals
from pte_instrument.server.feedback_window import OUTCOME_COUNTS
from pte_instrument.server.records import MODEL_TOTALS
from pte_instrument.server.turn_order import HEARTBEAT_S, PEER_ALIVE_S, WRITER_GONE_S, Watermarks

MAX_QUEUED = 10_000  # items waiting for the writer; past it an item is refused
_BATCH = 1024  # items per transaction at most
_EXPIRE_EVERY_S = 1.0  # a batch is due to close idle sessions at least this often, items or not
OPEN_TIMEOUT_S = 30.0  # how long the writer, and a route's read, wait for another process holding the file
# How long opening the store at start-up, and a pricing read, wait for another process holding
# it: a store that cannot be opened in that time is opened by the writer, in the background.
START_WAIT_S = 1.0
SERVER_ALIVE_S = 60.0  # a server whose writer committed within this long is using the store

# A turn's PTE, in its row and summed over its session.
TURN_PTE = (
    "pte_reference",
    "pte_served",
    "pte_ideal",
    "pte_eviction_tax",
    "pte_routing_tax",
    "pte_recompute",
)
# Seconds and money of a turn, in its row and summed over its session.
TURN_SECONDS = ("gpu_seconds", "latency_explained_s", "interference_s", "cost_usd")

# Fields of a turn row shown by the HTTP routes and the demo.
TURN_FIELDS = (
    "turn",
    "request_id",
    "prompt_tokens",
    "cached_tokens",
    "computed_prefill_tokens",
    "recomputed_tokens",
    "output_tokens",
    *TURN_PTE,
    "pause_s",
    "inference_s",
    "finish_reason",
    "finished_at",
    "predicted_seconds",
    *TURN_SECONDS,
    "replica",
)

SUMMED = ("prompt_tokens", "cached_tokens", "output_tokens", *TURN_PTE, "pause_s", *TURN_SECONDS)
# The sums ``/pte/sessions`` sorts sessions by.
SORT_KEYS = (
    "pte_served",
    "pte_eviction_tax",
    "pte_routing_tax",
    "pte_reference",
    "prompt_tokens",
    "output_tokens",
    "gpu_seconds",
    "cost_usd",
)

SCHEMA_VERSION = 1
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, model TEXT NOT NULL, first_seen REAL NOT NULL, last_seen REAL NOT NULL,
    touched INTEGER NOT NULL, n_turns INTEGER NOT NULL, turns_dropped INTEGER NOT NULL,
    last_prompt INTEGER NOT NULL, last_output INTEGER NOT NULL, last_finished_at REAL, last_replica TEXT,
    {", ".join(f"{k} REAL NOT NULL DEFAULT 0" for k in SUMMED)}
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS sessions_touched ON sessions (touched);
CREATE INDEX IF NOT EXISTS sessions_last_seen ON sessions (last_seen);
CREATE TABLE IF NOT EXISTS turns (
    session_id TEXT NOT NULL, seq INTEGER NOT NULL, row TEXT NOT NULL, PRIMARY KEY (session_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS servers (id TEXT PRIMARY KEY, last_seen REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS writers (
    id TEXT PRIMARY KEY, watermark REAL NOT NULL, last_seen REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS request_watermarks (id TEXT PRIMARY KEY, watermark REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS recent (
    request_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, model TEXT NOT NULL, benchmark TEXT NOT NULL,
    output_tokens INTEGER NOT NULL, truncated INTEGER NOT NULL, session_id TEXT, labeled INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS recent_seq ON recent (seq);
CREATE INDEX IF NOT EXISTS recent_session ON recent (session_id, seq);
CREATE TABLE IF NOT EXISTS outcomes (
    model TEXT NOT NULL, benchmark TEXT NOT NULL, {", ".join(f"{k} INTEGER NOT NULL DEFAULT 0" for k in OUTCOME_COUNTS)},
    PRIMARY KEY (model, benchmark)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS model_totals (
    model TEXT PRIMARY KEY, {", ".join(f"{k} NOT NULL DEFAULT 0" for k in MODEL_TOTALS)}
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tenant_totals (
    tenant TEXT PRIMARY KEY, {", ".join(f"{k} NOT NULL DEFAULT 0" for k in MODEL_TOTALS)}
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS lora_totals (
    lora_name TEXT PRIMARY KEY, model TEXT NOT NULL, {", ".join(f"{k} NOT NULL DEFAULT 0" for k in MODEL_TOTALS)}
) WITHOUT ROWID;
"""  # tables added later are created in an existing store as they are in a new one
# Columns added later, added to an existing store's tables (a sum starts at 0 there).
ADDED_COLUMNS = {
    "sessions": ("last_replica TEXT", "pte_routing_tax REAL NOT NULL DEFAULT 0"),
    **{
        table: ("pte_routing_tax NOT NULL DEFAULT 0", "gpu_seconds_routing_tax NOT NULL DEFAULT 0")
        for table in ("model_totals", "tenant_totals", "lora_totals")
    },
}
COUNTED = ("sessions_opened", "sessions_expired", "sessions_evicted", "turns_dropped")
SUMMARY_COLUMNS = ("id", "model", "n_turns", "turns_dropped", "first_seen", "last_seen", *SUMMED)


class StoreError(RuntimeError):
    """The session store cannot be opened or used (the message names the file and why)."""

    says_it_all = True  # a fault line shows the message, without a traceback


class StoreLocked(StoreError):
    """Another process holds the store locked: it can be opened once the lock goes."""


STORE_TABLES = frozenset(re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", SCHEMA))


def file_id(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``; None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def connect(path: Path, wait_s: float = OPEN_TIMEOUT_S) -> sqlite3.Connection:
    """A connection to the store, created with its schema if new; a file that is not a
    session store of this version is a :class:`StoreError` naming it, one another process
    holds locked for longer than ``wait_s`` (the connection's wait from then on) a
    :class:`StoreLocked`. A whole store is opened without a write, so that its reads go on
    while another process holds its write lock."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, timeout=wait_s, isolation_level=None, check_same_thread=False)
        foreign = _foreign_tables(db)
        if foreign:
            db.close()
            raise StoreError(
                f"the session store {path} is a SQLite database of something else, not a session store "
                f"(its tables: {', '.join(foreign)}); it is left untouched"
            )
        _turn_to_wal(db, wait_s)
        db.execute("PRAGMA synchronous = NORMAL")  # WAL: a process crash loses nothing committed
        db.executescript(SCHEMA)  # writes nothing where the tables are there
        _add_columns(db)
        found = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        if found is None:
            db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
            found = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        version = found[0]
    except (sqlite3.Error, OSError) as e:
        if _locked(e):
            raise StoreLocked(
                f"the session store {path} is locked by another process (waited {wait_s:g} s)"
            ) from None
        raise StoreError(f"cannot open the session store {path}: {e}") from None
    if version != SCHEMA_VERSION:
        db.close()
        raise StoreError(
            f"the session store {path} has schema {version!r}, this version reads {SCHEMA_VERSION}"
        )
    return db


def _foreign_tables(db: sqlite3.Connection, shown: int = 5) -> list[str]:
    """The first tables of a database that is someone else's: it has a table the store has
    not, and no schema row of the store's in a ``meta`` table (a name common enough). None for
    an empty file, a store, or one whose creation was cut short (only the store's tables)."""
    names = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
    if set(names) <= STORE_TABLES:
        return []
    with contextlib.suppress(sqlite3.Error):  # a meta of another layout: someone else's
        if db.execute("SELECT 1 FROM meta WHERE key = 'schema'").fetchone() is not None:
            return []
    return names[:shown]


def _locked(e: BaseException) -> bool:
    """SQLite's answer when another connection holds what it waited for past its busy timeout."""
    return isinstance(e, sqlite3.OperationalError) and str(e) == "database is locked"


def _turn_to_wal(db: sqlite3.Connection, wait_s: float) -> None:
    """Put the store in WAL mode. Another process turning a new file to WAL at the same moment
    (the API servers of one server start together) makes SQLite answer "database is locked"
    at once, without waiting out the busy timeout: wait for it here instead."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            db.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if not _locked(e) or time.monotonic() >= deadline:
                raise
        time.sleep(0.01)


def _add_columns(db: sqlite3.Connection) -> None:
    for table, columns in ADDED_COLUMNS.items():
        present = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        for column in columns:
            if column.split()[0] not in present:
                with contextlib.suppress(sqlite3.OperationalError):  # another process added it first
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column}")


def session_summary(row: tuple[Any, ...]) -> dict[str, Any]:
    s = dict(zip(SUMMARY_COLUMNS, row, strict=True))
    return {
        "session_id": s.pop("id"),
        "model": s.pop("model"),
        "turns": s.pop("n_turns"),
        "turns_dropped": s.pop("turns_dropped"),
        **s,
    }


# The owner's transaction: the connection (None: the store is not reachable), the batch's
# items in the order they were queued, and whether idle sessions are due to close.
Commit = Callable[[Any, list[tuple[Any, ...]], bool], None]


class BatchWriter:
    """A writer thread that hands what has queued (``put``) to ``commit``, a batch at a time,
    with the connection ``_connection`` gives it; the queue is bounded (a full one refuses).
    It commits at least every ``heartbeat_s`` (nothing queued: an empty batch), so that its
    watermark (``turn_order``) moves on: each second, or ``HEARTBEAT_S`` while other writers
    share the store (``commit`` sets it)."""

    def __init__(
        self, commit: Commit, on_error: Callable[[Exception], None], server_id: str, max_queued: int
    ) -> None:
        self.commit = commit
        self.on_error = on_error
        self.server_id = server_id
        self.writer_id = f"{server_id}/{uuid.uuid4().hex[:12]}"  # this process's writer
        self.heartbeat_s = _EXPIRE_EVERY_S
        self.max_queued = max_queued
        self._queue: queue.Queue[Any] = queue.Queue(max_queued)
        self._writer: threading.Thread | None = None
        self._writer_lock = threading.Lock()
        self._stalled: threading.Event | None = None  # the latest flush that timed out

    def put(self, item: tuple[Any, ...]) -> bool:
        """Queue an item for the next batch; False (and nothing queued) when the queue is full."""
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            return False
        self._ensure_writer()
        return True

    def expire(self) -> None:
        """Make the next batch close idle sessions (it does so every second anyway)."""
        self.put(("expire",))

    @property
    def opened(self) -> bool:
        """Whether the store is open to reads (a store that opens in the background is not,
        at first)."""
        return True

    @property
    def stalled(self) -> bool:
        """A flush timed out and the writer has not reached it yet."""
        stalled = self._stalled
        return stalled is not None and not stalled.is_set()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued before now is committed (or failed); False on timeout,
        and at once while the writer has not reached a flush that timed out before (a store
        another process holds locked): a read that flushes first waits for it once, not each."""
        if self.stalled:
            return False
        done = threading.Event()
        deadline = time.monotonic() + timeout
        try:  # a full queue drains: wait for room rather than give up
            self._queue.put(("flush", done), timeout=timeout)
        except queue.Full:
            return False
        self._ensure_writer()
        if done.wait(max(0.0, deadline - time.monotonic())):
            return True
        self._stalled = done
        return False

    def start(self) -> None:
        """Start the writer, so that the other writers hear from this one from now on."""
        self._ensure_writer()

    def with_peers(self, peers: bool) -> None:
        """Whether other writers share the store: this one's watermark is then wanted often."""
        self.heartbeat_s = HEARTBEAT_S if peers else _EXPIRE_EVERY_S

    def stop_writer(self) -> None:
        """Commit what is queued and stop the writer."""
        with self._writer_lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            self._queue.put(("stop",))
            writer.join(10)

    def _connection(self, conn: Any) -> Any:
        """The writer's connection for the next batch (``conn``: the last one; None at first)."""
        raise NotImplementedError

    def _release(self, conn: Any) -> None:
        """The writer stops: this server no longer uses the store."""

    def _ensure_writer(self) -> None:
        if self._writer is not None:
            return
        with self._writer_lock:
            if self._writer is None:
                self._writer = threading.Thread(target=self._run, name="pte-session-store", daemon=True)
                self._writer.start()

    def _run(self) -> None:
        conn = None
        next_expiry = 0.0
        while True:
            try:
                first = self._queue.get(timeout=self.heartbeat_s)
            except queue.Empty:
                first = ("beat",)
            batch = [first]
            while len(batch) < _BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            conn = self._connection(conn)
            expire = any(item[0] == "expire" for item in batch) or time.monotonic() >= next_expiry
            if expire:
                next_expiry = time.monotonic() + _EXPIRE_EVERY_S
            items = [item for item in batch if item[0] not in ("expire", "flush", "stop", "beat")]
            try:
                self.commit(conn, items, expire)
            except Exception as e:  # what the commit did not catch: said, and the writer goes on
                self._error(StoreError(f"session store: a batch failed ({type(e).__name__}: {e})"))
            flushed = [item[1] for item in batch if item[0] == "flush"]
            stop = any(item[0] == "stop" for item in batch)
            # Let the committed batch go before saying so, and before waiting for the next:
            # held, it is up to a batch of records kept alive between bursts and past a flush.
            del first, batch, items
            for done in flushed:
                done.set()
            if stop:
                self._release(conn)
                return

    def _error(self, e: Exception) -> None:
        with contextlib.suppress(Exception):  # the fault counter must not raise either
            self.on_error(e)


@dataclass
class _Reader:
    """A connection for reads, used by one reader at a time, and the file it is open on."""

    wait_s: float  # how long opening it, and its reads, wait for another process holding the file
    lock: threading.Lock = field(default_factory=threading.Lock)
    db: sqlite3.Connection | None = None
    file: tuple[int, int] | None = None

    def close(self) -> None:
        if self.db is not None:
            with contextlib.suppress(sqlite3.Error):
                self.db.close()
        self.db = self.file = None


class Store(BatchWriter):
    """One process's use of the SQLite store: a connection for the pricer's reads
    (``reading``), one for the routes' (``reading(route=True)``: a deep page of the sessions
    list, or a label waiting for the write lock, holds it, not the request path), and the
    writer thread with a connection of its own. A store another process holds locked at
    start-up for longer than ``START_WAIT_S`` is opened by the writer, in the background: its
    reads fail meanwhile (a turn is priced without its session's earlier turns, counted), its
    writes wait. A store deleted or replaced while the server runs (SQLite would go on writing
    the unlinked file, lost at restart) is opened again at its path, created if need be, as the
    request log is; the first write that finds it so says it (``on_error``) and counts it
    (``reopened``)."""

    def __init__(
        self,
        path: str | Path | None,
        commit: Commit,
        on_error: Callable[[Exception], None],
        server_id: str,
        max_queued: int = MAX_QUEUED,
    ) -> None:
        """``path``: the file (None: a private one, deleted at ``close``). ``server_id``: the
        server this process serves for (its API servers share one), so that a store two
        servers write to can say so (``other_servers``)."""
        super().__init__(commit, on_error, server_id, max_queued)
        self.reopened = 0
        self._private = path is None
        if path is None:
            fd, name = tempfile.mkstemp(prefix="pte-sessions-", suffix=".sqlite3")
            os.close(fd)
            path = name
        self.path = Path(path)
        self._pricing, self._routes = _Reader(START_WAIT_S), _Reader(OPEN_TIMEOUT_S)
        self._opened = threading.Event()  # the store was opened (by now, or by the writer)
        try:
            self._pricing.db = connect(self.path, START_WAIT_S)
            self._store_id = self._pricing.file = file_id(self.path)  # the file the connections use
        except StoreLocked as e:
            self._store_id = file_id(self.path)
            self._error(
                StoreLocked(
                    f"{e}; it is opened in the background once the lock goes: until then each turn is "
                    "priced without its session's earlier turns (counted), and the turns wait to be written"
                )
            )
        else:
            self._opened.set()

    @property
    def opened(self) -> bool:
        """False until the writer opened a store another process held locked at start-up (its
        owner starts the writer then)."""
        return self._opened.is_set()

    @contextlib.contextmanager
    def reading(self, route: bool = False) -> Iterator[sqlite3.Connection]:
        """A connection for reads (the pricer's, or with ``route`` the routes'), on the file
        the writer uses; one reader at a time on each. A read that fails, or meets the store
        not opened yet, is a :class:`StoreError` naming the file, as the Redis store's are."""
        reader = self._routes if route else self._pricing
        with reader.lock:
            if reader.db is None or reader.file != self._store_id:
                if not self._opened.is_set():
                    raise StoreError(
                        f"session store {self.path}: not opened yet (another process holds it locked)"
                    )
                reader.close()
                reader.db, reader.file = connect(self.path, reader.wait_s), self._store_id
            try:
                yield reader.db
            except sqlite3.Error as e:
                raise StoreError(f"session store {self.path}: {type(e).__name__}: {e}") from None

    def close(self) -> None:
        """Commit what is queued, stop the writer and close the store."""
        self.stop_writer()
        for reader in (self._pricing, self._routes):
            with reader.lock:
                reader.close()
        if self._private:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(OSError):
                    os.unlink(f"{self.path}{suffix}")

    def mark_alive(self, db: sqlite3.Connection) -> None:
        """Within the owner's transaction: this server is using the store."""
        db.execute(
            "INSERT INTO servers VALUES (?, ?) ON CONFLICT (id) DO UPDATE SET last_seen = excluded.last_seen",
            (self.server_id, time.time()),
        )

    def publish(self, db: sqlite3.Connection, watermarks: Watermarks) -> None:
        """Within the owner's transaction: this writer's watermarks (``turn_order``); whether
        other writers share the store sets how often they are published. The entries of
        writers gone for long are dropped."""
        now = time.time()
        db.execute("DELETE FROM writers WHERE last_seen < ?", (now - WRITER_GONE_S,))
        db.execute("DELETE FROM request_watermarks WHERE id NOT IN (SELECT id FROM writers)")
        db.execute(
            "INSERT INTO writers VALUES (?, ?, ?) ON CONFLICT (id) DO UPDATE SET"
            " watermark = excluded.watermark, last_seen = excluded.last_seen",
            (self.writer_id, watermarks.turns, now),
        )
        db.execute(
            "INSERT INTO request_watermarks VALUES (?, ?) ON CONFLICT (id) DO UPDATE SET"
            " watermark = excluded.watermark",
            (self.writer_id, watermarks.requests),
        )
        peers = db.execute(
            "SELECT 1 FROM writers WHERE id != ? AND last_seen > ? LIMIT 1",
            (self.writer_id, now - PEER_ALIVE_S),
        )
        self.with_peers(peers.fetchone() is not None)

    def peer_watermark(self, every_request: bool = False) -> float:
        """The earliest turns' (``every_request``: requests') watermark of the other writers
        that published lately (inf: none); a writer of an older release publishes only the
        turns'."""
        column = "COALESCE(r.watermark, w.watermark)" if every_request else "w.watermark"
        with self.reading() as db:
            (found,) = db.execute(
                f"SELECT MIN({column}) FROM writers w LEFT JOIN request_watermarks r ON r.id = w.id"
                " WHERE w.id != ? AND w.last_seen > ?",
                (self.writer_id, time.time() - PEER_ALIVE_S),
            ).fetchone()
        return math.inf if found is None else float(found)

    def other_servers(self) -> list[str]:
        """The other servers whose writers committed to this store in the last ``SERVER_ALIVE_S``."""
        with self.reading(route=True) as db:
            rows = db.execute(
                "SELECT id FROM servers WHERE id != ? AND last_seen > ? ORDER BY id",
                (self.server_id, time.time() - SERVER_ALIVE_S),
            ).fetchall()
        return [r[0] for r in rows]

    # --- reads (the same as the Redis store's) ---

    def tail(self, session_id: str) -> tuple[Any, ...] | None:
        """The session's (turns, last prompt, last output, last finished at, last replica)."""
        with self.reading() as db:
            return db.execute(
                "SELECT n_turns, last_prompt, last_output, last_finished_at, last_replica FROM sessions WHERE id = ?",
                (session_id,),
            ).fetchone()

    def session(self, session_id: str) -> dict[str, Any] | None:
        with self.reading(route=True) as db:
            row = db.execute(
                f"SELECT {', '.join(SUMMARY_COLUMNS)} FROM sessions WHERE id = ?", (session_id,)
            ).fetchone()
            if row is None:
                return None
            turns = db.execute(
                "SELECT row FROM turns WHERE session_id = ? ORDER BY seq", (session_id,)
            ).fetchall()
        return {**session_summary(row), "turn_rows": [json.loads(t[0]) for t in turns]}

    def top(self, limit: int, offset: int, key: str) -> tuple[int, list[dict[str, Any]]]:
        with self.reading(route=True) as db:
            total = db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]
            # The page's ids sorted first, then their rows: a deep page's sort holds (key, id) of
            # every session before it, not all of each session's columns.
            order = f"ORDER BY {key} DESC, id"
            rows = db.execute(
                f"SELECT {', '.join(SUMMARY_COLUMNS)} FROM sessions WHERE id IN"
                f" (SELECT id FROM sessions {order} LIMIT ? OFFSET ?) {order}",
                (limit, offset),
            ).fetchall()
        return total, [session_summary(r) for r in rows]

    def totals(self, kind: str) -> dict[str, dict[str, Any]]:
        """Per-model, per-tenant or per-adapter sums (``kind``: model, tenant, lora)."""
        read = {"model": totals.by_model, "tenant": totals.by_tenant, "lora": totals.by_lora}[kind]
        with self.reading(route=True) as db:
            return read(db)

    def label(self, correct: bool, request_ids: list[str], session_id: str | None) -> Any:
        with self.reading(route=True) as db:
            return feedback_window.label(db, correct, request_ids, session_id)

    def outcomes(self) -> dict[tuple[str, str], dict[str, int]]:
        with self.reading(route=True) as db:
            return feedback_window.outcomes(db)

    def host_stats(self) -> dict[str, int]:
        with self.reading(route=True) as db:
            counts = dict(db.execute("SELECT name, value FROM counters").fetchall())
            live = db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]
        return {"live": live, **{k: int(counts.get(k, 0)) for k in COUNTED}}

    def live(self) -> int:
        with self.reading() as db:
            return int(db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0])

    def _release(self, db: sqlite3.Connection | None) -> None:
        if db is not None:
            with contextlib.suppress(sqlite3.Error):  # no longer a server of this store
                db.execute("DELETE FROM servers WHERE id = ?", (self.server_id,))
                db.execute("DELETE FROM writers WHERE id = ?", (self.writer_id,))
                db.execute("DELETE FROM request_watermarks WHERE id = ?", (self.writer_id,))
            db.close()

    def _connection(self, db: sqlite3.Connection | None) -> sqlite3.Connection | None:
        """The writer's connection to the file now at the store's path."""
        if db is not None and file_id(self.path) == self._store_id:
            return db
        if db is not None:
            with contextlib.suppress(sqlite3.Error):
                db.close()
        try:
            db = connect(self.path)
        except StoreError as e:
            self._error(e)
            return None
        found = file_id(self.path)
        if self._store_id is not None and found != self._store_id:
            self.reopened += 1
            self._error(
                StoreError(
                    f"session store {self.path} was deleted or replaced while the server ran; opened it again "
                    "at its path (the sessions and totals in the old file are not in it)"
                )
            )
        self._store_id = found
        self._opened.set()
        return db
