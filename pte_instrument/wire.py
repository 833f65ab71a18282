"""Every message that crosses a process boundary, declared once: the engine hook's reports
to the API servers (over the transport) and the lines of the engine's step log (read by the
latency bench and ``pte calibrate``-style offline tools). Encoding and decoding live here;
only the transport touches the bytes on the socket.

msgspec Structs (msgspec ships with vLLM): a renamed field is a type error where the message
is built, and a malformed batch fails to decode as a whole, where it is counted.
"""

from __future__ import annotations

from typing import Union

import msgspec


class EngineHello(msgspec.Struct, tag="hello", frozen=True):
    """An engine's hook is active: its requests' totals will follow."""

    engine: int


class EngineFaults(msgspec.Struct, tag="faults", frozen=True):
    """The hook's faults since its previous report, by stage: to API server 0, so that they
    are counted once; the other API servers get it empty (there were faults)."""

    engine: int
    counts: dict[str, int]


class RequestTotals(msgspec.Struct, tag="totals", frozen=True):
    """One finished request as the engine accounted it, step by step (docs/cost-model.md §4).

    Token columns are floats because the accumulator keeps them in float64; ``ctx`` holds
    Σ context per KV-cache group. ``engine_*`` fields report the hook's state when sent."""

    request_id: str  # the engine's id
    external_id: str  # the id the API server knows (a parallel-sampling child: its parent's)
    engine: int
    finish_reason: str
    child_index: int | None = None  # parallel sampling (n > 1): which of the parent's samples
    api_server: int = 0  # vLLM's client index: the API server that submitted the request
    arrival_time: float = 0.0  # unix time the API server received the request (vLLM's)
    finished_at: float = 0.0  # unix time the engine freed it
    scheduled: bool = False  # whether the engine ever ran it (False: aborted while queued)
    prompt_tokens: int = 0
    output_tokens: int = 0
    num_preemptions: int = 0
    cached_tokens: int = 0  # prefix-cache hits at the first schedule
    prefill: float = 0.0
    recompute: float = 0.0
    decode_tokens: float = 0.0
    spec_tokens: float = 0.0
    rejected_tokens: float = 0.0
    ctx: tuple[float, ...] = ()
    pte_served: float = 0.0
    pte_recompute: float = 0.0
    pte_roofline: float = 0.0
    pte_rejected: float = 0.0  # PTE of speculative drafts computed and then rejected: wasted
    # Its share of the measured step times, by term (docs/cost-model.md §5b): Σ over all
    # requests = the engine's busy time; the durations of the steps it was in; and the
    # step-time model's cost of its own work alone.
    gpu_prefill_s: float = 0.0
    gpu_kv_s: float = 0.0
    gpu_weights_s: float = 0.0
    gpu_overhead_s: float = 0.0
    engine_latency_s: float = 0.0
    predicted_s: float = 0.0
    engine_live: int = 0  # requests the hook still tracks
    engine_steps: int = 0
    engine_hook_s: float = 0.0  # the hook's own time, all steps
    engine_busy_s: float = 0.0  # Σ measured step durations so far
    engine_attributed_s: float = 0.0  # Σ GPU seconds of the engine's totals sent so far, these included


class EngineCalibration(msgspec.Struct, tag="calibration", frozen=True):
    """The engine's step-time model now (docs/cost-model.md §5b): its coefficients, where
    they come from (theory, a saved fit, or the online fit) and how well they fit."""

    engine: int
    a: float  # s per prefill token
    b: float  # s per context token read
    w: float  # s of weight read per memory-bound step
    o: float  # s of fixed overhead per step
    source: str
    gamma_theory: float
    r2: float | None = None  # over the recent steps (None before the first fit)
    mape: float | None = None
    steps: int = 0  # steps the fit has seen
    speed: float = 1.0  # the host's speed: measured / modelled time of the recent steps


EngineMessage = Union[EngineHello, EngineFaults, RequestTotals, EngineCalibration]  # noqa: UP007 (msgspec needs a runtime Union on 3.10)

_batch_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(list[EngineMessage])


def encode_batch(messages: list[EngineMessage]) -> bytes:
    return _batch_encoder.encode(messages)


def decode_batch(data: bytes) -> list[EngineMessage]:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on a malformed batch."""
    return _batch_decoder.decode(data)


# --- the engine's step log (JSONL) -------------------------------------------------------


class StepLogHeader(msgspec.Struct, frozen=True):
    """First line of an engine's step log: the cost model the lines were priced with."""

    engine: int
    gammas: list[float]
    windows: list[int | None]
    n_active: float
    n_total: float
    hoi: float
    device: str
    weights_pte: float
    header: bool = True


class StepLogLine(msgspec.Struct):
    """One scheduler step. ``dt_s``: wall time from the end of scheduling to the model's
    outputs (None only while the step is running); ``hook_s``: the hook's own time;
    ``model_s``: the engine's step-time model's duration of it, at the host's speed of the
    steps before (what the step's requests were priced at, before its time was known)."""

    engine: int
    step: int
    t: float  # unix time when the step was scheduled
    n_reqs: int
    tokens: int
    prefill: int
    recompute: int
    decode_tokens: int
    spec_tokens: int
    ctx: list[float]  # Σ context read, per KV-cache group
    pte: float
    roofline_pte: float
    weights_pte: float
    hook_s: float
    dt_s: float | None = None
    model_s: float | None = None


STEP_LOG_FIELDS: tuple[str, ...] = StepLogLine.__struct_fields__


def _plain_number(value: object) -> object:
    """A numpy scalar (a clock, a reduction) as the Python number it is; msgspec refuses it."""
    item = getattr(value, "item", None)
    if callable(item):
        plain = item()
        if isinstance(plain, (int, float)):
            return plain
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


_json_encoder = msgspec.json.Encoder(enc_hook=_plain_number)
_line_decoder = msgspec.json.Decoder(StepLogLine)
_header_decoder = msgspec.json.Decoder(StepLogHeader)


def encode_step_log(entry: StepLogLine | StepLogHeader) -> str:
    return _json_encoder.encode(entry).decode() + "\n"


def decode_step_log(line: str | bytes) -> StepLogLine | StepLogHeader:
    """One step-log line; raises ``msgspec.ValidationError``/``DecodeError`` when malformed."""
    raw = line.encode() if isinstance(line, str) else line
    try:
        return _line_decoder.decode(raw)
    except msgspec.ValidationError:  # not a step: the header, or malformed
        return _header_decoder.decode(raw)
