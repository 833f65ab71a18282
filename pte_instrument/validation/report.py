"""Analyse a latency run's logs and write the report: ``report.json``, ``report.md`` and PNG
plots (matplotlib, Agg backend, imported only when plotting).

The report states, for each target, the measured figure, whether it was met, and when it
was not, which term of the fitted time model dominates the measured time and why PTE (or
the calibrated model) cannot follow it.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from pte_instrument.cost.devices import DEFAULT_DEVICE, PROFILES, DeviceProfile
from pte_instrument.offline.plots import pyplot, save_figure

from . import analysis as A
from . import seconds as S
from . import step_model as SM
from .calibrate import TERM_LABELS, Calibration, calibrate_requests, calibrate_steps, explain_shares
from .phases import Phase

TARGET_R = 0.95
TARGET_RHO = 0.95
# The seconds of the engine hook (docs/cost-model.md §5b).
TARGET_R_PREDICTED = 0.97  # r(predicted_seconds, inference_s) alone
TARGET_ATTRIBUTION = 0.97  # median gpu_seconds / inference_s alone
TARGET_COVERAGE = 0.95  # median latency_explained_s / (inference_s + queued_s) under load
# Spearman(predicted_seconds under load, inference_s of the same request alone): what the engine
# priced as a request's own work ranks requests as their cost alone does. Not GPU seconds: a
# request's share of batched steps is by design not its cost alone.
TARGET_MATCHED_RHO = 0.9
TARGET_STEP_MAPE = 0.10  # the four-term model on all steps
TARGET_STEP_R_DECODE = 0.98  # the four-term model on decode-only steps

# ---------------------------------------------------------------------------------------
# Analysis of one run
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    target: str
    value: float | None
    met: bool | None  # None: could not be evaluated
    detail: str = ""
    diagnosis: str = ""
    ci: tuple[float, float] | None = None  # 95% bootstrap interval of the value

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LatencyAnalysis:
    phases: list[Phase]
    requests: A.RequestTable
    steps: A.StepTable | None
    phase_requests: dict[str, A.RequestTable]
    phase_steps: dict[str, A.StepTable]
    step_fit: Calibration | None
    step_fit_decode: Calibration | None
    phase_step_fits: dict[str, Calibration]
    request_fit: Calibration | None
    levels: list[A.LevelResult]
    robustness: list[A.ProfileScore]
    turn_profiles: dict[str, Any]
    cost_model: dict[str, Any]
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    step_model: SM.StepModelAnalysis | None = None
    # phase → attribution and coverage summaries, gaps between steps, matched-pair facts
    seconds: dict[str, dict[str, Any]] = field(default_factory=dict)

    def level(self, level: str, phase: str) -> A.LevelResult | None:
        return next((lv for lv in self.levels if lv.level == level and lv.phase == phase), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "phases": [p.to_dict() for p in self.phases],
            "n_requests": len(self.requests),
            "n_steps": len(self.steps) if self.steps is not None else 0,
            "cost_model": self.cost_model,
            "calibration": {
                "step": self.step_fit.to_dict() if self.step_fit else None,
                "step_with_decode_term": self.step_fit_decode.to_dict() if self.step_fit_decode else None,
                "step_per_phase": {k: v.to_dict() for k, v in self.phase_step_fits.items()},
                "request_concurrency_1": self.request_fit.to_dict() if self.request_fit else None,
            },
            "levels": [lv.to_dict() for lv in self.levels],
            "robustness": [p.to_dict() for p in self.robustness],
            "turn_profiles": self.turn_profiles,
            "targets": [t.to_dict() for t in self.targets],
            "notes": self.notes,
            "step_model": self.step_model.to_dict() if self.step_model is not None else None,
            "seconds": {k: _seconds_dict(v) for k, v in self.seconds.items()},
        }


def _seconds_dict(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.to_dict() if hasattr(v, "to_dict") else v) for k, v in d.items()}


def _phase_of_requests(t: A.RequestTable, p: Phase) -> np.ndarray:
    return p.holds_requests(t.request_id, t.session_id, t["finished_at"])


def analyse_logs(
    requests_path: str | Path,
    steps_path: str | Path | None,
    phases: Sequence[Phase],
    *,
    n_boot: int = 1000,
    seed: int = 0,
    host_profile: DeviceProfile | None = None,
    profiles: Mapping[str, DeviceProfile] = PROFILES,
    default_device: str = DEFAULT_DEVICE,
    model_dir: str | Path | None = None,
    dtype: str = "float32",
    engine_step_model: Mapping[str, Any] | None = None,
    problems: Counter[str] | None = None,
    requests: A.RequestTable | None = None,
) -> LatencyAnalysis:
    """Everything the report shows, from the two logs and the phase windows. ``model_dir``
    and ``dtype`` give theory a shape when the step log has no header; ``engine_step_model``
    is /pte/summary's engine_hook.step_model at the end of the run (the online fit);
    ``problems`` counts what the logs held that is not what they should; ``requests``: the
    request log already read."""
    notes: list[str] = []
    if requests is None:
        requests = A.request_table(A.load_jsonl(requests_path, problems), problems)
    req = A.usable_requests(requests)
    steps = A.load_steps(steps_path, problems) if steps_path else None
    if steps is not None:
        steps = A.usable_steps(steps)
        if len(steps) < 10:
            steps = None
    if steps is None:
        notes.append(
            "no step log (engine hook off, or it wrote nothing): step-level validation and the "
            "step calibration are skipped; request and turn levels only"
        )
    phase_req = {p.name: req.select(_phase_of_requests(req, p)) for p in phases}
    phase_steps: dict[str, A.StepTable] = {}
    if steps is not None:
        for p in phases:
            sel = p.holds_times(steps["t"])
            if sel.sum() >= 10:
                phase_steps[p.name] = steps.select(sel)
        in_phases = np.zeros(len(steps), dtype=bool)
        for p in phases:
            in_phases |= p.holds_times(steps["t"])
        steps = steps.select(in_phases)  # warm-up steps stay out

    # --- calibration ---
    step_fit = step_fit_dec = None
    phase_fits: dict[str, Calibration] = {}
    if steps is not None and len(steps) >= 10:
        step_fit = calibrate_steps(steps, False, n_boot, seed)
        step_fit_dec = calibrate_steps(steps, True, n_boot, seed)
        phase_fits = {k: calibrate_steps(s, False, n_boot, seed) for k, s in phase_steps.items()}
    alone = min(phases, key=lambda p: p.concurrency) if phases else None
    request_fit = None
    if alone is not None and alone.concurrency == 1 and len(phase_req[alone.name]) >= 8:
        request_fit = calibrate_requests(phase_req[alone.name], n_boot, seed)
    gamma_cal = (
        step_fit.gamma_measured
        if step_fit is not None
        else (request_fit.gamma_measured if request_fit is not None else None)
    )

    # --- cost model actually used by the plugin ---
    gamma, hoi = (_median(_finite(req[name])) for name in ("gamma", "hoi"))
    cost_model: dict[str, Any] = {
        "gamma_logged": gamma,
        "hoi_logged": hoi,
        "device_logged": req.device[0] if len(req) else None,
        "gamma_calibrated": gamma_cal,
        "gamma_calibrated_source": "step log"
        if step_fit is not None
        else ("requests at concurrency 1" if request_fit else None),
    }
    if steps is not None and steps.header:
        cost_model["step_log_header"] = steps.header
    if host_profile is not None and math.isfinite(gamma) and hoi > 0:
        cost_model["host_measured"] = {
            "name": host_profile.name,
            "hoi": host_profile.hoi,
            "peak_flops": host_profile.peak_flops,
            "mem_bandwidth": host_profile.mem_bandwidth,
            "source": host_profile.source,
            "gamma_implied": gamma * host_profile.hoi / hoi,
        }

    # --- levels ---
    levels: list[A.LevelResult] = []
    if steps is not None:
        subsets = [("all", steps), *phase_steps.items()]
        decode_only = steps.select(steps["prefill"] == 0)
        if len(decode_only) >= 10:
            # Without prefill chunks, whose size dominates the variance of step time, what is
            # left is the decode side: the per-step constant against the context read.
            subsets.append(("decode-only", decode_only))
        for name, s in subsets:
            levels.append(
                A.evaluate(
                    "step",
                    name,
                    "dt_s",
                    s["dt_s"],
                    _step_metrics(s, step_fit, step_fit_dec),
                    A.STEP_PTE,
                    n_boot,
                    seed,
                )
            )
    step_model = None
    if steps is not None:
        step_model = _four_term(
            steps, phases, host_profile, model_dir, dtype, engine_step_model, n_boot, seed
        )
    turn_profiles: dict[str, Any] = {}
    for p in phases:
        t = phase_req[p.name]
        if len(t) < 3:
            notes.append(f"phase {p.name}: only {len(t)} usable requests in the log; not analysed")
            continue
        rm = A.request_metrics(t, gamma_cal, request_fit)
        if p.concurrency == 1 and step_model is not None and t.has("arrived_at"):
            rm += _offline_alone_metrics(t, steps, step_model)
        levels.append(
            A.evaluate(
                "request",
                p.name,
                "inference_s",
                t["inference_s"],
                rm,
                A.PRIMARY,
                n_boot,
                seed,
                note=f"concurrency {p.concurrency}",
                references=(A.PREDICTED,),
            )
        )
        if (t.turn > 0).any():
            has = t.turn > 0
            tt = t.select(has)
            levels.append(
                A.evaluate_turns(
                    p.name,
                    tt.session_id,
                    tt.turn,
                    "inference_s",
                    tt["inference_s"],
                    A.request_metrics(tt, gamma_cal, request_fit),
                    A.PRIMARY,
                    n_boot,
                    seed,
                )
            )
            turn_profiles[p.name] = A.turn_profile(
                tt.session_id,
                tt.turn,
                {
                    "prompt_tokens": tt["prompt_tokens"],
                    "cached_tokens": tt["cached_tokens"],
                    "output_tokens": tt["output_tokens"],
                    "pte_served": tt["pte_served"],
                    "pte_reference": tt["pte_reference"],
                    "inference_s": tt["inference_s"],
                },
            )

    # --- robustness (requests of every phase; γ ∝ HOI) ---
    robust: list[A.ProfileScore] = []
    if len(req) >= 3 and math.isfinite(gamma) and gamma > 0 and hoi > 0:
        profs = dict(profiles)
        if host_profile is not None:
            profs[host_profile.name] = host_profile
        base = alone.name if alone is not None else None
        t = phase_req.get(base, req) if base else req
        robust = A.robustness(
            t["pte_prefill"], t["pte_decode"], gamma, hoi, profs, default_device, t["inference_s"]
        )

    seconds = _seconds(phases, phase_req, phase_steps, alone, n_boot, seed)
    for p in phases:
        m = seconds.get(p.name, {}).pop("matched_level", None)
        if m is not None:
            levels.append(m)
    if len(req) and not req.has("gpu_seconds"):
        notes.append(
            "no engine seconds (gpu_seconds, predicted_seconds) in the request log: run with the "
            "engine hook; the seconds targets are not evaluated"
        )

    out = LatencyAnalysis(
        phases=list(phases),
        requests=req,
        steps=steps,
        phase_requests=phase_req,
        phase_steps=phase_steps,
        step_fit=step_fit,
        step_fit_decode=step_fit_dec,
        phase_step_fits=phase_fits,
        request_fit=request_fit,
        levels=levels,
        robustness=robust,
        turn_profiles=turn_profiles,
        cost_model=cost_model,
        notes=notes,
        step_model=step_model,
        seconds=seconds,
    )
    out.targets = evaluate_targets(out)
    return out


def _four_term(
    steps: A.StepTable,
    phases: Sequence[Phase],
    host: DeviceProfile | None,
    model_dir: str | Path | None,
    dtype: str,
    engine_step_model: Mapping[str, Any] | None,
    n_boot: int,
    seed: int,
) -> SM.StepModelAnalysis:
    """The four-term model fitted on the phases' steps, scored on all, decode-only, each phase."""
    subsets = {"all": np.ones(len(steps), dtype=bool), "decode-only": steps["prefill"] == 0}
    for p in phases:
        subsets[p.name] = p.holds_times(steps["t"])
    th = SM.build_theory(steps.header, model_dir, dtype, host)
    online = SM.engine_online_model(engine_step_model)
    return SM.analyse_step_model(steps, subsets, th, online, n_boot, seed)


