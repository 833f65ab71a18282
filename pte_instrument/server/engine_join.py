"""Joining the engine hook's exact totals to the requests the stat logger sees finish.

``EngineInbox`` receives the hook's messages (on the transport's thread) and keeps each
request's totals until its finish is reported; ``RequestJoin`` waits for totals that have
not arrived yet (2 s, up to 8 s while their engine lags), prices each request once, in the
order the requests arrived,
and prices from the totals alone the requests vLLM never reports (a client that hung up,
a request aborted while queued). The API server's pricer thread asks it for what is ready
within ``TICK_S`` of its totals or its finish arriving."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgspec

from pte_instrument.faults import FaultTracker
from pte_instrument.server.bounded import BoundedDict
from pte_instrument.server.records import FinishedRequest, child_request_id
from pte_instrument.wire import EngineCalibration, EngineFaults, EngineHello, EngineMessage, RequestTotals

MAX_ENGINE_RESULTS = 20_000  # totals waiting for their request's finish (in each of the two stores)
MAX_PER_ID = 64  # totals under one id (parallel-sampling children, a client reusing an id)
MAX_PRICED_ONCE = 10_000  # ids priced from one side, whose other side may still come
# What the inbox takes of a message, whoever sent it (the transport takes any sender): the
# engines it keeps state for (data-parallel ranks), the fault stages it counts by name (a
# metric label), and the sizes of a totals' ids and finish reason (vLLM's ids are the API
# server's bounded id, a prefix and a suffix) and context columns (one per KV-cache group).
MAX_ENGINES = 1024
MAX_ENGINE_STAGES = 32
MAX_FAULT_COUNT = 2**53  # faults one report adds to a stage (a float counter counts by one below it)
# The stages the engine hook reports its faults under: counted by name whatever else arrives.
HOOK_STAGES = ("engine_setup", "engine_step", "engine_finish", "engine_transport", "engine_step_log")
MAX_ENGINE_STAGE_LEN = 64
OTHER_ENGINE_STAGE = "engine_other"
MAX_ENGINE_ID_LEN = 1024
MAX_KV_GROUPS = 1024
# vLLM's finish reasons (``vllm.v1.engine.FINISH_REASON_STRINGS``): an orphan priced from its
# totals alone is named by one of them, or ``other`` (a metric label).
FINISH_REASONS = frozenset({"stop", "length", "abort", "error", "repetition"})
OTHER_FINISH_REASON = "other"
# How long a finished request waits for its engine's totals: at least ENGINE_JOIN_TIMEOUT_S
# (a request the engine holds back for a step still running, a busy transport); then, while
# its engine lags (no totals of a request it freed later, no fault said since), up to
# ENGINE_JOIN_MAX_WAIT_S: a busy host can delay the engine's pricing by seconds. Shorter than
# ``turn_order.UNLANDED_FOR_S``, so a session turn waiting here still holds later turns back.
ENGINE_JOIN_TIMEOUT_S = 2.0
ENGINE_JOIN_MAX_WAIT_S = 8.0
ORPHAN_AFTER_S = 5.0  # finished totals unclaimed this long: the stat logger never saw them
ABORT_GRACE_S = 0.05  # vLLM reports no stats for a client abort: price its totals at once
TICK_S = 0.02


class _Pending:
    """Totals under one id, oldest first, with when each arrived."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[tuple[RequestTotals, float]] = []


