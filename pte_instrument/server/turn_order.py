"""Turns of one session priced in the order they happened, whichever API server (or replica)
served each.

A turn's number, pause and reusable prefix come from the session's previous turn as the
store holds it when the turn is priced. The previous turn may have finished on another
process whose pricing lags (its engine totals late, its pricer or writer busy): priced then,
the turn would read the session as it was before, and take the previous turn's number. So
each writer publishes a watermark with every commit: a wall time before which every session
turn its process was told finished has landed in the store (``Unlanded``). A turn is priced
once every other writer's watermark, and this process's turns of the same session not yet
priced, have passed its arrival: every turn that finished before it arrived is then in the
store (a client sends the next turn after the previous one's answer, and vLLM reports a
request finished before its answer goes out). It waits at most ``TURN_ORDER_WAIT_S``, then
is priced as things are, counted as a fault. Across replicas (a Redis store) this holds
where their clocks agree to better than the time from a turn's answer to the next turn.

Each writer publishes a second watermark alike for every request its process was told
finished, session or not: a correctness label that reaches another API server than the one
that served its request waits for it before it looks again.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from pte_instrument.server.bounded import BoundedDict

TURN_ORDER_WAIT_S = 3.0  # longer than the engine join's least wait, so a late turn still lands first
HEARTBEAT_S = 0.05  # how often a writer publishes its watermark while other writers share the store
PEER_ALIVE_S = 3.0  # a writer that published within this long is waited for (a lone one does each second)
WRITER_GONE_S = 3600.0  # a writer silent this long has stopped (a crash): its entry is dropped
MAX_UNLANDED = 100_000  # requests told finished and not yet landed, remembered at most
UNLANDED_FOR_S = 10.0  # past this, a request that never landed (its pricing failed) holds nothing back


class Watermarks(NamedTuple):
    """What a writer publishes: times before which every session turn, and every request,
    its process was told finished has landed in the store."""

    turns: float
    requests: float


@dataclass(slots=True)
class _Told:
    """An id told finished: when first, and how many times not yet landed (or priced); a
    session turn's or another request's."""

    at: float
    count: int = 1
    turn: bool = True


@dataclass(slots=True)
class _Unpriced(_Told):
    session: str = ""


class Unlanded:
    """This process's requests told finished (``told``) and not yet in the store: priced
    (``priced``, session turns: then this process's own context reads see them), then
    committed, or given up (``landed``: the commit failed, or the pricing did). Kept in the
    order told, so that the earliest is the first; the unpriced turns also by session. Two
    watermarks come of them: the session turns' (the turn order waits for) and every
    request's (a correctness label sent to another API server waits for).

    An id is counted each time it is told: vLLM reports every sample of a parallel-sampling
    request (n > 1) finished under the parent's id, and the parent is on its way until each
    sample is priced and landed (the samples are priced and filed under ids of their own:
    ``records.reported_request_id`` gives the parent's back)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._unlanded: BoundedDict[str, _Told] = BoundedDict(MAX_UNLANDED)
        self._unpriced: BoundedDict[str, _Unpriced] = BoundedDict(MAX_UNLANDED)
        self._by_session: dict[str, dict[str, float]] = {}  # session → its unpriced turns, id → at

    def told(self, request_id: str, session_id: str | None) -> None:
        """``session_id``: None for a request of no session."""
        with self._lock:  # the time is read under the lock ``watermark`` reads it under
            at = self.clock()
            landing = self._unlanded.get(request_id)
            if landing is None:
                self._unlanded.put(request_id, _Told(at, turn=session_id is not None))
            else:  # counted where it was first told: the earliest still holds the watermark
                landing.count += 1
                landing.turn = landing.turn or session_id is not None
            if session_id is None:
                return
            pricing = self._unpriced.get(request_id)
            if pricing is not None and pricing.session == session_id:
                pricing.count += 1
                return
            self._unprice(request_id)  # a client may reuse an id, for another session
            for dropped, entry in self._unpriced.put(request_id, _Unpriced(at, session=session_id)):
                self._unlink(dropped, entry.session)
            self._by_session.setdefault(session_id, {})[request_id] = at

    def priced(self, request_id: str) -> None:
        with self._lock:
            pricing = self._unpriced.get(request_id)
            if pricing is not None:
                pricing.count -= 1
                if pricing.count <= 0:
                    self._unprice(request_id)

    def landed(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            for rid in request_ids:
                landing = self._unlanded.get(rid)
                left = 0
                if landing is not None:
                    landing.count -= 1
                    left = landing.count
                    if left <= 0:
                        self._unlanded.pop(rid)
                # A turn lands after it is priced, so no more of an id are unpriced than
                # unlanded: one that lands unpriced was given up (its pricing failed).
                pricing = self._unpriced.get(rid)
                if pricing is not None and pricing.count > left:
                    pricing.count = left
                    if left <= 0:
                        self._unprice(rid)

    def watermark(self, landing: Iterable[str] = (), every_request: bool = False) -> float:
        """A time before which every turn (``every_request``: every request) told finished has
        landed, or lands with ``landing`` (the batch being committed)."""
        marks = self.watermarks(landing)
        return marks.requests if every_request else marks.turns

    def watermarks(self, landing: Iterable[str] = ()) -> Watermarks:
        """Both watermarks, as of the batch ``landing``, in one pass from the earliest told."""
        landing = Counter(landing)
        with self._lock:
            now = self.clock()
            cutoff = now - UNLANDED_FOR_S  # a request that never landed holds nothing back
            while (old := self._unlanded.oldest()) is not None and old[1].at < cutoff:
                self._unlanded.pop_oldest()
            while (unpriced := self._unpriced.oldest()) is not None and unpriced[1].at < cutoff:
                self._unprice(unpriced[0])
            requests = None
            for rid, t in self._unlanded.items():
                if landing[rid] < t.count:
                    requests = t.at if requests is None else requests
                    if t.turn:
                        return Watermarks(t.at, requests)
            return Watermarks(now, now if requests is None else requests)

    def unpriced_since(self, session_id: str) -> float:
        """When the earliest turn of ``session_id`` not yet priced was told finished (inf: none)."""
        with self._lock:
            turns = self._by_session.get(session_id)
            return next(iter(turns.values())) if turns else math.inf

    def __len__(self) -> int:
        with self._lock:
            return len(self._unlanded)

    def _unprice(self, request_id: str) -> None:
        entry = self._unpriced.pop(request_id)
        if entry is not None:
            self._unlink(request_id, entry.session)

    def _unlink(self, request_id: str, session_id: str) -> None:
        turns = self._by_session.get(session_id)
        if turns is not None:
            turns.pop(request_id, None)
            if not turns:
                del self._by_session[session_id]