OFFLINE_PREDICTED = "predicted seconds (offline four-term fit)"
STEP_TIME_ALONE = "Σ dt_s of its steps (step log)"


def _offline_alone_metrics(t: A.RequestTable, steps: A.StepTable, sm: SM.StepModelAnalysis) -> list[A.Metric]:
    """Alone, the steps scheduled while a request was in the engine are its own: their
    measured durations (a check of the engine's GPU seconds) and the offline fit's
    prediction of them (one fit of the whole run, against the engine's fit of the moment)."""
    c = SM.step_columns(steps)
    pred = sm.fit.model.predict(c.prefill, c.ctx, c.memory_bound)
    return [
        A.Metric(
            OFFLINE_PREDICTED,
            "model",
            S.alone_step_sums(t, steps["t"], pred),
            "Σ over its steps of the four-term model fitted on the whole step log",
        ),
        A.Metric(
            STEP_TIME_ALONE,
            "measured",
            S.alone_step_sums(t, steps["t"], steps["dt_s"]),
            "Σ dt_s of the steps scheduled between its arrival and its end",
        ),
    ]


MATCHED_PRIMARY = "predicted seconds (under load)"
MATCHED_GPU = "GPU seconds (under load)"
MATCHED_INFERENCE = "inference_s under load"  # the matched request's own time under load


def _seconds(
    phases: Sequence[Phase],
    phase_req: Mapping[str, A.RequestTable],
    phase_steps: Mapping[str, A.StepTable],
    alone: Phase | None,
    n_boot: int,
    seed: int,
) -> dict[str, dict[str, Any]]:
    """Per phase: attribution and coverage summaries, gaps between steps, and under load the
    requests matched to the same requests alone (as a level of its own, ``matched_level``)."""
    out: dict[str, dict[str, Any]] = {}
    base = phase_req.get(alone.name) if alone is not None and alone.concurrency == 1 else None
    for p in phases:
        t = phase_req[p.name]
        d: dict[str, Any] = {"concurrency": p.concurrency}
        if p.name in phase_steps:
            st = phase_steps[p.name]
            d["gaps_between_steps"] = S.gaps_between_steps(st["t"], st["dt_s"])
            d["median_step_s"] = float(np.median(st["dt_s"]))
        if len(t) >= 3 and t.has("gpu_seconds"):
            d["attribution"] = S.attribution(t, TARGET_ATTRIBUTION, n_boot, seed)
            d["coverage"] = S.coverage(t, TARGET_COVERAGE, n_boot, seed)
            d["interference_share_median"] = _median(S.ratios(t["interference_s"], t["latency_explained_s"]))
            d["preempted_share"] = float(np.mean(np.nan_to_num(t["num_preemptions"]) > 0))
            if base is not None and p.concurrency > 1 and base.has("gpu_seconds"):
                d.update(_matched(p, t, base, n_boot, seed))
        out[p.name] = d
    return out