class EngineInbox:
    """The engine hooks' reports to this API server, bounded."""

    def __init__(
        self,
        faults: FaultTracker,
        on_engine_faults: Callable[[str, int], None],
        on_calibration: Callable[[EngineCalibration], None] = lambda c: None,
    ) -> None:
        self.faults = faults
        self._on_engine_faults = on_engine_faults
        self._on_calibration = on_calibration
        self.calibration: dict[int, EngineCalibration] = {}  # each engine's latest step-time model
        self.hooks: set[int] = set()  # engines whose scheduler hook said hello
        # Per engine: the latest unix time it freed a request whose totals came here (it sends
        # totals in the order it frees requests), and whether its latest word was a fault.
        self.freed_through: dict[int, float] = {}
        self.fault_said: dict[int, bool] = {}
        self.live: dict[int, int] = {}  # requests each engine's hook still tracks
        self.cost: dict[int, tuple[int, float]] = {}  # (steps, seconds in the hook)
        self.arrived = threading.Event()  # set when totals arrive: the join may have work
        self._finished: BoundedDict[str, _Pending] = BoundedDict(MAX_ENGINE_RESULTS)
        self._aborted: BoundedDict[str, _Pending] = BoundedDict(MAX_ENGINE_RESULTS)
        self._overflow = 0  # totals dropped past MAX_PER_ID or MAX_ENGINE_RESULTS
        # totals in each store: ids alone do not bound them (up to MAX_PER_ID under one)
        self._held: dict[BoundedDict[str, _Pending], int] = {self._finished: 0, self._aborted: 0}
        self.refused = 0  # totals refused for their size (``_fits``)
        self.engines_refused = 0  # messages of engines past MAX_ENGINES
        self._engines: set[int] = set()  # the engines state is kept for
        self._stages: set[str] = set(HOOK_STAGES)  # the fault stages counted by their own name
        # The ids of the totals received, in order (the first ``_arrived_base`` dropped), so
        # that each join looks up only the waiting requests whose totals came.
        self._arrived: list[str] = []
        self._arrived_base = 0
        self._lock = threading.Lock()

    @property
    def dropped(self) -> int:
        return self._finished.dropped + self._aborted.dropped + self._overflow + self.refused

    def __len__(self) -> int:
        with self._lock:
            return sum(len(p.items) for store in (self._finished, self._aborted) for p in store.values())

    def on_messages(self, messages: list[EngineMessage]) -> None:
        now = time.monotonic()
        refused = self.refused + self.engines_refused
        with self._lock:
            for m in messages:
                if not self._known(m.engine):
                    self.engines_refused += 1
                elif isinstance(m, EngineHello):
                    self.hooks.add(m.engine)
                elif isinstance(m, EngineFaults):  # the hook's faults since its last report
                    self.fault_said[m.engine] = True
                    for stage, n in m.counts.items():
                        if n <= 0:  # a count no hook sends: nothing to add (a metric cannot go down)
                            continue
                        stage, n = self._stage(stage), min(n, MAX_FAULT_COUNT)
                        self.faults.counts[stage] += n
                        try:
                            self._on_engine_faults(stage, n)
                        except Exception as e:  # the rest of the batch still goes in
                            self.faults.record("engine_join", e)
                elif isinstance(m, EngineCalibration):
                    self.calibration[m.engine] = m
                    self._on_calibration(m)
                elif not _fits(m):
                    self.refused += 1
                else:
                    self.fault_said[m.engine] = False
                    if m.finished_at > self.freed_through.get(m.engine, 0.0):
                        self.freed_through[m.engine] = m.finished_at
                    self.live[m.engine] = m.engine_live
                    self.cost[m.engine] = (m.engine_steps, m.engine_hook_s)
                    self._arrived.append(m.external_id)
                    store = self._aborted if m.finish_reason == "abort" else self._finished
                    pending = store.get(m.external_id) or _Pending()
                    pending.items.append((m, now))
                    self._held[store] += 1
                    if len(pending.items) > MAX_PER_ID:
                        del pending.items[0]
                        self._held[store] -= 1
                        self._overflow += 1
                    for _, lost in store.put(m.external_id, pending):  # never joined: bounded
                        self._held[store] -= len(lost.items)
                    # the oldest ids go, whole, until the store holds MAX_ENGINE_RESULTS totals at most
                    while self._held[store] > MAX_ENGINE_RESULTS:
                        _, lost = store.pop_oldest()
                        self._held[store] -= len(lost.items)
                        self._overflow += len(lost.items)
            if len(self._arrived) > 2 * MAX_ENGINE_RESULTS:  # keep the latest MAX_ENGINE_RESULTS
                del self._arrived[:-MAX_ENGINE_RESULTS]
                self._arrived_base = self.arrivals - MAX_ENGINE_RESULTS
        if (n := self.refused + self.engines_refused - refused) > 0:
            self.faults.record(
                "engine_join",
                ValueError(
                    f"{n} engine messages refused: an engine index past the {MAX_ENGINES} kept, or totals "
                    f"with an id over {MAX_ENGINE_ID_LEN} characters or over {MAX_KV_GROUPS} context columns"
                ),
            )
        self.arrived.set()

    def _known(self, engine: int) -> bool:
        """Whether state is kept for ``engine``: the first ``MAX_ENGINES`` engines heard from."""
        if engine in self._engines:
            return True
        if len(self._engines) >= MAX_ENGINES:
            return False
        self._engines.add(engine)
        return True

    def _stage(self, stage: str) -> str:
        """The name an engine's fault stage is counted under (a metric label): its own for
        the hook's stages and further ``engine_*`` stages of a sane length, up to
        ``MAX_ENGINE_STAGES - 1`` names in all; else ``OTHER_ENGINE_STAGE``."""
        if stage in self._stages:
            return stage
        if (
            len(self._stages) < MAX_ENGINE_STAGES - 1  # one kept for OTHER_ENGINE_STAGE
            and stage.startswith("engine_")
            and len(stage) <= MAX_ENGINE_STAGE_LEN
        ):
            self._stages.add(stage)
            return stage
        return OTHER_ENGINE_STAGE

    @property
    def arrivals(self) -> int:
        """Totals received so far."""
        return self._arrived_base + len(self._arrived)

    def arrived_since(self, count: int) -> tuple[list[str] | None, int]:
        """The ids of the totals received after the first ``count`` (None: some of them are
        no longer remembered), and how many have been received."""
        with self._lock:
            start = count - self._arrived_base
            return (self._arrived[start:] if start >= 0 else None), self.arrivals

    def take(self, keys: tuple[str, ...], output_tokens: int, finish_reason: str) -> RequestTotals | None:
        """The totals of a finished request known by one of ``keys``. Several totals under
        one id (parallel-sampling children, a reused id): the oldest whose output length
        and finish reason match, else the oldest."""
        with self._lock:
            for store in (self._finished, self._aborted):
                for key in keys:
                    pending = store.get(key)
                    if pending is None:
                        continue
                    items = pending.items
                    i = next(
                        (
                            i
                            for i, (t, _) in enumerate(items)
                            if t.output_tokens == output_tokens and t.finish_reason == finish_reason
                        ),
                        0,
                    )
                    totals = items.pop(i)[0]
                    self._held[store] -= 1
                    if not items:
                        store.pop(key)
                    return totals
        return None

    def take_orphans(self, now: float) -> list[RequestTotals]:
        """Totals no finished request claimed in time: requests vLLM's stat logger never
        reports (aborted: after ``ABORT_GRACE_S``; others after ``ORPHAN_AFTER_S``)."""
        out: list[RequestTotals] = []
        with self._lock:
            for store, wait_s in ((self._aborted, ABORT_GRACE_S), (self._finished, ORPHAN_AFTER_S)):
                while (oldest := store.oldest()) is not None and oldest[1].items[-1][1] <= now - wait_s:
                    store.pop_oldest()
                    self._held[store] -= len(oldest[1].items)
                    out += [t for t, _ in oldest[1].items]
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "engines": sorted(self.hooks),
            "live_requests": {str(k): v for k, v in self.live.items()},
            "results_unjoined": len(self),
            "results_dropped": self.dropped,
            "messages_refused": self.engines_refused,  # of engines past MAX_ENGINES
            "steps": {str(k): v[0] for k, v in self.cost.items()},
            "hook_seconds": {str(k): v[1] for k, v in self.cost.items()},
            "step_model": {str(k): msgspec.structs.asdict(c) for k, c in self.calibration.items()},
        }


