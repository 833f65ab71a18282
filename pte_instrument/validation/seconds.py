"""Request seconds from the engine hook (docs/cost-model.md §5b) against the client-visible
times of the request log:

- the attribution check: ``gpu_seconds / inference_s`` per request — alone (concurrency 1) a
  request is the only one in its steps, so its GPU seconds are the measured durations of its
  steps, and the ratio says how much of its inference time those steps cover;
- latency explained coverage: ``latency_explained_s / (inference_s + queued_s)`` — under load,
  the steps a request was scheduled in plus its queue time, against its whole latency;
- isolation: each phase replays the same sessions (bench/latency/driver.py), so a request
  under load is matched to the same request (session index, turn) alone, and the Spearman ρ
  of its GPU seconds under load with its inference time alone says whether the attribution
  recovers the cost it would have had without the others.

Medians and shares carry percentile bootstrap intervals (seeded). Pure numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pte_instrument.offline.statistics import index_chunks, interval_bounds, pearson, report_number

from .analysis import RequestTable

GPU_TERMS = {
    "prefill": "gpu_seconds_prefill",
    "kv_read": "gpu_seconds_kv_read",
    "weights": "gpu_seconds_weights",
    "overhead": "gpu_seconds_overhead",
}
QUANTILES = (0.05, 0.10, 0.25, 0.50, 0.75, 0.90, 0.95)


def session_index(session_id: str | None) -> int | None:
    """The index of a session id ``<prefix>-s<index>`` (None for any other id)."""
    _, sep, name = str(session_id or "").rpartition("-s")
    return int(name) if sep and name.isdigit() else None


@dataclass(frozen=True)
class RatioSummary:
    """Per-request ratios: median with its interval, quantiles, and the share at or above a
    threshold with its interval."""

    name: str
    n: int
    median: float
    median_ci: tuple[float, float]
    quantiles: dict[str, float]
    threshold: float
    share_at_least: float
    share_ci: tuple[float, float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "n": self.n,
            "median": report_number(self.median),
            "median_ci": [report_number(v) for v in self.median_ci],
            "quantiles": {k: report_number(v) for k, v in self.quantiles.items()},
            "threshold": self.threshold,
            "share_at_least": report_number(self.share_at_least),
            "share_ci": [report_number(v) for v in self.share_ci],
        }


def ratios(num: Any, den: Any) -> np.ndarray:
    """num/den where both are finite and den > 0 (the other rows dropped)."""
    n, d = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    ok = np.isfinite(n) & np.isfinite(d) & (d > 0)
    return n[ok] / d[ok]


def ratio_summary(
    name: str, num: Any, den: Any, threshold: float, n_boot: int = 1000, seed: int = 0, level: float = 0.95
) -> RatioSummary:
    r = ratios(num, den)
    if r.size == 0:
        nan2 = (math.nan, math.nan)
        return RatioSummary(name, 0, math.nan, nan2, {}, threshold, math.nan, nan2)
    q = {f"p{round(100 * p):02d}": float(np.quantile(r, p)) for p in QUANTILES}
    at_least = (r >= threshold).astype(np.float64)
    med_ci = share_ci = (math.nan, math.nan)
    if r.size >= 2 and n_boot > 0:
        meds, shares = [], []
        for idx in index_chunks(r.size, n_boot, np.random.default_rng(seed), 4_000_000):
            meds.append(np.median(r[idx], axis=1))
            shares.append(at_least[idx].mean(axis=1))
        med_ci = interval_bounds(np.concatenate(meds), level)
        share_ci = interval_bounds(np.concatenate(shares), level)
    return RatioSummary(
        name, int(r.size), float(np.median(r)), med_ci, q, threshold, float(at_least.mean()), share_ci
    )


ATTRIBUTION = "gpu_seconds / inference_s"
COVERAGE = "latency_explained_s / (inference_s + queued_s)"


def attribution(t: RequestTable, threshold: float, n_boot: int = 1000, seed: int = 0) -> RatioSummary:
    return ratio_summary(ATTRIBUTION, t["gpu_seconds"], t["inference_s"], threshold, n_boot, seed)


def coverage(t: RequestTable, threshold: float, n_boot: int = 1000, seed: int = 0) -> RatioSummary:
    queued = np.nan_to_num(t["queued_s"], nan=0.0)
    return ratio_summary(
        COVERAGE, t["latency_explained_s"], t["inference_s"] + queued, threshold, n_boot, seed
    )


# =========================================================================== matching


def match_requests(load: RequestTable, alone: RequestTable) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs (under load, alone) of the same request: same session index and turn. A
    key seen twice on one side (a session id outside the driver's scheme) is left out."""

    def keys(t: RequestTable) -> dict[tuple[int, int], int]:
        seen: dict[tuple[int, int], int] = {}
        dup: set[tuple[int, int]] = set()
        for i, (sid, turn) in enumerate(zip(t.session_id, t.turn.tolist(), strict=True)):
            s = session_index(sid)
            if s is None or turn < 1:
                continue
            k = (s, int(turn))
            if k in seen:
                dup.add(k)
            seen[k] = i
        return {k: v for k, v in seen.items() if k not in dup}

    kl, ka = keys(load), keys(alone)
    common = sorted(set(kl) & set(ka))
    return (
        np.array([kl[k] for k in common], dtype=np.intp),
        np.array([ka[k] for k in common], dtype=np.intp),
    )