def _median(x: np.ndarray) -> float:
    return float(np.median(x)) if x.size else math.nan


def _finite(x: np.ndarray) -> np.ndarray:
    """The finite values of ``x`` (a column the log left out is all NaN)."""
    x = np.asarray(x, dtype=np.float64)
    return x[np.isfinite(x)]


def _matched(p: Phase, load: A.RequestTable, alone: A.RequestTable, n_boot: int, seed: int) -> dict[str, Any]:
    il, ia = S.match_requests(load, alone)
    if il.size < 3:
        return {"matched": {"n": int(il.size)}}
    lt, y = load.take(il), alone["inference_s"][ia]
    metrics = [
        A.Metric(
            MATCHED_PRIMARY,
            "model",
            lt["predicted_seconds"],
            "its own work alone, as the engine priced it under load",
        ),
        A.Metric(MATCHED_GPU, "measured", lt["gpu_seconds"], "its share of the steps it was in, under load"),
        A.Metric(MATCHED_INFERENCE, "measured", lt["inference_s"], "the same request's own time under load"),
        A.Metric(
            "latency explained (under load)", "measured", lt["latency_explained_s"], "steps it was in + queue"
        ),
        A.Metric("PTE served", "pte", lt["pte_served"], "under load (prefix-cache hits may differ)"),
        A.Metric("output tokens", "baseline", lt["output_tokens"], ""),
    ]
    level = A.evaluate(
        "matched",
        p.name,
        "inference_s of the same request alone (c1)",
        y,
        metrics,
        MATCHED_PRIMARY,
        n_boot,
        seed,
        note=f"concurrency {p.concurrency}, matched by session index and turn",
    )
    return {
        "matched": {**S.matched_columns(load, alone, il, ia), **S.same_work(load, alone, il, ia)},
        "matched_level": level,
    }


def _step_metrics(s: A.StepTable, fit: Calibration | None, fit_dec: Calibration | None) -> list[A.Metric]:
    m = A.step_metrics(s, fit)
    if fit_dec is not None:
        m.append(
            A.Metric("calibrated step model (+decode)", "model", fit_dec.predict_steps(s), fit_dec.formula())
        )
    return m


# ---------------------------------------------------------------------------------------
# Targets and diagnosis
# ---------------------------------------------------------------------------------------


def _fmt(v: float | None, nd: int = 3) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.{nd}f}"


def _r(lv: A.LevelResult, name: str) -> float:
    m = lv.get(name)
    return m.corr.pearson if m is not None else math.nan


def diagnose_request(a: LatencyAnalysis, lv: A.LevelResult) -> str:
    """Why PTE served misses at request level: what the measured time is made of, and what
    the other predictors on the same rows show (facts from this run, not a script)."""
    parts = []
    fit = a.request_fit
    r_pte = _r(lv, A.PRIMARY)
    alone = lv.note == "concurrency 1"
    if fit is not None and alone:
        parts.append(explain_shares(fit) + ".")
        share = fit.shares.get("decode_steps", 0.0)
        if share >= 0.2:
            c = fit.coef.get("decode_steps", math.nan)
            equiv = (
                ""
                if not math.isfinite(fit.const_pte)
                else f", ≈ {fit.const_pte:.0f} prefill-token equivalents"
            )
            parts.append(
                f"A per-decode-step constant ({c * 1e3:.2f} ms per step{equiv}) makes up {share:.0%} of request "
                "time: the weight read and the engine's own per-step work, paid once per generated token "
                "whatever the context. PTE has no term for it; the roofline attribution (docs/cost-model.md §5) adds the weight "
                f"read (roofline r = {_fmt(_r(lv, A.ROOFLINE_ENGINE))}), output tokens count the steps "
                f"(r = {_fmt(_r(lv, A.OUTPUT_TOKENS))})."
            )
        r_fit = _r(lv, A.FITTED_REQUEST)
        if math.isfinite(r_fit):
            parts.append(
                f"A linear model with a per-step term reaches r = {r_fit:.3f} on the same requests "
                "(fitted on them: an upper bound for this shape of model)."
            )
    elif a.step_fit is not None:
        parts.append(explain_shares(a.step_fit) + " (steps of all phases).")
    if not alone:
        r_out = _r(lv, A.OUTPUT_TOKENS)
        parts.append(
            "Under load a request's inference time is the sum of the steps it lives through, each as long "
            "as the whole batch's work (other requests' prefill chunks included), so it measures exposure "
            "to the batch more than the request's own cost"
            + (f"; output tokens, which count those steps, reach r = {r_out:.3f}" if r_out > r_pte else "")
            + ". The step level is where cost models are compared under load."
        )
    g, gc = a.cost_model.get("gamma_logged"), a.cost_model.get("gamma_calibrated")
    if g and gc and math.isfinite(g) and math.isfinite(gc) and gc > 0 and not (0.5 < g / gc < 2):
        parts.append(
            f"The γ the plugin priced with ({g:.4g}) is {g / gc:.2g}× the γ calibrated on measured steps "
            f"({gc:.4g}): theory mis-weights the decode term on this host; at the calibrated γ, "
            f"r = {_fmt(_r(lv, A.PTE_CALIBRATED))}."
        )
    best = lv.best("baseline")
    if best is not None:
        parts.append(f"Best baseline: {best.name} (r = {_fmt(best.corr.pearson)}).")
    return " ".join(parts)


def diagnose_step(a: LatencyAnalysis) -> str:
    fit = a.step_fit
    if fit is None:
        return ""
    parts = [explain_shares(fit) + ";"]
    parts.append(f"residual RMS {fit.rmse_s * 1e3:.2f} ms on a mean step of {fit.mean_time_s * 1e3:.2f} ms.")
    if a.step_fit_decode is not None and a.step_fit_decode.r2 > fit.r2 + 0.02:
        parts.append(
            f"Adding a per-decode-token term lifts R² to {a.step_fit_decode.r2:.3f}: each decoded "
            "token's own matmuls are not free on this device."
        )
    parts.append(
        "What a linear model of (prefill, context, constant) leaves unexplained is jitter from "
        "the host (other processes on the same cores, the API server and the client sharing them), "
        "and prefill attention, which grows with the square of the chunk length."
    )
    return " ".join(parts)


def _ci(c: tuple[float, float] | None) -> str:
    if c is None or not all(math.isfinite(v) for v in c):
        return "no interval"
    return f"95% CI {c[0]:.3f}–{c[1]:.3f}"


def _met(value: float, ok: bool) -> bool | None:
    return bool(ok) if math.isfinite(value) else None


