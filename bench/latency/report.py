"""Analyse a latency run's logs and write the report: ``report.json``, ``report.md`` and PNG
plots (matplotlib, Agg backend, imported only when plotting).

The report states, for each target, the measured figure, whether it was met, and when it
was not, which term of the fitted time model dominates the measured time and why PTE (or
the calibrated model) cannot follow it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pte_instrument.cost.devices import DEFAULT_DEVICE, PROFILES, DeviceProfile

from . import analysis as A
from .calibrate import TERM_LABELS, Calibration, calibrate_requests, calibrate_steps, explain_shares

TARGET_R = 0.95
TARGET_RHO = 0.95

# ---------------------------------------------------------------------------------------
# Analysis of one run
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One workload phase: its requests carry session ids ``<prefix>-…``; its steps fall in
    [t_start, t_end] (the engine stamps steps with the same wall clock)."""

    name: str
    concurrency: int
    t_start: float
    t_end: float
    session_prefix: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Target:
    name: str
    target: str
    value: float | None
    met: bool | None  # None: could not be evaluated
    detail: str = ""
    diagnosis: str = ""

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
        }


def _phase_of_requests(t: A.RequestTable, p: Phase) -> np.ndarray:
    by_session = np.array([str(s).startswith(p.session_prefix + "-") for s in t.session_id], dtype=bool)
    if by_session.any():
        return by_session
    # No session ids in the log (session routes off): fall back to finish times.
    fin = t["finished_at"]
    return np.isfinite(fin) & (fin >= p.t_start) & (fin <= p.t_end + 5.0)


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
) -> LatencyAnalysis:
    """Everything the report shows, from the two logs and the phase windows."""
    notes: list[str] = []
    req = A.usable_requests(A.request_table(A.load_jsonl(requests_path)))
    steps = A.load_steps(steps_path) if steps_path else None
    if steps is not None:
        steps = A.usable_steps(steps)
        if len(steps) < 10:
            steps = None
    if steps is None:
        notes.append("no step log (engine hook off, or it wrote nothing): step-level validation and the "
                     "step calibration are skipped; request and turn levels only")  # fmt: skip
    phase_req = {p.name: req.select(_phase_of_requests(req, p)) for p in phases}
    phase_steps: dict[str, A.StepTable] = {}
    if steps is not None:
        for p in phases:
            sel = (steps["t"] >= p.t_start) & (steps["t"] <= p.t_end)
            if sel.sum() >= 10:
                phase_steps[p.name] = steps.select(sel)
        in_phases = np.zeros(len(steps), dtype=bool)
        for p in phases:
            in_phases |= (steps["t"] >= p.t_start) & (steps["t"] <= p.t_end)
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
    gamma_cal = step_fit.gamma_measured if step_fit is not None else (
        request_fit.gamma_measured if request_fit is not None else None)  # fmt: skip

    # --- cost model actually used by the plugin ---
    gamma = float(np.nanmedian(req["gamma"])) if len(req) else math.nan
    hoi = float(np.nanmedian(req["hoi"])) if len(req) else math.nan
    cost_model: dict[str, Any] = {
        "gamma_logged": gamma, "hoi_logged": hoi, "device_logged": req.device[0] if len(req) else None,
        "gamma_calibrated": gamma_cal,
        "gamma_calibrated_source": "step log" if step_fit is not None else ("requests at concurrency 1" if request_fit else None),
    }  # fmt: skip
    if steps is not None and steps.header:
        cost_model["step_log_header"] = steps.header
    if host_profile is not None and math.isfinite(gamma) and hoi > 0:
        cost_model["host_measured"] = {
            "name": host_profile.name, "hoi": host_profile.hoi, "peak_flops": host_profile.peak_flops,
            "mem_bandwidth": host_profile.mem_bandwidth, "source": host_profile.source,
            "gamma_implied": gamma * host_profile.hoi / hoi,
        }  # fmt: skip

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
            levels.append(A.evaluate("step", name, "dt_s", s["dt_s"], _step_metrics(s, step_fit, step_fit_dec),
                                     "PTE (logged γ)", n_boot, seed))  # fmt: skip
    turn_profiles: dict[str, Any] = {}
    for p in phases:
        t = phase_req[p.name]
        if len(t) < 3:
            notes.append(f"phase {p.name}: only {len(t)} usable requests in the log; not analysed")
            continue
        rm = A.request_metrics(t, gamma_cal, request_fit)
        levels.append(A.evaluate("request", p.name, "inference_s", t["inference_s"], rm, A.PRIMARY, n_boot, seed,
                                 note=f"concurrency {p.concurrency}"))  # fmt: skip
        if (t.turn > 0).any():
            has = t.turn > 0
            tt = t.select(has)
            levels.append(A.evaluate_turns(p.name, tt.session_id, tt.turn, "inference_s", tt["inference_s"],
                                           A.request_metrics(tt, gamma_cal, request_fit), A.PRIMARY, n_boot, seed))  # fmt: skip
            turn_profiles[p.name] = A.turn_profile(tt.session_id, tt.turn, {
                "prompt_tokens": tt["prompt_tokens"], "cached_tokens": tt["cached_tokens"],
                "output_tokens": tt["output_tokens"], "pte_served": tt["pte_served"],
                "pte_reference": tt["pte_reference"], "inference_s": tt["inference_s"],
            })  # fmt: skip

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

    out = LatencyAnalysis(
        phases=list(phases), requests=req, steps=steps, phase_requests=phase_req, phase_steps=phase_steps,
        step_fit=step_fit, step_fit_decode=step_fit_dec, phase_step_fits=phase_fits, request_fit=request_fit,
        levels=levels, robustness=robust, turn_profiles=turn_profiles, cost_model=cost_model, notes=notes,
    )  # fmt: skip
    out.targets = evaluate_targets(out)
    return out


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
                f"read (roofline r = {_fmt(_r(lv, 'roofline (engine)'))}), output tokens count the steps "
                f"(r = {_fmt(_r(lv, 'output tokens'))})."
            )
        r_fit = _r(lv, "fitted request model")
        if math.isfinite(r_fit):
            parts.append(f"A linear model with a per-step term reaches r = {r_fit:.3f} on the same requests "
                         "(fitted on them: an upper bound for this shape of model).")  # fmt: skip
    elif a.step_fit is not None:
        parts.append(explain_shares(a.step_fit) + " (steps of all phases).")
    if not alone:
        r_out = _r(lv, "output tokens")
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
            f"r = {_fmt(_r(lv, 'PTE served (γ calibrated)'))}."
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
        parts.append(f"Adding a per-decode-token term lifts R² to {a.step_fit_decode.r2:.3f}: each decoded "
                     "token's own matmuls are not free on this device.")  # fmt: skip
    parts.append("What a linear model of (prefill, context, constant) leaves unexplained is jitter from "
                 "the host (other processes on the same cores, the API server and the client sharing them), "
                 "and prefill attention, which grows with the square of the chunk length.")  # fmt: skip
    return " ".join(parts)


