"""Records of finished requests, priced in PTE: what the exporters and the request log read."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, get_args, get_type_hints

from pte_instrument.cost.model import CostModel, TurnTokens, price_turn
from pte_instrument.wire import RequestTotals

# The engine's step-by-step PTE of a request whose work all reached its client is its closed
# form up to rounding (relative differences of ~1e-15 a step): below this, no work past the end.
PAST_END_ROUNDING = 1e-9


@dataclass(frozen=True)
class FinishedRequest:
    """What the server reports about a finished request (adapter-neutral)."""

    request_id: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    finish_reason: str
    num_preemptions: int = 0
    recomputed_tokens: int = 0
    queued_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    inference_s: float = 0.0
    e2e_s: float = 0.0
    engine: int = 0
    session_id: str | None = None
    turn: int | None = None
    reusable_tokens: int = 0  # context the session's previous turn already paid for
    pause_s: float | None = None  # tool pause between the previous turn's end and this arrival
    replica: str | None = None  # the replica (PTE_INSTANCE) that served it
    previous_replica: str | None = None  # the replica that served its session's previous turn
    engine_totals: RequestTotals | None = None  # exact step-level totals from the engine hook
    benchmark: str = "none"  # allow-listed evaluation label (X-PTE-Benchmark)
    tenant: str | None = None  # allow-listed tenant or "other" (None: tenants off)
    lora_name: str | None = None  # the LoRA adapter that served it (None: the base model)
    arrived_at: float = 0.0  # unix times, vLLM's own (0: unknown)
    finished_at: float = 0.0
    child_index: int | None = None  # parallel sampling (n > 1): which sample of its parent
    ttft_s: float | None = None  # arrival → first token (None: no token, or unknown)
    tpot_s: float | None = None  # mean time per output token after the first (None: under 2 tokens)
    operation: str | None = None  # GenAI operation of its route (chat, text_completion); None: unknown
    traceparent: str | None = None  # the caller's W3C trace context, if it sent one
    trace_id: str | None = None  # the trace its span belongs to (None: no tracing)
    # which prompt of its HTTP request (a completion request may carry several)
    prompt_index: int | None = None
    prompt_digest: str | None = None  # of its prompt (``pte_instrument.prompt_digest``); None: not taken

    @property
    def ran(self) -> bool:
        """False for a request the engine never scheduled (aborted while queued): it did no work."""
        return self.engine_totals is None or self.engine_totals.scheduled


@dataclass(frozen=True)
class RequestRecord:
    """One finished request priced in PTE; the request-log line (README documents each field)."""

    request_id: str
    session_id: str | None
    turn: int | None
    model: str
    engine: int
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    computed_prefill_tokens: int
    recomputed_tokens: int
    output_tokens: int
    num_preemptions: int
    gamma: float
    hoi: float
    device: str
    pte_reference: float
    pte_served: float
    pte_ideal: float
    pte_prefill: float
    pte_decode: float
    pte_recompute: float
    pte_eviction_tax: float
    queued_s: float
    prefill_s: float
    decode_s: float
    inference_s: float
    e2e_s: float
    pause_s: float | None
    finished_at: float
    benchmark: str = "none"
    tenant: str | None = None  # allow-listed tenant or "other" (None: tenants off)
    # The reuse its session's previous turn left that it prefilled again, when that turn was
    # served by another replica (the cache was on another GPU; ``pte_eviction_tax`` is then 0);
    # its GPU seconds: that share of its prefill seconds.
    pte_routing_tax: float = 0.0
    gpu_seconds_routing_tax: float | None = None
    replica: str | None = None  # the replica (PTE_INSTANCE) that served it
    # the LoRA adapter that served it, priced as its base ``model`` (None: the base)
    lora_name: str | None = None
    arrived_at: float | None = None  # unix time vLLM received it
    child_index: int | None = None  # parallel sampling (n > 1): which sample; request_id is <index>_<parent>
    # Work done and thrown away, beside served PTE (which it does not change): speculative
    # drafts rejected, the part of an aborted request's work the client never received, and
    # the engine's work past the end of what another request's client received (tokens after
    # a stop string the API server saw, drafts accepted past max_tokens).
    pte_wasted_rejected_drafts: float = 0.0
    pte_wasted_aborted: float = 0.0
    pte_wasted_past_end: float = 0.0
    # Exact engine-side accounting (None without the scheduler hook).
    engine_pte_served: float | None = None
    engine_pte_roofline: float | None = None
    engine_prefill_tokens: float | None = None
    engine_recompute_tokens: float | None = None
    engine_decode_tokens: float | None = None
    engine_spec_tokens: float | None = None
    engine_rejected_tokens: float | None = None
    engine_request_id: str | None = None  # the engine's own id: unique even when clients reuse theirs
    # Seconds (docs/cost-model.md §5b; None without the step hook): its share of the measured
    # step times, by term; the step-time model's cost of its own work alone; the durations of
    # the steps it was in plus its queue time; the part of those that was other requests' work.
    gpu_seconds: float | None = None
    gpu_seconds_prefill: float | None = None
    gpu_seconds_kv_read: float | None = None
    gpu_seconds_weights: float | None = None
    gpu_seconds_overhead: float | None = None
    predicted_seconds: float | None = None
    latency_explained_s: float | None = None
    interference_s: float | None = None
    cost_usd: float | None = None  # gpu_seconds × GPUs per engine × price (PTE_GPU_HOURLY_PRICE)
    ttft_s: float | None = None  # arrival → first token, as vLLM timed it
    tpot_s: float | None = None  # mean time per output token after the first
    operation: str | None = None  # GenAI operation of the route (chat, text_completion); None: unknown
    traceparent: str | None = None  # the caller's W3C trace context: its span is this one's parent
    trace_id: str | None = None  # 32 hex digits: the trace of this request's span (None: tracing off)
    # SHA-256 (or keyed HMAC) of its prompt's roles and text; None: not taken
    prompt_digest: str | None = None

    @property
    def pte_reference_prefill(self) -> float:
        """Reference PTE's prefill part: the whole prompt re-prefilled (for a request aborted
        before its first token, the part it got through; none for one the engine never ran);
        the rest of ``pte_reference`` is its decode part."""
        return min(self.prompt_tokens, self.pte_reference)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _stand_ins() -> dict[str, float | None]:
    """What stands in each field of a record for a number that is not finite: None where the
    field may be unknown, else 0."""
    hints = get_type_hints(RequestRecord)
    return {f.name: None if type(None) in get_args(hints[f.name]) else 0.0 for f in fields(RequestRecord)}


_STAND_INS = _stand_ins()


def with_finite_numbers(r: RequestRecord) -> tuple[RequestRecord, ValueError | None]:
    """``r`` with each number that is not finite (NaN, ±inf) replaced by its field's stand-in
    (``_STAND_INS``), and the fault that says so (None: all were finite). One NaN added to a
    Prometheus counter or histogram stays in it for good, and the session stores sum records
    (SQLite stores NaN as NULL, Redis refuses it as a float)."""
    bad = {
        name: stand_in
        for name, stand_in in _STAND_INS.items()
        if isinstance(value := getattr(r, name), float) and not math.isfinite(value)
    }
    if not bad:
        return r, None
    return replace(r, **bad), ValueError(
        f"priced request {r.request_id!r}: {', '.join(bad)} not a finite number; "
        "taken as unknown (0 where the field must have a number)"
    )


def child_request_id(external_id: str, child_index: int | None) -> str:
    """The log's id of a request: its own, or for a parallel-sampling child vLLM's
    ``<index>_<parent id>``, so that every child has a unique entry."""
    return external_id if child_index is None else f"{child_index}_{external_id}"


def reported_request_id(request_id: str, child_index: int | None) -> str:
    """The id vLLM reported the request finished under (``child_request_id`` undone): a
    parallel-sampling child's finish is reported under its parent's id, once per child."""
    return request_id if child_index is None else request_id.removeprefix(f"{child_index}_")


def price_request(
    model: CostModel, req: FinishedRequest, finished_at: float, usd_per_gpu_second: float | None = None
) -> RequestRecord:
    """``usd_per_gpu_second``: the price of one second of the engine (all its GPUs); None: no money."""
    tokens = charged_tokens(req)
    cost = price_turn(model, tokens)
    totals = req.engine_totals
    missed = cost.eviction_tax  # reusable prefix prefilled again: routing's doing if the turn moved
    moved = req.replica is not None and req.previous_replica not in (None, req.replica)
    pte_routing_tax = missed if moved else 0.0
    wasted_aborted = wasted_past_end = 0.0
    if totals is not None:  # the engine's work beyond the charge was never returned
        beyond = totals.pte_served - totals.pte_rejected - cost.served
        if req.finish_reason == "abort":  # its last step's
            wasted_aborted = max(0.0, beyond)
        elif beyond > PAST_END_ROUNDING * totals.pte_served:  # not the step sums' rounding
            wasted_past_end = beyond
    return RequestRecord(
        request_id=req.request_id,
        session_id=req.session_id,
        turn=req.turn,
        model=req.model,
        engine=req.engine,
        finish_reason=req.finish_reason,
        prompt_tokens=req.prompt_tokens,
        cached_tokens=req.cached_tokens,
        computed_prefill_tokens=tokens.computed_prefill_tokens,
        recomputed_tokens=req.recomputed_tokens,
        output_tokens=req.output_tokens,
        num_preemptions=req.num_preemptions,
        gamma=model.gamma,
        hoi=model.device.hoi,
        device=model.device.name,
        pte_reference=cost.reference,
        pte_served=cost.served,
        pte_ideal=cost.ideal,
        pte_prefill=cost.served_prefill,
        pte_decode=cost.served_decode,
        pte_recompute=cost.recompute,
        pte_eviction_tax=missed - pte_routing_tax,
        pte_routing_tax=pte_routing_tax,
        gpu_seconds_routing_tax=_share_of_prefill(totals, pte_routing_tax, cost.served_prefill),
        replica=req.replica,
        queued_s=req.queued_s,
        prefill_s=req.prefill_s,
        decode_s=req.decode_s,
        inference_s=req.inference_s,
        e2e_s=req.e2e_s,
        pause_s=req.pause_s,
        finished_at=finished_at,
        benchmark=req.benchmark,
        tenant=req.tenant,
        lora_name=req.lora_name,
        arrived_at=req.arrived_at or None,
        child_index=req.child_index,
        ttft_s=req.ttft_s,
        tpot_s=req.tpot_s,
        operation=req.operation,
        traceparent=req.traceparent,
        trace_id=req.trace_id,
        prompt_digest=req.prompt_digest,
        pte_wasted_rejected_drafts=totals.pte_rejected if totals is not None else 0.0,
        pte_wasted_aborted=wasted_aborted,
        pte_wasted_past_end=wasted_past_end,
        **_engine_fields(totals),
        **_seconds(totals, req.queued_s, usd_per_gpu_second),
    )


def charged_tokens(req: FinishedRequest) -> TurnTokens:
    """What a request is priced on (docs/cost-model.md §2): its own token counts, except for
    a request stopped before its prompt was through. One the engine never ran is priced on
    nothing; one aborted before its first token on the part of its prompt the engine got
    through (its cached prefix and the positions it prefilled once), so that it is charged
    the prefill that ran, not its whole prompt."""
    if not req.ran:
        return TurnTokens(0, 0)
    prompt, totals = req.prompt_tokens, req.engine_totals
    if totals is not None and req.finish_reason == "abort" and req.output_tokens == 0:
        prompt = min(prompt, totals.cached_tokens + round(totals.prefill - totals.recompute))
    return TurnTokens(
        prompt_tokens=prompt,
        output_tokens=req.output_tokens,
        cached_tokens=min(req.cached_tokens, prompt),
        recomputed_tokens=req.recomputed_tokens,
        reusable_tokens=req.reusable_tokens,
    )


def _share_of_prefill(totals: RequestTotals | None, pte: float, served_prefill: float) -> float | None:
    """The prefill seconds of ``pte`` of the request's ``served_prefill`` (None without the hook)."""
    if totals is None:
        return None
    return totals.gpu_prefill_s * pte / served_prefill if pte > 0 else 0.0