def _at_least(
    name: str,
    bound: float,
    value: float,
    detail: str,
    diagnose: Callable[[], str],
    ci: tuple[float, float] | None,
) -> Target:
    """A target met when ``value`` ≥ ``bound``; ``diagnose`` runs only on a miss (or NaN)."""
    met = _met(value, value >= bound)
    return Target(name, f"≥ {bound}", value, met, detail, "" if met else diagnose(), ci)


def _alone(a: LatencyAnalysis) -> Phase | None:
    return next((p for p in sorted(a.phases, key=lambda p: p.concurrency) if p.concurrency == 1), None)


def _gaps_text(a: LatencyAnalysis, phase: str) -> str:
    d = a.seconds.get(phase, {})
    g, step = d.get("gaps_between_steps") or {}, d.get("median_step_s")
    if not g.get("n") or g.get("median_s") is None or step is None:
        return ""
    return (
        f"consecutive steps are {g['median_s'] * 1e3:.2f} ms apart (median) beyond their dt_s, against a "
        f"median step of {step * 1e3:.2f} ms: {g['share_of_step_time']:.1%} of the engine's busy time "
        "lies outside every step's dt_s (scheduling the next step, the engine loop's bookkeeping), and a "
        "request's steps do not cover it"
    )


def diagnose_predicted(a: LatencyAnalysis, lv: A.LevelResult, t: A.RequestTable) -> str:
    """Why predicted_seconds misses alone: the model's error (predicted vs the measured
    durations of the request's own steps) or the time outside steps (those vs inference_s)."""
    r_pg = A.pearson(t["predicted_seconds"], t["gpu_seconds"])
    r_gi = _r(lv, A.GPU_SECONDS)
    parts = [
        f"Alone, a request's GPU seconds are the measured durations of its own steps: r(predicted, GPU "
        f"seconds) = {_fmt(r_pg)} is the step-time model's error, r(GPU seconds, inference_s) = "
        f"{_fmt(r_gi)} the time outside the steps."
    ]
    if math.isfinite(r_pg) and (not math.isfinite(r_gi) or r_pg <= r_gi):
        shares = S.residual_terms(t, t["gpu_seconds"] - t["predicted_seconds"])
        if shares:
            k = max(shares, key=lambda x: shares[x] if math.isfinite(shares[x]) else -1)
            label = {
                "prefill": "prefill tokens (a)",
                "ctx": "Σ decode context (b)",
                "steps": "decode steps (w + o)",
            }[k]
            ratio = S.ratios(t["predicted_seconds"], t["gpu_seconds"])
            parts.append(
                f"The model's error dominates: predicted/measured has median {_median(ratio):.3f}, "
                f"p10–p90 {np.quantile(ratio, 0.1):.3f}–{np.quantile(ratio, 0.9):.3f}; of what a linear "
                f"model of the request's work explains of it, {shares[k]:.0%} follows {label}."
            )
        drift = S.drift(t["predicted_seconds"], t["gpu_seconds"], t["finished_at"])
        if math.isfinite(drift) and drift >= 0.2:
            parts.append(
                f"Consecutive requests' predicted/measured ratios correlate (r = {drift:.2f}): the host's "
                "speed drifts over seconds to minutes with the other load on its cores, and the model, "
                "fitted over the last 4,096 steps, cannot follow it."
            )
        r_off, r_sum = _r(lv, OFFLINE_PREDICTED), _r(lv, STEP_TIME_ALONE)
        if math.isfinite(r_off):
            parts.append(
                f"One four-term fit of the whole step log, summed over each request's steps, reaches "
                f"r = {r_off:.3f} (the steps' measured durations: {_fmt(r_sum)})."
            )
        sm = a.step_model
        if sm is not None and sm.online is not None:
            sc = sm.get(SM.ONLINE, "all")
            if sc is not None:
                parts.append(
                    f"The engine's online fit at the end of the run scores MAPE {sc.mape:.1%} on the "
                    "steps; the predicted seconds of each request were priced by the fit of its moment."
                )
    else:
        gaps = _gaps_text(a, lv.phase)
        parts.append("The time outside the steps dominates" + (f": {gaps}." if gaps else "."))
    return " ".join(parts)


def diagnose_attribution(a: LatencyAnalysis, phase: str, t: A.RequestTable) -> str:
    gap = (t["inference_s"] - t["gpu_seconds"]) / np.maximum(t["output_tokens"], 1)
    gap = gap[np.isfinite(gap)]
    parts = []
    if gap.size:
        parts.append(
            f"A request's inference time exceeds its steps by a median {np.median(gap) * 1e3:.2f} ms "
            "per output token (one step each)."
        )
    gaps = _gaps_text(a, phase)
    if gaps:
        parts.append(gaps[0].upper() + gaps[1:] + ".")
    return " ".join(parts)


def diagnose_coverage(a: LatencyAnalysis, phase: str) -> str:
    d = a.seconds.get(phase, {})
    parts = []
    gaps = _gaps_text(a, phase)
    if gaps:
        parts.append(gaps[0].upper() + gaps[1:] + ".")
    pre = d.get("preempted_share")
    if pre:
        parts.append(
            f"{pre:.0%} of the requests were preempted: the steps they waited through between their "
            "eviction and their recompute are not steps they were scheduled in."
        )
    return " ".join(parts)


def diagnose_matched(a: LatencyAnalysis, phase: str, lv: A.LevelResult | None) -> str:
    m = a.seconds.get(phase, {}).get("matched") or {}
    parts = []
    terms = [(k, v) for k, v in m.items() if k in S.GPU_TERMS and isinstance(v, dict)]
    shared_alone = sum((v.get("share_alone") or 0) for k, v in terms if k in ("weights", "overhead"))
    shared_load = sum((v.get("share_under_load") or 0) for k, v in terms if k in ("weights", "overhead"))
    if terms and shared_alone - shared_load >= 0.2:
        parts.append(
            f"Alone, the weight read and the per-step overhead are {shared_alone:.0%} of a request's GPU "
            f"seconds; under load, split over the requests of each step, {shared_load:.0%}. Batching "
            "amortises them, so under load a request's GPU seconds rank by its own prefill and KV reads, "
            "alone mostly by its number of steps (output tokens): the cost of a request under load is "
            "not its cost alone."
        )
    if terms:
        parts.append(
            "GPU seconds under load by term (share; r with the same term alone): "
            + ", ".join(
                f"{k} {v['share_under_load']:.0%}; {_fmt(v['pearson_load_vs_alone'], 2)}"
                for k, v in terms
                if v.get("share_under_load") is not None
            )
            + "."
        )
        shared = shared_load
        if shared >= 0.3 and shared_alone - shared_load < 0.2:
            parts.append(
                f"{shared:.0%} of it is the weight read and the per-step overhead, split evenly over the "
                "requests of each step: a request's share follows how many steps it lived through and "
                "how full they were, not its own work."
            )
    if m.get("computed_prefill_equal") is not None and m["computed_prefill_equal"] < 0.9:
        parts.append(
            f"Only {m['computed_prefill_equal']:.0%} of the matched pairs computed the same prefill (the "
            "prefix cache hit differently under load): the work itself differed."
        )
    if lv is not None:
        gpu = lv.get(MATCHED_GPU)
        if gpu is not None:
            parts.append(
                f"Its GPU seconds under load (its share of the batched steps, by design not its cost "
                f"alone) rank it ρ = {_fmt(gpu.corr.spearman)}."
            )
        r_inf = lv.get(MATCHED_INFERENCE)
        if r_inf is not None:
            parts.append(
                f"For comparison, the request's own inference time under load ranks it ρ = "
                f"{_fmt(r_inf.corr.spearman)} against alone."
            )
    return " ".join(parts)