def _fits(totals: RequestTotals) -> bool:
    """Whether totals are of a size vLLM's engine sends: held until joined, and their ids
    kept after (``arrived_since``), they are refused otherwise."""
    return (
        len(totals.external_id) <= MAX_ENGINE_ID_LEN
        and len(totals.request_id) <= MAX_ENGINE_ID_LEN
        and len(totals.finish_reason) <= MAX_ENGINE_ID_LEN
        and len(totals.ctx) <= MAX_KV_GROUPS
    )


def with_engine_totals(request: FinishedRequest, totals: RequestTotals) -> FinishedRequest:
    child = totals.child_index
    if child is not None and request.request_id == child_request_id(totals.external_id, child):
        # vLLM reports a child's finish under its parent's id: this one is no child, but a
        # request whose own id reads like one (a Responses API request_id ``<n>_…``)
        child = None
    return replace(
        request,
        request_id=child_request_id(request.request_id, child),
        child_index=child,
        recomputed_tokens=int(totals.recompute),
        engine_totals=totals,
    )


def orphan_request(totals: RequestTotals, model: str) -> FinishedRequest:
    """A request known only from the engine hook (vLLM reports no stats for aborts), under
    its external id (a child's is set after tagging: ``child_request_id``)."""
    arrived = totals.arrival_time or totals.finished_at
    return FinishedRequest(
        request_id=totals.external_id,
        model=model,
        engine=totals.engine,
        prompt_tokens=totals.prompt_tokens,
        cached_tokens=totals.cached_tokens,
        output_tokens=totals.output_tokens,
        finish_reason=totals.finish_reason if totals.finish_reason in FINISH_REASONS else OTHER_FINISH_REASON,
        num_preemptions=totals.num_preemptions,
        recomputed_tokens=int(totals.recompute),
        e2e_s=max(0.0, totals.finished_at - arrived),
        arrived_at=arrived,
        finished_at=totals.finished_at,
        child_index=totals.child_index,
        engine_totals=totals,
    )


