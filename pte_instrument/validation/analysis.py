"""Does PTE track wall-clock time? Correlations of predicted cost with measured time at three
levels (docs/cost-model.md §6), with bootstrap intervals, against token-count baselines on the same data.

Pure numpy; no vLLM, no plotting. Inputs are the plugin's request log (``PTE_REQUEST_LOG``)
and the engine's step log (``PTE_STEP_LOG``), both JSONL.

- step level: each scheduler step's predicted cost vs its measured ``dt_s``
- request level: each request's cost vs its ``inference_s`` (scheduled → last token)
- turn level (the published style): per-turn-index averages over sessions, then r over turns
"""

from __future__ import annotations

import glob
import gzip
import json
import math
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from pte_instrument.offline.statistics import (
    MIN_PAIRS,
    count_chunks,
    finite_pairs,
    index_chunks,
    interval_bounds,
    pearson,
    pearson_rows,
    rankdata,
    report_number,
    resample_ranks,
    spearman,
    weighted_pearson,
)
from pte_instrument.wire import STEP_LOG_FIELDS, StepLogHeader

NO_INTERVAL = (math.nan, math.nan)  # a statistic that was not bootstrapped

# ---------------------------------------------------------------------------------------
# Correlations with bootstrap intervals (the primitives live in offline.statistics)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corr:
    """Pearson and Spearman with percentile bootstrap intervals."""

    n: int
    pearson: float
    pearson_ci: tuple[float, float]
    spearman: float
    spearman_ci: tuple[float, float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "pearson": report_number(self.pearson),
            "pearson_ci": [report_number(v) for v in self.pearson_ci],
            "spearman": report_number(self.spearman),
            "spearman_ci": [report_number(v) for v in self.spearman_ci],
        }


@dataclass(frozen=True)
class _Boot:
    pearson: np.ndarray  # (B,) per metric
    spearman: np.ndarray


def _bootstrap_many(
    xs: Sequence[np.ndarray], y: np.ndarray, n_boot: int, seed: int, max_elems: int
) -> list[_Boot]:
    """Bootstrap rows of r and ρ for several metrics against one y, on shared resamples
    (so differences between metrics are paired). Rows must be finite."""
    n = len(y)
    rs: list[list[np.ndarray]] = [[] for _ in xs]
    rhos: list[list[np.ndarray]] = [[] for _ in xs]
    for W in count_chunks(n, n_boot, np.random.default_rng(seed), max_elems):
        ry = resample_ranks(W, y)
        for k, x in enumerate(xs):
            rs[k].append(weighted_pearson(W, x, y))
            rhos[k].append(weighted_pearson(W, resample_ranks(W, x), ry))
    return [_Boot(np.concatenate(a), np.concatenate(b)) for a, b in zip(rs, rhos, strict=True)]


def bootstrap_corr(
    x: Any, y: Any, n_boot: int = 1000, seed: int = 0, level: float = 0.95, max_elems: int = 4_000_000
) -> Corr:
    """Pearson and Spearman of (x, y) with percentile intervals from ``n_boot`` resamples
    of the pairs (non-finite pairs dropped first)."""
    x, y = finite_pairs(x, y)
    n = len(x)
    r, rho = pearson(x, y), spearman(x, y)
    if n < MIN_PAIRS or n_boot <= 0:
        return Corr(n, r, NO_INTERVAL, rho, NO_INTERVAL)
    (b,) = _bootstrap_many([x], y, n_boot, seed, max_elems)
    return Corr(n, r, interval_bounds(b.pearson, level), rho, interval_bounds(b.spearman, level))


def bootstrap_pearson_diff(
    a: Any,
    b: Any,
    y: Any,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    max_elems: int = 4_000_000,
) -> tuple[float, float, float]:
    """r(a, y) − r(b, y) with a paired bootstrap interval: is metric a really better than b
    on this data, or within noise? Rows where any of the three is non-finite are dropped."""
    a, b, y = (np.asarray(v, dtype=np.float64).ravel() for v in (a, b, y))
    ok = np.isfinite(a) & np.isfinite(b) & np.isfinite(y)
    a, b, y = a[ok], b[ok], y[ok]
    d = pearson(a, y) - pearson(b, y)  # NaN below MIN_PAIRS rows
    if len(y) < MIN_PAIRS or n_boot <= 0:
        return (d, *NO_INTERVAL)
    ba, bb = _bootstrap_many([a, b], y, n_boot, seed, max_elems)
    return (d, *interval_bounds(ba.pearson - bb.pearson, level))