def seconds_targets(a: LatencyAnalysis) -> list[Target]:
    """The targets of the engine hook's seconds (docs/cost-model.md §5b), from this run."""
    out: list[Target] = []
    alone = _alone(a)
    if alone is None:
        return out
    t, lv = a.phase_requests.get(alone.name), a.level("request", alone.name)
    if t is None or lv is None or lv.get(A.PREDICTED) is None:
        out.append(
            Target(
                "c=1 r(predicted_seconds, inference_s)",
                f"≥ {TARGET_R_PREDICTED}",
                None,
                None,
                "no predicted_seconds in the request log: run with the engine hook",
            )
        )
        return out
    pm = lv.get(A.PREDICTED)
    gm = lv.get(A.GPU_SECONDS)
    detail = f"{_ci(pm.corr.pearson_ci)}; Spearman ρ {_corr_cell(pm.corr, 'spearman')}"
    if gm is not None:
        detail += f"; GPU seconds: r {_corr_cell(gm.corr)}, ρ {_corr_cell(gm.corr, 'spearman')}"
    out.append(
        _at_least(
            "c=1 r(predicted_seconds, inference_s)",
            TARGET_R_PREDICTED,
            pm.corr.pearson,
            detail,
            partial(diagnose_predicted, a, lv, t),
            pm.corr.pearson_ci,
        )
    )
    rivals = [
        m
        for m in lv.metrics
        if (m.kind == "baseline" or m.name == A.PRIMARY)
        and math.isfinite(m.versus.get(A.PREDICTED, (math.nan,))[0])
    ]
    if rivals:
        closest = min(rivals, key=lambda m: m.versus[A.PREDICTED][0])
        d = closest.versus[A.PREDICTED]
        met = _met(d[0], all(m.versus[A.PREDICTED][0] > 0 for m in rivals))
        sig = sum(1 for m in rivals if m.versus[A.PREDICTED][1] > 0)
        out.append(
            Target(
                "c=1 predicted_seconds above every token baseline and PTE served",
                "r(predicted) − r(each) > 0",
                d[0],
                met,
                f"closest: {closest.name} (r {_fmt(closest.corr.pearson)}), r(predicted) − r = {d[0]:+.3f}, "
                f"{_ci((d[1], d[2]))}; the interval excludes 0 for {sig} of {len(rivals)}",
                "" if met else diagnose_predicted(a, lv, t),
                (d[1], d[2]),
            )
        )
    att = a.seconds.get(alone.name, {}).get("attribution")
    if att is not None:
        out.append(
            _at_least(
                "c=1 gpu_seconds / inference_s (median)",
                TARGET_ATTRIBUTION,
                att.median,
                f"{_ci(att.median_ci)}; share of requests ≥ {TARGET_ATTRIBUTION}: {att.share_at_least:.1%} "
                f"({_ci(att.share_ci)}); p10 {att.quantiles['p10']:.3f}, p90 {att.quantiles['p90']:.3f}",
                partial(diagnose_attribution, a, alone.name, t),
                att.median_ci,
            )
        )
    for p in sorted(a.phases, key=lambda p: p.concurrency):
        if p.concurrency <= 1:
            continue
        d = a.seconds.get(p.name, {})
        cov = d.get("coverage")
        if cov is not None:
            out.append(
                _at_least(
                    f"c={p.concurrency} latency explained / (inference_s + queued_s) (median)",
                    TARGET_COVERAGE,
                    cov.median,
                    f"{_ci(cov.median_ci)}; p05 {cov.quantiles['p05']:.3f}, p95 {cov.quantiles['p95']:.3f}; "
                    f"share ≥ {TARGET_COVERAGE}: {cov.share_at_least:.1%}",
                    partial(diagnose_coverage, a, p.name),
                    cov.median_ci,
                )
            )
        mlv = a.level("matched", p.name)
        mm = mlv.get(MATCHED_PRIMARY) if mlv is not None else None
        if mm is not None:
            out.append(
                _at_least(
                    f"c={p.concurrency} Spearman(predicted_seconds under load, inference_s alone)",
                    TARGET_MATCHED_RHO,
                    mm.corr.spearman,
                    f"{_ci(mm.corr.spearman_ci)}; {mm.corr.n} requests matched by session and turn; "
                    f"Pearson {_corr_cell(mm.corr)}",
                    partial(diagnose_matched, a, p.name, mlv),
                    mm.corr.spearman_ci,
                )
            )
    return out


def step_model_targets(a: LatencyAnalysis) -> list[Target]:
    """The calibrated four-term model on the steps: as the engine priced each one step ahead
    (its online fit of the moment at the host's speed) when the step log has it, else one fit
    of the whole log; the whole-log fit, with and without the host's speed, and theory beside."""
    sm = a.step_model
    if sm is None:
        return []
    out = []
    name = SM.LIVE if sm.get(SM.LIVE, "all") is not None else SM.FITTED
    label = "engine's online fit × host speed, one step ahead" if name == SM.LIVE else "four-term fit"

    def beside(subset: str, value: Any) -> str:
        return "".join(
            f"; {m} {value(o)}"
            for m in (SM.FITTED, SM.FITTED_SPEED, SM.THEORY)
            if m != name and (o := sm.get(m, subset)) is not None
        )

    sc = sm.get(name, "all")
    if sc is not None:
        met = _met(sc.mape, sc.mape <= TARGET_STEP_MAPE)
        why = "" if met else SM.explain_step_miss(sm, "all", "mape")
        if not met and sm.get(SM.THEORY, "all") is not None:
            why += " " + SM.explain_theory(sm) + "."
        out.append(
            Target(
                f"step MAPE, {label}, all steps",
                f"≤ {TARGET_STEP_MAPE:.0%}",
                sc.mape,
                met,
                f"{_ci(sc.mape_ci)}; median APE {sc.median_ape:.1%}, R² {_fmt(sc.r2)}, n {sc.n}"
                + beside("all", lambda o: f"{o.mape:.1%}"),
                why.strip(),
                sc.mape_ci,
            )
        )
    sd = sm.get(name, "decode-only")
    if sd is not None:
        out.append(
            _at_least(
                f"step r, {label}, decode-only steps",
                TARGET_STEP_R_DECODE,
                sd.corr.pearson,
                f"{_ci(sd.corr.pearson_ci)}; MAPE {sd.mape:.1%}, n {sd.n}"
                + beside("decode-only", lambda o: f"r {_fmt(o.corr.pearson)}"),
                partial(SM.explain_step_miss, sm, "decode-only", "r"),
                sd.corr.pearson_ci,
            )
        )
    return out


