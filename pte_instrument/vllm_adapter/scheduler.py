"""Engine-side step hook: a scheduler subclass selected with
``--scheduler-cls pte_instrument.vllm_adapter.scheduler.PteScheduler``
(``PteAsyncScheduler`` with ``--async-scheduling``).

Every step it turns the scheduler output into a step batch for the accumulator; when a
request finishes (stopped, length, aborted) its exact totals go to the API server through
the transport. A fault inside the hook is counted and logged, never raised into vLLM; a
hook that keeps failing switches itself off.
"""

from __future__ import annotations

import os
import time
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from pte_instrument.cost.step_time import StepTimeModel
from pte_instrument.engine.accounting import EngineAccounting
from pte_instrument.engine.report import EngineReporter
from pte_instrument.failpoints import failpoint
from pte_instrument.faults import FaultTracker, install_log_handler, log
from pte_instrument.settings import Settings
from pte_instrument.transport import ADDRESS_ENV, Sender
from pte_instrument.vllm_adapter import compat
from pte_instrument.wire import RequestTotals

MAX_FAULTS = 100  # then the hook turns itself off, with one log line


class _PteHook:
    """Mixed into vLLM's schedulers; the only code that reads their internals."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        install_log_handler()
        self._pte: EngineAccounting | None = None
        self._pte_faults = FaultTracker()
        try:
            settings = Settings.from_env()
            cfg = self.vllm_config  # type: ignore[attr-defined]
            address = compat.engine_transport(cfg, os.environ.get(ADDRESS_ENV))
            if not settings.enabled or not address:
                log.warning(
                    "pte-instrument engine hook inactive (%s)",
                    "disabled" if address else f"{ADDRESS_ENV} unset",
                )
                return
            engine = compat.engine_index(cfg)
            self._pte_reporter = EngineReporter(Sender(address), engine, self._pte_faults)
            cost_model = compat.cost_model_from_vllm(cfg, settings)
            step_model, source = None, "theory"
            if settings.calibration not in ("off", "online"):  # a saved fit
                step_model, source = StepTimeModel.load(settings.calibration), "file"
            self._pte = EngineAccounting(
                cost_model,
                self._pte_send,
                engine=engine,
                backend=settings.accumulator_backend,
                step_log=settings.step_log,
                external_id=compat.external_request_id,
                weight_bytes=compat.weight_bytes(cfg),
                step_model=step_model,
                step_model_source=source,
                calibrate_online=settings.calibration != "off",
            )
            if self._pte.step_log_error is not None:
                self._pte_step_log_off(settings.step_log, self._pte.step_log_error)
            self._pte_reporter.hello(compat.api_server_count(cfg), self._pte.calibration())
            log.info(
                "pte-instrument engine hook active (engine %d, %s accumulator, totals to %s)",
                engine,
                self._pte.acc.backend,
                address,
            )
        except Exception as e:
            self._pte_fault("setup", e)

    def _pte_step_log_off(self, path: str | None, error: OSError) -> None:
        """One line, counted once; the step log is off, the accounting goes on."""
        log.error(
            "pte-instrument: step log PTE_STEP_LOG=%r is not writable (%s); the step log is off, the "
            'engine hook\'s accounting continues; counted in pte_plugin_faults_total{stage="engine_step_log"}',
            path,
            error,
        )
        self._pte_faults.record("engine_step_log", error, logged=True)

    def _pte_send(self, totals: list[RequestTotals]) -> None:
        try:
            failpoint("transport")
            self._pte_reporter.send(totals, self._pte.calibration() if self._pte is not None else None)
        except Exception as e:  # those totals are lost; the API server prices without them
            self._pte_fault("transport", e)

    def _pte_fault(self, stage: str, e: Exception) -> None:
        self._pte_faults.record(f"engine_{stage}", e)
        if sum(self._pte_faults.counts.values()) >= MAX_FAULTS and self._pte is not None:
            log.error("pte-instrument engine hook switched off after %d faults", MAX_FAULTS)
            self._pte = None

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        if self._pte is not None:
            try:
                t0 = time.perf_counter()
                requests = self.requests  # type: ignore[attr-defined]
                scheduled = out.num_scheduled_tokens
                rids = list(scheduled)
                reqs = [requests[rid] for rid in rids]
                n = list(scheduled.values())
                spec = out.scheduled_spec_decode_tokens
                columns = [
                    # num_computed_tokens was already advanced by this step's n
                    [r.num_computed_tokens - k for r, k in zip(reqs, n, strict=True)],
                    n,
                    [r.num_prompt_tokens for r in reqs],
                    [len(spec.get(rid, ())) for rid in rids] if spec else [0] * len(rids),
                ]
                failpoint("engine_step")
                self._pte.hook_s += time.perf_counter() - t0  # reading vLLM's state counts too
                self._pte.on_schedule(rids, columns)
            except Exception as e:
                self._pte_fault("step", e)
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if self._pte is not None:
            self._pte.on_step_done()
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if self._pte is not None:
            try:
                if scheduler_output.scheduled_spec_decode_tokens:
                    requests = self.requests  # type: ignore[attr-defined]
                    for rid in scheduler_output.scheduled_spec_decode_tokens:
                        if rid in requests:
                            self._pte.accepted(rid, requests[rid].num_computed_tokens)
                self._pte.flush()
            except Exception as e:
                self._pte_fault("finish", e)
        return outputs

    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        result = super().finish_requests(*args, **kwargs)  # type: ignore[misc]
        if self._pte is not None:
            try:
                self._pte.flush()  # aborts arrive here, outside update_from_output
            except Exception as e:
                self._pte_fault("finish", e)
        return result

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        if self._pte is not None:
            try:
                reason = request.get_finished_reason()
                counts = compat.finished_counts(request)
                self._pte.on_finished(request.request_id, str(reason), request.num_computed_tokens, counts)
            except Exception as e:
                self._pte_fault("finish", e)
        return super()._free_request(request, *args, **kwargs)  # type: ignore[misc]

    def shutdown(self) -> None:
        if self._pte is not None:
            self._pte.close()
            self._pte_reporter.close()
        super().shutdown()  # type: ignore[misc]


class PteScheduler(_PteHook, Scheduler):
    pass


class PteAsyncScheduler(_PteHook, AsyncScheduler):
    pass
