"""Prices finished requests, files them under their session, and fans the records out to
the exporters, each isolated: a failing stage is counted as a fault and the others still
receive the record. An exporter that fails ``MAX_CONSECUTIVE_FAULTS`` times in a row is
switched off, with one log line, instead of failing (and logging) forever, and
``on_switch_off`` is told (the ``pte_exporter_enabled`` gauge an alert reads)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from pte_instrument.cost.model import CostModel
from pte_instrument.faults import FaultTracker, log
from pte_instrument.server.ledger import FinishedRequest, RequestRecord, price_request
from pte_instrument.server.sessions import SessionLedger

MAX_CONSECUTIVE_FAULTS = 100


def trace_of(traceparent: str | None) -> str | None:
    """The trace id of a W3C ``traceparent`` (``00-<trace id>-<parent span id>-<flags>``)."""
    return traceparent.split("-")[1] if traceparent else None


class Exporter(Protocol):
    def export(self, record: RequestRecord) -> None: ...


class Accountant:
    def __init__(
        self,
        cost_model: CostModel,
        exporters: Sequence[tuple[str, Exporter]],
        faults: FaultTracker,
        sessions: SessionLedger | None = None,
        clock: Callable[[], float] = time.time,
        usd_per_gpu_second: float | None = None,  # the engine's price per second, all its GPUs
        on_switch_off: Callable[[str], None] | None = None,  # given the stage of a switched-off exporter
        new_trace_id: Callable[[], str] | None = None,  # tracing on: a trace id for a request without one
    ) -> None:
        self.cost_model = cost_model
        self.new_trace_id = new_trace_id
        self.usd_per_gpu_second = usd_per_gpu_second
        self.exporters = list(exporters)
        self.faults = faults
        self.sessions = sessions
        self.clock = clock
        self.on_switch_off = on_switch_off
        self.disabled: list[str] = []
        self._streak: dict[str, int] = {}

    def on_finished(self, request: FinishedRequest) -> RequestRecord | None:
        now = self.clock()
        try:
            if request.session_id is not None and self.sessions is not None:
                ctx = self.sessions.context_for(
                    request.session_id, request.arrived_at or now - request.e2e_s, request.prompt_tokens
                )
                request = replace(
                    request, turn=ctx.turn, reusable_tokens=ctx.reusable_tokens, pause_s=ctx.pause_s
                )
            if self.new_trace_id is not None:
                request = replace(request, trace_id=trace_of(request.traceparent) or self.new_trace_id())
            record = price_request(
                self.cost_model, request, request.finished_at or now, self.usd_per_gpu_second
            )
        except Exception as e:
            self.faults.record("accounting", e)
            return None
        if self.sessions is not None:
            try:
                self.sessions.add(record)
            except Exception as e:
                self.faults.record("sessions", e)
        for stage, exporter in self.exporters:
            try:
                exporter.export(record)
            except Exception as e:
                self.faults.record(stage, e)
                self._streak[stage] = self._streak.get(stage, 0) + 1
                if self._streak[stage] >= MAX_CONSECUTIVE_FAULTS:
                    self._switch_off(stage)
            else:
                if self._streak.get(stage):
                    self._streak[stage] = 0
        return record

    def _switch_off(self, stage: str) -> None:
        self.exporters = [(s, e) for s, e in self.exporters if s != stage]
        self.disabled.append(stage)
        log.error(
            "pte-instrument: exporter %r failed %d times in a row and is switched off until restart; "
            "the other exporters continue",
            stage,
            MAX_CONSECUTIVE_FAULTS,
        )
        if self.on_switch_off is not None:
            with contextlib.suppress(Exception):  # reporting the switch-off must not raise either
                self.on_switch_off(stage)
