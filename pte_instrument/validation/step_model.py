"""The four-term step-time model (docs/cost-model.md §5b) on the latency bench's step log:

    t_step ≈ a·prefill_tokens + b·ctx + w·memory_bound + o

fitted with ``pte_instrument.cost.step_time.fit`` (theory as the prior), and scored — MAPE,
median APE, R², Pearson r with a bootstrap interval — over all steps, decode-only steps
(prefill = 0) and each phase, beside theory alone (``theory(cost_model, weight_bytes)``) and
the engine's own online fit when the run recorded it, and as the engine priced each step one
step ahead (the step log's ``model_s``: its fit of the moment at the host's speed of the steps
before) beside the whole-log fit at the host's speed (``HostSpeed``). When a target is missed, :func:`error_terms`
says which term's steps carry the error, and what the residuals follow that the model has no
term for.

Pure numpy on top of the cost package; no vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pte_instrument.cost.architecture import KVGroup, ModelShape, kv_dtype_bytes, load_config, parse_shape
from pte_instrument.cost.devices import PROFILES, DeviceProfile, measured_achieved, resolve_device
from pte_instrument.cost.model import CostModel
from pte_instrument.cost.step_time import TERMS, HostSpeed, StepTimeModel, fit, score_predictions, theory
from pte_instrument.offline.statistics import index_chunks, interval_bounds, pearson, report_number

from .analysis import Corr, StepTable, bootstrap_corr

TERM_NAMES = {
    "a": "a·prefill (compute)",
    "b": "b·ctx (KV read)",
    "w": "w·memory-bound (weight read)",
    "o": "o (per-step overhead)",
}
# Features the four-term model leaves out, tested against its residuals when a target is missed.
MISSING_FEATURES = {
    "decode_tokens": "tokens decoded in the step: each one's own matmuls, which the model has no term for",
    "n_reqs": "requests in the step: per-request work of the engine (inputs, sampling, outputs)",
    "prefill_squared": "prefill² per step: prefill attention, quadratic in the chunk length",
    "previous_residual": "the previous step's residual: the host's speed drifting over time (other "
    "processes on the same cores), which nothing in a step's work can predict",
}


# =========================================================================== features


@dataclass(frozen=True)
class StepColumns:
    """The model's features per step, as the engine and ``pte calibrate`` compute them."""

    prefill: np.ndarray
    ctx: np.ndarray  # γ-weighted over KV groups
    memory_bound: np.ndarray  # 1 where the engine's roofline classed the step memory-bound
    dt: np.ndarray

    def select(self, mask: np.ndarray) -> StepColumns:
        return StepColumns(self.prefill[mask], self.ctx[mask], self.memory_bound[mask], self.dt[mask])

    def __len__(self) -> int:
        return int(self.dt.size)


def step_columns(s: StepTable) -> StepColumns:
    """A step is memory-bound exactly when its logged roofline cost exceeds its tokens (the
    engine's classification, docs/cost-model.md §5)."""
    mb = (s["roofline_pte"] > s["tokens"]).astype(np.float64)
    return StepColumns(s["prefill"], s.ctx_w, mb, s["dt_s"])


# =========================================================================== theory


@dataclass(frozen=True)
class Theory:
    model: StepTimeModel
    shape_source: str  # "step log header" or "model dir"
    device: str
    notes: tuple[str, ...] = ()


def shape_from_header(header: Mapping[str, Any]) -> tuple[ModelShape, float]:
    """The cost-relevant shape a step-log header implies, and bytes per weight: group g reads
    γ_g·2·N_active/HOI KV bytes per context token, and the weights are
    weights_pte·2·N_active/HOI bytes (docs/cost-model.md §3, §5)."""
    n_active, n_total, hoi = (float(header[k]) for k in ("n_active", "n_total", "hoi"))
    per_gamma = 2.0 * n_active / hoi
    windows = header.get("windows") or [None] * len(header["gammas"])
    groups = tuple(
        KVGroup(0, float(g) * per_gamma, w) for g, w in zip(header["gammas"], windows, strict=True)
    )
    shape = ModelShape.from_kv_groups("step log header", groups, n_active, n_total)
    return shape, float(header["weights_pte"]) * per_gamma / n_total


def shape_from_model_dir(model_dir: str | Path, dtype: str) -> tuple[ModelShape, float]:
    """The shape from the model's config, KV cache and weights in the served dtype."""
    cfg = load_config(model_dir)
    return parse_shape(cfg, kv_cache_dtype=dtype), kv_dtype_bytes(dtype)