def bootstrap_metrics(
    xs: Sequence[Any],
    y: Any,
    primary: int | None,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    max_elems: int = 4_000_000,
) -> list[tuple[Corr, tuple[float, float, float] | None]]:
    """Corr of every metric with y and r(primary) − r(metric), all on the same resamples.

    Metrics finite wherever y and the primary are share one pass; any other is bootstrapped
    on its own rows."""
    y = np.asarray(y, dtype=np.float64).ravel()
    xs = [np.asarray(x, dtype=np.float64).ravel() for x in xs]
    base = np.isfinite(y) & (np.isfinite(xs[primary]) if primary is not None else True)
    shared = [k for k, x in enumerate(xs) if np.isfinite(x[base]).all()]
    out: list[tuple[Corr, tuple[float, float, float] | None]] = [None] * len(xs)  # type: ignore[list-item]
    n = int(base.sum())
    yb = y[base]
    boots = (
        _bootstrap_many([xs[k][base] for k in shared], yb, n_boot, seed, max_elems)
        if n >= MIN_PAIRS and n_boot > 0
        else []
    )
    by_k = dict(zip(shared, boots, strict=False))
    pb = by_k.get(primary) if primary is not None else None
    for k, x in enumerate(xs):
        if k not in shared:
            c = bootstrap_corr(x, y, n_boot, seed, level, max_elems)
            d = (
                bootstrap_pearson_diff(xs[primary], x, y, n_boot, seed, level, max_elems)
                if primary is not None
                else None
            )
            out[k] = (c, d)
            continue
        xb = xs[k][base]
        r, rho = pearson(xb, yb), spearman(xb, yb)
        bk = by_k.get(k)
        if bk is None:
            c = Corr(n, r, NO_INTERVAL, rho, NO_INTERVAL)
        else:
            c = Corr(n, r, interval_bounds(bk.pearson, level), rho, interval_bounds(bk.spearman, level))
        d = None
        if primary is not None and k != primary:
            rp = pearson(xs[primary][base], yb)
            ci = (
                interval_bounds(pb.pearson - bk.pearson, level)
                if (pb is not None and bk is not None)
                else NO_INTERVAL
            )
            d = (rp - r, *ci)
        out[k] = (c, d)
    return out


# ---------------------------------------------------------------------------------------
# Turn level: per-turn-index means over sessions, bootstrap over sessions
# ---------------------------------------------------------------------------------------


def turn_numbers(turns: Any) -> np.ndarray:
    """The turn numbers (1-based) some request has, ascending: the columns of :func:`turn_matrix`."""
    turns = np.asarray(turns, dtype=np.int64)
    return np.unique(turns[turns >= 1])


def turn_matrix(session_ids: Sequence[Any], turns: Any, values: Any) -> tuple[np.ndarray, list[Any]]:
    """(sessions × turn index) matrix of values, NaN where a session has no such turn; column
    j holds the j-th of :func:`turn_numbers` (turn j+1 when no number is skipped). A column per
    number present, not per number up to the largest: a stray turn of 10**12 is one column."""
    turns = np.asarray(turns, dtype=np.int64)
    values = np.asarray(values, dtype=np.float64)
    keys = sorted({s for s in session_ids}, key=str)
    row = {s: i for i, s in enumerate(keys)}
    numbers = turn_numbers(turns)
    column = np.searchsorted(numbers, turns)
    m = np.full((len(keys), numbers.size), np.nan)
    for s, t, c, v in zip(session_ids, turns, column, values, strict=True):
        if t >= 1:
            m[row[s], c] = v
    return m, keys


def turn_columns(present: np.ndarray, min_fraction: float = 0.5) -> np.ndarray:
    """Turn indices present in at least ``min_fraction`` of sessions (and in ≥ 2): later
    turns that only a few sessions reached would make a mean of one or two noisy values."""
    counts = present.sum(axis=0)
    need = max(2, math.ceil(min_fraction * present.shape[0])) if present.shape[0] >= 2 else 1
    return counts >= need


