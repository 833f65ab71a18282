"""Prices finished requests and fans the records out to the exporters, each isolated:
a failing exporter is counted as a fault and the others still receive the record."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from .core.cost import CostModel
from .core.ledger import FinishedRequest, RequestRecord, price_request
from .faults import FaultTracker


class Exporter(Protocol):
    def export(self, record: RequestRecord) -> None: ...


class Accountant:
    def __init__(
        self,
        cost_model: CostModel,
        exporters: Sequence[tuple[str, Exporter]],
        faults: FaultTracker,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cost_model = cost_model
        self.exporters = list(exporters)
        self.faults = faults
        self.clock = clock

    def on_finished(self, request: FinishedRequest) -> RequestRecord | None:
        try:
            record = price_request(self.cost_model, request, self.clock())
        except Exception as e:
            self.faults.record("accounting", e)
            return None
        for stage, exporter in self.exporters:
            try:
                exporter.export(record)
            except Exception as e:
                self.faults.record(stage, e)
        return record
