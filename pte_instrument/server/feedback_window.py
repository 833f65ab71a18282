"""The feedback window in the session store: the latest finished requests a correctness label
(``POST /pte/feedback``) can still reach, and the live efficiency's counts per (model,
benchmark) cell. Observed in the writer's transaction; labeled in a transaction of its own,
so that two API servers cannot label one instance twice."""

from __future__ import annotations

import sqlite3
from typing import Any

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

_RECENT = "SELECT request_id, model, benchmark, output_tokens, truncated, labeled FROM recent"


def observe(db: sqlite3.Connection, observed: list[tuple[Any, ...]], window: int) -> None:
    """Finished requests (request id, session id, model, benchmark, output tokens, truncated)
    into the window (an id seen again: the newer counts), the oldest past ``window`` out of
    it, and their cells' counts."""
    seq = db.execute("SELECT COALESCE(MAX(seq), 0) FROM recent").fetchone()[0]
    for rid, sid, model, benchmark, tokens, truncated in observed:
        seq += 1
        db.execute(
            "INSERT OR REPLACE INTO recent VALUES (?, ?, ?, ?, ?, ?, ?, 0)",
            (rid, seq, model, benchmark, tokens, truncated, sid),
        )
        db.execute(
            "INSERT INTO outcomes (model, benchmark, requests, truncated, output_tokens) VALUES (?, ?, 1, ?, ?)"
            " ON CONFLICT (model, benchmark) DO UPDATE SET requests = requests + 1,"
            " truncated = truncated + excluded.truncated, output_tokens = output_tokens + excluded.output_tokens",
            (model, benchmark, truncated, tokens),
        )
    db.execute("DELETE FROM recent WHERE seq <= ?", (seq - window,))


def label(
    db: sqlite3.Connection, correct: bool, request_ids: list[str], session_id: str | None
) -> dict[str, Any] | list | None:
    """Label the first of ``request_ids`` in the window, or all of ``session_id``'s requests in
    it, as one instance: its outcome; None if none is in the window; [] if already labeled."""
    with db:
        db.execute("BEGIN IMMEDIATE")
        if request_ids:  # spellings of one id: the first the window holds
            found = (db.execute(_RECENT + " WHERE request_id = ?", (rid,)).fetchall() for rid in request_ids)
            rows = next((r for r in found if r), [])
        else:
            rows = db.execute(_RECENT + " WHERE session_id = ? ORDER BY seq", (session_id,)).fetchall()
        if not rows:
            return None
        if any(r[5] for r in rows):
            return []
        first, last = rows[0], rows[-1]
        tokens = sum(r[3] for r in rows)
        truncated = bool(last[4])
        correct = bool(correct) and not truncated  # a truncated answer is never correct
        db.execute(
            "UPDATE outcomes SET labeled = labeled + 1, labeled_truncated = labeled_truncated + ?,"
            " labeled_output_tokens = labeled_output_tokens + ?, correct = correct + ?"
            " WHERE model = ? AND benchmark = ?",
            (int(truncated), tokens, int(correct), first[1], first[2]),
        )
        db.executemany("UPDATE recent SET labeled = 1 WHERE request_id = ?", [(r[0],) for r in rows])
    return {
        "model": first[1],
        "benchmark": first[2],
        "requests": len(rows),
        "output_tokens": tokens,
        "truncated": truncated,
        "correct": correct,
    }


def outcomes(db: sqlite3.Connection) -> dict[tuple[str, str], dict[str, int]]:
    """The counts per (model, benchmark), host-wide."""
    rows = db.execute(f"SELECT model, benchmark, {', '.join(OUTCOME_COUNTS)} FROM outcomes").fetchall()
    return {(r[0], r[1]): dict(zip(OUTCOME_COUNTS, r[2:], strict=True)) for r in rows}
