"""``vllm.stat_logger_plugins`` entry point: every finished request, to be priced.

vLLM loads this class in every API-server process and calls ``record()`` after every
engine-core output batch, for all of its engines (data parallel: one logger, engine
indexes as the ``engine`` label). ``record()`` runs on vLLM's output loop: it converts
vLLM's stats and queues them, and the plugin prices them on its own thread. Nothing here
may raise into vLLM: a fault is counted (``pte_plugin_faults_total``) and logged, and
serving continues.
"""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import AggregateStatLoggerBase
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

from pte_instrument.faults import install_log_handler, log
from pte_instrument.server.api_server import ServedModel, api_server
from pte_instrument.server.records import FinishedRequest
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
    process.

    Both are wall-clock differences: a clock set back while the request ran makes them
    negative, and they read as zero (the request arrived when it finished)."""
    e2e = float(stats.e2e_latency)
    key = iteration_timestamp - e2e  # the arrival on vLLM's clock, as its first-token entry has it
    tokens = int(stats.num_generation_tokens)
    ttft = None
    if tokens > 0:
        ttft = first_token_latencies.pop(key) if first_token_latencies is not None else None
        ttft = max(0.0, e2e - float(stats.decode_time) if ttft is None else ttft)
    e2e = max(0.0, e2e)
    arrival = iteration_timestamp - e2e
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
        prompt_index=compat.prompt_index(str(stats.request_id)),
    )


class PteStatLogger(AggregateStatLoggerBase):
    """One logger for every engine of this API server: converts vLLM's configuration and
    finish stats and hands them to this process's plugin (``ApiServer``)."""

    def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int] | None = None) -> None:
        install_log_handler()
        self.server = api_server()
        self.model = compat.served_model_name(vllm_config)
        self.first_tokens = FirstTokenLatencies()
        try:
            served = ServedModel(
                name=self.model,
                engines=tuple(engine_indexes or [0]),
                architecture=compat.served_architecture(vllm_config),
                kv_cache_dtype=compat.kv_cache_dtype(vllm_config),
                kv_block_size=compat.kv_block_size(vllm_config),
                gpus_per_engine=compat.gpus_per_engine(vllm_config),
                lora=compat.lora_enabled(vllm_config),
                api_server=compat.api_server_index(vllm_config),
                transport=compat.engine_transport(vllm_config, self.server.settings.engine_transport),
            )
        except Exception as e:  # a vLLM whose config lacks what the plugin reads: serve unpriced
            self.server.fault("setup", e)
            log.error("pte-instrument could not read vLLM's configuration and is inactive: %s", e)
            return
        self.server.configure(served, compat.request_keys)

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if iteration_stats is None or not self.server.active:
            return
        try:
            self.first_tokens.observe(iteration_stats)
        except Exception as e:
            self.server.fault("adapter", e)
        if iteration_stats.finished_requests:
            self.server.finished(self._converted(iteration_stats, engine_idx))

    def _converted(self, iteration: IterationStats, engine: int) -> list[FinishedRequest]:
        out = []
        for stats in iteration.finished_requests:
            try:
                out.append(
                    finished_request(
                        stats, self.model, engine, iteration.iteration_timestamp, self.first_tokens
                    )
                )
            except Exception as e:
                self.server.fault("adapter", e)
        return out

    def log_engine_initialized(self) -> None:
        self.server.announce(self.model)
