"""Engine → API-server transport for engine-side totals: ZeroMQ PUSH/PULL over an IPC
socket whose address the first process (the API server) puts in the environment before
vLLM spawns its engine processes, which inherit it.

Why not vLLM's own stats channel: ``SchedulerStats`` is not a stable interface and its
serialization drops unknown fields. A socket of our own works for every engine (data
parallel included), never blocks the scheduler (non-blocking send; what cannot be queued
is dropped and counted) and needs nothing from vLLM.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import uuid
from collections.abc import Callable
from typing import Any

import zmq

ADDRESS_ENV = "PTE_ENGINE_TRANSPORT"
HIGH_WATER_MARK = 10_000  # queued messages per socket before sends are dropped


def ensure_address() -> str:
    """The transport address, created (and exported to child processes) if missing."""
    addr = os.environ.get(ADDRESS_ENV)
    if not addr:
        path = os.path.join(tempfile.gettempdir(), f"pte-{os.getpid()}-{uuid.uuid4().hex[:8]}.ipc")
        addr = os.environ[ADDRESS_ENV] = f"ipc://{path}"
    return addr


class Sender:
    def __init__(self, address: str) -> None:
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self.dropped = 0

    def send(self, messages: list[dict[str, Any]]) -> None:
        try:
            self._sock.send(json.dumps(messages).encode(), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += len(messages)

    def close(self) -> None:
        self._sock.close(0)


class Receiver:
    """Binds the PULL side and hands each batch of messages to ``on_messages`` from a
    daemon thread."""

    def __init__(self, address: str, on_messages: Callable[[list[dict[str, Any]]], None]) -> None:
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._on_messages = on_messages
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="pte-engine-receiver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = self._sock.recv()
            except zmq.ContextTerminated:
                return
            try:
                self._on_messages(json.loads(data))
            except Exception:
                self.errors += 1