class _Waiting:
    """A finished request waiting for its engine's totals, seen finished at ``seen``
    (monotonic) and ``seen_at`` (unix); ``done``: handed out (its queue drops it later)."""

    __slots__ = ("done", "keys", "request", "seen", "seen_at")

    def __init__(self, request: FinishedRequest, seen: float, seen_at: float) -> None:
        self.request, self.seen, self.seen_at = request, seen, seen_at
        self.keys: tuple[str, ...] = ()
        self.done = False


class RequestJoin:
    """Hands out each finished request once, with the engine's exact totals when a hook runs.

    ``keys(request_id)``: the spellings under which the middleware and the engine may know
    a request's id; ``tag(request)``: the request with its session tag. Thread-safe: vLLM's
    output loop calls ``finished``, the pricer thread ``ready``. A tick's work is in the new
    requests, the totals that arrived and the requests it gives up, not in all those waiting:
    while an engine lags, seconds of requests wait."""

    def __init__(
        self,
        inbox: EngineInbox,
        model: str,
        keys: Callable[[str], tuple[str, ...]],
        tag: Callable[[FinishedRequest], FinishedRequest],
        faults: FaultTracker,
    ) -> None:
        self.inbox = inbox
        self.model = model
        self.keys = keys
        self.tag = tag
        self.faults = faults
        self._new: list[_Waiting] = []  # finished since the last tick
        self._queues: dict[int, deque[_Waiting]] = {}  # per engine, in the order seen
        self._by_key: dict[str, list[_Waiting]] = {}  # the waiting, under each of their keys
        self._waiting = 0
        self._arrivals = 0  # the inbox's totals this join has looked at
        # ids priced by one side whose other side may still come: count per id, one entry each
        self._priced_without_engine: BoundedDict[str, int] = BoundedDict(MAX_PRICED_ONCE)
        self._priced_from_engine: BoundedDict[str, int] = BoundedDict(MAX_PRICED_ONCE)
        self._lock = threading.Lock()

    def finished(self, request: FinishedRequest, now: float, seen_at: float | None = None) -> bool:
        """Queue a request vLLM reported finished (``now``: monotonic; ``seen_at``: unix, the
        clock the engine frees requests on); False if it was priced already."""
        with self._lock:
            if _consume(self._priced_from_engine, request.request_id):
                return False  # priced from its totals already (an abort vLLM reported after all)
            self._new.append(_Waiting(request, now, time.time() if seen_at is None else seen_at))
            return True

    def __len__(self) -> int:
        """Requests waiting for their engine's totals."""
        with self._lock:
            return self._waiting + len(self._new)

    def oldest_seen_at(self) -> float | None:
        """When the request that has waited longest was seen finished (unix); None: none waits."""
        with self._lock:
            seen = [w.seen_at for w in self._new[:1]]
            for queue in self._queues.values():  # in the order seen; the handed out leave lazily
                first = next((w for w in queue if not w.done), None)
                if first is not None:
                    seen.append(first.seen_at)
            return min(seen, default=None)

    def ready(self, now: float) -> list[FinishedRequest]:
        """The finished requests to price now, joined with the engine hook's exact totals. The
        engine sends them within a step or two of a request's end, so they often arrive
        first; a request whose engine's hook said hello waits for them as long as
        ``_gave_up`` says. Requests ready together come in arrival order (sessions number
        turns so)."""
        with self._lock:
            ready: list[FinishedRequest] = []
            arrived, self._arrivals = self.inbox.arrived_since(self._arrivals)
            candidates = (
                [w for queue in self._queues.values() for w in queue]
                if arrived is None  # more arrived than the inbox remembers: every one
                else [w for key in arrived for w in self._by_key.get(key, ())]
            )
            for w in candidates:
                if not w.done:
                    self._join(w, ready)
            new, self._new = self._new, []
            for w in new:
                self._first_look(w, ready)
            for queue in self._queues.values():
                # the give-ups are a prefix: later requests have waited less, and their
                # engine's later totals are needed to end their wait early
                while queue and (queue[0].done or self._give_up(queue[0], now, ready)):
                    queue.popleft()
            for totals in self.inbox.take_orphans(now):
                try:
                    if _consume(self._priced_without_engine, totals.external_id):
                        continue  # already priced: one entry per request
                    _count(self._priced_from_engine, totals.external_id)
                    # tagged under its full id: the child's, or an id that only reads like one
                    request = orphan_request(totals, self.model)
                    ready.append(
                        self.tag(
                            replace(
                                request, request_id=child_request_id(totals.external_id, totals.child_index)
                            )
                        )
                    )
                except Exception as e:
                    self.faults.record("engine_join", e)
            ready.sort(key=lambda r: r.arrived_at)
            return ready

    def _first_look(self, w: _Waiting, ready: list[FinishedRequest]) -> None:
        """A request just finished: with its totals, if they came first; priced at once when no
        hook can send them; otherwise it waits."""
        request = w.request
        try:
            w.keys = self.keys(request.request_id)
        except Exception as e:
            self.faults.record("engine_join", e)
            w.done = True
            ready.append(request)
            return
        self._queues.setdefault(request.engine, deque()).append(w)
        for key in w.keys:
            self._by_key.setdefault(key, []).append(w)
        self._waiting += 1
        if self._join(w, ready):
            return
        if not self.inbox.hooks:  # no hook at all: nothing to wait for
            self._hand_out(w)
            ready.append(request)
        # else it waits, its engine's hook or not: the hello of an engine on another node may
        # still be on its way (its transport connects when it can), and ``_gave_up`` ends it

    def _join(self, w: _Waiting, ready: list[FinishedRequest]) -> bool:
        """Hand ``w`` out with its totals, if they have come."""
        try:
            r = w.request
            totals = self.inbox.take(w.keys, r.output_tokens, r.finish_reason)
            if totals is None:
                return False
            request = with_engine_totals(r, totals)
        except Exception as e:
            self.faults.record("engine_join", e)
            request = w.request
        self._hand_out(w)
        ready.append(request)
        return True

    def _give_up(self, w: _Waiting, now: float, ready: list[FinishedRequest]) -> bool:
        """Price ``w`` without its totals if ``_gave_up`` says so."""
        try:
            missing = self._gave_up(w.request, now - w.seen, w.seen_at)
        except Exception as e:
            missing = e
        if missing is None:
            return False
        self._hand_out(w)
        self._without_totals(w, missing, ready)
        return True

    def _without_totals(self, w: _Waiting, missing: Exception, ready: list[FinishedRequest]) -> None:
        self.faults.record("engine_join", missing)
        # its totals may still come (a busy host, a hook that reached us late): they must not
        # price it a second time
        _count(self._priced_without_engine, w.request.request_id)
        ready.append(w.request)

    def _hand_out(self, w: _Waiting) -> None:
        """``w`` leaves the waiting requests (its queue drops it when it reaches the front)."""
        if w.done:
            return
        w.done = True
        self._waiting -= 1
        for key in w.keys:
            entries = self._by_key.get(key)
            if entries is not None and w in entries:
                entries.remove(w)
                if not entries:
                    del self._by_key[key]

    def _gave_up(self, request: FinishedRequest, waited: float, seen_at: float) -> Exception | None:
        """Why ``request``, seen finished ``waited`` s ago, is priced without its engine's
        totals now; None: they may still come, and it waits on. Its engine sends totals in the
        order it frees requests, so once totals of a request freed after this one was seen
        finished have come, this one's were lost (a step's hold-back is within the least wait).
        Both clocks are unix time: an engine on another node whose clock runs behind makes a
        lost request wait the longest, not the least."""
        if waited < ENGINE_JOIN_TIMEOUT_S:
            return None
        engine = request.engine
        if engine not in self.inbox.hooks:
            return self._unreached(request)
        if self.inbox.fault_said.get(engine):
            why = "its engine reported a fault and has sent no totals since"
        elif self.inbox.freed_through.get(engine, 0.0) > seen_at:
            why = "its engine has sent the totals of requests it freed after this one finished"
        elif waited >= ENGINE_JOIN_MAX_WAIT_S:
            why = "the longest the join waits"
        else:
            return None
        return TimeoutError(f"no engine totals for {request.request_id} after {waited:.1f} s: {why}")

    @staticmethod
    def _unreached(request: FinishedRequest) -> Exception:
        return LookupError(
            f"engine {request.engine}'s step hook has not reached this API server: its requests are "
            "priced without engine totals (on another node, start it with PTE_ENGINE_TRANSPORT=tcp; "
            "docs/deployment.md)"
        )


def _count(store: BoundedDict[str, int], key: str) -> None:
    store.put(key, (store.get(key) or 0) + 1)


def _consume(store: BoundedDict[str, int], key: str) -> bool:
    n = store.get(key)
    if not n:
        return False
    if n == 1:
        store.pop(key)
    else:
        store.put(key, n - 1)
    return True
