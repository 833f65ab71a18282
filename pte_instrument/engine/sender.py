"""The engine hook's side of the transport: each finished request's totals go to the API
server that submitted it, and the hook's new faults, once, to API server 0 (so that with
several API servers they are counted once in the merged metrics); the other API servers
hear only that there were some (totals they wait for may be lost)."""

from __future__ import annotations

import contextlib
from collections import defaultdict

from pte_instrument.failpoints import failpoint
from pte_instrument.faults import FaultTracker
from pte_instrument.transport import Sender
from pte_instrument.wire import EngineCalibration, EngineFaults, EngineHello, EngineMessage, RequestTotals


class TransportDropped(RuntimeError):
    """A batch the API server's queue had no room for (the API server is down or behind)."""


class EngineSender:
    def __init__(self, sender: Sender, engine: int, faults: FaultTracker) -> None:
        self.sender = sender
        self.engine = engine
        self.faults = faults
        self._faults_sent: dict[str, int] = {}
        self._calibration_sent: EngineCalibration | None = None
        self.api_servers = 1

    def hello(self, api_servers: int, calibration: EngineCalibration | None = None) -> None:
        """Every API server learns that this engine's totals will come; faults of the set-up
        (an unwritable step log) and the starting step-time model travel with it."""
        self.api_servers = api_servers
        by_server: defaultdict[int, list[EngineMessage]] = defaultdict(list)
        for api_server in range(api_servers):
            by_server[api_server].append(EngineHello(self.engine))
        if calibration is not None:
            by_server[0].append(calibration)
            self._calibration_sent = calibration
        self._send(by_server)

    def send(self, totals: list[RequestTotals], calibration: EngineCalibration | None = None) -> None:
        """Each request's totals to its API server; new faults, and the step-time model when
        it changed, to API server 0."""
        by_server: defaultdict[int, list[EngineMessage]] = defaultdict(list)
        for m in totals:
            by_server[m.api_server].append(m)
        if calibration is not None and calibration != self._calibration_sent:
            by_server[0].append(calibration)
            self._calibration_sent = calibration
        self._send(by_server)

    def deliver(self, totals: list[RequestTotals], calibration: EngineCalibration | None = None) -> bool:
        """``send`` that never raises: a failed send is a transport fault, counted and
        reported (False); the API server prices those requests without their totals."""
        try:
            failpoint("transport")
            self.send(totals, calibration)
        except Exception as e:
            self.fault("transport", e)
            return False
        return True

    def fault(self, stage: str, e: Exception) -> None:
        """Counted, and reported now: no later totals need follow (an idle engine sends none)."""
        self.faults.record(f"engine_{stage}", e)
        with contextlib.suppress(Exception):  # still counted; reported with the next batch
            self.send([])

    def _send(self, by_server: defaultdict[int, list[EngineMessage]]) -> None:
        """The batches, and the faults not yet reported to API server 0."""
        counts = dict(self.faults.counts)
        new = {k: n - self._faults_sent.get(k, 0) for k, n in counts.items()}
        new = {k: n for k, n in new.items() if n > 0}
        if new:
            by_server[0].append(EngineFaults(self.engine, new))
            for api_server in range(1, self.api_servers):
                if api_server in by_server:
                    by_server[api_server].append(EngineFaults(self.engine, {}))
                else:  # best effort: a notice dropped is not a fault of its own
                    self.sender.send([EngineFaults(self.engine, {})], api_server)
        for api_server, batch in by_server.items():
            if self.sender.send(batch, api_server):
                if api_server == 0:
                    self._faults_sent = counts
            else:  # counted now, reported with a later batch that gets through
                self.faults.record(
                    "engine_transport",
                    TransportDropped(
                        f"{len(batch)} messages to API server {api_server} dropped: its queue is full"
                    ),
                )
        if not new:
            self._faults_sent = counts

    def close(self) -> None:
        self.sender.close()