def evaluate_targets(a: LatencyAnalysis) -> list[Target]:
    out: list[Target] = []
    phases = sorted(a.phases, key=lambda p: p.concurrency)
    for p in phases:
        lv = a.level("request", p.name)
        if lv is None:
            continue
        prim = lv.get(A.PRIMARY)
        r = prim.corr.pearson if prim else math.nan
        label = "alone (concurrency 1)" if p.concurrency == 1 else f"under load (concurrency {p.concurrency})"
        met = bool(r >= TARGET_R) if math.isfinite(r) else None
        out.append(Target(f"request r(PTE served, inference_s), {label}", f"≥ {TARGET_R}", r, met,
                          f"95% CI {_fmt(prim.corr.pearson_ci[0])}–{_fmt(prim.corr.pearson_ci[1])}" if prim else "",
                          "" if met else diagnose_request(a, lv)))  # fmt: skip
        best = lv.best("baseline")
        if prim is not None and best is not None:
            beats = bool(r > best.corr.pearson)
            d = prim.corr.pearson - best.corr.pearson
            diff = next((m.primary_minus_this for m in lv.metrics if m.name == best.name), None)
            sig = ""
            if diff is not None and math.isfinite(diff[1]):
                sig = f"; r(PTE) − r({best.name}) = {d:+.3f}, 95% CI {diff[1]:+.3f}…{diff[2]:+.3f}"
            out.append(Target(f"PTE served beats every baseline at request level, {label}",
                              "r above the best baseline", d, beats,
                              f"best baseline {best.name} r = {_fmt(best.corr.pearson)}{sig}",
                              "" if beats else diagnose_request(a, lv)))  # fmt: skip
    lv = a.level("step", "all")
    if lv is not None:
        m = lv.get("calibrated step model")
        r = m.corr.pearson if m else math.nan
        met = bool(r >= TARGET_R) if math.isfinite(r) else None
        out.append(Target("step r(calibrated model, dt_s), all phases", f"≥ {TARGET_R}", r, met,
                          f"{a.step_fit.formula()} (R² {a.step_fit.r2:.3f})" if a.step_fit else "",
                          "" if met else diagnose_step(a)))  # fmt: skip
        pm = lv.get("PTE (logged γ)")
        if pm is not None:
            r2 = pm.corr.pearson
            out.append(Target("step r(PTE at logged γ, dt_s), all phases", f"≥ {TARGET_R}", r2,
                              bool(r2 >= TARGET_R) if math.isfinite(r2) else None,
                              "the γ the plugin priced with, no fitting",
                              "" if r2 >= TARGET_R else diagnose_step(a)))  # fmt: skip
    elif a.steps is None:
        out.append(Target("step r(calibrated model, dt_s)", f"≥ {TARGET_R}", None, None,
                          "no step log: run with the engine hook"))  # fmt: skip
    if a.robustness:
        std = [p for p in a.robustness if not p.device.startswith("measured")]
        worst = min(std, key=lambda p: p.spearman_vs_default)
        met = bool(worst.spearman_vs_default > TARGET_RHO)
        out.append(Target("robustness: Spearman ρ of request rankings vs the default profile, every datasheet profile",
                          f"> {TARGET_RHO}", worst.spearman_vs_default, met, f"lowest: {worst.device}",
                          "" if met else "γ varies across profiles by the HOI ratio; requests whose decode share "
                          "differs rank differently when decode gets cheaper or dearer."))  # fmt: skip
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


