"""Engine-side step hook: a scheduler subclass selected with
``--scheduler-cls pte_instrument.vllm_adapter.scheduler.PteScheduler``.

``PteScheduler`` keeps vLLM's choice of scheduler: constructed where vLLM's config has async
scheduling on (the GPU builds' default), it is vLLM's ``AsyncScheduler`` with the hook, and
otherwise vLLM's ``Scheduler`` with the hook. It never changes ``async_scheduling``.

Per step the hook keeps a reference to the scheduler output and two clock readings (it reads
the output's rows when the step is priced, ``raw_steps``), and times its own work on one step
in ``TIME_EVERY_STEPS``; per request it reads only what speculative drafts need. The
completed steps are priced together every ``PRICE_EVERY_STEPS`` steps or
``PRICE_EVERY_ROWS`` rows, or ``PRICE_DELAY_S`` after a request finished, or at once when
the engine runs out of requests: by default handed to the hook's pricing process
(``engine.pricing``: shipped there by a thread of the engine process), which prices them
(``EngineAccounting``) off the engine thread; with ``PTE_ENGINE_PRICING=inline``, priced
here. A finished request's exact totals then go to the API server through the transport,
once no step still running has it. A fault inside the hook is counted and logged, never
raised into vLLM; a hook that keeps failing (``MAX_FAULTS`` within ``FAULT_WINDOW_S``)
switches itself off.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from pte_instrument import failpoints
from pte_instrument.cost.step_time import StepTimeModel
from pte_instrument.engine.accounting import EngineAccounting, RawStep
from pte_instrument.engine.pricing import PricingConfig, PricingProcess, StepUnread, step_log_off
from pte_instrument.engine.sender import EngineSender
from pte_instrument.failpoints import failpoint
from pte_instrument.faults import FaultTracker, install_log_handler, log
from pte_instrument.settings import Settings
from pte_instrument.transport import ADDRESS_ENV, Sender
from pte_instrument.vllm_adapter import compat
from pte_instrument.wire import RequestTotals

# This many faults within FAULT_WINDOW_S, and the hook turns itself off, with one log line;
# faults scattered over a long-running server's life never add up to it.
MAX_FAULTS = 100
FAULT_WINDOW_S = 60.0
# A pricing pass costs about a millisecond whatever its size (dozens of numpy calls), so it
# waits for as many steps as it may: completed steps and their rows held at most before
# they are priced (memory, and the length of one pass), and how long a finished request's
# totals may wait (checked at each step: with steps of up to 10 ms, sent within 50 ms).
PRICE_EVERY_STEPS = 512
PRICE_EVERY_ROWS = 8192
PRICE_DELAY_S = 0.04
SCHEDULER_FLAG = "--scheduler-cls pte_instrument.vllm_adapter.scheduler.PteScheduler"

# What the engine thread keeps of one step, from the moment it is scheduled (a list: its fields
# still change): [the scheduler output, scheduled at, outputs back at, hook s (where timed),
# draft tokens per request, rejected drafts per request, positions to take back per request].
# The scheduler output is read only when the step is priced (``raw_steps``): by the pricing
# process's shipping thread, or at the pricing pass when pricing inline.
_OUT, _SCHEDULED, _DONE, _HOOK, _DRAFTS, _REJECTED, _BACK = range(7)
# The hook's per-step time is timed on one step in this many (timing a step takes as many
# clock readings as its work takes time) and counted that many times; passes are timed each.
TIME_EVERY_STEPS = 64


@dataclass(slots=True)
class HookState:
    """What the hook reads and writes on every step, in one small object rather than among
    the scheduler's ~100 attributes: after a model wait has cooled the caches, the hook's
    step costs less the less distinct memory it reaches."""

    pte: EngineAccounting | PricingProcess | None = None  # None: the hook is off
    clock: Callable[[], float] = time.perf_counter
    inflight: deque[list[Any]] = field(default_factory=deque)  # scheduled, outputs not back (in order)
    done: list[list[Any]] = field(default_factory=list)  # outputs back, not priced yet
    rows: int = 0  # their rows
    countdown: int = TIME_EVERY_STEPS  # outputs to take until the one that is timed
    failpoint: bool = False  # the ``engine_step`` failpoint is armed
    finished_at: float | None = None  # the earliest finish not sent yet
    last_t0: float = 0.0  # when the latest step's outputs came back
    next_at: float = 0.0  # when the next step's are due, if it takes as long as the latest
    updating: bool = False  # inside vLLM's update_from_output (which may finish requests)
    hook_s: float = 0.0  # the hook's own time on the engine thread (the accounting's at a pass)


def raw_steps(steps: list[list[Any]], lost: Callable[[Exception], None]) -> list[RawStep]:
    """The hook's steps as the accounting reads them: what each scheduler output says of its
    rows, with the hook's clocks and drafts. A step it cannot read (a field of another vLLM
    release) is left out, and ``lost`` told why."""
    raw: list[RawStep] = []
    for out, scheduled_at, done_at, hook_s, drafts, rejected, back in steps:
        try:
            new, cached = out.scheduled_new_reqs, out.scheduled_cached_reqs
            raw.append(
                (
                    [(d.req_id, d.num_computed_tokens, compat.prompt_length(d)) for d in new]
                    if new
                    else None,
                    cached.req_ids,
                    cached.num_computed_tokens,
                    out.num_scheduled_tokens,
                    scheduled_at,
                    done_at,
                    hook_s,
                    drafts,
                    rejected,
                    back,
                )
            )
        except Exception as e:
            lost(e)
    return raw


class _PteHook:
    """Mixed into vLLM's schedulers; the only code that reads their internals."""

    _pte_vllm_schedule: Callable[..., Any]
    _pte_vllm_update: Callable[..., Any]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # vLLM's methods the per-step ones wrap, found once per class: ``super()`` looks
        # through the classes' dicts on every call, about 1 µs a step at batch 1 once the
        # model wait has cooled the caches (median, measured).
        cls._pte_vllm_schedule = super().schedule  # type: ignore[misc]
        cls._pte_vllm_update = super().update_from_output  # type: ignore[misc]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        install_log_handler()
        # The failpoint is read once: looking in another module's dict on every step costs
        # about 2 µs at batch 1 (median, measured).
        self._pte_state = HookState(failpoint="engine_step" in failpoints.points)
        self._pte_faults = FaultTracker()
        self._pte_fault_times: deque[float] = deque(maxlen=MAX_FAULTS)
        self._pte_sender: EngineSender | None = None
        self._pte_prompts: dict[str, int] = {}  # prompt lengths from steps lost to the accounting
        try:
            settings = Settings.from_env()
            cfg = self.vllm_config  # type: ignore[attr-defined]
            self._pte_check_kind(cfg)
            address = compat.engine_transport(cfg, settings.engine_transport)
            if not settings.enabled or not address:
                log.warning(
                    "pte-instrument engine hook inactive (%s)",
                    "disabled" if address else f"{ADDRESS_ENV} unset",
                )
                return
            engine = compat.engine_index(cfg)
            self._pte_sender = EngineSender(Sender(address), engine, self._pte_faults)
            pte = self._pte_state.pte = self._pte_pricing(cfg, settings, engine, address)
            log.info(
                "pte-instrument engine hook active (engine %d, %s scheduling, %s, totals to %s)",
                engine,
                "async" if isinstance(self, AsyncScheduler) else "sync",
                f"{pte.backend} accumulator in pricing process {pte.pid}"
                if isinstance(pte, PricingProcess)
                else f"{pte.acc.backend} accumulator on the engine thread",
                address,
            )
        except Exception as e:
            self._pte_fault("setup", e)

    def _pte_pricing(
        self, cfg: Any, settings: Settings, engine: int, address: str
    ) -> EngineAccounting | PricingProcess:
        """The pricing process, or the accounting on the engine thread (``inline``, or a
        pricing process that could not start)."""
        if settings.engine_pricing == "process":
            try:
                return PricingProcess(
                    PricingConfig(
                        **self._pte_accounting_args(cfg, settings, engine, pricing_process=True),
                        transport=address,
                        api_servers=compat.api_server_count(cfg),
                    ),
                    compat.external_request_id,
                    raw_steps,
                )
            except Exception as e:
                log.error("pte-instrument: %s; pricing on the engine thread", e)
                self._pte_faults.record("engine_setup", e, logged=True)
        accounting = self._pte_accounting(cfg, settings, engine, self._pte_send)
        if accounting.step_log_error is not None:
            step_log_off(self._pte_faults, settings.step_log, accounting.step_log_error)
        assert self._pte_sender is not None
        self._pte_sender.hello(compat.api_server_count(cfg), accounting.calibration())
        return accounting

    def _pte_accounting(self, cfg: Any, settings: Settings, engine: int, send: Any) -> EngineAccounting:
        return EngineAccounting(
            send=send,
            external_id=compat.external_request_id,
            prompt_of=self._pte_prompt_of,
            **self._pte_accounting_args(cfg, settings, engine),
        )

    def _pte_accounting_args(
        self, cfg: Any, settings: Settings, engine: int, pricing_process: bool = False
    ) -> dict[str, Any]:
        step_model, source = None, "theory"
        if settings.calibration not in ("off", "online"):  # a saved fit
            try:
                step_model, source = StepTimeModel.load(settings.calibration), "file"
            except ValueError as e:  # changed since the settings read it: the fit is lost, not the hook
                log.error("pte-instrument: %s; the step-time model starts from theory", e)
                self._pte_faults.record("engine_setup", e, logged=True)
        backend = settings.accumulator_backend
        if pricing_process and backend == "auto":  # no CUDA context of its own on the serving device
            backend = "numpy"
        return {
            "cost_model": compat.cost_model_from_vllm(cfg, settings),
            "engine": engine,
            "backend": backend,
            "step_log": settings.step_log,
            "weight_bytes": compat.weight_bytes(cfg),
            "step_model": step_model,
            "step_model_source": source,
            "calibrate_online": settings.calibration != "off",
        }

    def _pte_check_kind(self, cfg: Any) -> None:
        """One warning when this class's kind is not the one vLLM's engine runs: a
        synchronous scheduler driven in async order schedules a decode every other step."""
        if compat.async_scheduling(cfg) and not isinstance(self, AsyncScheduler):
            log.warning(
                "pte-instrument: async scheduling is on but %s is vLLM's synchronous Scheduler, which "
                "loses what async scheduling is for; use %s, which keeps vLLM's choice",
                type(self).__name__,
                SCHEDULER_FLAG,
            )

    def _pte_prompt_of(self, rid: str) -> int:
        request = self.requests.get(rid)  # type: ignore[attr-defined]
        return request.num_prompt_tokens if request is not None else 0

    def _pte_send(self, totals: list[RequestTotals]) -> None:
        pte = self._pte_state.pte
        if self._pte_sender is not None and not self._pte_sender.deliver(
            totals, pte.calibration() if isinstance(pte, EngineAccounting) else None
        ):
            self._pte_switch_off_if_failing()

    def _pte_fault(self, stage: str, e: Exception) -> None:
        """Counted, and reported now."""
        if self._pte_sender is not None:
            self._pte_sender.fault(stage, e)
        else:
            self._pte_faults.record(f"engine_{stage}", e)
        self._pte_switch_off_if_failing()

    def _pte_switch_off_if_failing(self) -> None:
        state = self._pte_state
        times = self._pte_fault_times
        times.append(state.clock())
        if len(times) == MAX_FAULTS and times[-1] - times[0] < FAULT_WINDOW_S and state.pte is not None:
            log.error(
                "pte-instrument engine hook switched off after %d faults in %.0f s",
                MAX_FAULTS,
                times[-1] - times[0],
            )
            pte, state.pte = state.pte, None
            state.inflight.clear()
            state.done.clear()
            # Closing may wait seconds for its process: not on the engine thread.
            if isinstance(pte, PricingProcess):
                threading.Thread(target=pte.close, name="pte-pricing-close", daemon=True).start()

    # --- vLLM's scheduler interface -------------------------------------------------------

    # vLLM's own signatures, not (*args, **kwargs): packing a dict on every call costs more than
    # the hook's own work per step (scripts/vllm_contract.py checks them against each release).
    def schedule(self, throttle_prefills: bool = False) -> Any:
        out = self._pte_vllm_schedule(throttle_prefills)
        state = self._pte_state
        if state.pte is not None:
            clock = state.clock
            t = clock()
            state.inflight.append([out, t, 0.0, 0.0, None, None, None])
            if state.countdown == 1:  # the step update_from_output times
                state.hook_s += TIME_EVERY_STEPS * (clock() - t)
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        state = self._pte_state
        if state.pte is None:
            return self._pte_vllm_update(scheduler_output, model_runner_output)
        clock = state.clock
        t0 = clock()
        step, drafts = None, None
        try:
            if state.failpoint:
                failpoint("engine_step")
            inflight = state.inflight  # steps complete in order: the oldest, but for a fault
            step = (
                inflight.popleft()
                if inflight and inflight[0][_OUT] is scheduler_output
                else self._pte_completed(scheduler_output)
            )
            if step is not None:
                if scheduler_output.scheduled_spec_decode_tokens:
                    drafts = self._pte_drafts(
                        step, scheduler_output.scheduled_spec_decode_tokens, model_runner_output
                    )
                if rows := len(scheduler_output.num_scheduled_tokens):
                    # Kept before vLLM takes the outputs, with the rest of the hook's memory
                    # warm; its rejected drafts are added below, before it can be priced.
                    step[_DONE] = t0
                    state.rows += rows
                    state.done.append(step)
        except Exception as e:
            if step is not None:  # this step is lost to the accounting
                self._pte_lost(step)
                step, drafts = None, None
            self._pte_fault("step", e)
        state.countdown -= 1
        timed = not state.countdown
        if timed:
            state.countdown = TIME_EVERY_STEPS
        t1 = clock() if timed else 0.0
        state.updating = True
        try:
            outputs = self._pte_vllm_update(scheduler_output, model_runner_output)
        finally:
            state.updating = False
        t2 = clock() if timed else 0.0
        pass_s, priced = 0.0, False
        try:
            if drafts is not None and step is not None:
                self._pte_rejected(step, drafts)
            # A finish waits for company until the next step's outputs would come later than
            # PRICE_DELAY_S after it.
            finished_at = state.finished_at
            next_at = state.next_at = 2 * t0 - state.last_t0
            state.last_t0 = t0
            if (
                len(state.done) >= PRICE_EVERY_STEPS
                or state.rows >= PRICE_EVERY_ROWS
                or (
                    finished_at is not None
                    and (
                        next_at - finished_at >= PRICE_DELAY_S or not self.get_num_unfinished_requests()  # type: ignore[attr-defined]
                    )
                )
            ):
                t = clock()
                self._pte_price()
                pass_s, priced = clock() - t, True
                state.hook_s += pass_s
        except Exception as e:
            self._pte_fault("finish", e)
        if timed:
            step_s = TIME_EVERY_STEPS * ((t1 - t0) + (clock() - t2 - pass_s))
            state.hook_s += step_s
            if step is not None and not priced:  # not handed over yet: for its line in the step log
                step[_HOOK] = step_s
        return outputs

    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        result = super().finish_requests(*args, **kwargs)  # type: ignore[misc]
        state = self._pte_state
        # Aborts arrive here, outside update_from_output: priced now where the engine is idle
        # (it steps no more) or the next step's outputs are due too late. Requests vLLM fails
        # inside update_from_output arrive here too: that step's pass comes after it, once the
        # step's rejected drafts are read.
        if state.pte is not None and state.finished_at is not None and not state.updating:
            t = state.clock()
            try:
                if (
                    state.next_at - state.finished_at >= PRICE_DELAY_S
                    or not self.get_num_unfinished_requests()  # type: ignore[attr-defined]
                ):
                    self._pte_price()
            except Exception as e:
                self._pte_fault("finish", e)
            state.hook_s += state.clock() - t
        return result

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        state = self._pte_state
        if state.pte is not None:
            t = state.clock()
            try:
                reason = str(request.get_finished_reason())
                state.pte.on_finished(request.request_id, reason, compat.finished_counts(request))
                if state.finished_at is None:
                    state.finished_at = t
            except Exception as e:
                self._pte_fault("finish", e)
            state.hook_s += state.clock() - t
        return super()._free_request(request, *args, **kwargs)  # type: ignore[misc]

    def shutdown(self) -> None:
        state = self._pte_state
        if state.pte is not None:
            try:
                state.done += state.inflight  # never to complete: as they are
                state.inflight.clear()
                self._pte_price()
            except Exception as e:
                self._pte_fault("finish", e)
            if state.pte is not None:
                state.pte.hook_s = state.hook_s
                state.pte.close()
        if self._pte_sender is not None:
            self._pte_sender.close()
        super().shutdown()  # type: ignore[misc]

    # --- the hook's own work ------------------------------------------------------------

    def _pte_completed(self, out: Any) -> list[Any] | None:
        """The in-flight step whose outputs these are (``out``: its scheduler output) when it
        is not the oldest: the steps scheduled before it never completed, and are dropped."""
        inflight = self._pte_state.inflight
        for k, step in enumerate(inflight):
            if step[_OUT] is out:
                for _ in range(k):
                    self._pte_lost(inflight.popleft())
                return inflight.popleft()
        return None  # a step the hook lost (a fault): the ones in flight stay

    def _pte_lost(self, step: list[Any]) -> None:
        """A step the accounting will not see: the prompt lengths of the requests it started,
        which later steps do not carry (the pricing process cannot ask the scheduler). Those it
        cannot read are left out: it runs where a fault was met, and must not raise into vLLM."""
        with contextlib.suppress(Exception):
            for d in step[_OUT].scheduled_new_reqs:
                self._pte_prompts[d.req_id] = compat.prompt_length(d)

    def _pte_drafts(
        self, step: list[Any], spec: dict[str, list[int]], output: Any
    ) -> list[tuple[str, Any, int, int]]:
        """Before vLLM takes the step's outputs (it cuts a finished request's tokens short in
        place): the step's draft tokens per request and, per live request, its computed tokens
        and the drafts the model rejected (its drafts less the tokens it accepted beyond the
        one it samples, as vLLM counts them)."""
        counts = step[_DRAFTS] = {rid: len(tokens) for rid, tokens in spec.items()}
        requests = self.requests  # type: ignore[attr-defined]
        index, sampled = output.req_id_to_index, output.sampled_token_ids
        drafts = []
        for rid in spec:
            if (r := requests.get(rid)) is not None:
                generated = sampled[index[rid]] if sampled else ()
                drafts.append(
                    (rid, r, r.num_computed_tokens, counts[rid] + 1 - len(generated) if generated else 0)
                )
        return drafts

    def _pte_rejected(self, step: list[Any], drafts: list[tuple[str, Any, int, int]]) -> None:
        """A step's rejected drafts of requests live when its outputs came back, and what vLLM
        rolled back of each one's computed tokens for them: as many, unless a preemption while
        the step ran made its output stale (the count was reset instead). A step scheduled
        before these outputs were back (async scheduling) started its positions as many too
        far as vLLM rolled back: they are taken back when it is priced."""
        rejected = step[_REJECTED] = {}
        for rid, request, before, k in drafts:
            if k > 0:
                rejected[rid] = k
            rolled_back = before - request.num_computed_tokens
            if rolled_back > 0:
                for later in self._pte_state.inflight:
                    if rid in later[_OUT].num_scheduled_tokens:
                        back = later[_BACK] = later[_BACK] or {}
                        back[rid] = back.get(rid, 0) + rolled_back

    def _pte_price(self) -> None:
        """Price the completed steps, then send the finished requests no running step has."""
        state = self._pte_state
        pte = state.pte
        if pte is None:
            return
        done, state.done, state.rows = state.done, [], 0
        pte.hook_s = state.hook_s
        if done:  # the pricing process's shipping thread reads them, off the engine thread
            if not isinstance(pte, PricingProcess):
                done = raw_steps(done, lambda e: self._pte_fault("step", e))
            pte.price_raw(done, self._pte_prompts)
            self._pte_prompts = {}
        inflight = state.inflight
        try:
            pte.flush(
                (lambda rid: any(rid in s[_OUT].num_scheduled_tokens for s in inflight)) if inflight else None
            )
        except StepUnread as e:  # a step of an earlier pass, lost on the shipping thread
            self._pte_fault("step", e)
        if not pte.finished:
            state.finished_at = None


class PteScheduler(_PteHook, Scheduler):
    """vLLM's scheduler with the hook: ``AsyncScheduler`` where vLLM's config has async
    scheduling on, ``Scheduler`` otherwise (decided at construction)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> PteScheduler:
        if cls is PteScheduler:
            cfg = kwargs.get("vllm_config", args[0] if args else None)
            if compat.async_scheduling(cfg):
                cls = PteAsyncScheduler
        return super().__new__(cls)


class PteAsyncScheduler(PteScheduler, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with the hook (what ``PteScheduler`` becomes under async
    scheduling)."""
