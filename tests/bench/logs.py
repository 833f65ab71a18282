"""Lines of the two logs the latency bench analyses, the request log and the step log, as the
tests write them: each test names only what it varies."""

from __future__ import annotations

from typing import Any

import numpy as np


def request_line(cached: int = 0, decode_pte: float = 10.0, **fields: Any) -> dict[str, Any]:
    """A request-log line: the first turn of session c1-s000, 100 prompt tokens (``cached`` of
    them from the prefix cache, the rest prefilled) and 10 output tokens at γ 0.01, served as
    priced (its prefill plus ``decode_pte``) in 1 s; ``fields`` then override any field."""
    prefill = 100 - cached
    line = {
        "request_id": "r",
        "session_id": "c1-s000",
        "turn": 1,
        "finish_reason": "length",
        "prompt_tokens": 100,
        "cached_tokens": cached,
        "computed_prefill_tokens": prefill,
        "recomputed_tokens": 0,
        "output_tokens": 10,
        "gamma": 0.01,
        "hoi": 3.0,
        "device": "h100-sxm@hoi=3",
        "pte_reference": 110.0,
        "pte_served": prefill + decode_pte,
        "pte_ideal": prefill + decode_pte,
        "pte_prefill": float(prefill),
        "pte_decode": decode_pte,
        "queued_s": 0.0,
        "prefill_s": 0.1,
        "decode_s": 0.9,
        "inference_s": 1.0,
        "e2e_s": 1.0,
        "finished_at": 1.0,
    }
    return {**line, **fields}


def step_lines(
    prefill: np.ndarray,
    decode: np.ndarray,
    ctx: np.ndarray,
    dt_s: np.ndarray,
    n_reqs: np.ndarray,
    weights_pte: float,
    gamma: float,
) -> list[dict[str, Any]]:
    """Engine 0's step log, a step a second from t = 1000: per step the prompt tokens it
    prefilled, the samples it decoded, the context they read, its requests and its measured
    duration; its PTE and roofline as the engine logs them at ``gamma``."""
    lines = []
    for i in range(len(dt_s)):
        p, d, c = int(prefill[i]), int(decode[i]), float(ctx[i])
        kv = gamma * c
        tokens = p + d
        lines.append(
            {
                "engine": 0,
                "step": i,
                "t": 1000.0 + i,
                "n_reqs": int(n_reqs[i]),
                "tokens": tokens,
                "prefill": p,
                "recompute": 0,
                "decode_tokens": d,
                "spec_tokens": 0,
                "ctx": [c],
                "pte": p + kv,
                "roofline_pte": max(float(tokens), weights_pte + kv),
                "weights_pte": weights_pte,
                "hook_s": 1e-6,
                "dt_s": float(dt_s[i]),
            }
        )
    return lines