def host_device(host: DeviceProfile, device_type: str = "cpu") -> DeviceProfile:
    """The host's measured rates as a device: fractions 1 (measured rates are achieved rates)
    and the measured per-step overhead of its device type."""
    return DeviceProfile(
        host.name, host.peak_flops, host.mem_bandwidth, host.source, True, **measured_achieved(device_type)
    )  # type: ignore[arg-type]


def header_device(header: Mapping[str, Any]) -> DeviceProfile:
    """The device the step log was priced on: a profile name, optionally ``@hoi=`` overridden."""
    base, sep, _ = str(header.get("device", "")).partition("@hoi=")
    if base.lower() not in PROFILES:
        raise ValueError(f"the step log's device {header.get('device')!r} is no profile name")
    return resolve_device(base, float(header["hoi"]) if sep else None)


def build_theory(
    header: Mapping[str, Any] | None,
    model_dir: str | Path | None = None,
    dtype: str = "float32",
    host: DeviceProfile | None = None,
) -> Theory | None:
    """Theory seconds for the logged steps: the shape from the step log's header (what the
    engine priced with) or else the model dir; the device from the host's measured rates when
    known, else the header's profile. None when neither shape is available."""
    notes: list[str] = []
    if header and all(k in header for k in ("gammas", "n_active", "n_total", "hoi", "weights_pte")):
        shape, weight_bytes = shape_from_header(header)
        shape_source = "step log header"
    elif model_dir is not None and (Path(model_dir) / "config.json").is_file():
        shape, weight_bytes = shape_from_model_dir(model_dir, dtype)
        shape_source = "model dir"
    else:
        return None
    if host is not None:
        device = host_device(host)
    elif header:
        try:
            device = header_device(header)
        except ValueError as e:
            return Theory(StepTimeModel(0, 0, 0, 0, "no theory"), shape_source, "?", (str(e),))
        notes.append(f"no host measurement: theory at {device.name}'s rates")
    else:
        return None
    return Theory(theory(CostModel(shape, device), weight_bytes), shape_source, device.name, tuple(notes))


def engine_online_model(step_model: Mapping[str, Any] | None, engine: str = "0") -> StepTimeModel | None:
    """The engine's online fit as /pte/summary reported it (engine_hook.step_model[engine])."""
    m = (step_model or {}).get(engine)
    if not m or not all(isinstance(m.get(t), (int, float)) for t in TERMS):
        return None
    return StepTimeModel(*(float(m[t]) for t in TERMS), source=f"engine online fit ({m.get('source')})")


# =========================================================================== scores


@dataclass(frozen=True)
class ModelScore:
    """One model on one set of steps."""

    model: str
    subset: str
    n: int
    mape: float
    mape_ci: tuple[float, float]
    median_ape: float
    r2: float
    corr: Corr

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "subset": self.subset,
            "n": self.n,
            "mape": report_number(self.mape),
            "mape_ci": [report_number(v) for v in self.mape_ci],
            "median_ape": report_number(self.median_ape),
            "r2": report_number(self.r2),
            **{f"r_{k}": v for k, v in self.corr.to_dict().items() if k != "n"},
        }


