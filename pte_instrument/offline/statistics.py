"""Correlations, ranks and bootstrap intervals: the statistics shared by the
reasoning-efficiency decomposition, the agent pattern report and the latency bench. Pure numpy.

Small samples follow one rule everywhere, so that a report never has to catch anything:

- a correlation (Pearson r, Spearman ρ) over fewer than :data:`MIN_PAIRS` = 3 finite pairs,
  or with one side of zero variance (all its values equal), is NaN. Two points always give
  ±1, which says nothing; a constant side has no direction at all.
- a percentile interval from fewer than :data:`MIN_RESAMPLES` = 10 finite resamples is NaN
  (a 95 % interval of a handful of values is just their range). Resamples where the
  statistic is undefined (NaN or ±inf) are left out before counting.

Neither case raises or warns. Non-finite *input* pairs are dropped first; arrays of different
lengths are a caller's bug and raise ``ValueError``.

Resampling is done with count matrices: row b of a (resamples × n) matrix says how often
each of the n rows was drawn in resample b, so any sum over a resample is one matrix product
with the original values — no gather, no Python loop over resamples.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

MIN_PAIRS = 3
MIN_RESAMPLES = 10
LEVEL = 0.95  # two-sided percentile interval

__all__ = [
    "LEVEL",
    "MIN_PAIRS",
    "MIN_RESAMPLES",
    "bootstrap_means",
    "bootstrap_weights",
    "count_chunks",
    "counts_of",
    "finite_pairs",
    "index_chunks",
    "interval_bounds",
    "pearson",
    "pearson_rows",
    "percentile_interval",
    "rankdata",
    "resample_ranks",
    "spearman",
    "weighted_pearson",
]

# =========================================================================== ranks and correlations


def rankdata(a: Any) -> np.ndarray:
    """Average ranks (1-based, ties share the mean rank) along the last axis.

    Row-wise on 2-D input, so a whole batch of resamples is ranked in one pass: sort, find
    the runs of equal values, give every member of a run (start + end)/2 + 1. Callers drop
    non-finite values first (NaN never ties with itself, so each NaN would be its own run).
    """
    x = np.asarray(a, dtype=np.float64)
    squeeze = x.ndim == 1
    x = np.atleast_2d(x)
    n = x.shape[1]
    if n == 0:
        return x[0] if squeeze else x
    order = np.argsort(x, axis=1, kind="mergesort")
    s = np.take_along_axis(x, order, axis=1)
    pos = np.broadcast_to(np.arange(n), s.shape)
    first = np.ones_like(s, dtype=bool)
    first[:, 1:] = s[:, 1:] != s[:, :-1]
    last = np.ones_like(s, dtype=bool)
    last[:, :-1] = s[:, 1:] != s[:, :-1]
    start = np.maximum.accumulate(np.where(first, pos, 0), axis=1)
    end = np.minimum.accumulate(np.where(last, pos, n - 1)[:, ::-1], axis=1)[:, ::-1]
    ranks = np.empty_like(s)
    np.put_along_axis(ranks, order, (start + end) / 2.0 + 1.0, axis=1)
    return ranks[0] if squeeze else ranks


def pearson_rows(x: Any, y: Any) -> np.ndarray:
    """Pearson r of each row of x with the same row of y: shape (rows,). NaN for every row
    when rows are shorter than :data:`MIN_PAIRS`, and for a row where x or y is constant
    (checked exactly — the centred sums of a constant float row are rounding noise, not 0)."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float64))
    y = np.atleast_2d(np.asarray(y, dtype=np.float64))
    if x.shape != y.shape:
        raise ValueError(f"shape mismatch: {x.shape} vs {y.shape}")
    if x.shape[1] < MIN_PAIRS:
        return np.full(x.shape[0], np.nan)
    xm = x - x.mean(axis=1, keepdims=True)
    ym = y - y.mean(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = (xm * ym).sum(axis=1) / np.sqrt((xm * xm).sum(axis=1) * (ym * ym).sum(axis=1))
    r[(np.ptp(x, axis=1) == 0) | (np.ptp(y, axis=1) == 0)] = np.nan
    return np.clip(r, -1.0, 1.0)


def finite_pairs(x: Any, y: Any) -> tuple[np.ndarray, np.ndarray]:
    """x and y flattened, without the pairs where either is NaN or ±inf."""
    x = np.asarray(x, dtype=np.float64).ravel()
    y = np.asarray(y, dtype=np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f"length mismatch: {x.shape} vs {y.shape}")
    ok = np.isfinite(x) & np.isfinite(y)
    return x[ok], y[ok]


def pearson(x: Any, y: Any) -> float:
    """Pearson r over the finite pairs; NaN below three pairs or with a constant side."""
    x, y = finite_pairs(x, y)
    return float(pearson_rows(x, y)[0])


def spearman(x: Any, y: Any) -> float:
    """Spearman ρ (Pearson r of average ranks) over the finite pairs; NaN below three pairs
    or with a constant side."""
    x, y = finite_pairs(x, y)
    return float(pearson_rows(rankdata(x), rankdata(y))[0])


# =========================================================================== resampling


def counts_of(idx: np.ndarray, n: int) -> np.ndarray:
    """(B, n) float64 counts of a (B, n) index matrix: how often row b drew each of n rows.
    One bincount over offset indices; float so a matrix product gives weighted sums."""
    b = idx.shape[0]
    flat = (idx + np.arange(b)[:, None] * n).ravel()  # row b's draws land in bins [b·n, (b+1)·n)
    return np.bincount(flat, minlength=b * n).reshape(b, n).astype(np.float64)


def bootstrap_weights(n: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """(n_boot, n) counts of ``n_boot`` resamples of n rows, drawn as one index matrix."""
    if n_boot <= 0 or n == 0:
        return np.zeros((0, n))
    return counts_of(rng.integers(0, n, size=(n_boot, n)), n)


def index_chunks(n: int, n_boot: int, rng: np.random.Generator, max_elems: int) -> Iterator[np.ndarray]:
    """The index matrix of ``n_boot`` resamples of n rows, in chunks of at most ~``max_elems``
    entries (memory stays bounded). The rows drawn do not depend on the chunk size."""
    chunk = max(1, max_elems // max(n, 1))
    done = 0
    while done < n_boot:
        b = min(chunk, n_boot - done)
        yield rng.integers(0, n, size=(b, n))
        done += b


def count_chunks(n: int, n_boot: int, rng: np.random.Generator, max_elems: int) -> Iterator[np.ndarray]:
    """:func:`index_chunks` as count matrices (see :func:`counts_of`)."""
    for idx in index_chunks(n, n_boot, rng, max_elems):
        yield counts_of(idx, n)


def bootstrap_means(x: Any, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """(n_boot,) means of resamples of x; all NaN when x is empty or ``n_boot`` is 0."""
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0 or n_boot <= 0:
        return np.full(max(n_boot, 0), np.nan)
    return bootstrap_weights(x.size, n_boot, rng) @ x / x.size


def _standardize(x: np.ndarray) -> np.ndarray:
    sd = x.std()
    return (x - x.mean()) / (sd if sd > 0 else 1.0)


def _constant_in_resample(W: np.ndarray, v: np.ndarray) -> np.ndarray:
    """(B,) True where every row drawn in resample b has the same value of v (v is (n,) or
    (B, n)): zero variance, decided exactly rather than from rounded moments."""
    drawn = W > 0
    lo = np.where(drawn, v, np.inf).min(axis=1)
    hi = np.where(drawn, v, -np.inf).max(axis=1)
    return lo == hi


def weighted_pearson(W: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pearson r of (a, b) in each resample given by the count rows of W (B, n). a and b are
    original columns (n,) or per-resample values (B, n), finite. NaN, as :func:`pearson_rows`,
    for a resample where a or b is constant, and for all resamples when n < :data:`MIN_PAIRS`."""
    B, n = W.shape
    if n < MIN_PAIRS:
        return np.full(B, np.nan)
    N = W.sum(axis=1)
    const = _constant_in_resample(W, a) | _constant_in_resample(W, b)
    if a.ndim == 1 and b.ndim == 1:
        a, b = _standardize(a), _standardize(b)  # keeps E[x²] − E[x]² well conditioned
        sa, sb = W @ a / N, W @ b / N
        cov = W @ (a * b) / N - sa * sb
        va = W @ (a * a) / N - sa * sa
        vb = W @ (b * b) / N - sb * sb
    else:
        a = np.broadcast_to(a, W.shape)
        b = np.broadcast_to(b, W.shape)
        da = a - ((W * a).sum(axis=1) / N)[:, None]
        db = b - ((W * b).sum(axis=1) / N)[:, None]
        cov = (W * da * db).sum(axis=1)
        va = (W * da * da).sum(axis=1)
        vb = (W * db * db).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = cov / np.sqrt(va * vb)
    r[const] = np.nan
    return np.clip(r, -1.0, 1.0)


def resample_ranks(W: np.ndarray, x: np.ndarray) -> np.ndarray:
    """(B, n): the average rank (ties shared) each original row's value has inside each
    resample of W — :func:`rankdata` of the resample, without sorting it.

    In resample b, the copies of a tie group g (original rows with equal value) number
    G = Σ_{i∈g} W[b, i] and come after the C copies of smaller values, so they share rank
    C + (G + 1)/2."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    new = np.ones(len(xs), dtype=bool)
    new[1:] = xs[1:] != xs[:-1]
    starts = np.flatnonzero(new)
    gid = np.empty(len(x), dtype=np.int64)
    gid[order] = np.cumsum(new) - 1
    G = np.add.reduceat(W[:, order], starts, axis=1)
    avg = np.cumsum(G, axis=1) - G + (G + 1) / 2
    return avg[:, gid]


# =========================================================================== intervals


def _percents(level: float) -> tuple[float, float]:
    half = 50.0 * level  # 50·0.95 is exactly 47.5, so 95 % gives exactly (2.5, 97.5)
    return 50.0 - half, 50.0 + half


def percentile_interval(samples: Any, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """Two-sided percentile interval along axis 0 of (resamples, ...) samples: arrays of
    shape ``samples.shape[1:]``. Each column uses its finite resamples only, and is NaN with
    fewer than :data:`MIN_RESAMPLES` of them."""
    s = np.asarray(samples, dtype=np.float64)
    q = _percents(level)
    if s.shape[0] < MIN_RESAMPLES:
        nan = np.full(s.shape[1:], np.nan)
        return nan, nan.copy()
    finite = np.isfinite(s)
    if finite.all():  # the common case; nanpercentile is an order of magnitude slower
        lo, hi = np.percentile(s, q, axis=0)
        return lo, hi
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: NaN, said below
        lo, hi = np.nanpercentile(np.where(finite, s, np.nan), q, axis=0)
    few = finite.sum(axis=0) < MIN_RESAMPLES
    return np.where(few, np.nan, lo), np.where(few, np.nan, hi)


def interval_bounds(samples: Any, level: float = LEVEL) -> tuple[float, float]:
    """:func:`percentile_interval` of a flat set of resampled values, as two floats."""
    lo, hi = percentile_interval(np.asarray(samples, dtype=np.float64).ravel(), level)
    return float(lo), float(hi)


def finite_or_none(x: float | None) -> float | None:
    """A number for JSON: undefined (None, NaN, ±inf) is None."""
    return float(x) if x is not None and math.isfinite(x) else None


def report_number(v: float | None) -> float | None:
    """``v`` as a report writes it: :func:`finite_or_none`, rounded to 6 decimal places."""
    x = finite_or_none(v)
    return None if x is None else round(x, 6)