def _clean(o: Any) -> Any:
    """NaN/inf → None everywhere (strict JSON)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, np.generic):
        return _clean(o.item())
    return o


def report_dict(a: LatencyAnalysis | None, meta: Mapping[str, Any]) -> dict[str, Any]:
    return _clean({"benchmark": "latency", **meta, **({"analysis": a.to_dict()} if a is not None else {})})


def write_report(a: LatencyAnalysis | None, meta: Mapping[str, Any], out_dir: str | Path,
                 plots: bool = True) -> list[Path]:  # fmt: skip
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


def level_table(lv: A.LevelResult) -> list[str]:
    rows = [f"| metric | kind | Pearson r [95% CI] | Spearman ρ [95% CI] | r({lv.primary}) − r(metric) [95% CI] |",
            "|---|---|---|---|---|"]  # fmt: skip
    for m in sorted(lv.metrics, key=lambda m: -(m.corr.pearson if math.isfinite(m.corr.pearson) else -9)):
        d = m.primary_minus_this
        dc = "—" if d is None or not math.isfinite(d[0]) else (
            f"{d[0]:+.3f} [{d[1]:+.2f}, {d[2]:+.2f}]" if math.isfinite(d[1]) else f"{d[0]:+.3f}")  # fmt: skip
        name = f"**{m.name}**" if m.name == lv.primary else m.name
        rows.append(f"| {name} | {m.kind} | {_corr_cell(m.corr)} | {_corr_cell(m.corr, 'spearman')} | {dc} |")
    return rows


def _cal_rows(name: str, c: Calibration) -> str:
    return (f"| {name} | {c.n} | {c.r2:.3f} | {_fmt(c.gamma_measured, 5)} [{_fmt(c.gamma_ci[0], 5)}, "
            f"{_fmt(c.gamma_ci[1], 5)}] | {_fmt(c.gamma_theory, 5) if c.gamma_theory else 'n/a'} | "
            f"{_fmt(c.const_pte, 1)} | {c.formula()} |")  # fmt: skip


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
        f"Code: `{data.get('git_commit')}`{' (working tree dirty)' if data.get('git_dirty') else ''}.",
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
    L += ["## Targets", "", "| target | wanted | measured | met |", "|---|---|---|---|"]
    for t in a.targets:
        met = {True: "yes", False: "**no**", None: "n/a"}[t.met]
        L.append(f"| {t.name} | {t.target} | {_fmt(t.value)} | {met} |")
    L.append("")
    for t in a.targets:
        if t.detail or t.diagnosis:
            L.append(f"- **{t.name}** — {t.detail}" + (f"\n  - *Why:* {t.diagnosis}" if t.diagnosis else ""))
    L.append("")
    for n in [*a.notes, *data.get("notes", [])]:
        L.append(f"> {n}")
    cm = a.cost_model
    L += ["## Cost model", "",
          f"- γ the plugin priced with: {_fmt(cm.get('gamma_logged'), 5)} (device `{cm.get('device_logged')}`, "
          f"HOI {_fmt(cm.get('hoi_logged'), 2)})",
          f"- γ calibrated on measured time: {_fmt(cm.get('gamma_calibrated'), 5)} ({cm.get('gamma_calibrated_source')})"]  # fmt: skip
    hm = cm.get("host_measured")
    if hm:
        L.append(
            f"- host measured ({hm['source']}): HOI {hm['hoi']:.2f} → γ implied {hm['gamma_implied']:.5g}"
        )
    L += ["", "| fit | n | R² | γ measured [95% CI] | γ theory | c/a (per-step constant, prefill tokens) | model |",
          "|---|---|---|---|---|---|---|"]  # fmt: skip
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
    for lv in a.levels:
        title = {"step": "Step level", "request": "Request level", "turn": "Turn level"}[lv.level]
        L += [f"## {title} — {lv.phase} ({lv.time}, n = {lv.n})", ""]
        if lv.note:
            L += [lv.note, ""]
        L += [*level_table(lv), ""]
    if a.robustness:
        L += ["## Robustness across device profiles", "",
              "| device | HOI | γ | Spearman ρ vs default | r(PTE served, inference_s) |", "|---|---|---|---|---|"]  # fmt: skip
        for p in a.robustness:
            L.append(
                f"| {p.device} | {p.hoi:.2f} | {p.gamma:.5g} | {_fmt(p.spearman_vs_default, 4)} | {_fmt(p.pearson_vs_time)} |"
            )
        L.append("")
    phases = data.get("phases_run") or []
    if phases:
        L += ["## Phases", "", "| phase | concurrency | sessions | turns | errors | cut short | wall s | prompt tok | cached | output tok |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for p in phases:
            L.append(f"| {p.get('name')} | {p.get('concurrency')} | {p.get('sessions')} | {p.get('turns_done')} | "
                     f"{p.get('errors')} | {p.get('sessions_cut_short')} | {p.get('wall_s')} | {p.get('prompt_tokens')} | "
                     f"{p.get('cached_tokens')} | {p.get('output_tokens')} |")  # fmt: skip
        L.append("")
    if pngs:
        L += ["## Plots", "", *(f"![{p}]({p})" for p in pngs), ""]
    return "\n".join(L)


# ---------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


REQUEST_PLOT = ("output tokens", "total tokens", "price 1:3", "PTE served", "PTE served (γ calibrated)",
                "roofline (engine)")  # fmt: skip
STEP_PLOT = ("decode tokens", "total tokens", "PTE (logged γ)", "calibrated step model")


def _scatter_grid(plt: Any, metrics: Sequence[A.Metric], time: np.ndarray, lv: A.LevelResult | None,
                  title: str, ylabel: str, path: Path, log: bool = False) -> Path:  # fmt: skip
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_plots(a: LatencyAnalysis, out: Path) -> list[Path]:
    plt = _pyplot()
    files = []
    gamma_cal = a.cost_model.get("gamma_calibrated")
    for p in a.phases:
        t = a.phase_requests.get(p.name)
        if t is None or len(t) < 3:
            continue
        ms = [m for m in A.request_metrics(t, gamma_cal, a.request_fit) if m.name in REQUEST_PLOT]
        files.append(_scatter_grid(plt, ms, t["inference_s"], a.level("request", p.name),
                                   f"request level, concurrency {p.concurrency}: cost vs inference time",
                                   "inference s", out / f"scatter-request-{p.name}.png"))  # fmt: skip
    if a.steps is not None:
        ms = [m for m in _step_metrics(a.steps, a.step_fit, a.step_fit_decode) if m.name in STEP_PLOT]
        files.append(_scatter_grid(plt, ms, a.steps["dt_s"] * 1e3, a.level("step", "all"),
                                   "step level, all phases: predicted cost vs measured step time (log scales)",
                                   "step ms", out / "scatter-step.png", log=True))  # fmt: skip
    if a.turn_profiles:
        n = len(a.turn_profiles)
        fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 3.6), squeeze=False)
        for ax, (name, prof) in zip(axes[0], a.turn_profiles.items(), strict=True):
            turns = np.asarray(prof["turn"])
            for key, label in (("pte_served", "PTE served"), ("prompt_tokens", "prompt tokens"),
                               ("output_tokens", "output tokens"), ("inference_s", "inference time")):  # fmt: skip
                v = np.asarray([np.nan if x is None else x for x in prof[key]], dtype=float)
                if np.isfinite(v).any() and np.nanmax(v) > 0:
                    ax.plot(turns, v / np.nanmax(v), marker="o", ms=3, label=label)
            ax.set_xlabel("turn")
            ax.set_ylabel("mean per turn ÷ its maximum")
            ax.set_title(f"per-turn cost escalation, {name}", fontsize=9)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / "turns.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files