def _nanmean0(a: np.ndarray) -> np.ndarray:
    """Mean over the session axis, NaN (silently) where a column has no value."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(a, axis=-2)


def bootstrap_turn_corr(
    X: np.ndarray,
    Y: np.ndarray,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    min_fraction: float = 0.5,
) -> Corr:
    """Published-style correlation: mean cost and mean time per turn index (over sessions),
    then r across turn indices. Resamples whole sessions, so the interval reflects
    session-to-session variation rather than treating turns as independent."""
    present = np.isfinite(X) & np.isfinite(Y)
    X = np.where(present, X, np.nan)
    Y = np.where(present, Y, np.nan)
    cols = turn_columns(present, min_fraction)
    X, Y = X[:, cols], Y[:, cols]
    n_cols = int(cols.sum())
    mx, my = _nanmean0(X), _nanmean0(Y)
    r = pearson(mx, my)
    rho = spearman(mx, my)
    S = X.shape[0]
    if n_cols < MIN_PAIRS or S < 2 or n_boot <= 0:
        return Corr(n_cols, r, NO_INTERVAL, rho, NO_INTERVAL)
    rs, rhos = [], []
    for idx in index_chunks(S, n_boot, np.random.default_rng(seed), 4_000_000 // max(n_cols, 1)):
        bx, by = _nanmean0(X[idx]), _nanmean0(Y[idx])  # (B, T)
        ok = np.isfinite(bx).all(axis=1) & np.isfinite(by).all(axis=1)
        rr = np.full(len(idx), np.nan)
        rr[ok] = pearson_rows(bx[ok], by[ok])
        rh = np.full(len(idx), np.nan)
        rh[ok] = pearson_rows(rankdata(bx[ok]), rankdata(by[ok]))
        rs.append(rr)
        rhos.append(rh)
    r_ci, rho_ci = interval_bounds(np.concatenate(rs), level), interval_bounds(np.concatenate(rhos), level)
    return Corr(n_cols, r, r_ci, rho, rho_ci)


# ---------------------------------------------------------------------------------------
# Logs
# ---------------------------------------------------------------------------------------


def load_jsonl(path: str | Path, problems: Counter[str] | None = None) -> list[dict[str, Any]]:
    """Objects of a JSONL file (or .jsonl.gz). A line that is not a JSON object (a writer
    killed mid-write, another file's line) is skipped, and counted in ``problems["not_object"]``."""
    out: list[dict[str, Any]] = []
    p = Path(path)
    if not p.exists():
        return out
    opener = gzip.open if p.suffix == ".gz" else open
    # -sig: a byte-order mark (as some Windows tools write) is not the first line's
    with opener(p, "rt", encoding="utf-8-sig", errors="replace") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError):  # an integer past the digit limit is a plain ValueError
                obj = None
            if isinstance(obj, dict):
                out.append(obj)
            elif problems is not None:
                problems["not_object"] += 1
    return out


