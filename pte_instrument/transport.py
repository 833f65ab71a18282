"""Engine → API-server transport for engine-side totals: ZeroMQ PUSH/PULL. On one node, IPC
sockets: the first process (the API server, or ``vllm serve``'s launcher) puts a base
address in the environment before vLLM spawns its other processes, which inherit it, and
API server ``i`` binds ``<base>-i``. With engines on other nodes (``--headless``, launched
as a command of their own), TCP to an address both sides derive from vLLM's data-parallel
settings (``vllm_adapter.compat.engine_transport``), API server ``i`` on the base port + ``i``.
An engine sends each finished request's totals to the API server that submitted it (vLLM's
client index), so with several API servers every total reaches the process whose stat
logger sees that request finish.

Why not vLLM's own stats channel: ``SchedulerStats`` is not a stable interface and its
serialization drops unknown fields. A socket of our own works for every engine (data
parallel included), never blocks the scheduler (non-blocking send; what cannot be queued
is dropped and counted) and needs nothing from vLLM.

The messages are the declared types of ``pte_instrument.wire``; this module is the only one
that touches their bytes.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import uuid
import weakref
from collections.abc import Callable

import zmq

from pte_instrument.wire import EngineMessage, decode_batch, encode_batch

ADDRESS_ENV = "PTE_ENGINE_TRANSPORT"
HIGH_WATER_MARK = 10_000  # queued messages per socket before sends are dropped
# A batch is one pass's totals for one API server (a few hundred bytes each): past this, the
# receiving socket drops it unread (and its sender's connection) rather than hold it whole,
# whoever sent it (tcp takes any sender).
MAX_BATCH_BYTES = 16 * 1024 * 1024
# A Unix socket's path is at most IPC_PATH_MAX_LEN bytes (107 on Linux), and API server i
# binds <base>-i: a base leaves room for the suffix of up to 999 API servers.
MAX_IPC_BASE = zmq.IPC_PATH_MAX_LEN - len("-999")
CLOSE_WAIT_S = 2.0  # a closing sender delivers what it queued, for at most this long


def address_problem(addr: str) -> str | None:
    """Why ``addr`` cannot be a transport base (None: it can): ``tcp`` (derived from vLLM's
    data-parallel settings), ``tcp://<host>:<port>`` or ``ipc://<path>``."""
    if addr.strip().lower() == "tcp":
        return None
    if addr.startswith("ipc://"):
        path = addr.removeprefix("ipc://")
        if not path:
            return "an ipc:// address needs a path"
        if len(path.encode("utf-8", "surrogateescape")) > MAX_IPC_BASE:
            return f"an ipc:// path must be at most {MAX_IPC_BASE} bytes (a Unix socket's)"
        return None
    if addr.startswith("tcp://"):
        host, _, port = addr.removeprefix("tcp://").rpartition(":")
        if host and port.isascii() and port.isdigit() and 0 < int(port) < 65536:  # not "²" nor "٥"
            return None
        return "a tcp:// address needs a host and a port from 1 to 65535"
    return "not tcp, tcp://<host>:<port> or ipc://<path>"


def ensure_address(setting: tuple[str | None, str | None]) -> str:
    """The base transport address, created (and exported to child processes) if missing or
    unusable: an unusable one is named in one line, and the processes of this server share
    a working one instead. ``setting``: ``PTE_ENGINE_TRANSPORT`` as the settings read it
    (its value, and the line naming a malformed one)."""
    addr, problem = setting
    if problem is not None:
        from pte_instrument.faults import say_configuration

        say_configuration([problem])
    if addr is None:
        name = f"pte-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        addr = f"ipc://{os.path.join(tempfile.gettempdir(), name)}"
        if address_problem(addr) is not None:  # a TMPDIR too long for a Unix socket's path
            addr = f"ipc://{os.path.join('/tmp', name)}"
        os.environ[ADDRESS_ENV] = addr
    return addr


def address_for(base: str, api_server: int) -> str:
    """API server ``i``'s address: ``<base>-i`` for IPC, the base port + ``i`` for TCP."""
    if base.startswith("tcp://"):
        host, _, port = base.removeprefix("tcp://").rpartition(":")
        return f"tcp://{host}:{int(port) + api_server}"
    return f"{base}-{api_server}"


class Sender:
    """One PUSH socket per API server, connected on first use. Its own ZeroMQ context, so that
    closing it can wait for what it queued without waiting on anyone else's sockets."""

    def __init__(self, base: str) -> None:
        self._ctx = zmq.Context()
        self._base = base
        self._socks: dict[int, zmq.Socket] = {}
        self.dropped = 0  # messages
        self.dropped_batches = 0
        # A sender dropped unclosed is closed as close() would: left to pyzmq, a sender collected
        # in a reference cycle terms its context while its sockets are still open, for ever.
        self._closer = weakref.finalize(self, _close, self._ctx, self._socks, CLOSE_WAIT_S)

    def _socket(self, api_server: int) -> zmq.Socket:
        sock = self._socks.get(api_server)
        if sock is None:
            sock = self._socks[api_server] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address_for(self._base, api_server))
        return sock

    def send(self, messages: list[EngineMessage], api_server: int = 0) -> bool:
        """Queue one batch; False if the queue was full and the batch is dropped (never blocks)."""
        try:
            self._socket(api_server).send(encode_batch(messages), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += len(messages)
            self.dropped_batches += 1
            return False
        return True

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Deliver what is queued, for at most ``wait_s`` (an API server that is gone gets
        nothing), then end: a process that exits right after loses nothing it sent."""
        self._closer.detach()
        _close(self._ctx, self._socks, wait_s)


def _close(ctx: zmq.Context, socks: dict[int, zmq.Socket], wait_s: float) -> None:
    for sock in socks.values():
        sock.close(linger=int(wait_s * 1000))
    ctx.term()


class Receiver:
    """Binds the PULL side and hands each batch of messages to ``on_messages`` from a
    daemon thread; a malformed batch, or one ``on_messages`` fails on, to ``on_error``."""

    def __init__(
        self,
        address: str,
        on_messages: Callable[[list[EngineMessage]], None],
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._on_messages = on_messages
        self._on_error = on_error
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
                self._on_messages(decode_batch(data))  # malformed: the whole batch is lost
            except Exception as e:
                self.errors += 1
                if self._on_error is not None:
                    with contextlib.suppress(Exception):  # the receiver must keep receiving
                        self._on_error(e)
