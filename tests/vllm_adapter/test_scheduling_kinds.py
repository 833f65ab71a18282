"""The scheduler hook inside vLLM's real ``Scheduler`` and ``AsyncScheduler``, driven without a
model (``pte_instrument.vllm_adapter.driver``) through the same request streams: the hook's
per-request totals equal an independent, position-by-position count of what the scheduler
scheduled, under either kind; sync and async schedule the same work but for the steps async
scheduling runs past a request's end, which are charged to it; the hook never changes what
vLLM schedules; and each step's measured time, steps overlapping or not, adds up to the
engine's busy time."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from pte_instrument.settings import Settings
from pte_instrument.vllm_adapter.driver import Arrival, Driver, StepClock, build_scheduler
from pte_instrument.vllm_adapter.scheduler import PteAsyncScheduler, PteScheduler
from tests.conftest import ROOT
from tests.helpers import wait

MODEL = ROOT / "models" / "tiny"
pytestmark = pytest.mark.skipif(
    not (MODEL / "config.json").exists(), reason="needs the tiny model (make test)"
)


def mixed_stream(seed: int, n: int = 40) -> list[Arrival]:
    """Chunked prefills (prompts up to 600 tokens, 256 scheduled per step), prefix-cache hits
    (a shared 64-token prefix), stop tokens and length limits, parallel-sampling children
    (``0_p``, ``1_p``: the same prompt), and aborts while waiting, mid-prefill and mid-decode."""
    rng = np.random.default_rng(seed)
    shared = tuple(int(x) for x in rng.integers(100, 1000, 64))
    out: list[Arrival] = []
    for i in range(n):
        prompt = (shared if i % 3 == 0 else ()) + tuple(
            int(x) for x in rng.integers(100, 1000, int(rng.integers(5, 600)))
        )
        stop = int(rng.integers(0, 30)) if i % 2 else None
        step, max_tokens = i // 2, int(rng.integers(1, 40))
        abort = {3: step, 5: step + 1, 7: step + 6}.get(i % 10)  # waiting, mid-prefill, mid-decode
        if i % 11 == 4:  # parallel sampling: two children of one parent
            out += [Arrival(f"{k}_p{i}", prompt, max_tokens, step, stop, abort) for k in range(2)]
        else:
            out.append(Arrival(f"r{i}", prompt, max_tokens, step, stop, abort))
    return out


STREAMS = {
    "mixed": {"stream": mixed_stream(1), "num_blocks": 4096, "num_spec_tokens": 0, "prefix_caching": True},
    # a KV pool of 48 blocks of 16 tokens for 40 requests of up to 650: preemptions, which
    # recompute without the prefix cache (with it, a resumed request finds its blocks)
    "preemption": {
        "stream": mixed_stream(2),
        "num_blocks": 48,
        "num_spec_tokens": 0,
        "prefix_caching": False,
    },
    "speculative": {
        "stream": mixed_stream(3),
        "num_blocks": 4096,
        "num_spec_tokens": 3,
        "prefix_caching": True,
    },
    # drafts and preemptions together: under async scheduling a request is preempted while a
    # step of its drafts is in flight, and vLLM does not roll that stale output's rejections back
    "speculative-preemption": {
        "stream": mixed_stream(2),
        "num_blocks": 40,
        "num_spec_tokens": 3,
        "prefix_caching": False,
    },
}


def scheduler_for(kind: type, asynchronous: bool, case: dict):
    return build_scheduler(
        kind,
        MODEL,
        async_scheduling=asynchronous,
        num_blocks=case["num_blocks"],
        num_spec_tokens=case["num_spec_tokens"],
        prefix_caching=case["prefix_caching"],
        max_num_batched_tokens=256,
    )


def drive(kind: type, asynchronous: bool, case: dict, clock: StepClock | None = None) -> tuple[Driver, list]:
    s = scheduler_for(kind, asynchronous, case)
    sent: list = []
    if isinstance(s, PteScheduler):  # the hook's own accounting, totals into a list
        s._pte_state.pte = s._pte_accounting(s.vllm_config, Settings.from_env(), 0, sent.extend)
    d = Driver(s, async_scheduling=asynchronous, clock=clock)
    d.run(case["stream"])
    return d, sent


def independent_totals(d: Driver, overrun: bool = True) -> dict[str, dict]:
    """Per request, from the driver's record of each scheduled step: its positions, position
    by position, with the drafts the model rejected. A step scheduled before an earlier step's
    rejected drafts were rolled back (async scheduling) runs its positions back by what vLLM
    rolled back (nothing, where a preemption made the earlier step's output stale). ``overrun=False``: without the rows
    scheduled after the step that finished the request."""
    prompts = {a.rid: len(a.prompt) for a in d.arrivals.values()}
    out: dict[str, dict] = {}
    high: dict[str, int] = {}
    for step in d.steps:  # in schedule order
        for row in step.rows:
            fin = d.finished_in.get(row.rid)
            if not overrun and fin is not None and step.scheduled > fin:
                continue
            back = sum(
                p.rolled_back.get(row.rid, 0) for p in d.steps if p.scheduled < step.scheduled < p.delivered
            )
            c, P = row.c - back, prompts[row.rid]
            end, h = c + row.n, high.get(row.rid, 0)
            t = out.setdefault(
                row.rid,
                dict.fromkeys(("prefill", "recompute", "decode", "ctx", "spec", "rejected"), 0)
                | {"cached": c},
            )
            for p in range(c, end):
                if p < max(P, h):
                    t["prefill"] += 1
                    t["recompute"] += p < h
                else:
                    t["decode"] += 1
                    t["ctx"] += p + 1
            if max(h, c) < P <= end:  # the prompt's last position samples output 0
                t["decode"] += 1
                t["ctx"] += P
            rejected = step.rejected.get(row.rid, 0)
            t["spec"] += row.drafts
            t["rejected"] += rejected
            high[row.rid] = max(h, end - rejected)
    return out


def hook_totals(sent: list) -> dict[str, dict]:
    return {
        m.request_id: {
            "prefill": m.prefill,
            "recompute": m.recompute,
            "decode": m.decode_tokens,
            "ctx": m.ctx[0],
            "spec": m.spec_tokens,
            "rejected": m.rejected_tokens,
            "cached": m.cached_tokens,
        }
        for m in sent
        if m.scheduled
    }


@pytest.fixture(scope="module")
def runs() -> dict:
    """Every stream through vLLM's classes and through PteScheduler, sync and async."""
    out = {}
    for name, case in STREAMS.items():
        for asynchronous in (False, True):
            out[name, asynchronous, "vllm"] = drive(
                AsyncScheduler if asynchronous else Scheduler, asynchronous, case
            )
            out[name, asynchronous, "pte"] = drive(PteScheduler, asynchronous, case)
    return out


@pytest.mark.parametrize("name", STREAMS)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_the_hooks_totals_are_an_independent_count_of_what_ran(runs, name, asynchronous):
    d, sent = runs[name, asynchronous, "pte"]
    assert type(d.s) is (PteAsyncScheduler if asynchronous else PteScheduler)
    assert not d.s._pte_faults.counts
    # every request once, and before the engine shut down: the last when it ran out of work
    assert sorted(m.request_id for m in sent) == sorted(d.arrivals)
    expected = independent_totals(d)
    assert hook_totals(sent) == expected
    never = {m.request_id for m in sent if not m.scheduled}
    assert never == set(d.arrivals) - set(expected)
    assert d.s._pte_state.pte.live == 0 and d.s._pte_state.pte.acc.in_use == 0
    if name == "preemption":
        assert sum(t["recompute"] for t in expected.values()) > 0
    if name == "speculative-preemption" and asynchronous:  # rejected drafts vLLM did not roll back
        assert any(k and not st.rolled_back.get(r) for st in d.steps for r, k in st.rejected.items())
    if name == "speculative":
        assert sum(t["rejected"] for t in expected.values()) > 0
        assert sum(m.pte_rejected for m in sent) > 0


@pytest.mark.parametrize("name", STREAMS)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_the_pricing_process_sends_the_same_exact_totals(runs, name, asynchronous, monkeypatch, tmp_path):
    """The default: the engine thread ships its steps to a pricing process of its own, which
    sends each request's totals to the API server: the same totals as priced on the engine
    thread, all of them by the time the engine has shut down."""
    import queue
    import uuid

    from pte_instrument.engine.pricing import PricingProcess
    from pte_instrument.transport import Receiver, address_for
    from pte_instrument.wire import EngineHello, RequestTotals

    base = f"ipc://{tmp_path}/pte-{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("PTE_ENGINE_TRANSPORT", base)
    inbox: queue.Queue = queue.Queue()
    receiver = Receiver(address_for(base, 0), inbox.put)
    case = STREAMS[name]
    s = scheduler_for(PteScheduler, asynchronous, case)
    assert isinstance(s._pte_state.pte, PricingProcess)
    pricing = s._pte_state.pte._proc
    d = Driver(s, async_scheduling=asynchronous)
    d.run(case["stream"])
    s.shutdown()
    assert pricing.poll() == 0  # ended with the engine
    messages: list = []

    def every_request_sent() -> bool:  # sent before it exited; the receiver's thread may lag
        while not inbox.empty():
            messages.extend(inbox.get())
        return sum(isinstance(m, RequestTotals) for m in messages) >= len(d.arrivals)

    wait(every_request_sent, timeout_s=10, interval_s=0.05)
    assert not s._pte_faults.counts and receiver.errors == 0
    assert [m.engine for m in messages if isinstance(m, EngineHello)] == [0]
    sent = [m for m in messages if isinstance(m, RequestTotals)]
    assert sorted(m.request_id for m in sent) == sorted(d.arrivals)
    assert hook_totals(sent) == independent_totals(d)
    inline = {m.request_id: m for m in runs[name, asynchronous, "pte"][1]}
    for m in sent:  # the prices and seconds too, but for the clock each run reads
        assert m.pte_served == pytest.approx(inline[m.request_id].pte_served)
        assert m.pte_roofline == pytest.approx(inline[m.request_id].pte_roofline)
    assert max(m.engine_hook_s for m in sent) > 0


def test_a_pricing_process_that_cannot_start_leaves_pricing_on_the_engine_thread(monkeypatch, tmp_path):
    from pte_instrument.engine.accounting import EngineAccounting
    from pte_instrument.faults import install_log_handler, log
    from pte_instrument.vllm_adapter import scheduler

    class NeverStarts(scheduler.PricingProcess):
        def __init__(self, *args, **kwargs) -> None:
            raise RuntimeError("the pricing process did not start within 60 s")

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    monkeypatch.setattr(scheduler, "PricingProcess", NeverStarts)
    monkeypatch.setenv("PTE_ENGINE_TRANSPORT", f"ipc://{tmp_path}/pte")
    install_log_handler()  # as the hook does first; a handler of the test's own would stop it (no INFO)
    handler = Lines()
    log.addHandler(handler)
    try:
        s = build_scheduler(PteScheduler, MODEL, async_scheduling=False)
    finally:
        log.removeHandler(handler)
    assert isinstance(s._pte_state.pte, EngineAccounting)
    assert s._pte_faults.counts == {"engine_setup": 1}
    assert (
        "pte-instrument: the pricing process did not start within 60 s; pricing on the engine thread"
        in handler.lines
    )
    assert any("numpy accumulator on the engine thread" in line for line in handler.lines), handler.lines
    s.shutdown()


def test_a_saved_fit_the_hook_cannot_read_leaves_the_hook_on_with_the_theory(monkeypatch, tmp_path):
    """The settings read the fit's file, then the hook reads it again: a file changed or
    removed in between costs the fit (one line, a fault counted), not the whole hook."""
    from pte_instrument.cost.step_time import StepTimeModel
    from pte_instrument.engine.accounting import EngineAccounting

    saved = tmp_path / "fit.json"
    StepTimeModel(1e-12, 1e-12, 1e-3, 1e-4, source="fit").save(saved)
    monkeypatch.setenv("PTE_CALIBRATION", str(saved))
    monkeypatch.setenv("PTE_ENGINE_TRANSPORT", f"ipc://{tmp_path}/pte")
    monkeypatch.setenv("PTE_ENGINE_PRICING", "inline")

    class Unreadable(StepTimeModel):  # what the hook reads; the settings read the file as it was
        @classmethod
        def load(cls, path):
            raise ValueError(f"cannot read step-time model {path}: Permission denied")

    monkeypatch.setattr("pte_instrument.vllm_adapter.scheduler.StepTimeModel", Unreadable)
    s = build_scheduler(PteScheduler, MODEL, async_scheduling=False)
    try:
        assert isinstance(s._pte_state.pte, EngineAccounting)  # the hook is on
        assert s._pte_state.pte.calibration().source == "theory"
        assert s._pte_faults.counts == {"engine_setup": 1}
    finally:
        s.shutdown()


@pytest.mark.parametrize("name", STREAMS)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_the_hook_schedules_as_vllms_own_class(runs, name, asynchronous):
    ours, _ = runs[name, asynchronous, "pte"]
    theirs, _ = runs[name, asynchronous, "vllm"]
    assert [s.rows for s in ours.steps] == [s.rows for s in theirs.steps]
    assert ours.finished_in == theirs.finished_in


@pytest.mark.parametrize("name", ["mixed", "speculative"])
def test_sync_and_async_charge_the_same_work_but_the_steps_run_past_the_end(runs, name):
    """Without preemption both kinds schedule each request the same positions; async
    scheduling also runs one step past a request's end (it is scheduled before the engine
    sees the stop token, or the drafts that reach the length), which is charged to it."""
    sync, sync_sent = runs[name, False, "pte"]
    asyn, async_sent = runs[name, True, "pte"]
    aborted = {a.rid for a in sync.arrivals.values() if a.abort_at is not None}
    plain = independent_totals(asyn, overrun=False)
    for rid, totals in independent_totals(sync).items():
        if rid not in aborted:
            assert plain[rid] == totals, rid
    assert independent_totals(sync, overrun=False) == independent_totals(sync)  # sync never runs past
    past = {rid for rid, t in hook_totals(async_sent).items() if rid not in aborted and t != plain[rid]}
    stopped = {m.request_id for m in sync_sent if m.finish_reason == "stop"} - aborted
    assert stopped <= past  # every stop ran one step more under async
    assert past


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_each_steps_time_is_its_run_and_all_of_it_is_charged(asynchronous):
    """A controlled clock: each step's model runs 2–9 ms from when it was scheduled, or from
    when the previous step's run ended (one device); 1 ms of host time between calls."""
    runs_s = {}

    def run_s(k: int) -> float:
        return runs_s.setdefault(k, 0.002 + 0.001 * (k * 7 % 8))

    clock = StepClock(run_s)
    d, sent = drive(PteScheduler, asynchronous, STREAMS["mixed"], clock)
    busy = sum(run_s(s.scheduled) for s in d.steps if any(r.n for r in s.rows))
    timing = d.s._pte_state.pte.timing
    assert timing.busy_s == pytest.approx(busy, rel=1e-9)
    charged = sum(m.gpu_prefill_s + m.gpu_kv_s + m.gpu_weights_s + m.gpu_overhead_s for m in sent)
    assert charged + timing.unattributed_s == pytest.approx(busy, rel=1e-9)
    if asynchronous:  # steps overlapped: the union, not the sum of schedule → outputs intervals
        assert sum(s.done_at - s.scheduled_at for s in d.steps) > busy * 1.2


def test_the_hooks_own_time_counts_each_timed_step_as_many_times_as_it_stands_for(monkeypatch, tmp_path):
    """A clock that moves 1 µs at each reading: one request of 300 steps, priced inline. One
    step in ``TIME_EVERY_STEPS`` is timed and counted that many times (its ``schedule()``
    part: 1 reading apart; its ``update_from_output()`` part: 1 before vLLM's call and 1
    after); the pass when the request finished and the request's finish are timed each
    (1 µs). The step log shows each timed step's count, and 0 on the others."""
    import json

    from pte_instrument.vllm_adapter.scheduler import TIME_EVERY_STEPS

    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv("PTE_STEP_LOG", str(log))
    case = {**STREAMS["mixed"], "stream": [Arrival("one", tuple(range(100, 200)), 300)]}
    s = scheduler_for(PteScheduler, False, case)
    sent: list = []
    s._pte_state.pte = s._pte_accounting(s.vllm_config, Settings.from_env(), 0, sent.extend)
    readings = iter(range(10**9))
    s._pte_state.clock = lambda: next(readings) * 1e-6
    d = Driver(s, async_scheduling=False)
    d.run(case["stream"])
    hook_s = s._pte_state.hook_s
    s.shutdown()
    assert [bool(st.rows) for st in d.steps] == [True] * 300 + [False]  # then an empty one
    assert TIME_EVERY_STEPS == 64  # steps 64, 128, 192, 256 timed
    assert hook_s == pytest.approx(4 * 64 * (1 + 2) * 1e-6 + 2e-6, abs=1e-12)
    assert sent[0].engine_hook_s == pytest.approx(hook_s - 1e-6, abs=1e-12)  # but the pass that sent it
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    per_step = [x["hook_s"] for x in lines if not x.get("header")]
    assert len(per_step) == 300
    assert {k + 1: h for k, h in enumerate(per_step) if h} == {
        k: pytest.approx(64 * 2e-6, abs=1e-12) for k in (64, 128, 192, 256)
    }


def test_the_documented_class_becomes_vllms_async_scheduler_only_under_async_scheduling(caplog):
    sync = build_scheduler(PteScheduler, MODEL, async_scheduling=False, num_blocks=64)
    asyn = build_scheduler(PteScheduler, MODEL, async_scheduling=True, num_blocks=64)
    assert type(sync) is PteScheduler and not isinstance(sync, AsyncScheduler)
    assert type(asyn) is PteAsyncScheduler and isinstance(asyn, AsyncScheduler)
    assert asyn.vllm_config.scheduler_config.async_scheduling is True  # never changed

    class Subclassed(PteScheduler):  # a user's own subclass keeps its kind: vLLM's sync one
        pass

    with caplog.at_level(logging.WARNING, logger="pte_instrument"):
        mine = build_scheduler(Subclassed, MODEL, async_scheduling=True, num_blocks=64)
    assert type(mine) is Subclassed
    lines = [r.getMessage() for r in caplog.records if "async scheduling is on" in r.getMessage()]
    assert (
        len(lines) == 1 and "--scheduler-cls pte_instrument.vllm_adapter.scheduler.PteScheduler" in lines[0]
    )


def test_a_users_scheduler_under_the_hook_is_the_one_it_wraps():
    """A user's class that puts a scheduler of its own between the hook and vLLM's: the hook
    calls that scheduler's methods each step, as ``super()`` would, and prices what ran."""
    calls = {"schedule": 0, "update": 0}

    class Theirs(Scheduler):
        def schedule(self, throttle_prefills: bool = False):
            calls["schedule"] += 1
            return super().schedule(throttle_prefills)

        def update_from_output(self, scheduler_output, model_runner_output):
            calls["update"] += 1
            return super().update_from_output(scheduler_output, model_runner_output)

    class Mine(PteScheduler, Theirs):
        pass

    d, sent = drive(Mine, False, STREAMS["mixed"])
    assert calls["schedule"] == calls["update"] == len(d.steps) > 0
    assert hook_totals(sent) == independent_totals(d) and not d.s._pte_faults.counts


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_lost_step_is_counted_and_the_rest_stays_exact(monkeypatch, asynchronous):
    """A fault while a step is recorded loses that step, never a step in flight beside it:
    every request is still sent once, and the steps kept are charged as they ran."""
    from pte_instrument import failpoints

    monkeypatch.setitem(failpoints.points, "engine_step", 0.05)
    d, sent = drive(PteScheduler, asynchronous, STREAMS["mixed"])
    faults = dict(d.s._pte_faults.counts)
    assert set(faults) == {"engine_step"} and 0 < faults["engine_step"] < 100, faults
    assert sorted(m.request_id for m in sent) == sorted(d.arrivals)
    got, full = hook_totals(sent), independent_totals(d)
    assert all(got[r]["prefill"] <= full[r]["prefill"] for r in got)
    assert sum(t["prefill"] + t["decode"] for t in got.values()) < sum(
        t["prefill"] + t["decode"] for t in full.values()
    )
    assert d.s._pte_state.pte.live == 0


class FailingDriver(Driver):
    """Fails one request inside vLLM's ``update_from_output`` of the given update, as vLLM
    fails a request whose grammar did not compile: its ``finish_requests`` runs there."""

    def __init__(self, *args, fail: tuple[int, str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail = fail
        self.updates = 0

    def _update(self) -> None:
        if self.updates == self.fail[0]:
            self.s.grammar_compile_error_reqs.add(self.fail[1])
        self.updates += 1
        super()._update()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_request_failed_inside_vllms_update_is_charged_its_last_step_as_it_ran(asynchronous):
    """The last live request fails inside vLLM's update of a step in which some of its drafts
    were rejected: the finish that vLLM makes there leaves no request unfinished, and the hook
    must not price that step before it has read what vLLM rejected (nor send the request's
    totals without it)."""
    case = {**STREAMS["speculative"], "stream": [Arrival("x", tuple(range(100, 180)), 60)]}
    plain = Driver(
        scheduler_for(AsyncScheduler if asynchronous else Scheduler, asynchronous, case),
        async_scheduling=asynchronous,
    )
    plain.run(case["stream"])
    update = next(
        k for k, st in enumerate(sorted(plain.steps, key=lambda st: st.delivered)) if st.rejected.get("x")
    )
    s = scheduler_for(PteScheduler, asynchronous, case)
    sent: list = []
    s._pte_state.pte = s._pte_accounting(s.vllm_config, Settings.from_env(), 0, sent.extend)
    d = FailingDriver(s, async_scheduling=asynchronous, fail=(update, "x"))
    d.run(case["stream"])
    assert [m.finish_reason for m in sent] == ["error"]
    assert not d.s._pte_faults.counts
    assert hook_totals(sent) == independent_totals(d)
    assert independent_totals(d)["x"]["rejected"] > 0


@pytest.mark.parametrize("pricing", ["inline", "process"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_step_that_cannot_be_read_is_lost_alone_and_counted(monkeypatch, tmp_path, asynchronous, pricing):
    """The hook reads a scheduler output's rows when its step is priced, outside vLLM's
    calls (in the pricing process's shipping thread, or at the pass when inline): a fault
    there (a field of another vLLM release) loses that step, counted as a step fault, not
    the others of its pass; every request is still sent and the engine schedules on."""
    import queue
    import uuid

    from pte_instrument.transport import Receiver, address_for
    from pte_instrument.vllm_adapter import compat
    from pte_instrument.wire import RequestTotals

    prompt_length, calls = compat.prompt_length, []

    def fails_once(data):
        calls.append(data.req_id)
        if len(calls) == 1:
            raise AttributeError("prompt_token_ids")
        return prompt_length(data)

    monkeypatch.setattr(compat, "prompt_length", fails_once)
    case = STREAMS["mixed"]
    if pricing == "inline":
        d, sent = drive(PteScheduler, asynchronous, case)
    else:
        base = f"ipc://{tmp_path}/pte-{uuid.uuid4().hex[:6]}"
        monkeypatch.setenv("PTE_ENGINE_TRANSPORT", base)
        inbox: queue.Queue = queue.Queue()
        receiver = Receiver(address_for(base, 0), inbox.put)
        d = Driver(scheduler_for(PteScheduler, asynchronous, case), async_scheduling=asynchronous)
        d.run(case["stream"])
        sent = []

        def every_request_sent() -> bool:
            while not inbox.empty():
                sent.extend(m for m in inbox.get() if isinstance(m, RequestTotals))
            return len(sent) >= len(d.arrivals)

        assert wait(every_request_sent, timeout_s=10, interval_s=0.05)
        d.s.shutdown()
        assert receiver.errors == 0
    assert dict(d.s._pte_faults.counts) == {"engine_step": 1}
    assert sorted(m.request_id for m in sent) == sorted(d.arrivals)
    # the first step is the one lost: every request it did not run is exact
    lost = {row.rid for row in d.steps[0].rows}
    got, full = hook_totals(sent), independent_totals(d)
    assert calls[0] in lost and set(full) - lost
    assert {r: t for r, t in got.items() if r not in lost} == {r: t for r, t in full.items() if r not in lost}
    assert all(got[r]["prefill"] < full[r]["prefill"] for r in lost if r in got)


def test_a_fault_reaches_the_api_server_without_waiting_for_more_traffic(monkeypatch, tmp_path):
    """Every send of totals fails: the faults still reach API server 0 (in a batch of their
    own), and the last one with them, although no later totals follow it."""
    import queue
    import uuid

    from pte_instrument import failpoints
    from pte_instrument.engine.sender import EngineSender
    from pte_instrument.transport import Receiver, Sender, address_for
    from pte_instrument.wire import EngineFaults

    monkeypatch.setitem(failpoints.points, "transport", 1.0)
    base = f"ipc://{tmp_path}/pte-{uuid.uuid4().hex[:6]}"
    inbox: queue.Queue = queue.Queue()
    receiver = Receiver(address_for(base, 0), inbox.put)
    case = STREAMS["mixed"]
    s = build_scheduler(
        PteScheduler,
        MODEL,
        async_scheduling=False,
        num_blocks=case["num_blocks"],
        prefix_caching=True,
        max_num_batched_tokens=256,
    )
    s._pte_sender = EngineSender(Sender(base), 0, s._pte_faults)
    s._pte_state.pte = s._pte_accounting(s.vllm_config, Settings.from_env(), 0, s._pte_send)
    Driver(s, async_scheduling=False).run(case["stream"])
    lost = s._pte_faults.counts["engine_transport"]
    assert lost > 0
    reported = 0

    def take() -> bool:
        nonlocal reported
        while not inbox.empty():
            reported += sum(
                m.counts.get("engine_transport", 0) for m in inbox.get() if isinstance(m, EngineFaults)
            )
        return reported == lost

    assert wait(take, timeout_s=10), (reported, lost)
    s._pte_sender.close()
    assert receiver.errors == 0


def test_a_step_log_on_a_full_disk_is_said_once_and_never_raised_into_vllm(monkeypatch):
    """Its buffered lines fail to reach the disk mid-run and again at shutdown: the step log
    goes off, said once, and the accounting and vLLM's own shutdown go on."""
    monkeypatch.setenv("PTE_STEP_LOG", "/dev/full")  # opens; every write that reaches it fails
    case = {**STREAMS["mixed"], "stream": mixed_stream(5, n=120)}
    d, sent = drive(PteScheduler, False, case)
    d.s.shutdown()
    assert dict(d.s._pte_faults.counts) == {"engine_finish": 1}
    assert hook_totals(sent) == independent_totals(d)


@pytest.mark.parametrize("step_s, stays_on", [(1.0, True), (0.001, False)], ids=["scattered", "at-once"])
def test_the_hook_switches_itself_off_only_when_faults_come_fast(monkeypatch, step_s, stays_on):
    """A fault on every step: with steps of a second, a hundred faults take longer than a
    minute, and a server that has run long enough to meet them hook on; with steps of a
    millisecond, a hundred come at once, and the hook switches itself off."""
    from pte_instrument import failpoints

    monkeypatch.setitem(failpoints.points, "engine_step", 1.0)
    case = {**STREAMS["mixed"], "stream": mixed_stream(6, n=160)}
    d, _ = drive(PteScheduler, False, case, clock=StepClock(lambda _: step_s))
    assert sum(d.s._pte_faults.counts.values()) >= (150 if stays_on else 100)
    assert (d.s._pte_state.pte is not None) is stays_on


class FreeTimes(PteScheduler):
    """The hook, with the hook's clock when vLLM freed each request."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.freed_at: dict[str, float] = {}

    def _free_request(self, request, *args, **kwargs):
        self.freed_at[request.request_id] = self._pte_state.clock()
        return super()._free_request(request, *args, **kwargs)


@pytest.mark.parametrize("step_s", [0.002, 0.1], ids=["2ms-steps", "100ms-steps"])
def test_a_finished_requests_totals_leave_within_50_ms_however_long_the_steps(step_s):
    """Steps of 100 ms (a CPU build, or long prefills on a GPU): a request that finishes while
    others run is not held until the next step's outputs, 100 ms later."""
    clock = StepClock(lambda _: step_s)
    case = STREAMS["mixed"]
    s = scheduler_for(FreeTimes, False, case)
    sent_at: dict[str, float] = {}

    def send(totals: list) -> None:
        sent_at.update((m.request_id, clock.now) for m in totals)

    s._pte_state.pte = s._pte_accounting(s.vllm_config, Settings.from_env(), 0, send)
    d = Driver(s, async_scheduling=False, clock=clock)
    d.run(case["stream"])
    late = {rid: sent_at[rid] - at for rid, at in s.freed_at.items()}
    assert set(late) == set(d.arrivals)
    assert max(late.values()) <= 0.05, sorted(late.values())[-3:]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_lost_step_whose_prompts_cannot_be_read_either_is_not_raised_into_vllm(monkeypatch, asynchronous):
    """A step is lost to a fault after it was taken off the in-flight list (its drafts cannot
    be read), and the prompt lengths it would keep cannot be read either (fields of another
    vLLM release): both are counted, and vLLM's update goes on."""
    from pte_instrument.vllm_adapter import compat

    def unreadable(*args):
        raise AttributeError("a field of another vLLM release")

    monkeypatch.setattr(PteScheduler, "_pte_drafts", unreadable)
    monkeypatch.setattr(compat, "prompt_length", unreadable)
    d, _ = drive(PteScheduler, asynchronous, STREAMS["speculative"])
    assert set(d.s._pte_faults.counts) <= {"engine_step"} and d.s._pte_faults.counts["engine_step"] > 0
    assert d.s.get_num_unfinished_requests() == 0  # every request ran to its end
