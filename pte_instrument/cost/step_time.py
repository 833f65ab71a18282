"""The four-term step-time model (docs/cost-model.md §5b): seconds of one engine step from the
work the cost model counts,

    t_step ≈ a·prefill_tokens + b·ctx + w·memory_bound + o

- prefill_tokens: tokens computed at prefill positions in the step (recompute included);
- ctx: context read by the step's decode positions, γ-weighted over KV groups,
  Σ_g (γ_g/γ)·ctx_g with γ = Σ_g γ_g, so that b/a is γ_measured, comparable to γ_theory;
- memory_bound: 1 when the roofline classes the step memory-bound (tokens T < weights_pte +
  Σ_g γ_g·ctx_g, the classification of the engine's roofline attribution, §5), else 0. The
  weight read shows in step time only when compute does not hide it, and since compute-bound
  steps pay o without w, the two are told apart by regression;
- o: the engine's fixed work per step.

:func:`theory` gives each term from architecture × device (the achieved fractions and the
overhead of :class:`~pte_instrument.cost.devices.DeviceProfile`); :func:`fit` calibrates them
from measured steps (non-negative, Huber-robust, on relative errors); :class:`OnlineStepFit`
keeps a windowed fit up to date inside the engine, and :class:`HostSpeed` the host's speed
against it over the last few steps. Pure numpy, nothing of vLLM or the server:
it runs in the engine process, so it stays cheap.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np

from pte_instrument.cost.model import CostModel

FORMAT = "pte-step-time"
FORMAT_VERSION = 1
TERMS = ("a", "b", "w", "o")
FEATURES = ("prefill_tokens", "ctx", "memory_bound", "const")  # the column each term multiplies
UNITS = {"a": "s/prefill token", "b": "s/context token", "w": "s/memory-bound step", "o": "s/step"}
# A percentile interval needs this many finite resamples (the rule of the offline statistics).
MIN_RESAMPLES = 10
HUBER_K = 1.345  # 95% efficiency at normal errors
_MAD_TO_SIGMA = 1.4826


# =========================================================================== the model


@dataclass(frozen=True)
class StepTimeModel:
    """Coefficients of the four terms, in seconds per unit of each feature."""

    a: float  # s per prefill token
    b: float  # s per γ-weighted context token read at decode
    w: float  # s: the weight read, paid by memory-bound steps
    o: float  # s: the engine's fixed work per step
    source: str = ""  # what produced it: theory (device, fractions) or a fit

    def predict(self, prefill: Any, ctx: Any, memory_bound: Any) -> Any:
        """Predicted step seconds; numpy arrays or floats (a float in, a float out)."""
        t = (
            self.a * np.asarray(prefill, dtype=np.float64)
            + self.b * np.asarray(ctx, dtype=np.float64)
            + self.w * np.asarray(memory_bound, dtype=np.float64)
            + self.o
        )
        return float(t) if np.ndim(t) == 0 else t

    @property
    def gamma_measured(self) -> float:
        """b/a: one context token read at decode, in prefill tokens (NaN without an a)."""
        return self.b / self.a if self.a > 0 else math.nan

    @property
    def weights_pte(self) -> float:
        """w/a: the weight read in prefill-token units (theory: W·HOI/(2·N_active) at equal fractions)."""
        return self.w / self.a if self.a > 0 else math.nan

    def coefficients(self) -> np.ndarray:
        return np.array([self.a, self.b, self.w, self.o], dtype=np.float64)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            **{t: getattr(self, t) for t in TERMS},
            "units": dict(UNITS),
            "source": self.source,
            "gamma_measured": finite_or_none(self.gamma_measured),  # informative; not read back
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepTimeModel:
        """The inverse of :meth:`to_dict`; ValueError naming what is wrong."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a step-time model must be a JSON object, got {type(d).__name__}")
        if d.get("format") != FORMAT:
            raise ValueError(f"not a step-time model: format {d.get('format')!r}, expected {FORMAT!r}")
        if d.get("version") != FORMAT_VERSION:
            raise ValueError(f"step-time model version {d.get('version')!r} is not {FORMAT_VERSION}")
        values = []
        for t in TERMS:
            v = d.get(t)
            if isinstance(v, int) and not isinstance(v, bool):  # JSON reads 1000…0 as an int
                v = float(v) if abs(v) < 2**1023 else math.inf  # float() would raise past its range
            if not isinstance(v, float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"step-time model term {t!r} must be a finite number ≥ 0, got {v!r}")
            values.append(float(v))
        source = d.get("source", "")
        return cls(*values, source=source if isinstance(source, str) else "")

    def save(self, path: str | Path) -> None:
        """Write the model to ``path`` whole or not at all: a temporary file beside it, renamed
        over it once written, so that a failed write (a full disk) leaves the file that was
        there, which the server may read (PTE_CALIBRATION), as it was."""
        p = Path(path)
        data = (json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n").encode("utf-8")
        tmp = p.with_name(f".{p.name}.{secrets.token_hex(4)}.tmp")
        # O_EXCL: never another file's; mode 0o666 less the umask, as a plain open would give
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, p)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path) -> StepTimeModel:
        """A model saved by :meth:`save`; ValueError (one line, naming the file) on a bad file."""
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8"), parse_constant=_reject_constant)
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(
                f"cannot read step-time model {p}: {getattr(e, 'strerror', None) or e}"
            ) from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{p} is not valid JSON: {e}") from None
        except RecursionError:  # the json module recurses once per nesting level
            raise ValueError(f"{p} is not valid JSON: nested too deeply") from None
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from None


