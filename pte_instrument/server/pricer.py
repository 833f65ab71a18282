"""Prices finished requests, files them under their session, and fans the records out to
the exporters, each isolated: a failing stage is counted as a fault and the others still
receive the record. Every record an exporter does not take is counted lost for it
(``on_lost``), so that delivered + lost = priced for each exporter, whatever happens.

An exporter that fails ``MAX_CONSECUTIVE_FAULTS`` times in a row is suspended, with one log
line, instead of failing (and logging) on every record: it is skipped, each record it misses
counted lost, and tried again with the next record after a back-off (1 s, doubling to
``MAX_RETRY_S``), so a transient fault (a full disk, a collector away) ends by itself.
``on_state`` is told of each suspension and resumption (the ``pte_exporter_enabled`` gauge
an alert reads)."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Protocol

from pte_instrument.cost.model import CostModel
from pte_instrument.faults import FaultTracker, log
from pte_instrument.server.records import FinishedRequest, RequestRecord, price_request, with_finite_numbers
from pte_instrument.server.sessions import SessionLedger

MAX_CONSECUTIVE_FAULTS = 100
FIRST_RETRY_S = 1.0
MAX_RETRY_S = 60.0


def trace_of(traceparent: str | None) -> str | None:
    """The trace id of a W3C ``traceparent`` (``00-<trace id>-<parent span id>-<flags>``)."""
    return traceparent.split("-")[1] if traceparent else None


class Exporter(Protocol):
    def export(self, record: RequestRecord) -> None: ...


class RecordRefused(Exception):
    """An exporter has no room for a record now (its queue waits on a slower collector): the
    record is lost and counted, but the exporter is not failing, so this is no fault and does
    not count toward its suspension (which would lose every record while the queue drains)."""


@dataclass
class _Suspension:
    retry_at: float
    retries: int = 0  # failed retries so far: the back-off doubles with each


class RequestPricer:
    def __init__(
        self,
        cost_model: CostModel,
        exporters: Sequence[tuple[str, Exporter]],
        faults: FaultTracker,
        sessions: SessionLedger | None = None,
        replica: str | None = None,  # this replica's name (PTE_INSTANCE)
        clock: Callable[[], float] = time.time,
        usd_per_gpu_second: float | None = None,  # the engine's price per second, all its GPUs
        on_state: Callable[[str, bool], None] | None = None,  # (stage, on): suspended (False) or resumed
        on_lost: Callable[[str], None] | None = None,  # a record the exporter of the stage did not take
        new_trace_id: Callable[[], str] | None = None,  # tracing on: a trace id for a request without one
        monotonic: Callable[[], float] = time.monotonic,  # the back-off's clock
    ) -> None:
        self.cost_model = cost_model
        self.new_trace_id = new_trace_id
        self.usd_per_gpu_second = usd_per_gpu_second
        self.exporters = list(exporters)
        self.faults = faults
        self.sessions = sessions
        self.replica = replica
        self.clock = clock
        self.on_state = on_state
        self.on_lost = on_lost
        self.monotonic = monotonic
        self.delivered: Counter[str] = Counter()
        self.lost: Counter[str] = Counter()
        self._streak: Counter[str] = Counter()
        self._suspended: dict[str, _Suspension] = {}

    @property
    def suspended(self) -> list[str]:
        return list(self._suspended)

    def on_finished(self, request: FinishedRequest) -> RequestRecord | None:
        now = self.clock()
        request = self._in_session(request, now)
        try:
            request = replace(request, replica=self.replica)
            if self.new_trace_id is not None:
                request = replace(request, trace_id=trace_of(request.traceparent) or self.new_trace_id())
            record, not_finite = with_finite_numbers(
                price_request(self.cost_model, request, request.finished_at or now, self.usd_per_gpu_second)
            )
            if not_finite is not None:  # exported as the session stores keep it, and said
                self.faults.record("accounting", not_finite)
        except Exception as e:
            self.faults.record("accounting", e)
            if self.sessions is not None:
                self.sessions.gave_up(request)
            return None
        for stage, exporter in self.exporters:
            self._export(stage, exporter, record)
        if self.sessions is not None:  # after the feedback window's entry: it lands no later
            try:
                self.sessions.add(record)
            except Exception as e:
                self.faults.record("sessions", e)
        return record

    def _in_session(self, request: FinishedRequest, now: float) -> FinishedRequest:
        """The request with its session's context (turn, reusable prefix, pause); a session
        store that cannot give it is a sessions fault, and the request is priced without it."""
        if request.session_id is None or self.sessions is None:
            return request
        try:
            ctx = self.sessions.context_for(
                request.session_id, request.arrived_at or now - request.e2e_s, request.prompt_tokens
            )
        except Exception as e:
            self.faults.record("sessions", e)
            return request
        return replace(request, **asdict(ctx))

    def _export(self, stage: str, exporter: Exporter, record: RequestRecord) -> None:
        suspension = self._suspended.get(stage)
        if suspension is not None and self.monotonic() < suspension.retry_at:
            self._lose(stage)
            return
        try:
            exporter.export(record)
        except RecordRefused:
            self._lose(stage)
            return
        except Exception as e:
            self.faults.record(
                stage, e, logged=suspension is not None
            )  # a retry: the suspension line said it
            self._lose(stage)
            self._streak[stage] += 1
            if suspension is not None:
                suspension.retries += 1
                suspension.retry_at = self.monotonic() + self._next_wait(suspension.retries)
            elif self._streak[stage] >= MAX_CONSECUTIVE_FAULTS:
                self._suspend(stage, e)
            return
        self.delivered[stage] += 1
        self._streak[stage] = 0
        if suspension is not None:
            del self._suspended[stage]
            log.warning("pte-instrument: exporter %r resumed; it receives every record again", stage)
            self._tell(self.on_state, stage, True)

    @staticmethod
    def _next_wait(retries: int) -> float:
        """The back-off before the next retry, after ``retries`` failed ones."""
        return min(FIRST_RETRY_S * 2.0 ** min(retries, 30), MAX_RETRY_S)

    def _suspend(self, stage: str, error: Exception) -> None:
        self._suspended[stage] = _Suspension(self.monotonic() + self._next_wait(0))
        log.error(
            "pte-instrument: exporter %r failed %d times in a row (latest: %s) and is suspended; it is "
            "tried again after %g s, then with a back-off up to %g s, and every record it misses is counted "
            "in pte_exporter_records_lost_total; the other exporters continue",
            stage,
            MAX_CONSECUTIVE_FAULTS,
            error,
            FIRST_RETRY_S,
            MAX_RETRY_S,
        )
        self._tell(self.on_state, stage, False)

    def _lose(self, stage: str) -> None:
        self.lost[stage] += 1
        self._tell(self.on_lost, stage)

    @staticmethod
    def _tell(callback: Callable[..., None] | None, *args: object) -> None:
        if callback is not None:
            with contextlib.suppress(Exception):  # reporting must not raise either
                callback(*args)
