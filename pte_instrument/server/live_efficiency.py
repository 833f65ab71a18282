"""Live outcome-layer efficiency (docs/efficiency-model.md §1) per (model, benchmark label):
truncation rate and E[T] from every finished request, and — from correctness labels
posted back by an evaluation harness — r_logic and E0. Pooled ratios of sums, as the
spec requires; bounded memory (the labels join a window of recent requests)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pte_instrument.server.bounded import BoundedDict
from pte_instrument.server.request_tags import quoted


@dataclass
class _Recent:
    model: str
    benchmark: str
    output_tokens: int
    truncated: bool
    session_id: str | None = None
    labeled: bool = False


@dataclass
class Outcome:
    """Counts of one (model, benchmark) cell."""

    requests: int = 0
    truncated: int = 0
    output_tokens: int = 0
    labeled: int = 0  # requests or sessions with a correctness label
    labeled_truncated: int = 0
    labeled_output_tokens: int = 0
    correct: int = 0

    def summary(self) -> dict[str, Any]:
        completed = self.labeled - self.labeled_truncated
        return {
            **self.__dict__,
            "truncation_rate": self.truncated / self.requests if self.requests else None,
            "r_ctx": 1 - self.truncated / self.requests if self.requests else None,
            "mean_output_tokens": self.output_tokens / self.requests if self.requests else None,
            "r_logic": self.correct / completed if completed else None,
            "e0": 1000 * self.correct / self.labeled_output_tokens if self.labeled_output_tokens else None,
        }


class FeedbackError(LookupError):
    """A label that cannot be applied: unknown id (404) or already labeled (409)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class LiveEfficiency:
    """Per-cell outcome counts, and the window of the last ``window`` finished requests that
    labels join. A session keeps only its requests still in the window (they leave it
    with the request), so all sessions together hold at most ``window`` ids."""

    def __init__(self, window: int = 50_000) -> None:
        self.window = window
        self.cells: dict[tuple[str, str], Outcome] = {}
        self._requests: BoundedDict[str, _Recent] = BoundedDict(window)
        # session → its requests in the window, oldest first (a dict: O(1) removal by id)
        self._sessions: BoundedDict[str, dict[str, None]] = BoundedDict(window)
        self._lock = threading.Lock()

    def observe(self, request_id: str, session_id: str | None, model: str, benchmark: str,
                output_tokens: int, finish_reason: str) -> None:  # fmt: skip
        truncated = finish_reason == "length"
        with self._lock:
            cell = self.cells.setdefault((model, benchmark), Outcome())
            cell.requests += 1
            cell.truncated += truncated
            cell.output_tokens += output_tokens
            replaced = self._requests.pop(request_id)  # an id seen again: the newer request counts
            if replaced is not None:
                self._unlink(request_id, replaced)
            recent = _Recent(model, benchmark, output_tokens, truncated, session_id)
            for old_id, old in self._requests.put(request_id, recent):
                self._unlink(old_id, old)
            if session_id is not None:
                ids = self._sessions.get(session_id) or {}
                ids[request_id] = None
                self._sessions.put(session_id, ids)

    def _unlink(self, request_id: str, recent: _Recent) -> None:
        """Take a request that left the window out of its session."""
        if recent.session_id is None:
            return
        ids = self._sessions.get(recent.session_id)
        if ids is not None:
            ids.pop(request_id, None)
            if not ids:
                self._sessions.pop(recent.session_id)

    def label(
        self, correct: bool, request_ids: Sequence[str] = (), session_id: str | None = None
    ) -> dict[str, Any]:
        """Apply a correctness label to one request (the first known of ``request_ids``,
        spellings of one id) or to a whole session (one instance: its output is all its
        turns' tokens, truncated if its last turn was)."""
        name = quoted(request_ids[0] if request_ids else session_id or "")
        with self._lock:
            if request_ids:
                ids = [i for i in request_ids if i in self._requests][:1]
            else:
                ids = list(self._sessions.get(session_id or "") or ())
            if not ids:
                raise FeedbackError(404, f"no recent finished request for {name}")
            items = [self._requests[i] for i in ids]
            if any(it.labeled for it in items):
                raise FeedbackError(409, f"{name} is already labeled")
            first, last = items[0], items[-1]
            tokens = sum(it.output_tokens for it in items)
            correct = bool(correct) and not last.truncated  # a truncated answer is never correct
            cell = self.cells[(first.model, first.benchmark)]
            cell.labeled += 1
            cell.labeled_truncated += last.truncated
            cell.labeled_output_tokens += tokens
            cell.correct += correct
            for it in items:
                it.labeled = True
            return {"model": first.model, "benchmark": first.benchmark, "requests": len(ids),
                    "output_tokens": tokens, "truncated": last.truncated, "correct": correct}  # fmt: skip

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return [{"model": m, "benchmark": b, **c.summary()} for (m, b), c in sorted(self.cells.items())]
