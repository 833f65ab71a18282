"""The pricing process, started for real: what the engine thread ships is priced there and
reaches the API server's socket; the process ends with the engine, however the engine ends;
a pass it has no room for is dropped and said, never waited for."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from pte_instrument.engine.pricing import (
    MAX_HANDED_OVER,
    READ_CHUNK_STEPS,
    RING_BYTES,
    PricingConfig,
    PricingDropped,
    PricingProcess,
    StepUnread,
)
from pte_instrument.transport import Receiver, address_for
from pte_instrument.wire import EngineCalibration, EngineFaults, EngineHello, RequestTotals
from tests.engine.test_engine_accounting import COST, COUNTS
from tests.helpers import wait


@pytest.fixture
def api_server(tmp_path):
    """An API server's receiving end: (transport base address, queue of batches)."""
    base = f"ipc://{tmp_path}/pte-{uuid.uuid4().hex[:6]}"
    inbox: queue.Queue = queue.Queue()
    Receiver(address_for(base, 0), inbox.put)
    return base, inbox


def messages(inbox: queue.Queue, until, timeout_s: float = 20.0) -> list:
    got: list = []

    def arrived() -> bool:
        while not inbox.empty():
            got.extend(inbox.get())
        return until(got)

    assert wait(arrived, timeout_s=timeout_s), got
    return got


def step(new=(), running=(), t: float = 0.0) -> list:
    """A ``RawStep``: new requests as (id, prompt length, tokens scheduled), running ones as
    (id, tokens computed before the step, tokens scheduled); scheduled at t, back 1 ms later."""
    counts = {r[0]: r[2] for r in (*new, *running)}
    first = [(rid, 0, prompt) for rid, prompt, _ in new] or None
    return [
        first,
        [r[0] for r in running],
        [r[1] for r in running],
        counts,
        t,
        t + 0.001,
        0.0,
        None,
        None,
        None,
    ]


def start(base: str, **kwargs) -> PricingProcess:
    config = PricingConfig(
        COST,
        engine=3,
        transport=base,
        api_servers=1,
        calibrate_online=False,
        **kwargs,
    )
    return PricingProcess(config, lambda rid: (rid.upper(), None))


def test_what_the_engine_ships_is_priced_and_sent_to_the_api_server(api_server):
    base, inbox = api_server
    pricing = start(base)
    try:
        # a 10-token prompt in one step, then one decode step: prefill 10, decode 2, Σctx 10 + 11
        pricing.price_raw([step(new=[("a", 10, 10)]), step(running=[("a", 10, 1)], t=0.002)])
        pricing.on_finished("a", "stop", COUNTS)
        pricing.hook_s = 0.25
        pricing.flush()
        got = messages(inbox, lambda m: any(isinstance(x, RequestTotals) for x in m))
    finally:
        pricing.close()
    assert pricing._proc.returncode == 0
    assert isinstance(got[0], EngineHello) and got[0].engine == 3
    assert any(isinstance(m, EngineCalibration) for m in got)
    (totals,) = [m for m in got if isinstance(m, RequestTotals)]
    assert (totals.request_id, totals.external_id, totals.engine) == ("a", "A", 3)
    assert (totals.prefill, totals.decode_tokens, totals.ctx) == (10, 2, (21.0,))
    assert totals.engine_hook_s == 0.25 and totals.engine_steps == 2


