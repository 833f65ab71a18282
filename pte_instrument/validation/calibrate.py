"""γ calibrated from measured time (docs/cost-model.md §3, last paragraph).

Least squares of measured step time on the work the cost model counts:

    t ≈ a·prefill + b·ctx + c            (c: the per-step constant — weight read, scheduling)
    t ≈ a·prefill + b·ctx + c + d·decode (d: each decoded token's own matmuls)

γ_measured = b/a: the time of reading one context token during decode, in units of the time
of prefilling one token — exactly what γ_theory = KV_bytes·HOI/(2·N_active) predicts from
datasheets. c/a is the per-step constant in prefill-token units; the roofline of
docs/cost-model.md §5 predicts it as the weight read, W_bytes·HOI/(2·N_active).

Pure numpy (``measure_host_profile`` imports torch when called). Bootstrap intervals come from
refitting on resamples of the rows (count matrices and percentile intervals of
:mod:`pte_instrument.offline.statistics`), all resamples at once through batched normal equations.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pte_instrument.cost.devices import DeviceProfile
from pte_instrument.cost.step_time import r_squared
from pte_instrument.offline.statistics import count_chunks, interval_bounds, percentile_interval


@dataclass(frozen=True)
class LinearFit:
    terms: tuple[str, ...]
    coef: np.ndarray  # (k,)
    boot: np.ndarray  # (B, k) bootstrap refits; empty when not bootstrapped
    r2: float
    rmse: float
    n: int

    def ci(self, level: float = 0.95) -> np.ndarray:
        """(k, 2) percentile interval of each coefficient over the bootstrap refits."""
        if self.boot.size == 0:
            return np.full((len(self.terms), 2), np.nan)
        return np.stack(percentile_interval(self.boot, level), axis=1)


def fit_linear(
    features: Mapping[str, Any], y: Any, n_boot: int = 500, seed: int = 0, max_elems: int = 4_000_000
) -> LinearFit:
    """Ordinary least squares of y on the named feature columns (give a ``const`` column of
    ones for an intercept). Columns are scaled to unit RMS before solving: prefill tokens,
    context sums and a constant differ by six orders of magnitude."""
    terms = tuple(features)
    A = np.column_stack([np.asarray(features[k], dtype=np.float64) for k in terms])
    y = np.asarray(y, dtype=np.float64)
    ok = np.isfinite(A).all(axis=1) & np.isfinite(y)
    A, y = A[ok], y[ok]
    n, k = A.shape
    if n <= k:
        nan = np.full(k, np.nan)
        return LinearFit(terms, nan, np.empty((0, k)), math.nan, math.nan, n)
    scale = np.sqrt((A * A).mean(axis=0))
    scale[scale == 0] = 1.0
    As = A / scale
    coef_s, *_ = np.linalg.lstsq(As, y, rcond=None)
    pred = As @ coef_s
    ss_res = float(((y - pred) ** 2).sum())
    r2 = r_squared(y, pred)
    boots = []
    # Resample counts w (b, n): the weighted normal equations refit every resample at once.
    for w in count_chunks(n, n_boot, np.random.default_rng(seed), max_elems):
        G = np.einsum("bn,ni,nj->bij", w, As, As)
        h = np.einsum("bn,ni,n->bi", w, As, y)
        G += 1e-12 * np.eye(k)  # a resample without any prefill step would be singular
        boots.append(np.linalg.solve(G, h[..., None])[..., 0] / scale)
    boot = np.concatenate(boots) if boots else np.empty((0, k))
    return LinearFit(terms, coef_s / scale, boot, r2, math.sqrt(ss_res / n), n)


TERM_LABELS = {
    "prefill": "a·prefill tokens",
    "ctx": "b·Σ decode context",
    "const": "c per step",
    "decode_tokens": "d·decode tokens",
    "decode_steps": "c·decode steps",
    "request_const": "e per request",
}


@dataclass(frozen=True)
class Calibration:
    """A fitted time model and the γ it implies, beside the theory."""

    level: str  # "step" or "request"
    terms: tuple[str, ...]
    coef: dict[str, float]  # seconds per unit of each feature
    coef_ci: dict[str, tuple[float, float]]
    r2: float
    rmse_s: float
    n: int
    gamma_measured: float  # b/a
    gamma_ci: tuple[float, float]
    gamma_theory: float | None
    const_pte: float  # per-step constant in prefill-token units (c/a)
    const_pte_theory: float | None  # the weight read W·HOI/(2·N_active) (docs/cost-model.md §5)
    shares: dict[str, float]  # each term's share of the total predicted time
    mean_time_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def gamma_ratio(self) -> float:
        """γ_measured / γ_theory."""
        if not self.gamma_theory:
            return math.nan
        return self.gamma_measured / self.gamma_theory

    def predict(self, features: Mapping[str, Any]) -> np.ndarray:
        out = 0.0
        for k in self.terms:
            out = out + self.coef[k] * np.asarray(features[k], dtype=np.float64)
        return np.asarray(out, dtype=np.float64)

    def predict_steps(self, s: Any) -> np.ndarray:
        return self.predict(step_features(s, "decode_tokens" in self.terms))

    def predict_requests(self, t: Any) -> np.ndarray:
        return self.predict(request_features(t))

    def formula(self) -> str:
        return "t ≈ " + " + ".join(
            f"{self.coef[k]:.3g}·{k}" if k not in ("const", "request_const") else f"{self.coef[k]:.3g}"
            for k in self.terms
        )

    def dominant(self) -> tuple[str, float]:
        k = max(self.shares, key=lambda t: self.shares[t])
        return k, self.shares[k]

    def to_dict(self) -> dict[str, Any]:
        f = _num
        return {
            "level": self.level,
            "terms": list(self.terms),
            "formula": self.formula(),
            "coef_s": {k: f(v) for k, v in self.coef.items()},
            "coef_ci_s": {k: [f(a), f(b)] for k, (a, b) in self.coef_ci.items()},
            "r2": f(self.r2),
            "rmse_s": f(self.rmse_s),
            "n": self.n,
            "mean_time_s": f(self.mean_time_s),
            "gamma_measured": f(self.gamma_measured),
            "gamma_ci": [f(v) for v in self.gamma_ci],
            "gamma_theory": f(self.gamma_theory) if self.gamma_theory else None,
            "gamma_measured_over_theory": f(self.gamma_ratio),
            "const_pte": f(self.const_pte),
            "const_pte_theory": f(self.const_pte_theory) if self.const_pte_theory else None,
            "time_shares": {k: f(v) for k, v in self.shares.items()},
            "notes": self.notes,
        }


def _num(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(f"{v:.6g}")


def step_features(s: Any, with_decode: bool = False) -> dict[str, np.ndarray]:
    """Features of a StepTable (analysis.StepTable): prefill, γ-weighted context, constant."""
    f = {"prefill": s["prefill"], "ctx": s.ctx_w, "const": np.ones(len(s))}
    if with_decode:
        f["decode_tokens"] = s["decode_tokens"]
    return f


def request_features(t: Any) -> dict[str, np.ndarray]:
    """Features of a RequestTable at concurrency 1: each decode step after the first token
    pays the per-step constant alone, so (D−1) decode steps stand in for it."""
    return {
        "prefill": t["pte_prefill"],
        "ctx": t.ctx_sum,
        "decode_steps": np.maximum(t["output_tokens"] - 1, 0),
        "request_const": np.ones(len(t)),
    }


def calibrate(
    level: str,
    features: Mapping[str, Any],
    time: Any,
    gamma_theory: float | None = None,
    const_term: str = "const",
    const_pte_theory: float | None = None,
    n_boot: int = 500,
    seed: int = 0,
    level_ci: float = 0.95,
) -> Calibration:
    """Fit and derive γ_measured = b/a (with its bootstrap interval: the ratio is taken per
    resample, so the interval is honest about a and b being estimated together)."""
    fit = fit_linear(features, time, n_boot, seed)
    coef = dict(zip(fit.terms, fit.coef.tolist(), strict=True))
    ci = fit.ci(level_ci)
    coef_ci = {k: (float(ci[i, 0]), float(ci[i, 1])) for i, k in enumerate(fit.terms)}
    a, b = coef.get("prefill", math.nan), coef.get("ctx", math.nan)
    notes = []
    gamma = b / a if a > 0 else math.nan
    if not a > 0:
        notes.append("the prefill coefficient is not positive: no prefill variation to fit (γ undefined)")
    if b < 0:
        notes.append("the context coefficient is negative: decode context did not measurably cost time here")
    g_ci = (math.nan, math.nan)
    if fit.boot.size:
        ia, ib = fit.terms.index("prefill"), fit.terms.index("ctx")
        with np.errstate(invalid="ignore", divide="ignore"):
            g = np.where(fit.boot[:, ia] > 0, fit.boot[:, ib] / fit.boot[:, ia], np.nan)
        g_ci = interval_bounds(g, level_ci)
    # Shares of total predicted time: which term the measured time is made of.
    totals = {}
    for k in fit.terms:
        x = np.asarray(features[k], dtype=np.float64)
        totals[k] = coef[k] * float(np.nansum(x))
    pos_total = sum(max(v, 0.0) for v in totals.values())
    shares = {k: (max(v, 0.0) / pos_total if pos_total > 0 else math.nan) for k, v in totals.items()}
    c = coef.get(const_term, math.nan)
    y = np.asarray(time, dtype=np.float64)
    return Calibration(
        level=level,
        terms=fit.terms,
        coef=coef,
        coef_ci=coef_ci,
        r2=fit.r2,
        rmse_s=fit.rmse,
        n=fit.n,
        gamma_measured=gamma,
        gamma_ci=g_ci,
        gamma_theory=gamma_theory,
        const_pte=c / a if a > 0 else math.nan,
        const_pte_theory=const_pte_theory,
        shares=shares,
        mean_time_s=float(np.nanmean(y)) if y.size else math.nan,
        notes=notes,
    )


def calibrate_steps(s: Any, with_decode: bool = False, n_boot: int = 500, seed: int = 0) -> Calibration:
    """γ from a StepTable: t ≈ a·prefill + b·ctx + c (+ d·decode)."""
    header = s.header or {}
    return calibrate(
        "step",
        step_features(s, with_decode),
        s["dt_s"],
        gamma_theory=s.gamma,
        const_pte_theory=header.get("weights_pte"),
        n_boot=n_boot,
        seed=seed,
    )


def calibrate_requests(t: Any, n_boot: int = 500, seed: int = 0) -> Calibration:
    """γ from requests served alone (concurrency 1): inference time ≈ a·prefill + b·Σctx
    + c·(D−1) + e. A cross-check when no step log exists."""
    g = t["gamma"]
    gamma_theory = float(np.nanmedian(g)) if np.isfinite(g).any() else None
    return calibrate(
        "request",
        request_features(t),
        t["inference_s"],
        gamma_theory=gamma_theory,
        const_term="decode_steps",
        n_boot=n_boot,
        seed=seed,
    )


def measure_host_profile(
    dtype: str = "float32", threads: int = 1, size: int = 1024, copy_mib: int = 64, repeats: int = 5
) -> DeviceProfile:
    """HOI of this host as the engine uses it: a matmul in the served dtype on the engine's
    thread count, and a large copy. (core.devices.measure_profile times bf16, which CPUs
    without native bf16 run ~100× slower than the fp32 they are served in.)"""
    import torch

    dtype_t = getattr(torch, dtype)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if dtype_t == torch.bfloat16:
            size = min(size, 512)
        a = torch.randn(size, size, dtype=dtype_t)
        b = torch.randn(size, size, dtype=dtype_t)
        src = torch.empty(copy_mib << 20, dtype=torch.uint8)
        dst = torch.empty_like(src)

        def best(fn: Any) -> float:
            fn()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return min(times)

        t_mm = best(lambda: torch.mm(a, b))
        t_cp = best(lambda: dst.copy_(src))
    finally:
        torch.set_num_threads(prev)
    return DeviceProfile(
        name=f"measured:host-{dtype}-{threads}t",
        peak_flops=2.0 * size**3 / t_mm,
        mem_bandwidth=2.0 * (copy_mib << 20) / t_cp,
        source=f"measured {time.strftime('%Y-%m-%d')}: {dtype} {size}^3 matmul and {copy_mib} MiB copy, {threads} thread(s)",
        measured=True,
    )


def gamma_at_hoi(gamma: float, hoi_from: float, hoi_to: float) -> float:
    """γ scales linearly with the hardware operational intensity."""
    return gamma * hoi_to / hoi_from


def explain_shares(cal: Calibration, names: Sequence[str] | None = None) -> str:
    """One sentence: what the fitted time is made of, largest term first."""
    items = sorted(cal.shares.items(), key=lambda kv: -(kv[1] if math.isfinite(kv[1]) else -1))
    parts = [f"{TERM_LABELS.get(k, k)} {v:.0%}" for k, v in items if math.isfinite(v)]
    return f"fitted {cal.level} time = " + ", ".join(parts) + f" (R² {cal.r2:.3f})"