def _number(v: Any) -> float | None:
    """A JSON number as a float (an integer too large for one as inf); anything else (a
    string, a list, true) is not one."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    try:
        return float(v)
    except OverflowError:
        return math.inf


def _text(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _whole(v: Any, problems: Counter[str] | None = None) -> int:
    """A turn number; 0 (no session) for anything that is not one: a value that is not a
    number, or one out of range (negative, not finite, past 2**53: no int64), counted as
    :func:`_col` counts them."""
    x = _number(v)
    if x is not None and 0 <= x <= LARGEST_VALUE:  # NaN fails too
        return int(x)
    if v is not None and problems is not None:
        problems["not_number" if x is None else "out_of_range"] += 1
    return 0


# No count, second or unix time a log holds is this large; past it a float stops counting by
# one, and sums (or a window's requests in flight) overflow.
LARGEST_VALUE = 2.0**53


def _col(
    records: Sequence[Mapping[str, Any]], key: str, *aliases: str, problems: Counter[str] | None = None
) -> np.ndarray:
    """A numeric column; a value that is not a number, or one no log holds (not finite, or
    negative where the field cannot be), is read as missing (NaN) and counted in
    ``problems["not_number"]`` or ``problems["out_of_range"]``."""
    vals = []
    signed = key in MAY_BE_NEGATIVE
    for r in records:
        v = r.get(key)
        for a in aliases:
            if v is None:
                v = r.get(a)
        x = None if v is None else _number(v)
        if x is not None and not (abs(x) <= LARGEST_VALUE and (signed or x >= 0)):  # NaN fails too
            x = None
            if problems is not None:
                problems["out_of_range"] += 1
        elif v is not None and x is None and problems is not None:
            problems["not_number"] += 1
        vals.append(np.nan if x is None else x)
    return np.asarray(vals, dtype=np.float64)


REQUEST_FIELDS = (
    "prompt_tokens",
    "cached_tokens",
    "computed_prefill_tokens",
    "recomputed_tokens",
    "output_tokens",
    "gamma",
    "hoi",
    "pte_reference",
    "pte_served",
    "pte_ideal",
    "pte_prefill",
    "pte_decode",
    "queued_s",
    "prefill_s",
    "decode_s",
    "inference_s",
    "e2e_s",
    "finished_at",
    "num_preemptions",
    "arrived_at",
)
# The logs' only fields that may be negative: a request's interference (its queueing is in the
# latency it explains, not in its GPU seconds).
MAY_BE_NEGATIVE = frozenset({"interference_s"})
# Seconds from the engine hook (docs/cost-model.md §5b): the request's share of measured step
# time, by term; the step-time model's cost of its own work alone; the steps it was in plus
# its queue time; the part of those that was other requests' work; money.
SECONDS_FIELDS = (
    "gpu_seconds",
    "gpu_seconds_prefill",
    "gpu_seconds_kv_read",
    "gpu_seconds_weights",
    "gpu_seconds_overhead",
    "predicted_seconds",
    "latency_explained_s",
    "interference_s",
    "cost_usd",
)
# Engine-side fields exist only with the scheduler hook. The roofline one is read under both
# spellings: ``engine_roofline_pte`` and the request ledger's ``engine_pte_roofline``.
ENGINE_FIELDS: dict[str, tuple[str, ...]] = {
    "engine_pte_served": (),
    "engine_recompute_tokens": (),
    "engine_prefill_tokens": (),
    "engine_roofline_pte": ("engine_pte_roofline",),
}


@dataclass
class RequestTable:
    """Finished requests as columns (float arrays; NaN where a field is missing)."""

    request_id: list[str]
    session_id: list[str | None]
    turn: np.ndarray  # int, 0 where unknown
    device: list[str]
    finish_reason: list[str]
    cols: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.request_id)

    def __getitem__(self, key: str) -> np.ndarray:
        return self.cols[key]

    def has(self, key: str) -> bool:
        return key in self.cols and bool(np.isfinite(self.cols[key]).any())

    def select(self, mask: np.ndarray) -> RequestTable:
        return self.take(np.flatnonzero(mask))

    def take(self, idx: np.ndarray) -> RequestTable:
        """The rows at ``idx``, in that order."""
        return RequestTable(
            [self.request_id[i] for i in idx],
            [self.session_id[i] for i in idx],
            self.turn[idx],
            [self.device[i] for i in idx],
            [self.finish_reason[i] for i in idx],
            {k: v[idx] for k, v in self.cols.items()},
        )

    @property
    def ctx_sum(self) -> np.ndarray:
        """Σ context read while decoding, in γ-weighted tokens: pte_decode / γ (so sliding
        windows are honoured exactly as the plugin priced them)."""
        g = self.cols["gamma"]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(g > 0, self.cols["pte_decode"] / g, np.nan)


def request_table(records: Sequence[Mapping[str, Any]], problems: Counter[str] | None = None) -> RequestTable:
    cols = {k: _col(records, k, problems=problems) for k in (*REQUEST_FIELDS, *SECONDS_FIELDS)}
    for k, aliases in ENGINE_FIELDS.items():
        cols[k] = _col(records, k, *aliases, problems=problems)
    return RequestTable(
        request_id=[str(r.get("request_id", "")) for r in records],
        session_id=[_text(r.get("session_id")) for r in records],
        turn=np.asarray([_whole(r.get("turn"), problems) for r in records], dtype=np.int64),
        device=[str(r.get("device", "")) for r in records],
        finish_reason=[str(r.get("finish_reason", "")) for r in records],
        cols=cols,
    )


def usable_requests(t: RequestTable) -> RequestTable:
    """Requests that ran to completion with a measured inference time: aborted or failed
    ones have truncated timings that no cost model should be asked to explain."""
    ok = np.array([fr not in ("abort", "error") for fr in t.finish_reason], dtype=bool)
    ok &= np.isfinite(t["inference_s"]) & (t["inference_s"] > 0)
    return t.select(ok)


@dataclass
class StepTable:
    """Scheduler steps from the engine's step log (header first line, optional)."""

    header: dict[str, Any] | None
    cols: dict[str, np.ndarray]
    ctx: np.ndarray  # (steps, KV groups): Σ context read by decode samples, per group

    def __len__(self) -> int:
        return len(self.cols["dt_s"])

    def __getitem__(self, key: str) -> np.ndarray:
        return self.cols[key]

    @property
    def gammas(self) -> np.ndarray | None:
        g = (self.header or {}).get("gammas")
        return np.asarray(g, dtype=np.float64) if g else None

    @property
    def ctx_w(self) -> np.ndarray:
        """Context read per step, γ-weighted over KV groups (Σ_g γ_g ctx_g / Σ_g γ_g), so a
        single γ multiplies it; equals the plain context sum with one group."""
        g = self.gammas
        if g is None or g.shape[0] != self.ctx.shape[1] or g.sum() <= 0:
            # No header: recover it from the logged PTE when a single group is in play.
            return self.ctx.sum(axis=1)
        return self.ctx @ g / g.sum()

    @property
    def gamma(self) -> float | None:
        g = self.gammas
        return float(g.sum()) if g is not None else None

    def select(self, mask: np.ndarray) -> StepTable:
        return StepTable(self.header, {k: v[mask] for k, v in self.cols.items()}, self.ctx[mask])