def _seconds(
    totals: RequestTotals | None, queued_s: float, usd_per_gpu_second: float | None
) -> dict[str, float | None]:
    if totals is None:
        return {}
    gpu = totals.gpu_prefill_s + totals.gpu_kv_s + totals.gpu_weights_s + totals.gpu_overhead_s
    explained = totals.engine_latency_s + queued_s
    return {
        "gpu_seconds": gpu,
        "gpu_seconds_prefill": totals.gpu_prefill_s,
        "gpu_seconds_kv_read": totals.gpu_kv_s,
        "gpu_seconds_weights": totals.gpu_weights_s,
        "gpu_seconds_overhead": totals.gpu_overhead_s,
        "predicted_seconds": totals.predicted_s,
        "latency_explained_s": explained,
        "interference_s": explained - gpu,  # queueing included: it waited for other requests
        "cost_usd": None if usd_per_gpu_second is None else gpu * usd_per_gpu_second,
    }


def _engine_fields(totals: RequestTotals | None) -> dict[str, float | None]:
    if totals is None:
        return {}
    return {
        "engine_pte_served": totals.pte_served,
        "engine_pte_roofline": totals.pte_roofline,
        "engine_prefill_tokens": totals.prefill,
        "engine_recompute_tokens": totals.recompute,
        "engine_decode_tokens": totals.decode_tokens,
        "engine_spec_tokens": totals.spec_tokens,
        "engine_rejected_tokens": totals.rejected_tokens,
        "engine_request_id": totals.request_id,
    }


