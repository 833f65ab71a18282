"""Live outcome-layer efficiency (docs/efficiency-model.md §1) per (model, benchmark label):
truncation rate and E[T] from every finished request, and — from correctness labels
posted back by an evaluation harness — r_logic and E0. Pooled ratios of sums, as the
spec requires; bounded (the labels join a window of recent requests, kept in the host's
session store)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pte_instrument.server.request_tags import quoted
from pte_instrument.server.sessions import SessionLedger


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
    labels join, kept in the host's session store so that any API server takes a label for
    a request another one served. A session keeps only its requests still in the window
    (they leave it with the request), so all sessions together hold at most ``window`` ids.
    ``observe`` queues (the store's writer commits it); ``label`` and ``snapshot`` see every
    request this process observed before them."""

    def __init__(self, window: int = 50_000, store: SessionLedger | None = None) -> None:
        """``store``: the host's (its ``feedback_window`` is the window); None: a private one
        of ``window`` requests."""
        self._own = store is None
        self.store = store if store is not None else SessionLedger(feedback_window=window)
        self.window = self.store.feedback_window

    def observe(
        self,
        request_id: str,
        session_id: str | None,
        model: str,
        benchmark: str,
        output_tokens: int,
        finish_reason: str,
    ) -> None:
        self.store.observe(request_id, session_id, model, benchmark, output_tokens, finish_reason == "length")

    def label(
        self, correct: bool, request_ids: Sequence[str] = (), session_id: str | None = None
    ) -> dict[str, Any]:
        """Apply a correctness label to one request (the first known of ``request_ids``,
        spellings of one id) or to a whole session (one instance: its output is all its
        turns' tokens, truncated if its last turn was)."""
        name = quoted(request_ids[0] if request_ids else session_id or "")
        items = self.store.label(correct, list(request_ids), session_id)
        if items is None:
            of = "for" if request_ids else "of session"  # say which kind of id was looked for
            raise FeedbackError(404, f"no recent finished request {of} {name}")
        if not items:
            raise FeedbackError(409, f"{name} is already labeled")
        return items

    def snapshot(self) -> list[dict[str, Any]]:
        cells = self.store.outcomes()
        return [{"model": m, "benchmark": b, **Outcome(**c).summary()} for (m, b), c in sorted(cells.items())]

    def close(self) -> None:
        if self._own:
            self.store.close()