def test_the_shipping_thread_reads_a_pass_in_chunks_and_loses_only_the_steps_it_cannot_read(
    api_server, monkeypatch
):
    """``read_steps`` runs on the shipping thread, ``READ_CHUNK_STEPS`` steps at a time with
    the GIL released between chunks (never a whole long pass in one hold); a step it cannot
    read is reported at the next flush as ``StepUnread`` and the others are priced."""
    base, inbox = api_server
    chunks, sleeps, threads = [], [], set()
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if threading.current_thread().name == "pte-pricing-shipper":
            sleeps.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)

    def read_steps(steps, lost):
        threads.add(threading.current_thread().name)
        chunks.append(len(steps))
        out = []
        for s in steps:
            if s == "bad":
                lost(AttributeError("num_scheduled_tokens"))
            else:  # 0: a's 10-token prompt; k: its k-th decode step
                out.append(step(running=[("a", 9 + s, 1)], t=0.002 * s) if s else step(new=[("a", 10, 10)]))
        return out

    config = PricingConfig(COST, engine=3, transport=base, api_servers=1, calibrate_online=False)
    pricing = PricingProcess(config, lambda rid: (rid.upper(), None), read_steps)
    try:
        n = 2 * READ_CHUNK_STEPS + 5
        pricing.price_raw([0])
        pricing.flush()
        pricing.price_raw([*range(1, n + 1), "bad"])  # a's decode steps 1..n, then one unreadable
        pricing.on_finished("a", "stop", COUNTS)
        pricing.flush()
        got = messages(inbox, lambda m: any(isinstance(x, RequestTotals) for x in m))
        with pytest.raises(StepUnread, match="num_scheduled_tokens"):
            pricing.flush()
    finally:
        pricing.close()
    assert threads == {"pte-pricing-shipper"}
    assert chunks == [1, READ_CHUNK_STEPS, READ_CHUNK_STEPS, 6] and sleeps == [0, 0]
    (totals,) = [m for m in got if isinstance(m, RequestTotals)]
    assert (totals.prefill, totals.decode_tokens) == (10, 1 + n)


def test_a_request_a_running_step_still_has_waits_for_that_step(api_server):
    base, inbox = api_server
    pricing = start(base)
    try:
        pricing.price_raw([step(new=[("a", 10, 10), ("b", 10, 10)])])
        pricing.on_finished("a", "stop", COUNTS)
        pricing.on_finished("b", "stop", COUNTS)
        pricing.flush(hold=lambda rid: rid == "a")
        assert [f.rid for f in pricing.finished] == ["a"]
        pricing.price_raw([step(running=[("a", 10, 1)], t=0.01)])
        pricing.flush()
        got = messages(inbox, lambda m: sum(isinstance(x, RequestTotals) for x in m) == 2)
    finally:
        pricing.close()
    totals = {m.request_id: m for m in got if isinstance(m, RequestTotals)}
    assert totals["a"].decode_tokens == 2 and totals["b"].decode_tokens == 1


def test_the_pricing_process_ends_when_the_engine_is_gone(api_server):
    """A crashed engine says nothing: its end of the pipe closes."""
    pricing = start(api_server[0])
    pricing._proc.stdin.close()
    assert pricing._proc.wait(timeout=10) == 0


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_servers_process_group_leaves_the_pricing_to_end_with_its_engine(
    api_server, signal_number
):
    """Ctrl-C in a terminal, or a service manager stopping the server, signals every process
    of the group: the engine shuts down and ships its last pass, which is still priced."""
    base, inbox = api_server
    pricing = start(base)
    messages(inbox, lambda m: any(isinstance(x, EngineHello) for x in m))
    try:
        os.kill(pricing.pid, signal_number)
        time.sleep(0.3)  # the signal is handled (or not) before the engine's last pass
        pricing.price_raw([step(new=[("a", 10, 10)])])
        pricing.on_finished("a", "stop", COUNTS)
        pricing.flush()
        got = messages(inbox, lambda m: any(isinstance(x, RequestTotals) for x in m))
    finally:
        pricing.close()
    assert [m.request_id for m in got if isinstance(m, RequestTotals)] == ["a"]
    assert pricing._proc.returncode == 0


