"""The session store's file: one SQLite database (WAL) per server, shared by its API-server
processes: the schema, opening it, and the columns its tables and routes share. What is
written to it is the business of the session ledger (``sessions``), the totals
(``totals``) and the feedback window (``feedback_window``)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

from pte_instrument.server.ledger import MODEL_TOTALS

# Fields of a turn row shown by the HTTP routes and the demo.
TURN_FIELDS = (
    "turn",
    "request_id",
    "prompt_tokens",
    "cached_tokens",
    "computed_prefill_tokens",
    "recomputed_tokens",
    "output_tokens",
    "pte_reference",
    "pte_served",
    "pte_ideal",
    "pte_eviction_tax",
    "pte_recompute",
    "pause_s",
    "inference_s",
    "finish_reason",
    "finished_at",
    "gpu_seconds",
    "predicted_seconds",
    "latency_explained_s",
    "interference_s",
    "cost_usd",
)

SUMMED = (
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "pte_reference",
    "pte_served",
    "pte_ideal",
    "pte_eviction_tax",
    "pte_recompute",
    "pause_s",
    "gpu_seconds",
    "latency_explained_s",
    "interference_s",
    "cost_usd",
)

# Counts of one (model, benchmark) cell of the live efficiency (``live_efficiency.Outcome``).
OUTCOME_COUNTS = (
    "requests",
    "truncated",
    "output_tokens",
    "labeled",
    "labeled_truncated",
    "labeled_output_tokens",
    "correct",
)

SCHEMA_VERSION = 1
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, model TEXT NOT NULL, first_seen REAL NOT NULL, last_seen REAL NOT NULL,
    touched INTEGER NOT NULL, n_turns INTEGER NOT NULL, turns_dropped INTEGER NOT NULL,
    last_prompt INTEGER NOT NULL, last_output INTEGER NOT NULL, last_finished_at REAL,
    {", ".join(f"{k} REAL NOT NULL DEFAULT 0" for k in SUMMED)}
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS sessions_touched ON sessions (touched);
CREATE INDEX IF NOT EXISTS sessions_last_seen ON sessions (last_seen);
CREATE TABLE IF NOT EXISTS turns (
    session_id TEXT NOT NULL, seq INTEGER NOT NULL, row TEXT NOT NULL, PRIMARY KEY (session_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS servers (id TEXT PRIMARY KEY, last_seen REAL NOT NULL) WITHOUT ROWID;
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
COUNTED = ("sessions_opened", "sessions_expired", "sessions_evicted", "turns_dropped")
SUMMARY_COLUMNS = ("id", "model", "n_turns", "turns_dropped", "first_seen", "last_seen", *SUMMED)


class StoreError(RuntimeError):
    """The session store cannot be opened or used (the message names the file and why)."""


def file_id(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``; None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def connect(path: Path) -> sqlite3.Connection:
    """A connection to the store, created with its schema if new; a file that is not a
    session store of this version is a :class:`StoreError` naming it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")  # WAL: a process crash loses nothing committed
        db.executescript(SCHEMA)
        db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
        version = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()[0]
    except (sqlite3.Error, OSError) as e:
        raise StoreError(f"cannot open the session store {path}: {e}") from None
    if version != SCHEMA_VERSION:
        db.close()
        raise StoreError(
            f"the session store {path} has schema {version!r}, this version reads {SCHEMA_VERSION}"
        )
    return db


def session_summary(row: tuple[Any, ...]) -> dict[str, Any]:
    s = dict(zip(SUMMARY_COLUMNS, row, strict=True))
    return {
        "session_id": s.pop("id"),
        "model": s.pop("model"),
        "turns": s.pop("n_turns"),
        "turns_dropped": s.pop("turns_dropped"),
        **s,
    }