# The step log's scalar columns, from its declaration (ctx, per KV group, is read apart).
STEP_FIELDS = tuple(f for f in STEP_LOG_FIELDS if f != "ctx")


def _numbers(v: Any, problems: Counter[str] | None) -> list[float]:
    """A list of numbers (a step's context per KV group); anything else is none, counted."""
    if isinstance(v, list) and all(_number(x) is not None for x in v):
        return [x if abs(x) <= LARGEST_VALUE else math.nan for x in map(_number, v)]  # type: ignore[arg-type]
    if v is not None and problems is not None:
        problems["not_number"] += 1
    return []


# The header's fields and their wire types: a header may leave some out (an older engine,
# a hand-made log), but one it holds must be of its type.
_HEADER_TYPES = {f.name: f.type for f in msgspec.structs.fields(StepLogHeader)}
_HEADER_SIZES = ("n_active", "n_total", "hoi", "weights_pte")


def checked_header(
    header: dict[str, Any] | None, problems: Counter[str] | None = None
) -> dict[str, Any] | None:
    """The step log's header when each field it holds is of its wire type and of the shape
    ``pte calibrate`` checks (positive sizes, a γ ≥ 0 and a window per KV group). Any other is
    ignored (None) and counted in ``problems["header"]``."""
    if header is None:
        return None
    try:
        for name, value in header.items():
            if name in _HEADER_TYPES:
                msgspec.convert(value, _HEADER_TYPES[name])
    except msgspec.ValidationError:  # a field of another type (null included)
        shaped = False
    else:
        gammas, windows = header.get("gammas"), header.get("windows")
        shaped = bool(
            all(0 < header[k] <= LARGEST_VALUE for k in _HEADER_SIZES if k in header)  # NaN fails too
            and (gammas is None or (gammas and all(0 <= g <= LARGEST_VALUE for g in gammas)))
            and (windows is None or gammas is None or len(windows) == len(gammas))
        )
    if shaped:
        return header
    if problems is not None:
        problems["header"] += 1
    return None


def step_table(records: Sequence[Mapping[str, Any]], problems: Counter[str] | None = None) -> StepTable:
    header = checked_header(next((dict(r) for r in records if r.get("header")), None), problems)
    rows = [r for r in records if not r.get("header") and "dt_s" in r]
    cols = {k: _col(rows, k, problems=problems) for k in STEP_FIELDS}
    contexts = [_numbers(r.get("ctx"), problems) for r in rows]
    ctx = np.zeros((len(rows), max(map(len, contexts), default=1) or 1))
    for i, c in enumerate(contexts):
        ctx[i, : len(c)] = c
    return StepTable(header, cols, ctx)


