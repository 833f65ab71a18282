"""Which requests and steps of the logs are analysed together: a phase.

The latency bench runs its workload in phases of known concurrency, each a time window
whose sessions share a name prefix. A server's own logs have no phases, so ``pte validate``
finds two in the request log itself: the requests that had the engine to themselves (no
other request in flight at any moment between their arrival and their finish: what
"alone" means, whatever the client's concurrency) and the rest, under load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MIN_ALONE = 8  # fewer requests served alone: no alone phase (nothing to calibrate on)


@dataclass(frozen=True)
class Phase:
    """Requests and steps analysed together, at one ``concurrency`` (1: alone).

    A bench phase: its requests carry session ids ``<session_prefix>-…`` and its steps fall in
    [t_start, t_end] (the engine stamps steps with the same wall clock). A phase found in a
    log: exactly ``request_ids``, and the steps within ``windows`` (its requests' own
    [arrival, finish] intervals, merged)."""

    name: str
    concurrency: int
    t_start: float
    t_end: float
    session_prefix: str = ""
    request_ids: frozenset[str] = frozenset()
    windows: tuple[tuple[float, float], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "concurrency": self.concurrency,
            "t_start": self.t_start,
            "t_end": self.t_end,
            "session_prefix": self.session_prefix,
            **({"requests": len(self.request_ids), "windows": len(self.windows)} if self.request_ids else {}),
        }

    def holds_requests(
        self, request_ids: Sequence[str], session_ids: Sequence[Any], finished_at: np.ndarray
    ) -> np.ndarray:
        """Which requests of a table are this phase's."""
        if self.request_ids:
            return np.array([r in self.request_ids for r in request_ids], dtype=bool)
        prefix = self.session_prefix + "-"
        by_session = np.array([str(s).startswith(prefix) for s in session_ids], dtype=bool)
        if self.session_prefix and by_session.any():
            return by_session
        # no session ids in the log (session routes off): by finish time
        return np.isfinite(finished_at) & (finished_at >= self.t_start) & (finished_at <= self.t_end + 5.0)

    def holds_times(self, t: np.ndarray) -> np.ndarray:
        """Which of the times ``t`` (of steps) fall in this phase."""
        if not self.windows:
            return (t >= self.t_start) & (t <= self.t_end)
        starts = np.array([w[0] for w in self.windows])
        ends = np.array([w[1] for w in self.windows])
        i = np.searchsorted(starts, t, side="right") - 1  # the last window starting at or before t
        ok = i >= 0
        out = np.zeros(t.shape, dtype=bool)
        out[ok] = t[ok] <= ends[i[ok]]
        return out


def served_alone(arrived: np.ndarray, finished: np.ndarray) -> np.ndarray:
    """Which requests had no other request in flight between their arrival and their finish."""
    n = len(arrived)
    order = np.argsort(arrived, kind="stable")
    a, f = arrived[order], finished[order]
    latest_before = np.maximum.accumulate(np.concatenate([[-np.inf], f[:-1]])) if n else f
    next_arrival = np.concatenate([a[1:], [np.inf]]) if n else a
    alone_sorted = (latest_before <= a) & (next_arrival >= f)
    out = np.zeros(n, dtype=bool)
    out[order] = alone_sorted
    return out


def merged(intervals: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """Intervals merged where they overlap, in order."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return tuple((s, e) for s, e in out)


def phases_of_log(request_ids: Sequence[str], arrived: np.ndarray, finished: np.ndarray) -> list[Phase]:
    """The phases a request log holds: ``alone`` (served alone, when at least ``MIN_ALONE``
    were) and ``under-load`` (the others, at their mean number in flight), each with its
    requests' windows. Requests without both times are in neither."""
    timed = np.isfinite(arrived) & np.isfinite(finished)
    ids = [r for r, ok in zip(request_ids, timed, strict=True) if ok]
    a, f = arrived[timed], finished[timed]
    alone = served_alone(a, f)
    out: list[Phase] = []
    groups = (
        [("alone", alone), ("under-load", ~alone)]
        if alone.sum() >= MIN_ALONE
        else [("all", np.ones_like(alone))]
    )
    for name, sel in groups:
        if not sel.any():
            continue
        windows = merged(list(zip(a[sel].tolist(), f[sel].tolist(), strict=True)))
        busy = sum(e - s for s, e in windows)
        in_flight = float(np.sum(f[sel] - a[sel]) / busy) if busy > 0 else 1.0
        concurrency = 1 if name == "alone" else max(2, round(in_flight))
        out.append(
            Phase(
                name,
                concurrency,
                float(a[sel].min()),
                float(f[sel].max()),
                request_ids=frozenset(r for r, s in zip(ids, sel, strict=True) if s),
                windows=windows,
            )
        )
    return out