def _reject_constant(literal: str) -> float:
    raise json.JSONDecodeError(f"{literal} is not a finite number", literal, 0)


def finite_or_none(v: float) -> float | None:
    return v if math.isfinite(v) else None


def theory(cost_model: CostModel, weight_bytes: float) -> StepTimeModel:
    """Each term from architecture × device, at the profile's achieved fractions:

    - a = 2·N_active / (peak FLOP/s · flops_fraction);
    - b = KV bytes per context token / (bandwidth · bandwidth_fraction): with KV_g ∝ γ_g, b times
      the γ-weighted ctx is exactly Σ_g KV_g·ctx_g / bandwidth;
    - w = n_total · weight_bytes / (bandwidth · bandwidth_fraction);
    - o = the profile's fixed per-step overhead.

    b/a is then γ · flops_fraction / bandwidth_fraction: the datasheet γ when both fractions agree.
    """
    shape, dev = cost_model.shape, cost_model.device
    flops = dev.peak_flops * dev.flops_fraction
    bandwidth = dev.mem_bandwidth * dev.bandwidth_fraction
    return StepTimeModel(
        a=2.0 * shape.n_active / flops,
        b=shape.kv_bytes_per_token / bandwidth,
        w=shape.n_total * weight_bytes / bandwidth,
        o=dev.step_overhead_s,
        source=(
            f"theory: {dev.name}, {dev.flops_fraction:g} of peak FLOP/s, {dev.bandwidth_fraction:g} of "
            f"bandwidth, {dev.step_overhead_s * 1e3:g} ms per step ({dev.achieved_source})"
        ),
    )


# =========================================================================== features


def weighted_ctx(ctx_groups: Any, gammas: Any) -> np.ndarray:
    """Σ_g (γ_g/γ)·ctx_g per step from (steps, groups) context sums: one γ then prices it."""
    c = np.atleast_2d(np.asarray(ctx_groups, dtype=np.float64))
    g = np.asarray(gammas, dtype=np.float64).ravel()
    if c.shape[1] != g.size:
        raise ValueError(f"{c.shape[1]} context groups but {g.size} gammas")
    total = g.sum()
    if not total > 0:
        return c.sum(axis=1)
    return c @ (g / total)