def load_steps(path: str | Path, problems: Counter[str] | None = None) -> StepTable | None:
    """The step log of one engine (and ``<path>.engine<N>`` files of others, appended);
    None when there is none or it holds no step."""
    p = Path(path)
    # the name is a name, not a pattern: `steps[0].jsonl` must not match `steps0.jsonl.engine1`
    files = [p, *sorted(p.parent.glob(glob.escape(p.name) + ".engine*"))] if p.parent.exists() else []
    records: list[dict[str, Any]] = []
    for f in files:
        records += load_jsonl(f, problems)
    t = step_table(records, problems)
    return t if len(t) else None


def usable_steps(s: StepTable) -> StepTable:
    """Steps that computed something and have a positive measured duration."""
    ok = np.isfinite(s["dt_s"]) & (s["dt_s"] > 0) & (s["tokens"] > 0)
    return s.select(ok)


# ---------------------------------------------------------------------------------------
# Metrics: what each cost model predicts, on the same rows
# ---------------------------------------------------------------------------------------

PRICE_RATIOS = (1.5, 3.0, 4.0)
PRIMARY = "PTE served"
PREDICTED = "predicted seconds"  # the step-time model's cost of the request's own work alone
GPU_SECONDS = "GPU seconds"  # the request's share of the measured step times
STEP_PTE = "PTE (logged γ)"  # a step's PTE at the γ the plugin priced with
STEP_MODEL = "calibrated step model"  # the step-time model fitted to the steps
OUTPUT_TOKENS = "output tokens"  # the baseline that counts a request's decode steps
PTE_CALIBRATED = "PTE served (γ calibrated)"
ROOFLINE_ENGINE = "roofline (engine)"
FITTED_REQUEST = "fitted request model"


@dataclass(frozen=True)
class Metric:
    """A cost predictor's values. ``name`` is shown and looked up: code names it only by the
    constants above, so renaming one renames it everywhere."""

    name: str
    kind: str  # "pte" (a PTE variant), "baseline" (token counts, prices), "model" (fitted/roofline)
    values: np.ndarray
    note: str = ""


def price_weighted(prompt: Any, output: Any, ratio: float) -> np.ndarray:
    """Price-weighted tokens at input:output = 1:ratio, input counted as prompt tokens."""
    return np.asarray(prompt, dtype=np.float64) + ratio * np.asarray(output, dtype=np.float64)


def rescale_gamma(pte_prefill: Any, pte_decode: Any, gamma_from: float, gamma_to: float) -> np.ndarray:
    """PTE served repriced at another γ: the decode term is linear in γ."""
    return np.asarray(pte_prefill, dtype=np.float64) + (gamma_to / gamma_from) * np.asarray(pte_decode)


def request_metrics(
    t: RequestTable, gamma_calibrated: float | None = None, request_model: Any | None = None
) -> list[Metric]:
    """Every cost predictor on the request rows: baselines, PTE variants, and (when known)
    the calibrated and engine-side ones."""
    prompt, cached, out = t["prompt_tokens"], t["cached_tokens"], t["output_tokens"]
    m = [
        Metric(OUTPUT_TOKENS, "baseline", out),
        Metric("total tokens", "baseline", prompt + out, "prompt + output"),
        Metric("uncached tokens", "baseline", prompt - cached + out, "prompt − cached + output"),
        *(
            Metric(f"price 1:{r:g}", "baseline", price_weighted(prompt, out, r), f"prompt + {r:g}·output")
            for r in PRICE_RATIOS
        ),
        Metric("PTE reference", "pte", t["pte_reference"], "L + γ·L·D (no cache reuse)"),
        Metric(PRIMARY, "pte", t["pte_served"], "computed prefill + γ·Σ context (logged γ)"),
    ]
    if gamma_calibrated is not None and math.isfinite(gamma_calibrated) and gamma_calibrated > 0:
        g = t["gamma"]
        with np.errstate(invalid="ignore", divide="ignore"):
            vals = t["pte_prefill"] + gamma_calibrated * t.ctx_sum
        m.append(
            Metric(
                PTE_CALIBRATED,
                "pte",
                np.where(g > 0, vals, np.nan),
                f"γ = {gamma_calibrated:.4g} fitted on measured step times",
            )
        )
    if t.has("engine_pte_served"):
        m.append(
            Metric("PTE served (engine)", "pte", t["engine_pte_served"], "exact, from the scheduler hook")
        )
    if t.has("engine_roofline_pte"):
        m.append(
            Metric(
                ROOFLINE_ENGINE,
                "model",
                t["engine_roofline_pte"],
                "docs/cost-model.md §5 attribution: max(compute, weights + KV) per step, shared",
            )
        )
    if request_model is not None:
        m.append(
            Metric(
                FITTED_REQUEST,
                "model",
                request_model.predict_requests(t),
                "a·prefill + b·Σctx + c·(D−1) + e, fitted at concurrency 1",
            )
        )
    if t.has("predicted_seconds"):
        m.append(
            Metric(
                PREDICTED,
                "model",
                t["predicted_seconds"],
                "engine: the step-time model's cost of the request's own work alone (online fit)",
            )
        )
    if t.has("gpu_seconds"):
        m.append(
            Metric(
                GPU_SECONDS,
                "measured",
                t["gpu_seconds"],
                "engine: its share of each measured step time it was in",
            )
        )
    return m