def test_a_pass_with_no_room_is_dropped_and_said_the_engine_never_waits(api_server):
    """Said at the engine thread's next pass: the pass was handed over before it was found
    to have no room."""
    pricing = start(api_server[0])
    pricing._proc.kill()
    pricing._proc.wait()
    running = [(f"request-{i:05d}", 100, 1) for i in range(1000)]  # over 10 kB a pass

    def pass_dropped() -> bool:
        pricing.price_raw([step(running=running)])
        pricing.flush()
        while pricing._handed_over.qsize():  # shipped one by one, as passes a step apart are
            time.sleep(0.0005)
        return False

    with pytest.raises(PricingDropped, match=r"the pricing process exited \(-9\)"):
        for _ in range(RING_BYTES // 10_000):
            pass_dropped()
        wait(pass_dropped, timeout_s=20)
    pricing.close()


def test_a_pricing_process_that_died_is_said_at_the_next_pass_not_when_the_ring_is_full(api_server):
    """Its passes would fill the ring for thousands of requests first, each one's totals lost
    unsaid while its API server waits for them."""
    pricing = start(api_server[0])
    pricing._proc.kill()
    pricing._proc.wait()
    said = []
    try:
        for i in range(20):  # a few hundred bytes each: the ring never fills
            pricing.price_raw([step(new=[(f"r{i}", 10, 10)])])
            pricing.on_finished(f"r{i}", "stop", COUNTS)
            try:
                pricing.flush()
            except PricingDropped as e:
                said.append(str(e))
            wait(lambda: pricing._handed_over.qsize() == 0)
    finally:
        pricing.close()
    assert said and "the pricing process exited (-9)" in said[0], said
    assert len(said) >= 18  # each pass after it, at the engine's next


def test_closing_prices_every_pass_in_the_ring_though_a_step_could_not_be_read(api_server):
    """A step lost on the shipping thread is said; the passes the pricing process has not read
    yet (it is behind) are still priced and sent before it ends, the shutdown's among them."""
    base, inbox = api_server

    def read_steps(steps, lost):
        for s in steps:
            if s == "unreadable":
                lost(AttributeError("a field of another vLLM release"))
        return [s for s in steps if s != "unreadable"]

    config = PricingConfig(COST, engine=3, transport=base, api_servers=1, calibrate_online=False)
    pricing = PricingProcess(config, lambda rid: (rid, None), read_steps)
    messages(inbox, lambda m: any(isinstance(x, EngineHello) for x in m))
    os.kill(pricing.pid, signal.SIGSTOP)  # behind: the passes wait in the ring
    try:
        for i in range(30):
            pricing.price_raw([step(new=[(f"r{i}", 10, 10)])])
            pricing.on_finished(f"r{i}", "stop", COUNTS)
            pricing.flush()
        pricing.price_raw(["unreadable"])  # the shutdown's pass
        pricing.flush()
        assert wait(lambda: pricing._ship_errors)  # read on the shipping thread: said at close
    finally:
        os.kill(pricing.pid, signal.SIGCONT)
        pricing.close()
    got = messages(inbox, lambda m: sum(isinstance(x, RequestTotals) for x in m) >= 30, timeout_s=5)
    assert sorted(m.request_id for m in got if isinstance(m, RequestTotals)) == sorted(
        f"r{i}" for i in range(30)
    )
    assert pricing._proc.returncode == 0


def test_a_step_log_on_a_full_disk_costs_the_pricing_process_none_of_its_totals(api_server):
    """The step log's lines fail to reach the disk: said once, and the pricing process still
    sends every total and ends cleanly."""
    base, inbox = api_server
    config = PricingConfig(
        COST, engine=0, transport=base, api_servers=1, calibrate_online=False, step_log="/dev/full"
    )  # engine 0's step log is the path itself, which opens; every write that reaches it fails
    pricing = PricingProcess(config, lambda rid: (rid, None))
    try:
        for i in range(40):
            pricing.price_raw([step(new=[(f"r{i}", 10, 10)])] * 50)
            pricing.on_finished(f"r{i}", "stop", COUNTS)
            pricing.flush()
    finally:
        pricing.close()
    got = messages(inbox, lambda m: sum(isinstance(x, RequestTotals) for x in m) >= 40)
    assert pricing._proc.returncode == 0
    faults: dict[str, int] = {}
    for m in got:
        if isinstance(m, EngineFaults):  # each report: the faults since the one before
            for stage, n in m.counts.items():
                faults[stage] = faults.get(stage, 0) + n
    assert faults == {"engine_finish": 1}


def test_a_pass_larger_than_the_ring_goes_in_parts_and_every_total_is_exact(api_server):
    """Request ids are the client's choice and may be long: a pass whose message would not fit
    in the ring (600 steps of a 9,000-character id, twice a step: 10.8 MB) goes in parts, its
    steps in order and its finished request with the last; its totals are what one pass gives."""
    base, inbox = api_server
    pricing = start(base)
    rid = "x" * 9000
    # a 10-token prompt, then 599 decode steps: prefill 10, decode 1 + 599,
    # Σctx 10 + Σ_{k=1..599} (10 + k) = 10 + 5,990 + 179,700
    steps = [step(new=[(rid, 10, 10)])]
    steps += [step(running=[(rid, 9 + k, 1)], t=0.002 * k) for k in range(1, 600)]
    try:
        pricing.price_raw(steps)
        pricing.on_finished(rid, "length", COUNTS)
        pricing.flush()
        got = messages(inbox, lambda m: any(isinstance(x, RequestTotals) for x in m))
        pricing.flush()  # nothing was dropped: nothing to say
    finally:
        pricing.close()
    (totals,) = [m for m in got if isinstance(m, RequestTotals)]
    assert (totals.prefill, totals.decode_tokens, totals.ctx) == (10, 600, (185_700.0,))
    assert totals.engine_steps == 600


def test_a_step_too_large_for_any_message_is_lost_alone_and_said(api_server):
    """A step whose own message would be over a quarter of the ring (a 700,000-character id,
    twice) is lost, said at the next flush; the pass's other steps and its finished request
    still go."""
    base, inbox = api_server
    pricing = start(base)
    rid = "y" * 700_000
    try:
        pricing.price_raw([step(new=[(rid, 10, 10)]), step(running=[("z", 5, 1)])])
        pricing.on_finished(rid, "length", COUNTS)
        pricing.flush()
        assert wait(lambda: pricing._handed_over.qsize() == 0 and pricing._ship_errors)
        with pytest.raises(StepUnread, match="over the"):
            pricing.flush()
        got = messages(inbox, lambda m: any(isinstance(x, RequestTotals) for x in m))
    finally:
        pricing.close()
    (totals,) = [m for m in got if isinstance(m, RequestTotals)]
    assert totals.request_id == rid and not totals.scheduled  # its only step was the one lost


def test_passes_the_shipping_thread_has_not_shipped_are_bounded(api_server):
    """A shipping thread that cannot keep up holds at most ``MAX_HANDED_OVER`` passes: the
    next one is dropped and said, and the engine thread never waits for it."""
    pricing = start(api_server[0])
    ship, stuck = pricing._ship, threading.Event()

    def slow(batch):
        stuck.wait(20)
        ship(batch)

    pricing._ship = slow
    try:
        pricing.price_raw([step(new=[("first", 10, 10)])])
        pricing.flush()
        assert wait(lambda: pricing._handed_over.qsize() == 0)  # taken by the thread, which waits
        for i in range(MAX_HANDED_OVER):
            pricing.price_raw([step(new=[(f"r{i}", 10, 10)])])
            pricing.flush()
        pricing.price_raw([step(new=[("late", 10, 10)])])
        with pytest.raises(PricingDropped, match=f"{MAX_HANDED_OVER} passes still wait"):
            pricing.flush()
    finally:
        stuck.set()
        pricing.close()
    assert pricing._proc.returncode == 0


def test_the_engine_thread_hands_a_pass_over_without_encoding_it(api_server):
    """Encoding a pass, copying it into the ring and waking the pricing process take the
    engine thread about a hundred µs after a model wait has cooled its caches: they run on
    the engine process's shipping thread, which the GIL lets run while the engine thread
    waits for the model. The engine thread's passes are still priced in order."""
    base, inbox = api_server
    pricing = start(base)
    encoded_on = []
    encode = pricing._encoder.encode

    def spy(batch):
        encoded_on.append(threading.current_thread())
        return encode(batch)

    pricing._encoder = SimpleNamespace(encode=spy)
    try:
        for i in range(20):
            pricing.price_raw([step(new=[(f"r{i}", 10, 10)], t=0.01 * i)])
            pricing.on_finished(f"r{i}", "stop", COUNTS)
            pricing.flush()
        got = messages(inbox, lambda m: sum(isinstance(x, RequestTotals) for x in m) == 20)
    finally:
        pricing.close()
    assert encoded_on and threading.main_thread() not in encoded_on
    assert [m.request_id for m in got if isinstance(m, RequestTotals)] == [f"r{i}" for i in range(20)]
    assert pricing.ship_s > 0


def test_a_step_log_that_cannot_be_opened_is_reported_by_the_pricing_process(api_server, tmp_path):
    base, inbox = api_server
    (tmp_path / "file").write_text("")
    pricing = start(base, step_log=str(tmp_path / "file" / "steps.jsonl"))
    try:
        got = messages(inbox, lambda m: any(isinstance(x, EngineFaults) for x in m))
    finally:
        pricing.close()
    assert [m.counts for m in got if isinstance(m, EngineFaults)] == [{"engine_step_log": 1}]


def test_a_pricing_process_that_fails_at_start_is_an_error_and_leaves_no_ring(
    api_server, tmp_path, monkeypatch
):
    from pte_instrument.engine import ring

    monkeypatch.setattr(ring, "ring_directories", lambda: [str(tmp_path)])
    with pytest.raises(RuntimeError, match=r"the pricing process did not start \(exit code 1\)"):
        start(api_server[0], backend="abacus")  # not an accumulator backend: it fails at start
    assert not list(tmp_path.glob("pte-pricing-*"))
    pricing = start(api_server[0])  # a good one: its ring's name is gone once it is mapped
    assert not list(tmp_path.glob("pte-pricing-*")) and pricing._ring.path.startswith(str(tmp_path))
    pricing.close()


def test_an_idle_pricing_process_sleeps_until_a_pass_is_shipped(api_server):
    """Woken by the pass, not by a clock: nothing to price costs it no CPU (polling the ring
    every 5 ms woke it 400 times in 2 s), and a pass shipped after a long idle is priced at
    once. Its safety look is an hour here, so only the pass's wake-up can have it priced.
    Counted in wake-ups, not CPU time: the kernel's CPU time comes in 10 ms ticks, one of
    which a busy host may charge to a single wake-up."""
    base, inbox = api_server
    pricing = start(base, idle_look_s=3600.0)
    try:
        time.sleep(0.5)  # its start-up done
        before = wake_ups(pricing.pid)
        time.sleep(2.0)
        idle = wake_ups(pricing.pid) - before
        pricing.price_raw([step(new=[("a", 10, 10)])])
        pricing.on_finished("a", "stop", COUNTS)
        pricing.flush()
        messages(inbox, lambda m: any(isinstance(x, RequestTotals) for x in m), timeout_s=10)
    finally:
        pricing.close()
    assert idle <= 4, f"{idle} wake-ups in 2 s of idle"


def wake_ups(pid: int) -> int:
    """How many times the threads of a process have gone to sleep and been woken (Linux)."""
    return sum(
        int(line.split()[1])
        for task in Path(f"/proc/{pid}/task").iterdir()
        for line in (task / "status").read_text().splitlines()
        if line.startswith("voluntary_ctxt_switches:")
    )


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling classes")
def test_the_pricing_process_never_preempts_the_engine_when_woken(api_server):
    """It runs under SCHED_BATCH: a pass shipped wakes it without taking the engine's core
    from the engine thread (on a busy host a wake-up preempted the engine thread for about
    as long as the pass took to price)."""
    pricing = start(api_server[0])
    try:
        assert os.sched_getscheduler(pricing.pid) == os.SCHED_BATCH
        assert os.sched_getparam(pricing.pid).sched_priority == 0
    finally:
        pricing.close()