def matched_columns(
    load: RequestTable, alone: RequestTable, il: np.ndarray, ia: np.ndarray
) -> dict[str, Any]:
    """Per-term facts of the matched pairs, for the diagnosis: each GPU-seconds term's share
    of the total under load, and r of the term under load with the same term alone."""
    out: dict[str, Any] = {"n": int(il.size)}
    if il.size == 0:
        return out
    total = np.nansum(load["gpu_seconds"][il])
    for term, col in GPU_TERMS.items():
        x, y = load[col][il], alone[col][ia]
        out[term] = {
            "share_under_load": report_number(float(np.nansum(x)) / total if total > 0 else math.nan),
            "share_alone": report_number(float(np.nansum(y)) / float(np.nansum(alone["gpu_seconds"][ia])))
            if np.nansum(alone["gpu_seconds"][ia]) > 0
            else None,
            "pearson_load_vs_alone": report_number(pearson(x, y)),
        }
    ratio = ratios(load["gpu_seconds"][il], alone["gpu_seconds"][ia])
    out["gpu_seconds_load_over_alone_median"] = report_number(float(np.median(ratio))) if ratio.size else None
    return out


def same_work(load: RequestTable, alone: RequestTable, il: np.ndarray, ia: np.ndarray) -> dict[str, Any]:
    """Whether the matched requests did the same work: shares of pairs with equal prompt and
    output tokens, and of equal computed prefill (the prefix cache may differ under load)."""
    if il.size == 0:
        return {}

    def share(col: str) -> float | None:
        a, b = load[col][il], alone[col][ia]
        return report_number(float(np.mean(a == b)))

    return {
        "prompt_tokens_equal": share("prompt_tokens"),
        "output_tokens_equal": share("output_tokens"),
        "computed_prefill_equal": share("computed_prefill_tokens"),
    }


def gaps_between_steps(t: np.ndarray, dt: np.ndarray, max_gap_s: float = 1.0) -> dict[str, Any]:
    """Time between consecutive steps that no step's ``dt_s`` covers: t[i+1] − (t[i] + dt[i])
    (the engine's scheduling and bookkeeping, and anything else on the loop); gaps over
    ``max_gap_s`` are idle time (no request running) and are left out."""
    order = np.argsort(t, kind="stable")
    ts, ds = t[order], dt[order]
    g = ts[1:] - (ts[:-1] + ds[:-1])
    g = g[np.isfinite(g) & (g < max_gap_s)]
    if g.size == 0:
        return {"n": 0}
    busy = np.clip(g, 0, None)
    return {
        "n": int(g.size),
        "median_s": report_number(float(np.median(busy))),
        "mean_s": report_number(float(busy.mean())),
        "p90_s": report_number(float(np.quantile(busy, 0.9))),
        "share_of_step_time": report_number(float(busy.sum() / (busy.sum() + np.nansum(ds)))),
    }


def drift(predicted: Any, measured: Any, when: Any) -> float:
    """r between consecutive requests' predicted/measured ratios in time order: near 0 when
    each request's error is its own, high when the error drifts (a host slowing down)."""
    p, m, w = (np.asarray(v, dtype=np.float64) for v in (predicted, measured, when))
    ok = np.isfinite(p) & np.isfinite(m) & (m > 0) & np.isfinite(w)
    ratio = (p[ok] / m[ok])[np.argsort(w[ok], kind="stable")]
    return pearson(ratio[:-1], ratio[1:]) if ratio.size > 3 else math.nan


def residual_terms(t: RequestTable, err: np.ndarray) -> dict[str, float]:
    """Least squares of a per-request error on the request's work (prefill tokens, Σ context,
    decode steps): each term's share of Σ|fitted error|, i.e. which term the error follows."""
    cols = {"prefill": t["pte_prefill"], "ctx": t.ctx_sum, "steps": t["output_tokens"]}
    X = np.column_stack([*cols.values(), np.ones(len(t))])
    ok = np.isfinite(X).all(axis=1) & np.isfinite(err)
    if ok.sum() <= X.shape[1]:
        return {}
    Xo = X[ok]
    scale = np.sqrt((Xo * Xo).mean(axis=0))
    scale[scale == 0] = 1.0
    coef, *_ = np.linalg.lstsq(Xo / scale, err[ok], rcond=None)
    contrib = np.abs((Xo / scale) * coef).sum(axis=0)[:3]
    tot = float(contrib.sum())
    return {k: (float(v) / tot if tot > 0 else math.nan) for k, v in zip(cols, contrib, strict=True)}


def alone_step_sums(t: RequestTable, step_t: Any, step_values: Any) -> np.ndarray:
    """Σ of a per-step value over the steps scheduled while each request was in the engine
    ([arrived_at, arrived_at + e2e_s]). Only alone (concurrency 1) does that window hold the
    request's own steps and no other's; NaN for a request without its arrival time."""
    st = np.asarray(step_t, dtype=np.float64)
    order = np.argsort(st, kind="stable")
    st = st[order]
    csum = np.concatenate([[0.0], np.cumsum(np.asarray(step_values, dtype=np.float64)[order])])
    start = t["arrived_at"]
    end = start + t["e2e_s"]
    out = np.full(len(t), np.nan)
    ok = np.isfinite(start) & np.isfinite(end)
    lo = np.searchsorted(st, start[ok], side="left")
    hi = np.searchsorted(st, end[ok], side="right")
    out[ok] = csum[hi] - csum[lo]
    return out


def names_present(t: RequestTable, names: Sequence[str]) -> bool:
    return all(t.has(n) for n in names)
