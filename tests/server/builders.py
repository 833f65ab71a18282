"""Finished and priced requests as the server tests build them: one place for the fields a
test does not care about, so that each test names only those it checks."""

from __future__ import annotations

import dataclasses
from typing import Any

from pte_instrument.server.records import FinishedRequest, RequestRecord


def finished_request(
    rid: str, output: int, reason: str = "stop", arrived: float = 100.0, engine: int = 0
) -> FinishedRequest:
    """What vLLM reports of request ``rid`` of model "m": 10 prompt tokens, none cached,
    ``output`` output tokens, one second from ``arrived`` to its end."""
    return FinishedRequest(
        rid, "m", 10, 0, output, reason, arrived_at=arrived, finished_at=arrived + 1, e2e_s=1.0, engine=engine
    )


def request_record(fill: float = 1.0, **fields: Any) -> RequestRecord:
    """A priced request "r" of model "m" on engine 0, outside any session, that stopped after
    100 prompt tokens (10 of them cached) and 7 output tokens: 90 PTE of prefill and 3 of
    decode served, 120 the reference. The fields a record must have and these leave out are
    ``fill``; ``fields`` override any field."""
    required = {f.name: fill for f in dataclasses.fields(RequestRecord) if f.default is dataclasses.MISSING}
    served_by = dict(request_id="r", model="m", engine=0, device="h200")
    no_session = dict(session_id=None, turn=None, pause_s=None)
    tokens = dict(prompt_tokens=100, cached_tokens=10, output_tokens=7, finish_reason="stop")
    pte = dict(pte_prefill=90.0, pte_decode=3.0, pte_reference=120.0, pte_served=93.0)
    return RequestRecord(**{**required, **served_by, **no_session, **tokens, **pte, **fields})


def gpu_split(prefill: float, kv_read: float, weights: float, overhead: float) -> dict[str, float]:
    """A request's GPU seconds by term, and their sum, as record fields."""
    return dict(
        gpu_seconds=prefill + kv_read + weights + overhead,
        gpu_seconds_prefill=prefill,
        gpu_seconds_kv_read=kv_read,
        gpu_seconds_weights=weights,
        gpu_seconds_overhead=overhead,
    )
