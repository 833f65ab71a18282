"""``vllm.stat_logger_plugins`` entry point: prices every finished request.

vLLM loads this class in every API-server process and calls ``record()`` after every
engine-core output batch, for all of its engines (data parallel: one logger, engine
indexes as the ``engine`` label). Nothing here may raise into vLLM: a fault is counted
(``pte_plugin_faults_total``) and logged, and serving continues.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import AggregateStatLoggerBase
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

from pte_instrument.faults import install_log_handler, log
from pte_instrument.server.accountant import Accountant
from pte_instrument.server.engine_join import RequestJoin
from pte_instrument.server.records import FinishedRequest
from pte_instrument.server.runtime import get_runtime
from pte_instrument.vllm_adapter import compat


class FirstTokenLatencies:
    """vLLM's own arrival → first-token latency of each request not yet finished.

    vLLM keeps it out of its finish stats: each output batch lists the latencies of the
    requests whose first token it carried (``time_to_first_tokens_iter``), without their
    ids, as ``iteration_timestamp − arrival_time``. The finish stats give
    ``e2e_latency = iteration_timestamp − arrival_time`` of the finishing batch. Both
    subtract the arrival time from a timestamp within a factor of two of it, which is exact
    in floating point, and so is the arrival recovered from either: the arrival time is the
    key. Children of one parallel-sampling request share it and are taken in order.
    Requests aborted after their first token never finish there; the oldest entries go
    once ``limit`` are kept."""

    def __init__(self, limit: int = 65_536) -> None:
        self.limit = limit
        self._by_arrival: dict[float, list[float]] = {}

    def __len__(self) -> int:
        return len(self._by_arrival)

    def observe(self, iteration: IterationStats) -> None:
        for latency in iteration.time_to_first_tokens_iter:
            self._by_arrival.setdefault(iteration.iteration_timestamp - latency, []).append(latency)
        while len(self._by_arrival) > self.limit:
            del self._by_arrival[next(iter(self._by_arrival))]

    def pop(self, arrival: float) -> float | None:
        latencies = self._by_arrival.get(arrival)
        if not latencies:
            return None
        latency = latencies.pop(0)
        if not latencies:
            del self._by_arrival[arrival]
        return latency


def finished_request(
    stats: FinishedRequestStats,
    model: str,
    engine: int,
    iteration_timestamp: float,
    first_token_latencies: FirstTokenLatencies | None = None,
) -> FinishedRequest:
    """``iteration_timestamp``: vLLM's wall time of the output batch that finished the
    request, from which its ``e2e_latency`` is measured (so arrival = that − e2e).

    The time to first token is vLLM's own, from ``first_token_latencies``. Without it
    (none given, or the entry dropped by its bound) it is ``e2e_latency − decode_time``
    (``decode_time`` runs from the first token to the last on the engine core's clock),
    which also counts how much longer the last output took than the first to reach this
    process."""
    e2e = float(stats.e2e_latency)
    arrival = iteration_timestamp - e2e
    tokens = int(stats.num_generation_tokens)
    ttft = None
    if tokens > 0:
        ttft = first_token_latencies.pop(arrival) if first_token_latencies is not None else None
        if ttft is None:
            ttft = max(0.0, e2e - float(stats.decode_time))
    return FinishedRequest(
        request_id=str(stats.request_id),
        model=model,
        engine=engine,
        prompt_tokens=int(stats.num_prompt_tokens),
        cached_tokens=int(stats.num_cached_tokens),
        output_tokens=int(stats.num_generation_tokens),
        finish_reason=str(stats.finish_reason),
        num_preemptions=int(stats.num_preemptions),
        queued_s=float(stats.queued_time),
        prefill_s=float(stats.prefill_time),
        decode_s=float(stats.decode_time),
        inference_s=float(stats.inference_time),
        e2e_s=e2e,
        arrived_at=arrival,
        finished_at=iteration_timestamp,
        ttft_s=ttft,
        tpot_s=float(stats.mean_time_per_output_token) if tokens > 1 else None,
    )


class PteStatLogger(AggregateStatLoggerBase):
    """One logger for every engine of this API server: an accountant per engine (its
    ``engine`` label); the ledgers, routes and transport of the process are shared."""

    def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int] | None = None) -> None:
        install_log_handler()
        self.engine_indexes = list(engine_indexes or [0])
        self.model = compat.served_model_name(vllm_config)
        self.accountants: dict[int, Accountant] = {}
        self.runtime = get_runtime()
        self.first_tokens = FirstTokenLatencies()
        self._next_expiry = 0.0
        self.join = RequestJoin(
            self.runtime.inbox,
            self.model,
            compat.request_keys,
            self._tagged,
            self._price,
            self.runtime.faults,
        )
        settings = self.runtime.settings
        if not settings.enabled:
            log.info("pte-instrument disabled (PTE_ENABLED=0)")
            return
        try:
            cost_model = compat.cost_model_from_vllm(vllm_config, settings)
            price = settings.gpu_hourly_price  # USD per GPU-hour; an engine runs on TP × PP GPUs
            usd_per_engine_second = (
                None if price is None else price * compat.gpus_per_engine(vllm_config) / 3600
            )
            if cost_model.shape.assumed:  # priced, but on a guess: one line naming it
                log.warning(
                    "pte-instrument cost model for %r: %s", self.model, "; ".join(cost_model.shape.assumed)
                )
            self.runtime.sessions.block_size = compat.kv_block_size(vllm_config)
            # adapters are priced as their base model: the same weights and KV cache
            self.runtime.lora_names.enabled = compat.lora_enabled(vllm_config)
            for engine in self.engine_indexes:
                exporters = self.runtime.exporters_for(self.model, engine, cost_model)
                self.accountants[engine] = Accountant(
                    cost_model,
                    exporters,
                    self.runtime.faults,
                    self.runtime.sessions,
                    usd_per_gpu_second=usd_per_engine_second,
                    new_trace_id=self.runtime.new_trace_id,
                    on_state=partial(self.runtime.exporter_state, self.model, engine),
                    on_lost=partial(self.runtime.exporter_lost, self.model, engine),
                )
        except Exception as e:  # unknown architecture, bad device name…: keep serving unpriced
            self.accountants.clear()
            self.runtime.faults.record("setup", e)
            log.error("pte-instrument could not build its cost model and is inactive: %s", e)
            return
        self.runtime.listen(
            compat.api_server_index(vllm_config),
            compat.engine_transport(vllm_config, self.runtime.settings.engine_transport),
        )
        self.runtime.joins.append(self.join)
        self.join.start_timer()

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if not self.accountants or iteration_stats is None:
            return
        now = time.monotonic()
        try:
            self.first_tokens.observe(iteration_stats)
        except Exception as e:
            self.runtime.faults.record("adapter", e)
        for stats in iteration_stats.finished_requests:
            try:
                request = finished_request(
                    stats, self.model, engine_idx, iteration_stats.iteration_timestamp, self.first_tokens
                )
                request = self._tagged(request)
            except Exception as e:
                self.runtime.faults.record("adapter", e)
                continue
            self.join.finished(request, now)
        self.join.price_ready(now)
        if now >= self._next_expiry:  # close idle sessions even when no turn arrives
            self._next_expiry = now + 1.0
            try:
                self.runtime.sessions.expire()
                self.runtime.ledger_metrics.sync()
            except Exception as e:
                self.runtime.faults.record("sessions", e)

    def _tagged(self, request: FinishedRequest) -> FinishedRequest:
        return self.runtime.tagged(
            request, self.runtime.pending.claim(*compat.request_keys(request.request_id))
        )

    def _price(self, request: FinishedRequest) -> None:
        accountant = self.accountants.get(request.engine)
        if accountant is None:  # an engine index vLLM did not announce
            self.runtime.faults.record("adapter", KeyError(f"unknown engine {request.engine}"))
            return
        accountant.on_finished(request)
        totals = request.engine_totals
        if totals is not None:
            try:
                self.runtime.prometheus[(self.model, request.engine)].publish_engine_time(
                    totals.engine_busy_s, totals.engine_unattributed_s
                )
            except Exception as e:
                self.runtime.faults.record("prometheus", e)
        try:
            self.runtime.ledger_metrics.sync()
        except Exception as e:
            self.runtime.faults.record("sessions", e)

    def log(self) -> None:
        if self.accountants:
            self.join.price_ready(time.monotonic())

    def log_engine_initialized(self) -> None:
        if not self.accountants:
            return
        c = next(iter(self.accountants.values())).cost_model
        log.info(
            "pte-instrument active for %s (engines %s, API server %d, engine totals on %s): gamma=%.6g, "
            "device=%s (HOI %.1f), N_active=%.4g, KV bytes/token=%g",
            self.model,
            ",".join(map(str, self.accountants)),
            self.runtime.api_server,
            self.runtime.receiver_address or "nothing (no engine hook can reach this process)",
            c.gamma,
            c.device.name,
            c.device.hoi,
            c.shape.n_active,
            c.shape.kv_bytes_per_token,
        )
