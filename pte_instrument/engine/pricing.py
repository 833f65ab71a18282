"""The engine's pricing process: the hook's accounting (``EngineAccounting``) in a process of
its own beside the engine core, so that the engine thread only keeps references to its
steps and hands them over.

At each pricing pass the hook gives ``PricingProcess`` its completed steps (references to the
scheduler outputs, with the hook's clocks) and the finished requests no running step still
has, and returns. The engine process's shipping thread reads the steps' rows (``RawStep``s),
encodes them as one message (msgspec, in C) into a ring in shared memory (``engine.ring``)
and wakes the pricing process with one byte on its stdin: after a model wait has cooled the
caches that takes about a hundred µs, which the thread spends while the engine thread waits
for the model with the GIL released, as vLLM's engine core encodes its outputs on a thread of
its own. The pricing process sleeps
until woken (an idle engine costs it no CPU; woken, it never preempts the engine thread:
SCHED_BATCH), prices the steps, writes the step log, fits the step-time model and sends each
finished request's totals to its API server, as the hook would: the same code, off the
engine thread and its GIL.

Passes are shipped and read in the order they were handed over, so a request's steps are
priced before its totals are read. A pass the ring has no room for (the pricing process is
far behind), shipped to a pricing process that has exited, or that finds ``MAX_HANDED_OVER``
passes still waiting for the shipping thread, is dropped and counted as a fault at the engine
thread's next pass; the engine never waits. A pass whose message would take over a quarter of
the ring (request ids are the client's choice, and may be long) goes in parts, which the
shipping thread waits a little for room to put. The pricing process ends when the hook shuts
down, or when the engine process is gone (its stdin closes); a SIGINT or SIGTERM to the
server's process group does not end it before the engine's last pass.

    python -m pte_instrument.engine.pricing   (started by the hook; its config on stdin)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from pte_instrument.cost.model import CostModel
from pte_instrument.cost.step_time import StepTimeModel
from pte_instrument.engine.accounting import EngineAccounting, Finished, RawStep, split_held
from pte_instrument.engine.ring import Ring
from pte_instrument.engine.sender import EngineSender
from pte_instrument.faults import FaultTracker, install_log_handler, log
from pte_instrument.transport import Sender

START_TIMEOUT_S = 60.0  # its imports take ~0.3 s; a loaded machine may take far longer
STOP_TIMEOUT_S = 10.0  # to price what is left and send it, at shutdown
RING_BYTES = 4 << 20  # pricing passes waiting to be read (a pass of 8,192 rows: ~0.5 MB)
# How long the pricing process sleeps between looks at the ring when nothing wakes it (a wake-up
# lost to a full pipe is made up for by the next one, or by this).
IDLE_LOOK_S = 1.0
# Passes handed over and not shipped yet, at most (a pass of 8,192 rows is about 0.5 MB):
# the shipping thread waits for the GIL at most a switch interval (5 ms) while the engine thread
# holds it, and ships a pass in about 100 µs, so more than a few wait only if it is gone.
MAX_HANDED_OVER = 64
# Steps the shipping thread reads between releases of the GIL: a Python thread that never
# releases it holds an engine thread back from its model wait for up to the switch interval
# (5 ms); reading a step whose output has gone cold takes a few µs.
READ_CHUNK_STEPS = 32
# The largest message one pass is shipped in (a quarter of the ring): a larger pass goes in
# parts, each of which waits up to ROOM_WAIT_S for the pricing process to make room.
MAX_MESSAGE_BYTES = RING_BYTES // 4
ROOM_WAIT_S = 1.0


@dataclass(frozen=True)
class PricingConfig:
    """What the pricing process needs to account for one engine (pickled to its stdin)."""

    cost_model: CostModel
    engine: int
    transport: str  # the API servers' transport base address
    api_servers: int
    ring: str = ""  # the shared-memory ring's file (``PricingProcess`` makes it)
    backend: str = "numpy"
    step_log: str | None = None
    weight_bytes: float = 2.0
    step_model: StepTimeModel | None = None
    step_model_source: str = "theory"
    calibrate_online: bool = True
    idle_look_s: float = IDLE_LOOK_S


class PricingBatch(msgspec.Struct, array_like=True, gc=False):
    """One pricing pass: steps to price, then the finished requests to send (in that order);
    ``hook_s``: the hook's time on the engine thread so far; ``last``: the hook shut down."""

    steps: list[RawStep]
    prompts: dict[str, int]  # of requests whose first step was lost
    finished: list[Finished]
    hook_s: float
    last: bool = False