# Per-model running sums for ``/pte/summary``: PTE and tokens over every request; seconds
# (docs/cost-model.md §5b: None without the step hook) and money (None also without
# PTE_GPU_HOURLY_PRICE) summed with None as 0, beside the count of requests that had them,
# so a total is never read as covering every request.
SUMMED_TOKENS_AND_PTE = (
    "prompt_tokens",
    "cached_tokens",
    "computed_prefill_tokens",
    "recomputed_tokens",
    "output_tokens",
    "pte_reference",
    "pte_served",
    "pte_ideal",
    "pte_prefill",
    "pte_decode",
    "pte_recompute",
    "pte_eviction_tax",
    "pte_routing_tax",
)
GPU_SECONDS_TERMS = (
    "gpu_seconds_prefill",
    "gpu_seconds_kv_read",
    "gpu_seconds_weights",
    "gpu_seconds_overhead",
)
TIMED = ("gpu_seconds", *GPU_SECONDS_TERMS, "predicted_seconds", "latency_explained_s", "interference_s")
PRICED = ("cost_usd",)
TIMED_COUNT, PRICED_COUNT = "requests_timed", "requests_priced"
ROUTING_SECONDS = "gpu_seconds_routing_tax"
MODEL_TOTALS = (
    "requests",
    *SUMMED_TOKENS_AND_PTE,
    TIMED_COUNT,
    *TIMED,
    ROUTING_SECONDS,
    PRICED_COUNT,
    *PRICED,
)


def model_totals_row(r: RequestRecord) -> tuple[float, ...]:
    """What one record adds to its model's totals, in the order of ``MODEL_TOTALS``."""
    return (
        1,
        *(getattr(r, k) for k in SUMMED_TOKENS_AND_PTE),
        int(r.gpu_seconds is not None),
        *(getattr(r, k) or 0.0 for k in TIMED),
        r.gpu_seconds_routing_tax or 0.0,
        int(r.cost_usd is not None),
        *(getattr(r, k) or 0.0 for k in PRICED),
    )
