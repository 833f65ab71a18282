"""Joining the engine hook's exact totals to the requests the stat logger sees finish.

``EngineInbox`` receives the hook's messages (on the transport's thread) and keeps each
request's totals until its finish is reported; ``RequestJoin`` (on vLLM's stat-logger
thread) waits a little for totals that have not arrived yet, prices each request once, and
prices from the totals alone the requests vLLM never reports (a client that hung up)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pte_instrument.faults import FaultTracker
from pte_instrument.server.bounded import BoundedDict
from pte_instrument.server.ledger import FinishedRequest
from pte_instrument.wire import EngineFaults, EngineHello, EngineMessage, RequestTotals

MAX_ENGINE_RESULTS = 20_000
MAX_PRICED_WITHOUT_ENGINE = 10_000
ENGINE_JOIN_TIMEOUT_S = 2.0
ORPHAN_AFTER_S = 5.0  # engine results unclaimed this long are requests the stat logger never saw


class EngineInbox:
    """The engine hooks' reports to this API server, bounded."""

    def __init__(self, faults: FaultTracker, on_engine_faults: Callable[[str, int], None]) -> None:
        self.faults = faults
        self._on_engine_faults = on_engine_faults
        self.hooks: set[int] = set()  # engines whose scheduler hook said hello
        self.live: dict[int, int] = {}  # requests each engine's hook still tracks
        self.cost: dict[int, tuple[int, float]] = {}  # (steps, seconds in the hook)
        self._results: BoundedDict[str, tuple[RequestTotals, float]] = BoundedDict(MAX_ENGINE_RESULTS)
        self._lock = threading.Lock()

    @property
    def dropped(self) -> int:
        return self._results.dropped

    def __len__(self) -> int:
        return len(self._results)

    def on_messages(self, messages: list[EngineMessage]) -> None:
        now = time.monotonic()
        with self._lock:
            for m in messages:
                if isinstance(m, EngineHello):
                    self.hooks.add(m.engine)
                elif isinstance(m, EngineFaults):  # the hook's faults since its last report
                    for stage, n in m.counts.items():
                        self._on_engine_faults(stage, n)
                        self.faults.counts[stage] += n
                else:
                    self.live[m.engine] = m.engine_live
                    self.cost[m.engine] = (m.engine_steps, m.engine_hook_s)
                    self._results.put(m.external_id, (m, now))  # never joined: bounded

    def take(self, *keys: str) -> RequestTotals | None:
        with self._lock:
            for key in keys:
                found = self._results.pop(key)
                if found is not None:
                    return found[0]
        return None

    def take_orphans(self, older_than_s: float) -> list[RequestTotals]:
        """Totals no finished request claimed in time: requests vLLM's stat logger never
        reports (a client that disconnected: aborted)."""
        cutoff = time.monotonic() - older_than_s
        out = []
        with self._lock:
            while (oldest := self._results.oldest()) is not None and oldest[1][1] <= cutoff:
                self._results.pop_oldest()
                out.append(oldest[1][0])
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "engines": sorted(self.hooks),
            "live_requests": {str(k): v for k, v in self.live.items()},
            "results_unjoined": len(self),
            "results_dropped": self.dropped,
            "steps": {str(k): v[0] for k, v in self.cost.items()},
            "hook_seconds": {str(k): v[1] for k, v in self.cost.items()},
        }


def orphan_request(totals: RequestTotals, model: str) -> FinishedRequest:
    """A request known only from the engine hook (vLLM reports no stats for aborts)."""
    return FinishedRequest(
        request_id=totals.external_id,
        model=model,
        engine=totals.engine,
        prompt_tokens=totals.prompt_tokens,
        cached_tokens=totals.cached_tokens,
        output_tokens=totals.output_tokens,
        finish_reason=totals.finish_reason,
        num_preemptions=totals.num_preemptions,
        recomputed_tokens=int(totals.recompute),
        engine_totals=totals,
    )


class RequestJoin:
    """Prices each finished request once, with the engine's exact totals when a hook runs.

    ``keys(request_id)``: the spellings under which the middleware and the engine may know
    a request's id; ``tag(request)``: the request with its session tag; ``price(request)``:
    hands it to the accountant of its engine."""

    def __init__(
        self,
        inbox: EngineInbox,
        model: str,
        keys: Callable[[str], tuple[str, ...]],
        tag: Callable[[FinishedRequest], FinishedRequest],
        price: Callable[[FinishedRequest], None],
        faults: FaultTracker,
    ) -> None:
        self.inbox = inbox
        self.model = model
        self.keys = keys
        self.tag = tag
        self.price = price
        self.faults = faults
        self.waiting: list[tuple[FinishedRequest, float]] = []
        self._priced_without_engine: BoundedDict[str, None] = BoundedDict(MAX_PRICED_WITHOUT_ENGINE)

    def finished(self, request: FinishedRequest, now: float) -> None:
        self.waiting.append((request, now + ENGINE_JOIN_TIMEOUT_S))

    def price_ready(self, now: float) -> None:
        """Price finished requests, joined with the engine hook's exact totals. Those
        usually arrive first (sent before the engine returns its outputs); a request
        waits for them at most ENGINE_JOIN_TIMEOUT_S, and only when a hook is running."""
        waiting, self.waiting = self.waiting, []
        for request, deadline in waiting:
            try:
                totals = self.inbox.take(*self.keys(request.request_id))
                if totals is None and self.inbox.hooks and now < deadline:
                    self.waiting.append((request, deadline))
                    continue
                if totals is None and self.inbox.hooks:
                    self.faults.record("engine_join", TimeoutError(f"no engine totals for {request.request_id}"))
                    self._priced_without_engine.put(request.request_id, None)  # their late totals: no 2nd entry
                if totals is not None:
                    request = replace(request, recomputed_tokens=int(totals.recompute), engine_totals=totals)
            except Exception as e:
                self.faults.record("engine_join", e)
            self.price(request)

        for totals in self.inbox.take_orphans(ORPHAN_AFTER_S):
            try:
                if totals.external_id in self._priced_without_engine:  # already priced: one entry per request
                    self._priced_without_engine.pop(totals.external_id)
                    continue
                request = self.tag(orphan_request(totals, self.model))
            except Exception as e:
                self.faults.record("engine_join", e)
                continue
            self.price(request)