class PricingDropped(RuntimeError):
    """A pricing pass the pricing process's queue had no room for."""


# Reads the hook's steps into the accounting's rows; tells ``lost`` of a step it cannot read.
ReadSteps = Callable[[list[Any], Callable[[Exception], None]], list[RawStep]]


class StepUnread(RuntimeError):
    """A step the shipping thread could not read (``read_steps``): lost to the accounting."""


class PricingProcess:
    """The engine thread's end: ``on_finished``, ``price_raw`` and ``flush`` as
    ``EngineAccounting``'s, which it runs in the pricing process. ``read_steps(steps, lost)``
    turns the steps ``price_raw`` is given into ``RawStep``s on the shipping thread, calling
    ``lost`` for each one it cannot read (None: they are ``RawStep``s). ``ship_s``: the
    shipping thread's CPU time so far."""

    def __init__(
        self,
        config: PricingConfig,
        external_id: Callable[[str], tuple[str, int | None]],
        read_steps: ReadSteps | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.backend = config.backend
        self.external_id = external_id
        self._read_steps = read_steps
        self.finished: list[Finished] = []
        self.hook_s = 0.0
        self._steps: list[Any] = []
        self._prompts: dict[str, int] = {}
        self.ship_s = 0.0
        self._encoder = msgspec.msgpack.Encoder()
        self._ring = Ring.create(f"pte-pricing-{os.getpid()}-{uuid.uuid4().hex[:8]}", RING_BYTES)
        try:
            self._proc = self._start(dataclasses.replace(config, ring=self._ring.path), start_timeout_s)
        except BaseException:
            self._ring.close()
            raise
        finally:
            with contextlib.suppress(OSError):  # both have it mapped, or it failed: no name needed
                os.unlink(self._ring.path)
        self._handed_over: queue.SimpleQueue[PricingBatch | None] = queue.SimpleQueue()
        self._ship_errors: deque[Exception] = deque(maxlen=MAX_HANDED_OVER)
        self._shipper = threading.Thread(target=self._ship_all, name="pte-pricing-shipper", daemon=True)
        self._shipper.start()

    @staticmethod
    def _start(config: PricingConfig, timeout_s: float) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        try:
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps(config))
            proc.stdin.flush()  # stays open: each byte wakes the process, its end says the engine is gone
            os.set_blocking(proc.stdin.fileno(), False)  # a full pipe never holds the engine
            _wait_ready(proc, timeout_s)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            proc.stdout.close()  # type: ignore[union-attr]
        return proc

    @property
    def pid(self) -> int:
        return self._proc.pid

    def on_finished(self, rid: str, reason: str, counts: Mapping[str, float]) -> None:
        self.finished.append(Finished.of(rid, reason, counts, self.external_id))

    def price_raw(self, steps: list[Any], prompts: Mapping[str, int] | None = None) -> None:
        """Kept until the ``flush`` that follows, which ships them."""
        self._steps += steps
        self._prompts.update(prompts or {})

    def flush(self, hold: Callable[[str], bool] | None = None) -> None:
        """Hand the steps and the finished requests ``hold`` does not keep back to the
        shipping thread; raises ``PricingDropped`` for a pass it could not ship since the
        last call, or ``StepUnread`` for a step it could not read."""
        done, self.finished = split_held(self.finished, hold)
        steps, self._steps = self._steps, []
        prompts, self._prompts = self._prompts, {}
        if steps or done:
            self._hand_over(PricingBatch(steps, prompts, done, self.hook_s))
        if self._ship_errors:
            raise self._ship_errors.popleft()

    def _hand_over(self, batch: PricingBatch | None) -> None:
        if batch is not None and not batch.last and self._handed_over.qsize() >= MAX_HANDED_OVER:
            raise PricingDropped(
                f"a pricing pass of {len(batch.steps)} steps and {len(batch.finished)} finished "
                f"requests dropped: {MAX_HANDED_OVER} passes still wait for the shipping thread"
            )
        self._handed_over.put(batch)

    def _ship_all(self) -> None:
        """The shipping thread: each pass handed over, in order, until ``None``."""
        while (batch := self._handed_over.get()) is not None:
            t = time.thread_time()
            try:
                self._ship(batch)
            except Exception as e:  # said on the engine thread
                self._ship_errors.append(e)
            self.ship_s += time.thread_time() - t

    def _ship(self, batch: PricingBatch) -> None:
        if self._read_steps is not None and batch.steps:
            batch.steps = self._read(self._read_steps, batch.steps)
        parts = self._parts(batch)
        for k, data in enumerate(parts):
            # the parts of a pass too large for one message: the pricing process reads the
            # ring as they come, so each waits a little for room before it is said dropped
            self._put(data, batch, ROOM_WAIT_S if len(parts) > 1 else 0.0)
            if k:
                time.sleep(0)  # the GIL to an engine thread back from its model wait

    def _parts(self, batch: PricingBatch) -> list[bytes]:
        """The pass as messages of at most ``MAX_MESSAGE_BYTES``, the finished requests in the
        last: request ids are the client's choice, and a pass of long ones would not fit in
        the ring. A step too large on its own is lost (said), its prompt lengths kept."""
        data = self._encoder.encode(batch)
        if len(data) <= MAX_MESSAGE_BYTES:
            return [data]
        steps, finished = batch.steps, batch.finished
        if len(steps) > 1 or (not steps and len(finished) > 1):
            cut_steps, cut_finished = (len(steps) // 2, 0) if steps else (0, len(finished) // 2)
            head = PricingBatch(steps[:cut_steps], batch.prompts, finished[:cut_finished], batch.hook_s)
            tail = PricingBatch(steps[cut_steps:], {}, finished[cut_finished:], batch.hook_s, batch.last)
            return self._parts(head) + self._parts(tail)
        if steps:
            self._step_unread(
                ValueError(f"it takes {len(data)} bytes, over the {MAX_MESSAGE_BYTES} a message may")
            )
            prompts = {**batch.prompts, **{rid: prompt for rid, _, prompt in steps[0][0] or ()}}
            return self._parts(PricingBatch([], prompts, finished, batch.hook_s, batch.last))
        return [data]  # one finished request: the ring has room for it or says not

    def _put(self, data: bytes, batch: PricingBatch, wait_s: float) -> None:
        put = self._ring.put(data)
        until = time.monotonic() + wait_s
        while not put and time.monotonic() < until and self._proc.poll() is None:
            time.sleep(0.001)
            put = self._ring.put(data)
        if put:
            try:
                os.write(self._proc.stdin.fileno(), b"\0")  # type: ignore[union-attr]
            except BlockingIOError:  # a full pipe holds unread wake-ups already
                pass
            except BrokenPipeError:  # the process is gone, and with it what the ring holds
                put = False
        if not put:
            code = self._proc.poll()
            raise PricingDropped(
                f"a pricing pass of {len(batch.steps)} steps and {len(batch.finished)} finished "
                "requests dropped: "
                + (
                    "the pricing process is behind"
                    if code is None
                    else f"the pricing process exited ({code})"
                )
            )

    def _read(self, read_steps: ReadSteps, steps: list[Any]) -> list[RawStep]:
        read: list[RawStep] = []
        for k in range(0, len(steps), READ_CHUNK_STEPS):
            if k:
                time.sleep(0)  # the GIL to an engine thread back from its model wait
            read += read_steps(steps[k : k + READ_CHUNK_STEPS], self._step_unread)
        return read

    def _step_unread(self, e: Exception) -> None:
        lost = StepUnread(f"a step could not be read and is lost to the accounting: {e!r}")
        lost.__cause__ = e
        self._ship_errors.append(lost)

    def close(self) -> None:
        """The last pass, then wait for the process to price what the ring holds and send it:
        what went wrong on the shipping thread since the last ``flush`` is said, and costs
        none of the passes behind it."""
        try:
            self._hand_over(PricingBatch([], {}, [], self.hook_s, last=True))
            self._hand_over(None)
            self._shipper.join(STOP_TIMEOUT_S)
            while self._ship_errors:
                log.error("pte-instrument: %s", self._ship_errors.popleft())
            self._proc.wait(STOP_TIMEOUT_S)
        except Exception as e:  # shutting down: say it, end the process
            log.error("pte-instrument: the pricing process did not finish cleanly (%s)", e)
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._ring.close()
            if self._proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self._proc.stdin.close()


def _wait_ready(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Until the pricing process says it is ready (its first line on stdout)."""
    assert proc.stdout is not None
    readable, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not readable:
        raise RuntimeError(f"the pricing process did not start within {timeout_s:g} s")
    if proc.stdout.readline() != b"ready\n":  # it failed, and said why on stderr
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        raise RuntimeError(f"the pricing process did not start (exit code {proc.poll()})")


# --- the pricing process ------------------------------------------------------------------


def serve(config: PricingConfig, ready: Callable[[], None], woken: threading.Event) -> None:
    """Price what the hook ships until its last pass; between passes, sleep until ``woken``."""
    faults = FaultTracker()
    sender = EngineSender(Sender(config.transport), config.engine, faults)
    acc = EngineAccounting(
        config.cost_model,
        lambda totals: sender.deliver(totals, acc.calibration()),
        engine=config.engine,
        backend=config.backend,
        step_log=config.step_log,
        weight_bytes=config.weight_bytes,
        step_model=config.step_model,
        step_model_source=config.step_model_source,
        calibrate_online=config.calibrate_online,
    )
    if acc.step_log_error is not None:
        step_log_off(faults, config.step_log, acc.step_log_error)
    sender.hello(config.api_servers, acc.calibration())
    ring = Ring(config.ring)
    decoder = msgspec.msgpack.Decoder(PricingBatch)
    ready()
    try:
        while True:
            messages = ring.take()
            if not messages:
                woken.wait(config.idle_look_s)
                woken.clear()
            for data in messages:
                try:
                    batch = decoder.decode(data)
                    acc.hook_s = batch.hook_s
                    acc.finished += batch.finished
                    acc.price_raw(batch.steps, batch.prompts)
                    acc.flush()
                except Exception as e:
                    sender.fault("finish", e)
                    continue
                if batch.last:
                    return
    finally:
        acc.close()
        sender.close()
        ring.close()


def step_log_off(faults: FaultTracker, path: str | None, error: OSError) -> None:
    """One line, counted once; the step log is off, the accounting goes on."""
    log.error(
        "pte-instrument: step log PTE_STEP_LOG=%r is not writable (%s); the step log is off, the "
        'engine hook\'s accounting continues; counted in pte_plugin_faults_total{stage="engine_step_log"}',
        path,
        error,
    )
    faults.record("engine_step_log", error, logged=True)


def _read_wake_ups(woken: threading.Event) -> None:
    """Each byte the engine writes to our stdin wakes the pricing loop; the pipe's end (the
    engine gone, a crash included) ends this process."""
    with contextlib.suppress(OSError):  # the raw descriptor: no buffer lock held at exit
        while os.read(sys.stdin.fileno(), 1 << 16):
            woken.set()
    os._exit(0)


def main() -> None:
    # Ctrl-C or a service manager signals the server's whole process group: the engine then
    # ships its last pass, which this process prices before it ends (or its stdin closes).
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)
    # Woken after each pass, it would otherwise preempt the engine thread on a busy host (the
    # engine's time then includes the pricing); SCHED_BATCH keeps its share of the CPU but
    # never preempts on wake-up.
    if hasattr(os, "SCHED_BATCH"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    install_log_handler()
    config = pickle.load(sys.stdin.buffer)
    woken = threading.Event()

    def ready() -> None:
        threading.Thread(target=_read_wake_ups, args=(woken,), daemon=True).start()
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # nobody reads the pipe any more

    serve(config, ready, woken)


if __name__ == "__main__":
    main()
