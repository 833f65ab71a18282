"""``pte calibrate STEPS``: the four-term step-time model (docs/cost-model.md §5b) fitted on
measured steps, beside its theory from architecture × device.

STEPS is the plugin's step log (``PTE_STEP_LOG``: a header line, then one JSON line per step;
``.gz`` read as gzip) or a CSV with a header row:

    prefill_tokens  tokens computed at prefill positions (recompute included)
    ctx             context read by decode positions, γ-weighted over KV groups
    dt_s            measured step seconds
    memory_bound    optional, 0/1. Absent: computed from the columns tokens, weights_pte and
                    pte when all three are there (tokens < weights_pte + pte − prefill_tokens,
                    the engine's roofline classification); else 1 for decode-only steps
                    (prefill_tokens = 0), 0 for the others.

Theory comes from ``--model-dir`` (the model's config.json, with ``--device``), else from the
step log's header (its γ, N_active, n_total, weight read and device; ``--device`` replaces the
device). A CSV without ``--model-dir`` is fitted without theory. Steps are taken in the
file's order for the host's speed (the model at the speed of the steps before each).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import math
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from pte_instrument.cli.errors import (
    UsageError,
    nonempty,
    output_path,
    print_json,
    report_warning,
    whole_number,
)
from pte_instrument.cost.architecture import (
    ArchitectureError,
    KVGroup,
    ModelShape,
    config_file,
    kv_dtype_bytes,
    load_config,
    parse_shape,
)
from pte_instrument.cost.devices import PROFILES, DeviceProfile, UnknownDeviceError, resolve_device
from pte_instrument.cost.model import CostModel
from pte_instrument.cost.step_time import (
    TERMS,
    UNITS,
    FitResult,
    HostSpeed,
    StepTimeModel,
    bootstrap_intervals,
    fit,
    memory_bound,
    score,
    score_predictions,
    theory,
    weighted_ctx,
)
from pte_instrument.wire import StepLogHeader, StepLogLine, decode_step_log

MIN_STEPS = 8  # fewer usable steps than this cannot say anything about four terms
# No step is this large or its dt_s this small; the fit weighs each step by 1/dt_s and squares
# its features, so past it the sums overflow.
LARGEST_VALUE = 2.0**53
DEFAULT_BOOTSTRAP = 200
LEVEL = 0.95
CSV_REQUIRED = ("prefill_tokens", "ctx", "dt_s")
CSV_ROOFLINE = ("tokens", "weights_pte", "pte")


@dataclass(frozen=True)
class Steps:
    """The features of the usable steps of one input (dt_s > 0; in a step log, tokens > 0;
    every value within ±2**53, dt_s from 2**-53 s: see :func:`_usable`)."""

    prefill: np.ndarray
    ctx: np.ndarray
    memory_bound: np.ndarray
    dt: np.ndarray
    format: str  # "step-log" or "csv"
    rows: int  # step rows read, usable or not
    header: StepLogHeader | None = None
    notes: tuple[str, ...] = ()

    @property
    def n(self) -> int:
        return int(self.dt.size)


@dataclass(frozen=True)
class Theory:
    model: StepTimeModel
    cost_model: CostModel
    weights_pte: float  # the weight read in PTE, W·HOI/(2·N_active)
    notes: tuple[str, ...] = ()


# =========================================================================== reading


def _lines(path: Path) -> Iterator[str]:
    """Text lines of a file, gzip when it ends in .gz; errors as one UsageError line."""
    try:
        raw = path.open("rb")
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    with raw:
        stream = gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw
        text = io.TextIOWrapper(stream, encoding="utf-8-sig")  # -sig: a byte-order mark is no column's
        try:
            yield from text
        except UnicodeDecodeError:
            raise UsageError(f"{path} is not UTF-8 text") from None
        except (OSError, EOFError, zlib.error) as e:  # a corrupt or truncated .gz
            raise UsageError(f"cannot read {path}: {e}") from None


def read_steps(path: str | Path) -> Steps:
    """A step log or a CSV (told apart by the first non-blank character: ``{`` is JSON)."""
    p = Path(path)
    lines = _lines(p)
    # blank: the leading blank lines, so that error messages count lines as an editor does
    for blank, line in enumerate(lines):
        if line.strip():
            rest = chain([line], lines)
            if line.lstrip().startswith("{"):
                return _read_step_log(p, rest, blank)
            return _read_csv(p, rest, blank)
    raise UsageError(f"{p} holds no steps")


def _read_step_log(path: Path, lines: Iterator[str], offset: int = 0) -> Steps:
    header: StepLogHeader | None = None
    steps: list[StepLogLine] = []
    for i, line in enumerate(lines, offset + 1):
        if not line.strip():
            continue
        try:
            entry = decode_step_log(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise UsageError(f"{path} line {i}: not a step-log line ({e})") from None
        except RecursionError:
            raise UsageError(f"{path} line {i}: not a step-log line (nested too deeply)") from None
        if isinstance(entry, StepLogHeader):
            if header is None:
                header = entry
            elif (entry.gammas, entry.weights_pte, entry.n_active) != (
                header.gammas,
                header.weights_pte,
                header.n_active,
            ):
                raise UsageError(
                    f"{path} line {i}: a second header with another cost model; calibrate one model's steps at a time"
                )
        else:
            steps.append(entry)
    if not steps:
        raise UsageError(f"{path} holds no step lines")
    groups = {len(s.ctx) for s in steps}
    if len(groups) != 1:
        raise UsageError(f"{path}: step lines have {sorted(groups)} context groups; one model per log")
    n_groups = groups.pop()
    notes: list[str] = []
    ctx = np.array([s.ctx for s in steps], dtype=np.float64).reshape(len(steps), n_groups)
    if header is not None and len(header.gammas) == n_groups:
        ctx_w = weighted_ctx(ctx, header.gammas)
    else:
        ctx_w = ctx.sum(axis=1)
        if n_groups > 1:
            notes.append("no header with γ per KV group: ctx is the plain sum over groups")
    tokens = _floats(s.tokens for s in steps)
    dt = np.array([math.nan if s.dt_s is None else s.dt_s for s in steps], dtype=np.float64)
    # The engine's classification exactly: its roofline cost exceeds T only when memory-bound.
    mb = np.array([s.roofline_pte > s.tokens for s in steps], dtype=np.float64)
    prefill = _floats(s.prefill for s in steps)
    ok = _usable(dt, prefill, ctx_w, tokens) & (tokens > 0)
    return Steps(prefill[ok], ctx_w[ok], mb[ok], dt[ok], "step-log", len(steps), header, tuple(notes))


def _read_csv(path: Path, lines: Iterator[str], offset: int = 0) -> Steps:
    reader = csv.DictReader(lines)
    columns = [c.strip() for c in reader.fieldnames or []]
    for c in (*CSV_REQUIRED, "memory_bound", *CSV_ROOFLINE):
        where = [k + 1 for k, name in enumerate(columns) if name == c]
        if len(where) > 1:  # which one the fit should read is anyone's guess: refuse, as for records
            raise UsageError(
                f"{path}: column {c} appears {len(where)} times in the header (columns "
                f"{', '.join(map(str, where))}); keep one"
            )
    missing = [c for c in CSV_REQUIRED if c not in columns]
    if missing:
        raise UsageError(
            f"{path}: CSV lacks column(s) {', '.join(missing)} (needs {', '.join(CSV_REQUIRED)}; "
            "optional memory_bound, or tokens, weights_pte and pte)"
        )
    wanted = [c for c in (*CSV_REQUIRED, "memory_bound", *CSV_ROOFLINE) if c in columns]
    values: dict[str, list[float]] = {c: [] for c in wanted}
    try:
        for row in reader:
            row = {(k or "").strip(): v for k, v in row.items()}
            for c in wanted:
                values[c].append(_number(row.get(c), c, reader.line_num + offset))
    except csv.Error as e:
        raise UsageError(f"{path} line {reader.line_num + offset}: {e}") from None
    except ValueError as e:
        raise UsageError(f"{path} {e}") from None
    cols = {c: np.array(v, dtype=np.float64) for c, v in values.items()}
    if not cols["dt_s"].size:
        raise UsageError(f"{path} holds no steps")
    notes: list[str] = []
    prefill = cols["prefill_tokens"]
    if "memory_bound" in cols:
        mb = cols["memory_bound"]
        bad = ~np.isin(mb, (0.0, 1.0))
        if bad.any():
            raise UsageError(f"{path}: memory_bound must be 0 or 1 (row {int(np.argmax(bad)) + 1})")
    elif all(c in cols for c in CSV_ROOFLINE):
        mb = memory_bound(cols["tokens"], cols["pte"] - prefill, cols["weights_pte"])
        notes.append("memory_bound computed from tokens < weights_pte + (pte − prefill_tokens)")
    else:
        mb = (prefill == 0).astype(np.float64)
        notes.append("no memory_bound column: decode-only steps (prefill_tokens = 0) taken as memory-bound")
    dt = cols["dt_s"]
    ok = _usable(dt, prefill, cols["ctx"], mb)
    return Steps(prefill[ok], cols["ctx"][ok], mb[ok], dt[ok], "csv", int(dt.size), None, tuple(notes))


def _floats(values: Iterable[int]) -> np.ndarray:
    """Counts as floats; a JSON integer too large for a float (numpy refuses it) as inf."""
    return np.array([v if abs(v) <= LARGEST_VALUE else math.inf for v in values], dtype=np.float64)


def _usable(dt: np.ndarray, *features: np.ndarray) -> np.ndarray:
    """The steps a fit can use: dt_s from 2**-53 s and every feature finite, within ±2**53.
    The fit weighs each step by 1/dt_s and squares its features: past those bounds the sums
    overflow (no real step is that short, or that large)."""
    ok = np.isfinite(dt) & (dt >= 1 / LARGEST_VALUE) & (dt <= LARGEST_VALUE)
    for f in features:
        ok &= np.isfinite(f) & (np.abs(f) <= LARGEST_VALUE)
    return ok


def _number(v: str | None, column: str, line: int) -> float:
    try:
        return float((v or "").strip())
    except ValueError:
        raise ValueError(f"line {line}: column {column}: {v!r} is not a number") from None


# =========================================================================== theory


def _device(name: str | None, header: StepLogHeader | None) -> tuple[DeviceProfile, list[str]]:
    notes: list[str] = []
    try:
        if name:
            return resolve_device(name), notes
        if header is None:
            return resolve_device("auto"), notes
        base, sep, _ = header.device.partition("@hoi=")
        if base.lower() not in PROFILES:
            raise UsageError(
                f"the step log's device {header.device!r} is no profile name: give --device "
                f"(auto, measured, {', '.join(PROFILES)})"
            )
        if sep:
            notes.append(
                f"the step log's device is {base} with HOI overridden to {header.hoi:g}: theory seconds use "
                f"{base}'s bandwidth; give --device for this host's figures"
            )
        return resolve_device(base, header.hoi if sep else None), notes
    except UnknownDeviceError as e:
        raise UsageError(str(e)) from None


def _shape_from_header(h: StepLogHeader) -> tuple[ModelShape, float]:
    """The cost-relevant shape a step-log header implies, and bytes per weight: KV bytes per
    group γ_g·2·N_active/HOI, weight bytes weights_pte·2·N_active/HOI (docs/cost-model.md §3, §5)."""
    for name in ("n_active", "n_total", "hoi", "weights_pte"):
        v = getattr(h, name)
        if not (math.isfinite(v) and v > 0):
            raise UsageError(f"the step log's header has {name} = {v!r}; it must be a positive number")
    if len(h.windows) != len(h.gammas) or not all(math.isfinite(g) and g >= 0 for g in h.gammas):
        raise UsageError("the step log's header has malformed gammas/windows")
    per_gamma = 2.0 * h.n_active / h.hoi
    groups = tuple(KVGroup(0, g * per_gamma, w) for g, w in zip(h.gammas, h.windows, strict=True))
    shape = ModelShape.from_kv_groups("step-log header", groups, h.n_active, h.n_total)
    return shape, h.weights_pte * per_gamma / h.n_total


def build_theory(args: argparse.Namespace, header: StepLogHeader | None) -> Theory | None:
    notes: list[str] = []
    if args.model_dir:
        try:
            cfg = load_config(args.model_dir)
            shape = parse_shape(cfg, kv_cache_dtype=args.kv_cache_dtype)
            weight_bytes = kv_dtype_bytes(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"))
        except ArchitectureError as e:
            raise UsageError(str(e)) from None
        notes += list(shape.assumed)
    elif header is not None:
        shape, weight_bytes = _shape_from_header(header)
    else:
        return None
    device, more = _device(args.device, header)
    cost = CostModel(shape, device)
    weights_pte = shape.n_total * weight_bytes * device.hoi / (2.0 * shape.n_active)
    return Theory(theory(cost, weight_bytes), cost, weights_pte, tuple(notes + more))


# =========================================================================== the report


def _num(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)


def _ratio(x: float, y: float | None) -> float | None:
    return _num(x / y) if y else None


def calibration_report(
    steps: Steps,
    th: Theory | None,
    result: FitResult,
    ci: dict[str, tuple[float, float]],
    n_boot: int,
    seed: int,
) -> dict[str, Any]:
    m, t = result.model, th.model if th else None
    terms = {
        k: {
            "unit": UNITS[k],
            "theory": _num(getattr(t, k)) if t else None,
            "measured": _num(getattr(m, k)),
            "ci": [_num(ci[k][0]), _num(ci[k][1])],
            "from_prior": k in result.from_prior,
            "measured_over_theory": _ratio(getattr(m, k), getattr(t, k) if t else None),
        }
        for k in TERMS
    }
    # the engine prices each step at the host's speed of the steps before it (the file's order)
    pred = m.predict(steps.prefill, steps.ctx, steps.memory_bound)
    speed = HostSpeed()
    r2_s, mape_s, mdape_s = score_predictions(pred * speed.advance(pred, steps.dt), steps.dt)
    at_host_speed = {
        "r2": _num(r2_s),
        "mape": _num(mape_s),
        "median_ape": _num(mdape_s),
        "final_speed": _num(speed.ratio),
    }
    gamma_theory = th.cost_model.gamma if th else None
    theory_only = None
    if t is not None:
        r2, mape, mdape = score(t, steps.prefill, steps.ctx, steps.memory_bound, steps.dt)
        theory_only = {"r2": _num(r2), "mape": _num(mape), "median_ape": _num(mdape)}
    device = None
    if th is not None:
        d = th.cost_model.device
        device = {
            "name": d.name,
            "peak_flops": d.peak_flops,
            "mem_bandwidth": d.mem_bandwidth,
            "hoi": d.hoi,
            "flops_fraction": d.flops_fraction,
            "bandwidth_fraction": d.bandwidth_fraction,
            "step_overhead_s": d.step_overhead_s,
            "source": d.source,
            "achieved_source": d.achieved_source,
        }
    return {
        "input": {
            "format": steps.format,
            "rows": steps.rows,
            "usable_steps": steps.n,
            "memory_bound_steps": int(steps.memory_bound.sum()),
        },
        "device": device,
        "terms": terms,
        "gamma": {
            "theory": _num(gamma_theory) if gamma_theory is not None else None,
            "theory_model": _num(t.gamma_measured) if t else None,  # b/a of theory, at the fractions
            "measured": _num(m.gamma_measured),
            "ci": [_num(ci["gamma"][0]), _num(ci["gamma"][1])],
            "measured_over_theory": _ratio(m.gamma_measured, gamma_theory),
        },
        "weight_read_pte": {"theory": _num(th.weights_pte) if th else None, "measured": _num(m.weights_pte)},
        "calibrated": {
            "r2": _num(result.r2),
            "mape": _num(result.mape),
            "median_ape": _num(result.median_ape),
        },
        "at_host_speed": at_host_speed,
        "theory_only": theory_only,
        "from_prior": list(result.from_prior),
        "bootstrap": {"resamples": n_boot, "seed": seed, "level": LEVEL},
        "notes": [*steps.notes, *(th.notes if th else ()), *result.notes],
    }


def _fmt(v: float | None, digits: int = 4) -> str:
    return "–" if v is None else f"{v:.{digits}g}"


TERM_LABELS = {
    "a": "a  s/prefill token",
    "b": "b  s/context token",
    "w": "w  s/memory-bound step",
    "o": "o  s/step",
}


def _print_report(report: dict[str, Any], path: str) -> None:
    from rich.console import Console
    from rich.table import Table

    inp = report["input"]
    table = Table(title=f"{path}: {inp['usable_steps']} steps, {inp['memory_bound_steps']} memory-bound")
    for c in ("term", "theory", "measured", f"{LEVEL:.0%} interval", "×theory"):
        table.add_column(c, justify="left" if c == "term" else "right")
    rows = [
        (TERM_LABELS[k] + (" (prior)" if v["from_prior"] else ""), v["theory"], v["measured"], v["ci"])
        for k, v in report["terms"].items()
    ]
    g, wr = report["gamma"], report["weight_read_pte"]
    rows += [
        ("γ = b/a", g["theory"], g["measured"], g["ci"]),
        ("w/a  PTE", wr["theory"], wr["measured"], None),
    ]
    for label, theory_v, measured, ci in rows:
        ratio = measured / theory_v if measured is not None and theory_v else None
        interval = f"{_fmt(ci[0])} – {_fmt(ci[1])}" if ci else ""
        table.add_row(label, _fmt(theory_v), _fmt(measured), interval, _fmt(ratio, 3))
    console = Console(markup=False)  # a path is text, whatever brackets it holds
    console.print(table)
    hs = report["at_host_speed"]
    lines = [
        f"calibrated:  {_goodness(report['calibrated'])}",
        f"calibrated at the host's speed of the steps before each (as the engine prices them): "
        f"{_goodness(hs)}; speed at the end ×{_fmt(hs['final_speed'], 3)}",
    ]
    if report["theory_only"] is not None:
        lines.append(f"theory only: {_goodness(report['theory_only'])}")
        lines.append(f"γ of the theory model (b/a at the device's fractions): {_fmt(g['theory_model'])}")
    if report["device"] is not None:
        lines.append(f"device {report['device']['name']}: {report['device']['achieved_source']}")
    lines += [f"note: {n}" for n in report["notes"]]
    if report.get("saved"):
        lines.append(f"saved the calibrated model to {report['saved']}")
    for line in lines:
        console.print(line, highlight=False)


def _goodness(g: dict[str, float | None]) -> str:
    return f"R² {_fmt(g['r2'], 3)}, MAPE {_pct(g['mape'])} (median {_pct(g['median_ape'])})"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.1%}"


def _save_target(save: str, inputs: dict[str, Path]) -> Path:
    """The file ``--save`` writes: ``save`` itself, or the file it links to (a link is written
    through, as ``cp`` does: the link stays, its target gets the model), refused where it is
    one of ``inputs`` (what it names → path), which the command reads."""
    p = Path(save)
    if p.is_symlink():
        try:
            p = p.resolve(strict=False)
        except (OSError, RuntimeError) as e:  # a loop of links
            raise UsageError(f"cannot write {save}: {e}") from None
        if p.is_symlink():  # resolve gives up on a loop of links and returns a link of it
            raise UsageError(f"cannot write {save}: a loop of symbolic links")
    for what, src in inputs.items():
        if p.exists() and src.exists() and p.samefile(src):  # it would replace a file the fit read
            raise UsageError(f"--save {save} is {what}; save the model to another file")
    return p


def cmd_calibrate(args: argparse.Namespace) -> int:
    if args.kv_cache_dtype is not None and not args.model_dir:
        # the theory from a step log's header has its KV bytes already: the dtype would do nothing
        raise UsageError("--kv-cache-dtype applies only with --model-dir")
    steps = read_steps(args.steps)
    save = None
    if args.save is not None:
        inputs = {"the step log read": Path(args.steps)}
        if args.model_dir:
            inputs["the model's config read"] = config_file(args.model_dir)
        save = _save_target(args.save, inputs)
    if steps.n < MIN_STEPS:
        raise UsageError(
            f"{args.steps}: {steps.n} usable step(s) (dt_s > 0, tokens > 0, values within ±2**53); "
            f"at least {MIN_STEPS} are needed"
        )
    th = build_theory(args, steps.header)
    if th is None and args.device:
        report_warning("calibrate", "--device needs --model-dir or a step-log header: fitted without theory")
    prior = th.model if th else None
    features = (steps.prefill, steps.ctx, steps.memory_bound, steps.dt)
    result = fit(*features, prior)
    ci = bootstrap_intervals(*features, prior, n_boot=args.bootstrap, seed=args.seed, level=LEVEL)
    report = calibration_report(steps, th, result, ci, args.bootstrap, args.seed)
    report["saved"] = None
    if save is not None:
        try:
            result.model.save(save)
        except OSError as e:
            raise UsageError(f"cannot write {args.save}: {e.strerror or e}") from None
        report["saved"] = str(args.save)
    if args.json:
        print_json(report)
    else:
        _print_report(report, args.steps)
    return 0


def add_calibrate_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate",
        help="fit the four-term step-time model on a step log or CSV, beside its theory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "steps", type=nonempty("path"), help="the plugin's step log (JSONL, .gz too) or a CSV of steps"
    )
    p.add_argument(
        "--model-dir",
        type=nonempty("path"),
        help="model directory or config.json for the theory (else the log's header)",
    )
    p.add_argument(
        "--device",
        type=nonempty("device name"),
        default=None,
        help=f"device profile: auto, measured, {', '.join(PROFILES)}",
    )
    p.add_argument(
        "--kv-cache-dtype",
        type=nonempty("dtype"),
        default=None,
        help="KV cache dtype with --model-dir (auto, fp8…)",
    )
    p.add_argument(
        "--bootstrap",
        type=whole_number(0, 100_000),
        default=DEFAULT_BOOTSTRAP,
        help=f"bootstrap resamples for the intervals (default {DEFAULT_BOOTSTRAP}; 0: none)",
    )
    p.add_argument("--seed", type=whole_number(0), default=0)
    p.add_argument(
        "--save",
        type=output_path,
        help="write the calibrated model here (JSON; PTE_CALIBRATION reads it); a symbolic link is "
        "written through: the link stays, the file it points to gets the model",
    )
    p.add_argument("--json", action="store_true", help="stable JSON (sorted keys) instead of the table")
    p.set_defaults(func=cmd_calibrate)
    return p