def evaluate_targets(a: LatencyAnalysis) -> list[Target]:
    out: list[Target] = [*seconds_targets(a), *step_model_targets(a)]
    phases = sorted(a.phases, key=lambda p: p.concurrency)
    for p in phases:
        lv = a.level("request", p.name)
        if lv is None:
            continue
        prim = lv.get(A.PRIMARY)
        r = prim.corr.pearson if prim else math.nan
        label = "alone (concurrency 1)" if p.concurrency == 1 else f"under load (concurrency {p.concurrency})"
        out.append(
            _at_least(
                f"request r(PTE served, inference_s), {label}",
                TARGET_R,
                r,
                f"95% CI {_fmt(prim.corr.pearson_ci[0])}–{_fmt(prim.corr.pearson_ci[1])}" if prim else "",
                partial(diagnose_request, a, lv),
                prim.corr.pearson_ci if prim else None,
            )
        )
        best = lv.best("baseline")
        if prim is not None and best is not None:
            beats = bool(r > best.corr.pearson)
            d = prim.corr.pearson - best.corr.pearson
            diff = next((m.primary_minus_this for m in lv.metrics if m.name == best.name), None)
            sig = ""
            if diff is not None and math.isfinite(diff[1]):
                sig = f"; r(PTE) − r({best.name}) = {d:+.3f}, 95% CI {diff[1]:+.3f}…{diff[2]:+.3f}"
            out.append(
                Target(
                    f"PTE served beats every baseline at request level, {label}",
                    "r above the best baseline",
                    d,
                    beats,
                    f"best baseline {best.name} r = {_fmt(best.corr.pearson)}{sig}",
                    "" if beats else diagnose_request(a, lv),
                    (diff[1], diff[2]) if diff else None,
                )
            )
    lv = a.level("step", "all")
    if lv is not None:
        m = lv.get(A.STEP_MODEL)
        out.append(
            _at_least(
                "step r(calibrated model, dt_s), all phases",
                TARGET_R,
                m.corr.pearson if m else math.nan,
                f"{a.step_fit.formula()} (R² {a.step_fit.r2:.3f})" if a.step_fit else "",
                partial(diagnose_step, a),
                m.corr.pearson_ci if m else None,
            )
        )
        pm = lv.get(A.STEP_PTE)
        if pm is not None:
            out.append(
                _at_least(
                    "step r(PTE at logged γ, dt_s), all phases",
                    TARGET_R,
                    pm.corr.pearson,
                    "the γ the plugin priced with, no fitting",
                    partial(diagnose_step, a),
                    pm.corr.pearson_ci,
                )
            )
    elif a.steps is None:
        out.append(
            Target(
                "step r(calibrated model, dt_s)",
                f"≥ {TARGET_R}",
                None,
                None,
                "no step log: run with the engine hook",
            )
        )
    if a.robustness:
        std = [p for p in a.robustness if not p.device.startswith("measured")]
        worst = min(std, key=lambda p: p.spearman_vs_default)
        met = bool(worst.spearman_vs_default > TARGET_RHO)
        out.append(
            Target(
                "robustness: Spearman ρ of request rankings vs the default profile, every datasheet profile",
                f"> {TARGET_RHO}",
                worst.spearman_vs_default,
                met,
                f"lowest: {worst.device}",
                ""
                if met
                else "γ varies across profiles by the HOI ratio; requests whose decode share "
                "differs rank differently when decode gets cheaper or dearer.",
            )
        )
    return out


# ---------------------------------------------------------------------------------------
# Writers
# ---------------------------------------------------------------------------------------


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def strict_json(o: Any) -> Any:
    """NaN/inf → None everywhere (strict JSON)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: strict_json(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [strict_json(v) for v in o]
    if isinstance(o, np.generic):
        return strict_json(o.item())
    return o


def report_dict(a: LatencyAnalysis | None, meta: Mapping[str, Any]) -> dict[str, Any]:
    return strict_json(
        {"benchmark": "latency", **meta, **({"analysis": a.to_dict()} if a is not None else {})}
    )


def write_report(
    a: LatencyAnalysis | None, meta: Mapping[str, Any], out_dir: str | Path, plots: bool = True
) -> list[Path]:
    """report.json, report.md and (when matplotlib is present) PNG plots in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = report_dict(a, meta)
    files = []
    p = out / "report.json"
    p.write_text(json.dumps(data, indent=2, sort_keys=True, default=_json_default, allow_nan=False) + "\n")
    files.append(p)
    pngs: list[Path] = []
    if plots and a is not None:
        try:
            pngs = make_plots(a, out)
        except ImportError as e:
            data.setdefault("notes", []).append(f"no plots: {e}")
    p = out / "report.md"
    p.write_text(markdown(a, data, [q.name for q in pngs]))
    files.append(p)
    return files + pngs


def _corr_cell(c: A.Corr, which: str = "pearson") -> str:
    v = getattr(c, which)
    lo, hi = getattr(c, f"{which}_ci")
    if not math.isfinite(v):
        return "n/a"
    return f"{v:.3f} [{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) else f"{v:.3f}"


def _diff_cell(d: tuple[float, float, float] | None) -> str:
    if d is None or not math.isfinite(d[0]):
        return "—"
    return f"{d[0]:+.3f} [{d[1]:+.2f}, {d[2]:+.2f}]" if math.isfinite(d[1]) else f"{d[0]:+.3f}"


def level_table(lv: A.LevelResult) -> list[str]:
    refs = [r for r in lv.references if lv.get(r) is not None]
    head = "".join(f" r({r}) − r(metric) [95% CI] |" for r in refs)
    rows = [
        f"| metric | kind | Pearson r [95% CI] | Spearman ρ [95% CI] | r({lv.primary}) − r(metric) [95% CI] |{head}",
        "|---|---|---|---|---|" + "---|" * len(refs),
    ]
    for m in sorted(lv.metrics, key=lambda m: -(m.corr.pearson if math.isfinite(m.corr.pearson) else -9)):
        name = f"**{m.name}**" if m.name == lv.primary or m.name in refs else m.name
        more = "".join(f" {_diff_cell(m.versus.get(r))} |" for r in refs)
        rows.append(
            f"| {name} | {m.kind} | {_corr_cell(m.corr)} | {_corr_cell(m.corr, 'spearman')} | "
            f"{_diff_cell(m.primary_minus_this)} |{more}"
        )
    return rows


def _ratio_cell(r: S.RatioSummary | None) -> str:
    if r is None or not math.isfinite(r.median):
        return "n/a"
    lo, hi = r.median_ci
    return f"{r.median:.3f} [{lo:.3f}, {hi:.3f}]" if math.isfinite(lo) else f"{r.median:.3f}"


def seconds_section(a: LatencyAnalysis) -> list[str]:
    """Per phase: the attribution check, latency explained coverage, gaps between steps."""
    rows = [d for d in a.seconds.values() if d.get("attribution") is not None]
    if not rows:
        return []
    L = [
        "## Engine seconds per request",
        "",
        "GPU seconds: the request's share of each measured step it was in; latency explained: those "
        "steps' durations + its queue time (docs/cost-model.md §5b). Medians with 95% bootstrap intervals.",
        "",
        f"| phase | n | gpu_seconds / inference_s | share ≥ {TARGET_ATTRIBUTION} | p10–p90 | latency explained / "
        f"(inference + queue) | share ≥ {TARGET_COVERAGE} | p05–p95 | interference share (median) | gap between "
        "steps (median ms) | preempted |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, d in a.seconds.items():
        at, cov = d.get("attribution"), d.get("coverage")
        if at is None or cov is None:
            continue
        g = d.get("gaps_between_steps") or {}
        gap = "n/a" if g.get("median_s") is None else f"{g['median_s'] * 1e3:.2f}"
        L.append(
            f"| {name} | {at.n} | {_ratio_cell(at)} | {at.share_at_least:.1%} | {at.quantiles['p10']:.3f}–"
            f"{at.quantiles['p90']:.3f} | {_ratio_cell(cov)} | {cov.share_at_least:.1%} | "
            f"{cov.quantiles['p05']:.3f}–{cov.quantiles['p95']:.3f} | {_fmt(d.get('interference_share_median'))} | "
            f"{gap} | {d.get('preempted_share', 0):.1%} |"
        )
    L.append("")
    for name, d in a.seconds.items():
        m = d.get("matched")
        if m and m.get("n"):
            L.append(
                f"- {name}: {m['n']} requests matched to the same request alone; equal prompt tokens "
                f"{_pct(m.get('prompt_tokens_equal'))}, output tokens {_pct(m.get('output_tokens_equal'))}, "
                f"computed prefill {_pct(m.get('computed_prefill_equal'))}; median GPU seconds under load ÷ "
                f"alone {_fmt(m.get('gpu_seconds_load_over_alone_median'))}"
            )
    L.append("")
    return L


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0%}"