def memory_bound(tokens: Any, kv_pte: Any, weights_pte: float) -> np.ndarray:
    """1.0 where the roofline classes a step memory-bound: T < weights_pte + Σ_g γ_g·ctx_g
    (the engine's roofline attribution, docs/cost-model.md §5), else 0.0."""
    t = np.asarray(tokens, dtype=np.float64)
    return (t < weights_pte + np.asarray(kv_pte, dtype=np.float64)).astype(np.float64)


# =========================================================================== the fit


@dataclass(frozen=True)
class FitResult:
    """A calibrated model and how well it explains the steps it was fitted on."""

    model: StepTimeModel
    r2: float  # of step seconds, over the fitted steps
    mape: float  # mean |predicted − measured| / measured over the fitted steps (outliers included)
    median_ape: float  # its median: what a typical step sees
    n: int  # steps fitted
    from_prior: tuple[str, ...]  # terms the data could not identify, taken from the prior
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict(),
            "r2": finite_or_none(self.r2),
            "mape": finite_or_none(self.mape),
            "median_ape": finite_or_none(self.median_ape),
            "n": self.n,
            "from_prior": list(self.from_prior),
            "notes": list(self.notes),
        }


def _usable_steps(prefill: Any, ctx: Any, mb: Any, dt: Any) -> tuple[np.ndarray, np.ndarray]:
    """(n, 4) design (the const column included) and y of the usable steps (finite, dt > 0)."""
    cols = [np.asarray(v, dtype=np.float64).ravel() for v in (prefill, ctx, mb, dt)]
    n = cols[3].size
    if any(c.size != n for c in cols):
        raise ValueError(f"feature lengths differ: {[c.size for c in cols]}")
    X = np.column_stack([*cols[:3], np.ones(n)])
    y = cols[3]
    ok = np.isfinite(X).all(axis=1) & np.isfinite(y) & (y > 0)
    return X[ok], y[ok]


def score(model: StepTimeModel, prefill: Any, ctx: Any, mb: Any, dt: Any) -> tuple[float, float, float]:
    """(R², MAPE, median APE) of ``model`` on the usable steps (finite, dt > 0)."""
    X, y = _usable_steps(prefill, ctx, mb, dt)
    return score_predictions(X @ model.coefficients(), y)


def r_squared(y: np.ndarray, pred: np.ndarray) -> float:
    """R² of ``pred`` against ``y``; NaN where ``y`` has no variance to explain (values that
    are all the same leave only the rounding of their mean, about 1e-16 of their square)."""
    ss_tot = float(((y - y.mean()) ** 2).sum())
    if not ss_tot > 1e-12 * float((y * y).sum()):
        return math.nan
    return 1.0 - float(((y - pred) ** 2).sum()) / ss_tot


