"""Per-session (multi-turn agent) accounting, bounded: at most ``max_sessions`` live
sessions, each closed after ``idle_ttl_s`` without a turn, and at most ``max_turns`` turn
rows kept per session (totals keep counting). Whatever is dropped is counted."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pte_instrument.cost.model import reusable_prefix
from pte_instrument.server.bounded import BoundedDict
from pte_instrument.server.ledger import RequestRecord

# Fields of a turn row shown by the HTTP routes and the demo.
TURN_FIELDS = (
    "turn", "request_id", "prompt_tokens", "cached_tokens", "computed_prefill_tokens",
    "recomputed_tokens", "output_tokens", "pte_reference", "pte_served", "pte_ideal",
    "pte_eviction_tax", "pte_recompute", "pause_s", "inference_s", "finish_reason", "finished_at",
    "gpu_seconds", "predicted_seconds", "latency_explained_s", "interference_s", "cost_usd",
)  # fmt: skip


@dataclass(frozen=True)
class TurnContext:
    """What a new turn inherits from its session."""

    turn: int
    reusable_tokens: int  # context the previous turn already paid for
    pause_s: float | None  # tool pause since the previous turn finished


@dataclass
class SessionState:
    session_id: str
    model: str
    first_seen: float
    last_seen: float
    turns: deque[tuple[Any, ...]]  # rows of TURN_FIELDS; tuples are half the size of dicts
    n_turns: int = 0
    turns_dropped: int = 0
    last_prompt: int = 0  # the latest turn's prompt and output tokens
    last_output: int = 0
    last_finished_at: float | None = None
    totals: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "model": self.model,
            "turns": self.n_turns,
            "turns_dropped": self.turns_dropped,
            "first_seen": self.first_seen,
            "last_seen": self.last_seen,
            **self.totals,
        }


SUMMED = ("prompt_tokens", "cached_tokens", "output_tokens", "pte_reference", "pte_served", "pte_ideal",
          "pte_eviction_tax", "pte_recompute", "pause_s", "gpu_seconds", "latency_explained_s",
          "interference_s", "cost_usd")  # fmt: skip


@dataclass
class LedgerStats:
    sessions_opened: int = 0
    sessions_expired: int = 0  # idle longer than the TTL
    sessions_evicted: int = 0  # pushed out by the max_sessions cap
    turns_dropped: int = 0  # rows beyond max_turns (their totals are kept)


class SessionLedger:
    def __init__(
        self,
        max_sessions: int = 5000,
        idle_ttl_s: float = 3600.0,
        max_turns: int = 64,
        block_size: int = 1,
        on_close: Callable[[SessionState, str], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_sessions < 1 or max_turns < 1 or idle_ttl_s <= 0:
            raise ValueError("max_sessions and max_turns must be ≥ 1, idle_ttl_s > 0")
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self.max_turns = max_turns
        self.block_size = block_size  # the server's KV block: prefix caching is per block
        self.on_close = on_close
        self.clock = clock
        self.stats = LedgerStats()
        self._sessions: BoundedDict[str, SessionState] = BoundedDict(max_sessions)  # least recently seen first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def context_for(self, session_id: str, arrived_at: float, prompt_tokens: int) -> TurnContext:
        """Turn number, reusable prefix and pause for the next turn of ``session_id``."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None:
                return TurnContext(turn=1, reusable_tokens=0, pause_s=None)
            pause = None if s.last_finished_at is None else max(0.0, arrived_at - s.last_finished_at)
            reusable = reusable_prefix(s.last_prompt, s.last_output, prompt_tokens, self.block_size)
            return TurnContext(s.n_turns + 1, reusable, pause)

    def add(self, record: RequestRecord) -> None:
        if record.session_id is None:
            return
        closed: list[tuple[SessionState, str]] = []
        with self._lock:
            now = self.clock()
            s = self._sessions.get(record.session_id)
            if s is None:
                s = SessionState(record.session_id, record.model, now, now, deque(maxlen=self.max_turns),
                                 totals=dict.fromkeys(SUMMED, 0.0))  # fmt: skip
                for _, old in self._sessions.put(record.session_id, s):
                    self.stats.sessions_evicted += 1
                    closed.append((old, "evicted"))
                self.stats.sessions_opened += 1
            else:
                self._sessions.touch(record.session_id)
            if len(s.turns) == self.max_turns:
                s.turns_dropped += 1
                self.stats.turns_dropped += 1
            s.turns.append(tuple(getattr(record, k) for k in TURN_FIELDS))
            s.n_turns += 1
            s.last_seen = now
            s.last_prompt, s.last_output = record.prompt_tokens, record.output_tokens
            s.last_finished_at = record.finished_at
            for k in SUMMED:
                s.totals[k] += getattr(record, k) or 0.0
            closed += self._expire_locked(now)
        self._notify(closed)

    def expire(self) -> int:
        """Close sessions idle for longer than the TTL; returns how many."""
        with self._lock:
            closed = self._expire_locked(self.clock())
        self._notify(closed)
        return len(closed)

    def _expire_locked(self, now: float) -> list[tuple[SessionState, str]]:
        closed = []
        while (entry := self._sessions.oldest()) is not None:
            oldest = entry[1]
            if now - oldest.last_seen <= self.idle_ttl_s:
                break
            self._sessions.pop_oldest()
            self.stats.sessions_expired += 1
            closed.append((oldest, "idle"))
        return closed

    def _notify(self, closed: list[tuple[SessionState, str]]) -> None:
        if self.on_close is not None:
            for state, reason in closed:
                self.on_close(state, reason)

    def get(self, session_id: str) -> dict[str, Any] | None:
        with self._lock:
            s = self._sessions.get(session_id)
            return (
                None
                if s is None
                else {**s.summary(), "turn_rows": [dict(zip(TURN_FIELDS, t, strict=True)) for t in s.turns]}
            )

    def top(
        self, limit: int = 50, offset: int = 0, key: str = "pte_served"
    ) -> tuple[int, list[dict[str, Any]]]:
        """Live sessions by descending ``key`` (a summed field), paginated; also the total count."""
        with self._lock:
            ranked = sorted(self._sessions.values(), key=lambda s: s.totals[key], reverse=True)
            return len(ranked), [s.summary() for s in ranked[offset : offset + limit]]