def step_model_section(a: LatencyAnalysis) -> list[str]:
    sm = a.step_model
    if sm is None:
        return []
    L = [
        "## Step-time model (four terms)",
        "",
        "t_step ≈ a·prefill + b·ctx + w·memory_bound + o (docs/cost-model.md §5b), fitted on all steps of the "
        "phases with `pte_instrument.cost.step_time.fit` (theory as the prior), scored beside theory alone, "
        "the engine's online fit at the end of the run, the whole-log fit at the host's speed of the steps before "
        "each, and the engine's own one-step-ahead price of each step (the step log's `model_s`: its fit of the "
        "moment at the host's speed).",
        "",
        "| model | a (s/prefill token) | b (s/context token) | w (s/memory-bound step) | o (s/step) | γ = b/a | w/a (PTE) | source |",
        "|---|---|---|---|---|---|---|---|",
    ]
    models = [(SM.FITTED, sm.fit.model)]
    if sm.theory is not None:
        models.append((SM.THEORY, sm.theory.model))
    if sm.online is not None:
        models.append((SM.ONLINE, sm.online))
    for name, m in models:
        L.append(
            f"| {name} | {m.a:.4g} | {m.b:.4g} | {m.w:.4g} | {m.o:.4g} | {_fmt(m.gamma_measured, 5)} | "
            f"{_fmt(m.weights_pte, 1)} | {m.source} |"
        )
    if sm.fit.from_prior:
        L.append(
            f"\nTerms taken from the prior (not identifiable on these steps): {', '.join(sm.fit.from_prior)}."
        )
    L += [
        "",
        "| model | steps | n | MAPE [95% CI] | median APE | R² | Pearson r [95% CI] | Spearman ρ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for sc in sm.scores:
        ci = f" [{sc.mape_ci[0]:.1%}, {sc.mape_ci[1]:.1%}]" if math.isfinite(sc.mape_ci[0]) else ""
        L.append(
            f"| {sc.model} | {sc.subset} | {sc.n} | {sc.mape:.1%}{ci} | {sc.median_ape:.1%} | {_fmt(sc.r2)} | "
            f"{_corr_cell(sc.corr)} | {_fmt(sc.corr.spearman)} |"
        )
    L += [
        "",
        "Error of the four-term fit by the term that dominates each step's prediction:",
        "",
        "| steps | dominant term | steps | share | MAPE | share of Σ APE | share of Σ squared error | median (pred − dt)/dt |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for subset in ("all", "decode-only"):
        for e in sm.errors.get(subset, []):
            L.append(
                f"| {subset} | {SM.TERM_NAMES[e.term]} | {e.steps} | {e.step_share:.1%} | {e.mape:.1%} | "
                f"{e.ape_share:.1%} | {e.sq_share:.1%} | {e.bias:+.1%} |"
            )
    leads = sm.leads.get("all") or {}
    if leads:
        L += [
            "",
            "r of the relative residual with what the model leaves out (all steps): "
            + ", ".join(f"{k} {_fmt(v, 2)}" for k, v in leads.items()),
        ]
    if sm.theory_errors:
        L += ["", "- " + SM.explain_theory(sm)]
    if sm.theory is not None and sm.theory.notes:
        L += [f"- {n}" for n in sm.theory.notes]
    L.append("")
    return L


def _cal_rows(name: str, c: Calibration) -> str:
    return (
        f"| {name} | {c.n} | {c.r2:.3f} | {_fmt(c.gamma_measured, 5)} [{_fmt(c.gamma_ci[0], 5)}, "
        f"{_fmt(c.gamma_ci[1], 5)}] | {_fmt(c.gamma_theory, 5) if c.gamma_theory else 'n/a'} | "
        f"{_fmt(c.const_pte, 1)} | {c.formula()} |"
    )


def _analysed(data: Mapping[str, Any]) -> str:
    an = data.get("analysed") or {}
    if not an:
        return ""
    return f"; analysed {an.get('date')} with `{an.get('git_commit')}`{' (dirty)' if an.get('git_dirty') else ''}"


# Load average above which the report says other work shared the host: the run's own engine,
# API server and client keep about 2 processes runnable (1.9–2.3 measured with nothing else).
LOAD_NOTE_ABOVE = 3.0


def _load_note(data: Mapping[str, Any]) -> list[str]:
    """One line when the host was loaded by other work during the run (load average > 3)."""
    loads = [
        (data.get("machine") or {}).get("load_avg_1m"),
        data.get("load_avg_1m_end"),
        *((p or {}).get("load_avg_1m_end") for p in data.get("phases_run") or []),
    ]
    loads = [float(v) for v in loads if isinstance(v, (int, float))]
    if not loads or max(loads) <= LOAD_NOTE_ABOVE:
        return []
    return [
        f"**Timings were taken with other load on the machine**: 1-minute load average up to {max(loads):.1f} "
        f"(sampled at the start, at the end of each phase and of the run) on "
        f"{(data.get('machine') or {}).get('cpu_count')} CPUs; step and request times carry that jitter."
    ]


def markdown(a: LatencyAnalysis | None, data: Mapping[str, Any], pngs: Sequence[str]) -> str:
    m = data.get("machine", {})
    cfg = data.get("config", {})
    load_end = data.get("load_avg_1m_end")
    L = [
        f"# Latency bench — {cfg.get('model_preset', '?')} model, {data.get('date', '?')}",
        "",
        f"Machine: `{m.get('hostname')}` — {m.get('platform')}, {m.get('cpu_count')} CPUs "
        f"({m.get('affinity_cpus')} usable), load avg {m.get('load_avg_1m')} at start"
        + ("" if load_end is None else f", {load_end} at end")
        + f"; python {m.get('python')}, torch {m.get('torch') or '-'}, vLLM {m.get('vllm') or '-'}.",
        f"Code: `{data.get('git_commit')}`{' (working tree dirty)' if data.get('git_dirty') else ''}"
        + _analysed(data)
        + ".",
        *_load_note(data),
        "",
        "Configuration:",
        "",
        "```json",
        json.dumps(cfg, indent=1, sort_keys=True, default=str),
        "```",
        "",
    ]
    if a is None:
        return "\n".join([*L, "No analysis (the run failed before any request was logged).", ""])
    L += ["## Targets", "", "| target | wanted | measured | 95% CI | met |", "|---|---|---|---|---|"]
    for t in a.targets:
        met = {True: "yes", False: "**no**", None: "n/a"}[t.met]
        ci = (
            "–" if t.ci is None or not all(math.isfinite(v) for v in t.ci) else f"{t.ci[0]:.3f}–{t.ci[1]:.3f}"
        )
        L.append(f"| {t.name} | {t.target} | {_fmt(t.value, 4)} | {ci} | {met} |")
    L.append("")
    for t in a.targets:
        if t.detail or t.diagnosis:
            L.append(f"- **{t.name}** — {t.detail}" + (f"\n  - *Why:* {t.diagnosis}" if t.diagnosis else ""))
    L.append("")
    for n in [*a.notes, *data.get("notes", [])]:
        L.append(f"> {n}")
    cm = a.cost_model
    L += [
        "## Cost model",
        "",
        f"- γ the plugin priced with: {_fmt(cm.get('gamma_logged'), 5)} (device `{cm.get('device_logged')}`, "
        f"HOI {_fmt(cm.get('hoi_logged'), 2)})",
        f"- γ calibrated on measured time: {_fmt(cm.get('gamma_calibrated'), 5)} ({cm.get('gamma_calibrated_source')})",
    ]
    hm = cm.get("host_measured")
    if hm:
        L.append(
            f"- host measured ({hm['source']}): HOI {hm['hoi']:.2f} → γ implied {hm['gamma_implied']:.5g}"
        )
    L += [
        "",
        "| fit | n | R² | γ measured [95% CI] | γ theory | c/a (per-step constant, prefill tokens) | model |",
        "|---|---|---|---|---|---|---|",
    ]
    if a.step_fit:
        L.append(_cal_rows("steps, all phases", a.step_fit))
    if a.step_fit_decode:
        L.append(_cal_rows("steps, + decode term", a.step_fit_decode))
    for k, c in a.phase_step_fits.items():
        L.append(_cal_rows(f"steps, {k}", c))
    if a.request_fit:
        L.append(_cal_rows("requests at concurrency 1", a.request_fit))
    L.append("")
    for c in (a.step_fit, a.request_fit):
        if c is not None:
            L.append(f"- {explain_shares(c)}; terms: " + ", ".join(TERM_LABELS.get(k, k) for k in c.terms))
    L.append("")
    L += seconds_section(a)
    L += step_model_section(a)
    for lv in a.levels:
        title = {
            "step": "Step level",
            "request": "Request level",
            "turn": "Turn level",
            "matched": "Request level, under load vs the same request alone",
        }[lv.level]
        L += [f"## {title} — {lv.phase} ({lv.time}, n = {lv.n})", ""]
        if lv.note:
            L += [lv.note, ""]
        L += [*level_table(lv), ""]
    if a.robustness:
        L += [
            "## Robustness across device profiles",
            "",
            "| device | HOI | γ | Spearman ρ vs default | r(PTE served, inference_s) |",
            "|---|---|---|---|---|",
        ]
        for p in a.robustness:
            L.append(
                f"| {p.device} | {p.hoi:.2f} | {p.gamma:.5g} | {_fmt(p.spearman_vs_default, 4)} | {_fmt(p.pearson_vs_time)} |"
            )
        L.append("")
    phases = data.get("phases_run") or []
    if phases:
        L += [
            "## Phases",
            "",
            "| phase | concurrency | sessions | turns | errors | cut short | wall s | prompt tok | cached | output tok |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p in phases:
            L.append(
                f"| {p.get('name')} | {p.get('concurrency')} | {p.get('sessions')} | {p.get('turns_done')} | "
                f"{p.get('errors')} | {p.get('sessions_cut_short')} | {p.get('wall_s')} | {p.get('prompt_tokens')} | "
                f"{p.get('cached_tokens')} | {p.get('output_tokens')} |"
            )
        L.append("")
    if pngs:
        L += ["## Plots", "", *(f"![{p}]({p})" for p in pngs), ""]
    return "\n".join(L)


# ---------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------


REQUEST_PLOT = (
    A.OUTPUT_TOKENS,
    "total tokens",
    "price 1:3",
    A.PRIMARY,
    A.PTE_CALIBRATED,
    A.ROOFLINE_ENGINE,
)
STEP_PLOT = ("decode tokens", "total tokens", A.STEP_PTE, A.STEP_MODEL)


def _scatter_grid(
    plt: Any,
    metrics: Sequence[A.Metric],
    time: np.ndarray,
    lv: A.LevelResult | None,
    title: str,
    ylabel: str,
    path: Path,
    log: bool = False,
) -> Path:
    """One panel per metric; ``log`` puts both axes on log scales where the values allow it
    (steps span four decades: a lone decode token to a 2k-token prefill chunk)."""
    n = len(metrics)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, m in zip(axes.ravel(), metrics, strict=False):
        ax.scatter(m.values, time, s=6, alpha=0.5, linewidths=0)
        r = lv.get(m.name).corr.pearson if lv and lv.get(m.name) else A.pearson(m.values, time)
        ax.set_title(f"{m.name}\nr = {r:.3f}", fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        if log and np.nanmin(time) > 0:
            ax.set_yscale("log")
            if np.nanmin(m.values) > 0:
                ax.set_xscale("log")
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path, dpi=110)


def make_plots(a: LatencyAnalysis, out: Path) -> list[Path]:
    plt = pyplot()
    files = []
    gamma_cal = a.cost_model.get("gamma_calibrated")
    for p in a.phases:
        t = a.phase_requests.get(p.name)
        if t is None or len(t) < 3:
            continue
        ms = [m for m in A.request_metrics(t, gamma_cal, a.request_fit) if m.name in REQUEST_PLOT]
        files.append(
            _scatter_grid(
                plt,
                ms,
                t["inference_s"],
                a.level("request", p.name),
                f"request level, concurrency {p.concurrency}: cost vs inference time",
                "inference s",
                out / f"scatter-request-{p.name}.png",
            )
        )
    if a.steps is not None:
        ms = [m for m in _step_metrics(a.steps, a.step_fit, a.step_fit_decode) if m.name in STEP_PLOT]
        files.append(
            _scatter_grid(
                plt,
                ms,
                a.steps["dt_s"] * 1e3,
                a.level("step", "all"),
                "step level, all phases: predicted cost vs measured step time (log scales)",
                "step ms",
                out / "scatter-step.png",
                log=True,
            )
        )
    if a.turn_profiles:
        n = len(a.turn_profiles)
        fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 3.6), squeeze=False)
        for ax, (name, prof) in zip(axes[0], a.turn_profiles.items(), strict=True):
            turns = np.asarray(prof["turn"])
            for key, label in (
                ("pte_served", "PTE served"),
                ("prompt_tokens", "prompt tokens"),
                ("output_tokens", "output tokens"),
                ("inference_s", "inference time"),
            ):
                v = np.asarray([np.nan if x is None else x for x in prof[key]], dtype=float)
                if np.isfinite(v).any() and np.nanmax(v) > 0:
                    ax.plot(turns, v / np.nanmax(v), marker="o", ms=3, label=label)
            ax.set_xlabel("turn")
            ax.set_ylabel("mean per turn ÷ its maximum")
            ax.set_title(f"per-turn cost escalation, {name}", fontsize=9)
            ax.legend(fontsize=7)
        files.append(save_figure(fig, out / "turns.png", dpi=110))
    return files