def score_predictions(pred: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """(R², MAPE, median APE) of predicted step times against measured ones (dt > 0)."""
    if y.size == 0:
        return math.nan, math.nan, math.nan
    ape = np.abs(pred - y) / y
    return r_squared(y, pred), float(ape.mean()), float(np.median(ape))


@cache
def _subsets(k: int) -> tuple[np.ndarray, ...]:
    """Index arrays of every non-empty subset of k columns, one (m, size) array per size."""
    return tuple(np.array(list(combinations(range(k), s)), dtype=np.intp) for s in range(1, k + 1))


def _nnls(G: np.ndarray, h: np.ndarray, tt: float) -> np.ndarray:
    """min ‖t − Z c‖² over c ≥ 0 from the normal equations (G = ZᵀZ, h = Zᵀt, tt = tᵀt).

    Exact for few columns: the NNLS optimum is the least-squares solution on its own support,
    so the best of the feasible subset solutions is the optimum. The unconstrained solution,
    when feasible, is it at once (the common case: one solve)."""
    k = h.size
    ridge = 1e-12 * max(float(np.trace(G)) / max(k, 1), 1e-300)  # only against exact singularity
    eye = np.eye(k)
    c = np.linalg.solve(G + ridge * eye, h)
    if (c >= 0).all():
        return c
    best, best_rss = np.zeros(k), tt  # the empty support
    for idx in _subsets(k):  # all subsets of one size in one batched solve
        s = idx.shape[1]
        Gs = G[idx[:, :, None], idx[:, None, :]] + ridge * np.eye(s)
        hs = h[idx]
        cs = np.linalg.solve(Gs, hs[..., None])[..., 0]
        rss = tt - (cs * hs).sum(axis=1)  # at a least-squares solution, ‖t − Zc‖² = tᵀt − cᵀh
        rss[~(cs >= 0).all(axis=1)] = np.inf
        i = int(np.argmin(rss))
        if rss[i] < best_rss:
            best_rss = float(rss[i])
            best = np.zeros(k)
            best[idx[i]] = cs[i]
    return best


def _identifiable(X: np.ndarray, y: np.ndarray) -> tuple[list[int], list[str]]:
    """Columns the data can identify, and why the others cannot. A term whose column does not
    vary (no memory-bound step, no prefill step…) is confounded with o, or absent; then, while
    the rest is collinear, w, b and a are given up in that order (the terms theory knows best
    first: the weight read is a byte count)."""
    free, notes = [3], []  # o always stays: it is the level the other terms move from
    for j, t in enumerate(TERMS[:3]):
        col = X[:, j]
        if np.ptp(col) == 0:
            notes.append(f"{t}: {FEATURES[j]} has no variation (all {col[0]:g}): not identifiable")
        else:
            free.append(j)
    free.sort()
    Z = X / y[:, None]  # the columns as the fit weighs them (relative errors)
    G = Z.T @ Z
    d = np.sqrt(np.diag(G))
    d[d == 0] = 1.0  # an all-zero column is not free anyway
    G = G / np.outer(d, d)  # correlation-like: the test below is free of units
    for t in ("w", "b", "a"):
        ev = np.linalg.eigvalsh(G[np.ix_(free, free)])
        if ev[0] > 1e-10 * ev[-1]:
            break
        j = TERMS.index(t)
        if j in free:
            free.remove(j)
            notes.append(f"{t}: {FEATURES[j]} is collinear with the other columns: not identifiable")
    return free, notes


def _fixed_terms(free: list[int], prior: StepTimeModel | None) -> np.ndarray:
    """The coefficients the fit leaves alone: the prior's (0 without one) for the terms the
    steps cannot identify; the free terms' entries are 0 (the fit sets them)."""
    prior_coef = prior.coefficients() if prior is not None else np.zeros(4)
    return np.where(np.isin(np.arange(4), free), 0.0, prior_coef)


def _fit_free(
    X: np.ndarray,
    y: np.ndarray,
    counts: np.ndarray | None,
    free: list[int],
    fixed: np.ndarray,
    iterations: int,
    huber_k: float,
) -> np.ndarray:
    """The free coefficients by Huber-weighted NNLS on relative errors, the others fixed.

    Relative errors: step times span orders of magnitude (a decode step against a long
    prefill), their noise grows with them, and MAPE is the figure reported, so each step counts
    by its relative error. Relative to the prediction (the first pass: to the measurement), as
    a gamma GLM weighs its residuals: a step far below its prediction (a batch that did not run
    whole) then costs at most −1, where relative to its own small time it could cost any
    multiple. Huber weights cap the pull of the rest (a step stalled by something outside the
    model). Columns are scaled: token counts, context sums and a 0/1 column differ by orders of
    magnitude."""
    coef = fixed.copy()
    fixed_cols = [j for j in range(4) if j not in free]
    known = X[:, fixed_cols] @ fixed[fixed_cols]  # seconds the fixed terms predict
    t = y - known
    scale = np.sqrt(((X[:, free] / y[:, None]) ** 2).mean(axis=0))
    scale[scale == 0] = 1.0
    Z = X[:, free] / scale
    k = len(free)
    # Row outer products once: each iteration's Gram is then one (n,)·(n, k²) product.
    outer = (Z[:, :, None] * Z[:, None, :]).reshape(y.size, k * k)
    zt, tt = Z * t[:, None], t * t
    base = np.ones(y.size) if counts is None else counts
    drawn = base > 0
    half = int(drawn.sum()) // 2
    wt = base / (y * y)
    floor = 0.01 * y  # a prediction near 0 would weigh without bound
    c = np.zeros(k)
    for _ in range(max(iterations, 1)):
        c_new = _nnls((wt @ outer).reshape(k, k), wt @ zt, float(wt @ tt))
        converged = float(np.abs(c_new - c).max()) <= 1e-7 * float(np.abs(c_new).max())
        c = c_new
        pred = known + Z @ c
        mu = np.maximum(pred, floor)
        a = np.abs(y - pred) / mu
        # Relative residuals are centred near 0: the median |r| serves as the MAD.
        sigma = _MAD_TO_SIGMA * float(np.partition(a[drawn] if counts is not None else a, half)[half])
        if converged or not sigma > 0:  # converged, or an exact fit: nothing to down-weight
            break
        wt = base * np.minimum(1.0, huber_k * sigma / np.maximum(a, 1e-300)) / (mu * mu)
    coef[free] = c / scale
    return coef


def fit(
    prefill: Any,
    ctx: Any,
    memory_bound: Any,
    dt: Any,
    prior: StepTimeModel | None = None,
    *,
    iterations: int = 10,
    huber_k: float = HUBER_K,
) -> FitResult:
    """Calibrate the four terms on measured steps (dt in seconds; steps with dt ≤ 0 or a
    non-finite value are left out). Non-negative least squares, Huber-robust, on relative
    errors. A term the steps cannot identify (its column does not vary, or is collinear) takes
    the prior's value (0 without a prior), and is named in ``from_prior``."""
    X, y = _usable_steps(prefill, ctx, memory_bound, dt)
    if y.size < 2:
        return FitResult(
            prior or StepTimeModel(0.0, 0.0, 0.0, 0.0, "no prior"),
            math.nan,
            math.nan,
            math.nan,
            int(y.size),
            TERMS,
            (f"{y.size} usable step(s): nothing fitted",),
        )
    free, notes = _identifiable(X, y)
    from_prior = tuple(t for j, t in enumerate(TERMS) if j not in free)
    if from_prior:
        notes.append(("prior" if prior is not None else "no prior: 0") + f" used for {', '.join(from_prior)}")
    coef = _fit_free(X, y, None, free, _fixed_terms(free, prior), iterations, huber_k)
    r2, mape, mdape = score_predictions(X @ coef, y)
    label = f"fit: {y.size} steps" + (f", {', '.join(from_prior)} from prior" if from_prior else "")
    model = StepTimeModel(*coef.tolist(), source=label)
    return FitResult(model, r2, mape, mdape, int(y.size), from_prior, tuple(notes))


def bootstrap_intervals(
    prefill: Any,
    ctx: Any,
    memory_bound: Any,
    dt: Any,
    prior: StepTimeModel | None = None,
    *,
    n_boot: int = 200,
    seed: int = 0,
    level: float = 0.95,
    iterations: int = 10,
) -> dict[str, tuple[float, float]]:
    """Percentile intervals of a, b, w, o and γ_measured (= b/a, taken per resample) over
    ``n_boot`` resamples of the steps (seeded). The terms the full data cannot identify stay at
    the prior in every resample, so each interval is of one model. For offline use: each
    resample is one full fit. NaN bounds with fewer than 10 finite resamples."""
    X, y = _usable_steps(prefill, ctx, memory_bound, dt)
    keys = (*TERMS, "gamma")
    if y.size < 2 or n_boot <= 0:
        return {k: (math.nan, math.nan) for k in keys}
    free, _ = _identifiable(X, y)
    fixed = _fixed_terms(free, prior)
    rng = np.random.default_rng(seed)
    n = y.size
    samples = np.empty((n_boot, 5))
    for i in range(n_boot):
        counts = np.bincount(rng.integers(0, n, size=n), minlength=n).astype(np.float64)
        c = _fit_free(X, y, counts, free, fixed, iterations, HUBER_K)
        samples[i, :4] = c
        samples[i, 4] = c[1] / c[0] if c[0] > 0 else np.nan
    return {k: _percentile_interval(samples[:, i], level) for i, k in enumerate(keys)}


def _percentile_interval(x: np.ndarray, level: float) -> tuple[float, float]:
    x = x[np.isfinite(x)]
    if x.size < MIN_RESAMPLES:
        return math.nan, math.nan
    half = 50.0 * level
    lo, hi = np.percentile(x, [50.0 - half, 50.0 + half])
    return float(lo), float(hi)


# =========================================================================== the host's speed

SPEED_STEPS = 16.0  # time constant of the host's speed, in steps
SPEED_CLIP = 0.5  # a step's log ratio counts at most ±0.5 off the current one: the speed moves ≤ ×1.03 a step


class HostSpeed:
    """How fast the host runs against the step-time model now: measured / modelled step
    time over the recent steps, as an exponentially weighted mean of its logarithm with a
    time constant of ``steps`` steps. A step's log ratio is clipped to ± ``clip`` around the
    current value, so that one stalled step moves it little. The coefficients fit the last
    few thousand steps; a host whose speed drifts over seconds (clock changes, other work on
    its cores or its memory bus) is followed by this ratio instead, and each step is priced
    at the speed of the steps before it: one step ahead, never from its own time."""

    def __init__(self, steps: float = SPEED_STEPS, clip: float = SPEED_CLIP) -> None:
        if not steps >= 1 or not clip > 0:
            raise ValueError("steps must be ≥ 1 and clip > 0")
        self.alpha = 1.0 / steps
        self.clip = clip
        self.log_ratio = 0.0

    @property
    def ratio(self) -> float:
        return math.exp(self.log_ratio)

    def advance(self, modelled: Any, dt: Any) -> np.ndarray:
        """Per step, the ratio in force before it; then the ratio moves past the steps.
        Steps the model prices at nothing, or without a usable time, leave it."""
        m = np.asarray(modelled, dtype=np.float64).ravel()
        d = np.asarray(dt, dtype=np.float64).ravel()
        if m.shape != d.shape:
            raise ValueError(f"{m.size} modelled steps, {d.size} measured")
        usable = (m > 0) & (d > 0) & np.isfinite(m) & np.isfinite(d)
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.where(usable, np.log(d / m), np.nan).tolist()
        before = []
        e, alpha, clip = self.log_ratio, self.alpha, self.clip
        for x in logs:  # the recursion, on plain floats (the logs are taken above, at once)
            before.append(e)
            if x == x:  # not NaN: a usable step
                x -= e
                e += alpha * (clip if x > clip else -clip if x < -clip else x)
        self.log_ratio = e
        return np.exp(before)

    def rebase(self, modelled: Any, dt: Any) -> None:
        """Start again from speed 1 over the given steps (the newest last): after a refit the
        ratio is against the new coefficients, which already carry the window's mean speed."""
        self.log_ratio = 0.0
        self.advance(modelled, dt)


# =========================================================================== the online fit


class OnlineStepFit:
    """A step-time fit kept up to date over the last ``window`` steps, for the engine.

    ``add`` appends a batch of steps to a ring buffer (a few numpy slice assignments, no Python
    loop over steps). :meth:`refit` fits the window once ``min_steps`` usable steps exist; until
    then :attr:`model` is the prior (theory, or a model loaded from a file). The caller runs it
    every K steps (the engine: every 256), or ``refit_every=K`` has ``add`` do so. One refit is
    a few Huber iterations of 4-column normal equations on the window: 2.2 ms (median) at the
    default 4096 steps on the 2-core development VM. Not thread-safe: one caller.
    """

    def __init__(
        self,
        prior: StepTimeModel,
        window: int = 4096,
        refit_every: int | None = None,
        min_steps: int = 64,
        iterations: int = 6,
    ) -> None:
        if window < 2 or min_steps < 2 or (refit_every is not None and refit_every < 1):
            raise ValueError("window and min_steps must be ≥ 2, refit_every ≥ 1 (or None)")
        self.prior = prior
        self.window = window
        self.refit_every = refit_every
        self.min_steps = min_steps
        self.iterations = iterations
        self._x = np.zeros((window, 3))
        self._y = np.zeros(window)
        self._pos = 0  # next row to write
        self._filled = 0
        self._since = 0  # steps added since the last refit
        self.steps_seen = 0
        self.last_fit: FitResult | None = None
        self.speed = HostSpeed()  # the caller advances it with the steps it prices

    def add(self, prefill: Any, ctx: Any, memory_bound: Any, dt: Any) -> None:
        """Append one batch of steps (arrays of equal length, or floats); unusable steps
        (dt ≤ 0 or not finite) are dropped. With ``refit_every``, refits when that many steps
        have arrived since the last refit."""
        cols = [np.asarray(v, dtype=np.float64).ravel() for v in (prefill, ctx, memory_bound, dt)]
        ok = (cols[3] > 0) & np.isfinite(cols[0] + cols[1] + cols[2] + cols[3])  # NaN/inf anywhere
        if not ok.all():
            cols = [c[ok] for c in cols]
        m = cols[3].size
        if m == 0:
            return
        if m > self.window:  # only the newest fit in the window
            cols = [c[-self.window :] for c in cols]
            m = self.window
        first = min(m, self.window - self._pos)  # up to the end of the buffer, then wrap
        for j in range(3):
            self._x[self._pos : self._pos + first, j] = cols[j][:first]
            self._x[: m - first, j] = cols[j][first:]
        self._y[self._pos : self._pos + first] = cols[3][:first]
        self._y[: m - first] = cols[3][first:]
        self._pos = (self._pos + m) % self.window
        self._filled = min(self.window, self._filled + m)
        self._since += m
        self.steps_seen += m
        if (
            self.refit_every is not None
            and self._since >= self.refit_every
            and self._filled >= self.min_steps
        ):
            self.refit()

    def refit(self) -> FitResult | None:
        """Fit the window now (None, keeping the prior, below ``min_steps`` steps)."""
        self._since = 0
        if self._filled < self.min_steps:
            return None
        X, y = self._x[: self._filled], self._y[: self._filled]
        self.last_fit = fit(X[:, 0], X[:, 1], X[:, 2], y, self.prior, iterations=self.iterations)
        k = min(self._filled, int(8 * SPEED_STEPS))  # the newest steps, in order: e^-8 of the start left
        newest = (self._pos - k + np.arange(k)) % self.window  # below a full window, _pos = _filled
        Xn = self._x[newest]
        self.speed.rebase(self.last_fit.model.predict(Xn[:, 0], Xn[:, 1], Xn[:, 2]), self._y[newest])
        return self.last_fit

    @property
    def n(self) -> int:
        """Steps in the window."""
        return self._filled

    @property
    def model(self) -> StepTimeModel:
        return self.last_fit.model if self.last_fit is not None else self.prior

    @property
    def r2(self) -> float:
        return self.last_fit.r2 if self.last_fit is not None else math.nan

    @property
    def mape(self) -> float:
        return self.last_fit.mape if self.last_fit is not None else math.nan