def step_metrics(s: StepTable, fit: Any | None = None) -> list[Metric]:
    """Cost predictors for each scheduler step. ``fit`` is a calibrate.Calibration."""
    prefill, dec = s["prefill"], s["decode_tokens"]
    m = [
        Metric("decode tokens", "baseline", dec, "tokens generated this step (≈ output tokens)"),
        Metric("total tokens", "baseline", s["tokens"], "all tokens computed this step"),
        *(
            Metric(f"price 1:{r:g}", "baseline", price_weighted(prefill, dec, r), f"prefill + {r:g}·decode")
            for r in PRICE_RATIOS
        ),
        Metric(STEP_PTE, "pte", s["pte"], "prefill + Σ_g γ_g·ctx_g"),
    ]
    if fit is not None and math.isfinite(fit.gamma_measured) and fit.gamma_measured > 0:
        m.append(
            Metric(
                "PTE (γ calibrated)",
                "pte",
                prefill + fit.gamma_measured * s.ctx_w,
                f"prefill + {fit.gamma_measured:.4g}·ctx",
            )
        )
    if np.isfinite(s["roofline_pte"]).any():
        roofline_note = "max(tokens, weights + KV), docs/cost-model.md §5"
        m.append(Metric("roofline (logged)", "model", s["roofline_pte"], roofline_note))
    if fit is not None:
        m.append(Metric(STEP_MODEL, "model", fit.predict_steps(s), fit.formula()))
    return m


# ---------------------------------------------------------------------------------------
# A level's result: every metric against one time column
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricResult:
    name: str
    kind: str
    corr: Corr
    note: str = ""
    # r(primary) − r(this) with a paired bootstrap interval (None for the primary itself)
    primary_minus_this: tuple[float, float, float] | None = None
    # r(reference) − r(this), paired, for each further reference metric of the level
    versus: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "kind": self.kind, "note": self.note, **self.corr.to_dict()}
        if self.primary_minus_this is not None:
            d["primary_minus_this_pearson"] = [report_number(v) for v in self.primary_minus_this]
        if self.versus:
            d["reference_minus_this_pearson"] = {
                k: [report_number(x) for x in v] for k, v in self.versus.items()
            }
        return d


@dataclass(frozen=True)
class LevelResult:
    level: str  # "step", "request", "turn"
    phase: str  # e.g. "c1", "c16", "all"
    time: str  # the measured time column
    n: int
    primary: str
    metrics: list[MetricResult] = field(default_factory=list)
    note: str = ""
    references: tuple[str, ...] = ()  # further metrics every other one is compared with (paired)

    def get(self, name: str) -> MetricResult | None:
        return next((m for m in self.metrics if m.name == name), None)

    def best(self, kind: str | None = None) -> MetricResult | None:
        cands = [
            m for m in self.metrics if (kind is None or m.kind == kind) and math.isfinite(m.corr.pearson)
        ]
        return max(cands, key=lambda m: m.corr.pearson, default=None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "phase": self.phase,
            "time": self.time,
            "n": self.n,
            "primary": self.primary,
            "note": self.note,
            "metrics": [m.to_dict() for m in self.metrics],
            "references": list(self.references),
        }