def bootstrap_mean(x: np.ndarray, n_boot: int, seed: int, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the mean of x over ``n_boot`` seeded resamples."""
    x = x[np.isfinite(x)]
    if x.size < 2 or n_boot <= 0:
        return (math.nan, math.nan)
    means = [
        x[idx].mean(axis=1) for idx in index_chunks(x.size, n_boot, np.random.default_rng(seed), 4_000_000)
    ]
    return interval_bounds(np.concatenate(means), level)


def score_model(
    name: str, pred: np.ndarray, subset: str, dt: np.ndarray, n_boot: int, seed: int
) -> ModelScore:
    """Predicted step times against the measured ``dt`` (steps without a prediction left out)."""
    ok = np.isfinite(pred)
    pred, dt = pred[ok], dt[ok]
    r2, mape, mdape = score_predictions(pred, dt)
    ape = np.abs(pred - dt) / dt
    return ModelScore(
        name,
        subset,
        int(ok.sum()),
        mape,
        bootstrap_mean(ape, n_boot, seed),
        mdape,
        r2,
        bootstrap_corr(pred, dt, n_boot, seed),
    )


def at_host_speed(pred: np.ndarray, dt: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``pred`` at the host's speed of the steps before each (in time order), as the engine
    prices them: :class:`HostSpeed` over the same steps."""
    order = np.argsort(t, kind="stable")
    out = np.empty_like(pred)
    out[order] = pred[order] * HostSpeed().advance(pred[order], dt[order])
    return out


# =========================================================================== error by term


@dataclass(frozen=True)
class TermError:
    """The error of a model split by the term that dominates each step's prediction."""

    term: str
    steps: int
    step_share: float
    mape: float
    ape_share: float  # share of Σ |pred − dt|/dt: what MAPE is made of
    sq_share: float  # share of Σ (pred − dt)²: what limits r and R²
    bias: float  # median (pred − dt)/dt of those steps: + over-, − under-predicted

    def to_dict(self) -> dict[str, Any]:
        return {k: (report_number(v) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def dominant_terms(model: StepTimeModel, c: StepColumns) -> np.ndarray:
    """Index (into TERMS) of the largest term of each step's predicted time."""
    parts = np.stack(
        [model.a * c.prefill, model.b * c.ctx, model.w * c.memory_bound, np.full(len(c), model.o)]
    )
    return np.argmax(parts, axis=0)


def error_terms(model: StepTimeModel, c: StepColumns) -> list[TermError]:
    """Steps grouped by their dominant term: how much of the error each group carries."""
    pred = model.predict(c.prefill, c.ctx, c.memory_bound)
    rel = (pred - c.dt) / c.dt
    ape, sq = np.abs(rel), (pred - c.dt) ** 2
    dom = dominant_terms(model, c)
    out = []
    for j, t in enumerate(TERMS):
        m = dom == j
        if not m.any():
            continue
        out.append(
            TermError(
                t,
                int(m.sum()),
                float(m.mean()),
                float(ape[m].mean()),
                float(ape[m].sum() / ape.sum()) if ape.sum() > 0 else math.nan,
                float(sq[m].sum() / sq.sum()) if sq.sum() > 0 else math.nan,
                float(np.median(rel[m])),
            )
        )
    return out


def residual_leads(model: StepTimeModel, s: StepTable, mask: np.ndarray | None = None) -> dict[str, float]:
    """Pearson r of the relative residual (dt − pred)/pred with each feature the model leaves
    out, and with the previous step's residual (in time order): a clear r says what the missing
    time follows."""
    c = step_columns(s)
    if mask is not None:
        c, s = c.select(mask), s.select(mask)
    pred = model.predict(c.prefill, c.ctx, c.memory_bound)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = (c.dt - pred) / pred
    feats = {"decode_tokens": s["decode_tokens"], "n_reqs": s["n_reqs"], "prefill_squared": s["prefill"] ** 2}
    out = {k: pearson(v, rel) for k, v in feats.items()}
    order = np.argsort(s["t"], kind="stable")
    out["previous_residual"] = pearson(rel[order][:-1], rel[order][1:]) if rel.size > 3 else math.nan
    return out


def theory_term_errors(
    theory_model: StepTimeModel, fitted: StepTimeModel, c: StepColumns
) -> dict[str, float]:
    """Share of theory's error that each term's coefficient carries, measured against the
    fit: Σ_steps |θ_theory − θ_fit|·x over the terms, normalised."""
    x = np.stack([c.prefill, c.ctx, c.memory_bound, np.ones(len(c))])
    d = np.abs(theory_model.coefficients() - fitted.coefficients())[:, None] * x
    tot = float(d.sum())
    return {t: (float(d[j].sum()) / tot if tot > 0 else math.nan) for j, t in enumerate(TERMS)}


# =========================================================================== the whole analysis


@dataclass
class StepModelAnalysis:
    fit: Any  # step_time.FitResult on all steps
    theory: Theory | None
    online: StepTimeModel | None
    scores: list[ModelScore]
    errors: dict[str, list[TermError]]  # subset → error by dominant term of the fitted model
    leads: dict[str, dict[str, float]]  # subset → r(residual, missing feature)
    theory_errors: dict[str, float]  # term → share of theory's error (against the fit), all steps
    notes: list[str] = field(default_factory=list)

    def get(self, model: str, subset: str) -> ModelScore | None:
        return next((s for s in self.scores if s.model == model and s.subset == subset), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fit": self.fit.to_dict(),
            "theory": None
            if self.theory is None
            else {
                "model": self.theory.model.to_dict(),
                "shape_source": self.theory.shape_source,
                "device": self.theory.device,
                "notes": list(self.theory.notes),
            },
            "engine_online": None if self.online is None else self.online.to_dict(),
            "scores": [s.to_dict() for s in self.scores],
            "error_by_dominant_term": {k: [e.to_dict() for e in v] for k, v in self.errors.items()},
            "residual_correlations": {
                k: {f: report_number(r) for f, r in v.items()} for k, v in self.leads.items()
            },
            "theory_error_by_term": {k: report_number(v) for k, v in self.theory_errors.items()},
            "notes": self.notes,
        }


FITTED, THEORY, ONLINE = "four-term fit", "theory", "engine online fit"
FITTED_SPEED = "four-term fit × host speed"
LIVE = "engine, one step ahead"  # the step log's model_s


def analyse_step_model(
    steps: StepTable,
    subsets: Mapping[str, np.ndarray],
    theory_: Theory | None,
    online: StepTimeModel | None,
    n_boot: int = 1000,
    seed: int = 0,
) -> StepModelAnalysis:
    """Fit the four terms on all ``steps`` (theory as prior), score every model on every subset
    (masks over ``steps``), and split the fitted model's error by term."""
    c = step_columns(steps)
    prior = theory_.model if theory_ is not None and theory_.model.a > 0 else None
    result = fit(c.prefill, c.ctx, c.memory_bound, c.dt, prior)
    fitted = result.model.predict(c.prefill, c.ctx, c.memory_bound)
    preds = {FITTED: fitted, FITTED_SPEED: at_host_speed(fitted, c.dt, steps["t"])}
    if prior is not None:
        preds[THEORY] = prior.predict(c.prefill, c.ctx, c.memory_bound)
    if online is not None:
        preds[ONLINE] = online.predict(c.prefill, c.ctx, c.memory_bound)
    live = steps.cols.get("model_s")
    if live is not None and np.isfinite(live).mean() > 0.5:  # logs before model_s have none
        preds[LIVE] = np.where(live > 0, live, np.nan)
    scores, errors, leads = [], {}, {}
    for name, mask in subsets.items():
        sub = c.select(mask)
        if len(sub) < 3:
            continue
        scores += [score_model(m, pred[mask], name, sub.dt, n_boot, seed) for m, pred in preds.items()]
        errors[name] = error_terms(result.model, sub)
        leads[name] = residual_leads(result.model, steps, mask)
    th_err = theory_term_errors(prior, result.model, c) if prior is not None else {}
    return StepModelAnalysis(result, theory_, online, scores, errors, leads, th_err, list(result.notes))


def explain_step_miss(a: StepModelAnalysis, subset: str, metric: str) -> str:
    """Why the fitted model misses on ``subset``: the term whose steps carry most of the error
    (Σ APE for MAPE, Σ squared error for r) and what the residuals follow."""
    errs = a.errors.get(subset) or []
    if not errs:
        return ""
    key = "ape_share" if metric == "mape" else "sq_share"
    worst = max(errs, key=lambda e: getattr(e, key) if math.isfinite(getattr(e, key)) else -1)
    what = "Σ relative error" if metric == "mape" else "Σ squared error"
    side = "over" if worst.bias > 0 else "under"
    parts = [
        f"Steps dominated by {TERM_NAMES[worst.term]} carry {getattr(worst, key):.0%} of the {what} "
        f"({worst.steps} steps, {worst.step_share:.0%} of them; their MAPE {worst.mape:.1%}, median "
        f"{side}-prediction {abs(worst.bias):.1%})."
    ]
    leads = {k: v for k, v in (a.leads.get(subset) or {}).items() if math.isfinite(v)}
    if leads:
        k = max(leads, key=lambda f: abs(leads[f]))
        if abs(leads[k]) >= 0.2:
            parts.append(f"The relative residual follows {MISSING_FEATURES[k]} (r = {leads[k]:+.2f}).")
        else:
            parts.append(
                "The residuals follow none of the features the model leaves out (decode tokens, requests "
                f"per step, prefill², the previous step's residual: |r| ≤ {max(abs(v) for v in leads.values()):.2f}): "
                "what is left is jitter of single steps (other processes on the same cores)."
            )
    return " ".join(parts)


def explain_theory(a: StepModelAnalysis) -> str:
    """Which coefficient theory gets most wrong, against the fit."""
    if not a.theory_errors or a.theory is None:
        return ""
    t = max(a.theory_errors, key=lambda k: a.theory_errors[k] if math.isfinite(a.theory_errors[k]) else -1)
    th, ft = getattr(a.theory.model, t), getattr(a.fit.model, t)
    ratio = f", {ft / th:.2g}× theory" if th > 0 else ""
    return (
        f"theory's error is mostly its {TERM_NAMES[t]} term ({a.theory_errors[t]:.0%} of Σ|Δθ·x|): "
        f"theory {th:.3g} s, fitted {ft:.3g} s{ratio}"
    )