def evaluate(
    level: str,
    phase: str,
    time_name: str,
    time: np.ndarray,
    metrics: Sequence[Metric],
    primary: str,
    n_boot: int = 1000,
    seed: int = 0,
    note: str = "",
    references: Sequence[str] = (),
) -> LevelResult:
    """Correlate every metric with the measured time on the same rows (paired resamples), and
    each with the primary and with every reference present: r(reference) − r(metric), paired."""
    names = [m.name for m in metrics]
    p = names.index(primary) if primary in names else None
    stats = bootstrap_metrics([m.values for m in metrics], time, p, n_boot, seed)
    refs = tuple(r for r in references if r in names and r != primary)
    results = []
    for m, (c, d) in zip(metrics, stats, strict=True):
        versus = {
            r: bootstrap_pearson_diff(metrics[names.index(r)].values, m.values, time, n_boot, seed)
            for r in refs
            if r != m.name
        }
        results.append(MetricResult(m.name, m.kind, c, m.note, d, versus))
    return LevelResult(level, phase, time_name, int(np.isfinite(time).sum()), primary, results, note, refs)


def evaluate_turns(
    phase: str,
    session_ids: Sequence[Any],
    turns: np.ndarray,
    time_name: str,
    time: np.ndarray,
    metrics: Sequence[Metric],
    primary: str,
    n_boot: int = 1000,
    seed: int = 0,
    min_fraction: float = 0.5,
) -> LevelResult:
    """Turn level: per-turn-index means over sessions, resampling sessions."""
    Y, _ = turn_matrix(session_ids, turns, time)
    results = []
    for m in metrics:
        X, _ = turn_matrix(session_ids, turns, m.values)
        results.append(
            MetricResult(
                m.name, m.kind, bootstrap_turn_corr(X, Y, n_boot, seed, min_fraction=min_fraction), m.note
            )
        )
    n = results[0].corr.n if results else 0
    return LevelResult(
        "turn",
        phase,
        f"mean {time_name} per turn index",
        n,
        primary,
        results,
        f"{len(set(session_ids))} sessions; turn indices reached by ≥{min_fraction:.0%} of sessions",
    )


def turn_profile(
    session_ids: Sequence[Any], turns: np.ndarray, columns: Mapping[str, np.ndarray]
) -> dict[str, Any]:
    """Per-turn-index means (the escalation the report plots): turn → mean of each column."""
    out: dict[str, Any] = {}
    count = None
    for name, vals in columns.items():
        M, _ = turn_matrix(session_ids, turns, vals)
        if count is None:
            count = np.isfinite(M).sum(axis=0)
            out["turn"] = turn_numbers(turns).tolist()
            out["sessions"] = count.tolist()
        out[name] = [report_number(v) for v in _nanmean0(M)]
    return out


# ---------------------------------------------------------------------------------------
# Robustness: the ranking under every device profile
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileScore:
    device: str
    hoi: float
    gamma: float
    spearman_vs_default: float  # ranking of requests vs the default profile's ranking
    pearson_vs_time: float  # r(PTE served under this profile, measured time)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "hoi": report_number(self.hoi),
            "gamma": report_number(self.gamma),
            "spearman_vs_default": report_number(self.spearman_vs_default),
            "pearson_vs_time": report_number(self.pearson_vs_time),
        }


def robustness(
    pte_prefill: Any,
    pte_decode: Any,
    gamma: float,
    hoi: float,
    profiles: Mapping[str, Any],
    default: str,
    time: Any | None = None,
) -> list[ProfileScore]:
    """Re-score every request under each profile (γ ∝ HOI, so γ' = γ·HOI'/HOI) and compare
    rankings with the default profile's. ``profiles`` maps name → object with ``.hoi``."""
    pre = np.asarray(pte_prefill, dtype=np.float64)
    dec = np.asarray(pte_decode, dtype=np.float64)
    base = rescale_gamma(pre, dec, gamma, gamma * profiles[default].hoi / hoi)
    out = []
    for name, p in profiles.items():
        g = gamma * p.hoi / hoi
        score = rescale_gamma(pre, dec, gamma, g)
        out.append(
            ProfileScore(
                name, p.hoi, g, spearman(score, base), pearson(score, time) if time is not None else math.nan
            )
        )
    return out
