"""The reasoning-efficiency decomposition (docs/efficiency-model.md §1–4), pure numpy.

One benchmark at a time, the data is a (model × instance) grid (:class:`EvalTable`). Every
reported quantity is a ratio of *sums over instances*, so one matrix product of bootstrap
count weights (resamples × instances) with the per-instance values gives every quantity for
every resample at once — no Python loop over instances or resamples. All models share the
same count matrix, so the bootstrap is paired wherever models share instances. Counts,
intervals and rank correlations come from :mod:`pte_instrument.offline.statistics`.

Three *views* of a benchmark, each an exact decomposition on its own instance set:

- ``outcome``: all instances. Δlog E0 = Δlog r_ctx + Δlog r_logic − Δlog E[T].
- ``workload``: instances with a workload W. Δlog E0 = Δlog r_ctx + Δlog r_logic − Δlog V̄O − Δlog κ.
- ``trace``: instances with a visible trace (and W when the workload view exists).
  Δlog E0 = Δlog r_ctx + Δlog r_logic + Δlog q_trace − Δlog V̄O_sig − Δlog κ_sig
  (or − Δlog E[T_sig] without W).

Δlog terms compare a model with the reference on the instances *both* have in the view;
the per-model tables use each model's own instances. Terms are stored as contributions to
Δlog E0 (``length`` = −Δlog E[T], ``overhead`` = −Δlog V̄O, ...), so they add up to it.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pte_instrument.offline.statistics import count_chunks, finite_or_none, percentile_interval, spearman

DEFAULT_BOOTSTRAP = 500
DEFAULT_SPLITS = 200
MAX_BOOT_ELEMS = 4_000_000  # entries of one chunk of resample counts: memory stays bounded
LOOP_WINDOW = 256  # words at the end of a truncated trace examined for loops
NGRAM = 4
TOP_K = (1, 3, 5)


class AnalysisError(ValueError):
    """The request cannot be analysed (unknown reference, no workload, ...)."""


# =========================================================================== trace features


def compression_ratio(text: str | bytes) -> float:
    """σ_c = min(1, |zlib(trace)| / |trace|) in bytes, default zlib level. Measures surface
    redundancy (repeated text compresses well), not whether the reasoning is valid."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    if not data:
        raise ValueError("σ_c of an empty trace is undefined")
    return min(1.0, len(zlib.compress(data)) / len(data))


def _ngrams(words: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[k : k + n]) for k in range(len(words) - n + 1)]


def loop_audit(
    trace: str, prompt: str | None = None, window: int = LOOP_WINDOW, n: int = NGRAM
) -> tuple[float, float]:
    """Truncation-loop audit of one output: over the 4-grams of its last ``window``
    whitespace-separated words, (share that repeat an earlier 4-gram of the window,
    share that also occur in the prompt). A model stuck in a loop until the budget ran
    out scores high on the first; one echoing its prompt on the second. NaN when the
    window has no 4-gram (or, for the overlap, when there is no prompt)."""
    grams = _ngrams(trace.split()[-window:], n)
    if not grams:
        return math.nan, math.nan
    repeated = 1.0 - len(set(grams)) / len(grams)
    if prompt is None:
        return repeated, math.nan
    in_prompt = set(_ngrams(prompt.split(), n))
    return repeated, sum(g in in_prompt for g in grams) / len(grams)


# =========================================================================== data


@dataclass(frozen=True)
class EvalTable:
    """One benchmark as (model × instance) arrays; absent cells hold 0 (counts) or NaN."""

    benchmark: str
    models: tuple[str, ...]
    instances: tuple[str, ...]
    present: np.ndarray  # (M, N) bool: the model answered the instance
    correct: np.ndarray  # (M, N) 0/1
    tokens: np.ndarray  # (M, N) T > 0 where present
    truncated: np.ndarray  # (M, N) 0/1
    workload: np.ndarray  # (N,) W > 0, NaN unknown (an instance property)
    sigma: np.ndarray  # (M, N) σ_c, NaN without a trace
    pte: np.ndarray  # (M, N) PTE (served) of the answer, NaN unknown
    loop_repeat: np.ndarray  # (M, N) truncation-loop audit, NaN unless truncated with a trace
    loop_overlap: np.ndarray  # (M, N)

    @classmethod
    def from_arrays(
        cls,
        benchmark: str,
        models: Sequence[str],
        instances: Sequence[str],
        present: Any,
        correct: Any,
        tokens: Any,
        truncated: Any,
        workload: Any = None,
        sigma: Any = None,
        pte: Any = None,
        loop_repeat: Any = None,
        loop_overlap: Any = None,
    ) -> EvalTable:
        M, N = len(models), len(instances)
        present = np.asarray(present, dtype=bool)

        def grid(x: Any, fill: float) -> np.ndarray:
            a = np.full((M, N), fill) if x is None else np.asarray(x, dtype=np.float64)
            if a.shape != (M, N):
                raise AnalysisError(f"array of shape {a.shape}, expected {(M, N)}")
            return np.where(present, a, fill)

        w = np.full(N, np.nan) if workload is None else np.asarray(workload, dtype=np.float64)
        if present.shape != (M, N) or w.shape != (N,):
            raise AnalysisError("present must be (models, instances) and workload (instances,)")
        table = cls(
            benchmark,
            tuple(models),
            tuple(instances),
            present,
            grid(correct, 0.0),
            grid(tokens, 0.0),
            grid(truncated, 0.0),
            w,
            grid(sigma, np.nan),
            grid(pte, np.nan),
            grid(loop_repeat, np.nan),
            grid(loop_overlap, np.nan),
        )
        t = table.tokens[present]
        if (t <= 0).any() or not np.isfinite(t).all():
            raise AnalysisError("output tokens must be finite and > 0 where present")
        if ((table.correct > 0) & (table.truncated > 0)).any():
            raise AnalysisError("a truncated answer cannot be correct")
        return table

    def index(self, model: str) -> int:
        try:
            return self.models.index(model)
        except ValueError:
            raise AnalysisError(
                f"model {model!r} not in benchmark {self.benchmark!r} (models: {', '.join(self.models)})"
            ) from None


# =========================================================================== results


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its percentile bootstrap interval (NaN without bootstrap)."""

    value: float
    low: float = math.nan
    high: float = math.nan

    def to_dict(self) -> dict[str, float | None]:
        v, lo, hi = self.value, self.low, self.high
        return {"value": finite_or_none(v), "low": finite_or_none(lo), "high": finite_or_none(hi)}


@dataclass(frozen=True)
class Decomposition:
    """Δlog E0 of a model against the reference, split into additive terms."""

    n_shared: int
    dlog_e0: Estimate
    terms: dict[str, Estimate]
    residual: float  # Δlog E0 − Σ terms at the point estimate: 0 up to rounding


@dataclass(frozen=True)
class ViewResult:
    name: str  # outcome | workload | trace
    terms: tuple[str, ...]
    quantities: dict[str, dict[str, Estimate]]  # model -> quantity -> estimate
    decomposition: dict[str, Decomposition]  # model -> decomposition vs the reference


@dataclass(frozen=True)
class SplitAudit:
    """Spearman ρ over held-out random half splits of the reference pool."""

    n_splits: int
    n_valid: int  # splits where ρ was defined
    median: float
    p5: float
    p95: float


@dataclass(frozen=True)
class SolverAudits:
    leave_self_out: dict[str, float]  # {"vo": ρ, "kappa": ρ}
    leave_top_k: dict[int, dict[str, Any]]  # k -> {"removed": [...], "vo": ρ, "kappa": ρ}
    held_out: dict[str, SplitAudit]  # "vo" / "kappa"


@dataclass(frozen=True)
class SolverResult:
    """Solver-derived workload: W_solv(i) = T of the highest-ranked pool model (by E0) that
    answered i correctly."""

    ordering: tuple[tuple[str, float], ...]  # (model, E0) of the pool, best first
    instance_solver: dict[str, str | None]  # instance -> solver (None: nobody solved it)
    n_covered: int
    coverage: Estimate
    shares: dict[str, Estimate]  # model -> share of covered instances it solves first
    top1_share: Estimate
    top3_share: Estimate
    effective_solvers: Estimate  # inverse Simpson index 1 / Σ share²
    audits: SolverAudits


@dataclass(frozen=True)
class Signature:
    """Which Δlog term costs a model most against the reference (docs/efficiency-model.md §4)."""

    label: str
    view: str | None = None
    term: str | None = None
    value: float | None = None
    significant: bool | None = None  # the term's bootstrap interval lies below 0


@dataclass(frozen=True)
class BenchmarkResult:
    benchmark: str
    reference: str
    models: tuple[str, ...]
    n_instances: int
    workload_source: str | None  # "native", "solver" or None
    views: dict[str, ViewResult]
    solver: SolverResult | None
    signatures: dict[str, Signature]
    n_bootstrap: int
    seed: int
    notes: list[str] = field(default_factory=list)


# =========================================================================== sums → quantities

# Per-instance values summed over a set of instances; every quantity is a ratio of these.
SUMS = (
    "n",
    "s",
    "t",
    "c",
    "w",
    "vo",
    "ts",
    "vos",
    "pte",
    "pte_n",
    "loop_n",
    "loop_rep",
    "ovl_n",
    "ovl",
)

_OUTCOME_QUANTITIES = ("n", "accuracy", "e0", "mean_tokens", "r_ctx", "r_logic")  # every view has these
VIEW_QUANTITIES: dict[str, tuple[str, ...]] = {
    "outcome": (
        *_OUTCOME_QUANTITIES,
        "pte_per_correct",
        "mean_pte",
        "loop_repeat",
        "loop_prompt_overlap",
        "n_truncated_traces",
    ),
    "workload": (*_OUTCOME_QUANTITIES, "mean_workload", "vo", "kappa"),
    "trace": (
        *_OUTCOME_QUANTITIES,
        "q_trace",
        "mean_signal_tokens",
        "mean_workload",
        "vo_sig",
        "kappa_sig",
    ),
}


def _value_stack(table: EvalTable, W: np.ndarray, rows: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(len(SUMS), M, N): for output column m, the per-instance values of model ``rows[m]``
    on the instances ``mask[m]`` keeps (0 elsewhere)."""
    S, T, C = table.correct[rows], table.tokens[rows], table.truncated[rows]
    sig, pte = table.sigma[rows], table.pte[rows]
    rep, ovl = table.loop_repeat[rows], table.loop_overlap[rows]
    Wm = np.broadcast_to(W, T.shape)
    known_w = mask & np.isfinite(Wm)
    known_s = mask & np.isfinite(sig)
    with np.errstate(invalid="ignore", divide="ignore"):
        vo = np.where(known_w, T / np.where(known_w, Wm, 1.0), 0.0)
        tsig = np.where(known_s, T * sig, 0.0)
        vos = np.where(known_w & known_s, tsig / np.where(known_w, Wm, 1.0), 0.0)
    m = mask.astype(np.float64)
    has_pte, has_rep, has_ovl = mask & np.isfinite(pte), mask & np.isfinite(rep), mask & np.isfinite(ovl)
    return np.stack(
        [
            m,
            m * S,
            m * T,
            m * C,
            np.where(known_w, Wm, 0.0),
            vo,
            tsig,
            vos,
            np.where(has_pte, pte, 0.0),
            has_pte.astype(np.float64),
            has_rep.astype(np.float64),
            np.where(has_rep, rep, 0.0),
            has_ovl.astype(np.float64),
            np.where(has_ovl, ovl, 0.0),
        ]
    )


def _sums(weights: np.ndarray | Iterable[np.ndarray], stack: np.ndarray) -> dict[str, np.ndarray]:
    """Weighted sums: (B, N) count weights, whole or as chunks of rows, × (n_sums, C, N)
    values -> name -> (B, C)."""
    ns, C, N = stack.shape
    values = stack.reshape(ns * C, N).T
    chunks = [weights] if isinstance(weights, np.ndarray) else weights
    out = np.concatenate([w @ values for w in chunks]).reshape(-1, ns, C)
    return {k: out[:, j, :] for j, k in enumerate(SUMS)}


def quantities(s: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every quantity of docs/efficiency-model.md §1–3 from the sums of one instance set.

    E0 = 1000·ΣS/ΣT (pooled ratio of sums); r_ctx = 1 − mean C; r_logic = ΣS/Σ(1−C);
    E[T]; V̄O = mean(T/W); κ = E[T]/(E[W]·V̄O) = E[W·VO]/(E[W]·E[VO]) since W·VO = T;
    q_trace = E[T_sig]/E[T]; V̄O_sig, κ_sig the same on T_sig = T·σ_c. PTE per correct
    answer is pooled too (ΣPTE/ΣS), and only defined when every answer has a PTE."""
    n, S, T, C, w = s["n"], s["s"], s["t"], s["c"], s["w"]
    with np.errstate(invalid="ignore", divide="ignore"):
        all_pte = s["pte_n"] == n
        return {
            "n": n,
            "accuracy": S / n,
            "e0": 1000.0 * S / T,
            "mean_tokens": T / n,
            "r_ctx": 1.0 - C / n,
            "r_logic": S / (n - C),
            "mean_workload": w / n,
            "vo": s["vo"] / n,
            "kappa": T * n / (w * s["vo"]),
            "q_trace": s["ts"] / T,
            "mean_signal_tokens": s["ts"] / n,
            "vo_sig": s["vos"] / n,
            "kappa_sig": s["ts"] * n / (w * s["vos"]),
            "pte_per_correct": np.where(all_pte, s["pte"] / S, np.nan),
            "mean_pte": np.where(all_pte, s["pte"] / n, np.nan),
            "loop_repeat": s["loop_rep"] / s["loop_n"],
            "loop_prompt_overlap": s["ovl"] / s["ovl_n"],
            "n_truncated_traces": s["loop_n"],
        }


def view_terms(view: str, with_workload: bool) -> tuple[str, ...]:
    if view == "outcome":
        return ("ctx", "logic", "length")
    if view == "workload":
        return ("ctx", "logic", "overhead", "coupling")
    return (
        ("ctx", "logic", "q_trace", "overhead_sig", "coupling_sig")
        if with_workload
        else ("ctx", "logic", "q_trace", "length_sig")
    )


# name -> (quantity, sign): term = sign · (log q_model − log q_reference)
TERM_DEFINITIONS: dict[str, tuple[str, int]] = {
    "ctx": ("r_ctx", 1),
    "logic": ("r_logic", 1),
    "length": ("mean_tokens", -1),
    "overhead": ("vo", -1),
    "coupling": ("kappa", -1),
    "q_trace": ("q_trace", 1),
    "overhead_sig": ("vo_sig", -1),
    "coupling_sig": ("kappa_sig", -1),
    "length_sig": ("mean_signal_tokens", -1),
}


def dlog_terms(
    terms: Sequence[str], qm: dict[str, np.ndarray], qr: dict[str, np.ndarray]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(Δlog E0, {term: contribution}) of model quantities ``qm`` against reference ``qr``."""
    with np.errstate(invalid="ignore", divide="ignore"):

        def d(k: str) -> np.ndarray:
            return np.log(qm[k]) - np.log(qr[k])

        return d("e0"), {t: TERM_DEFINITIONS[t][1] * d(TERM_DEFINITIONS[t][0]) for t in terms}


# =========================================================================== bootstrap


def _estimates(point: np.ndarray, boot: np.ndarray | None) -> list[Estimate]:
    if boot is None or boot.shape[0] == 0:
        return [Estimate(float(v)) for v in point]
    lo, hi = percentile_interval(boot)
    return [Estimate(float(v), float(a), float(b)) for v, a, b in zip(point, lo, hi, strict=True)]


def _rng(seed: int, benchmark: str, stream: int) -> np.random.Generator:
    # Seeded per benchmark and purpose: results for one benchmark do not depend on which
    # other benchmarks were analysed alongside it.
    return np.random.default_rng([seed, zlib.crc32(benchmark.encode()), stream])


# =========================================================================== solver workload


def pooled_e0(table: EvalTable) -> np.ndarray:
    """E0 per model over its own instances (absent cells hold 0)."""
    return 1000.0 * table.correct.sum(axis=1) / table.tokens.sum(axis=1)


def reference_order(table: EvalTable, pool: Sequence[int]) -> list[int]:
    """Pool model indices by E0 (each over its own instances), best first; ties by name."""
    e0 = pooled_e0(table)
    return sorted(pool, key=lambda m: (-e0[m], table.models[m]))


def solver_workload(table: EvalTable, order: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(solver index per instance, −1 if none; W_solv per instance, NaN if none): the
    generated length of the first model in ``order`` that answered correctly — fall through
    the ranking past models that failed or skipped the instance."""
    N = len(table.instances)
    if len(order) == 0:
        return np.full(N, -1), np.full(N, np.nan)
    order = np.asarray(order)
    solved = table.present[order] & (table.correct[order] > 0)  # (P, N) in ranking order
    first = solved.argmax(axis=0)  # first True; 0 when none, masked below
    has = solved.any(axis=0)
    solver = np.where(has, order[first], -1)
    W = np.where(has, table.tokens[order[first], np.arange(N)], np.nan)
    return solver, W


def overhead_coupling(table: EvalTable, W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(V̄O, κ) per model over its instances with a known W (NaN without any)."""
    q = table.present & np.isfinite(W)[None, :]
    n = q.sum(axis=1)
    Wq = np.where(q, W[None, :], 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        vo_sum = np.where(q, table.tokens / np.where(q, W[None, :], 1.0), 0.0).sum(axis=1)
        t_sum = np.where(q, table.tokens, 0.0).sum(axis=1)
        return vo_sum / n, t_sum * n / (Wq.sum(axis=1) * vo_sum)


def _solver_shares(K: np.ndarray, solver: np.ndarray, pool: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(covered count (B,), solver counts (B, P)) under count weights K."""
    onehot = (solver[:, None] == np.asarray(pool)[None, :]).astype(np.float64)  # (N, P)
    counts = K @ onehot
    return counts.sum(axis=1), counts


def _share_stats(covered: np.ndarray, counts: np.ndarray) -> dict[str, np.ndarray]:
    """Solver shares (of covered instances), top-1 and top-3 share, and the effective number
    of solvers 1 / Σ share²: the inverse Simpson index, i.e. the inverse Herfindahl–Hirschman
    concentration of the shares (k equal solvers give k; one dominant solver gives ≈ 1)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        shares = counts / covered[:, None]
        ordered = -np.sort(-shares, axis=1)
        return {
            "shares": shares,
            "top1": ordered[:, :1].sum(axis=1),
            "top3": ordered[:, :3].sum(axis=1),
            "effective": 1.0 / (shares**2).sum(axis=1),
        }


def solver_audits(
    table: EvalTable,
    order: Sequence[int],
    shares: np.ndarray,
    n_splits: int,
    rng: np.random.Generator,
) -> SolverAudits:
    """Spearman ρ of V̄O and κ model rankings under perturbed pools against the full pool.

    - leave-self-out: each pool model's W built without it (others keep the full-pool W);
    - leave-top-k: the k pool models with the largest solver share removed (k < pool size);
    - held-out: ``n_splits`` random halves; W from one half, ρ over the other half.
    One loop iteration per pool variant, each vectorized over models × instances."""
    order = list(order)
    vo_full, ka_full = overhead_coupling(table, solver_workload(table, order)[1])

    vo_lso, ka_lso = vo_full.copy(), ka_full.copy()
    for m in order:
        vo, ka = overhead_coupling(table, solver_workload(table, [x for x in order if x != m])[1])
        vo_lso[m], ka_lso[m] = vo[m], ka[m]
    lso = {"vo": spearman(vo_lso, vo_full), "kappa": spearman(ka_lso, ka_full)}

    # largest share first; ties keep the reference order (a stable sort)
    by_share = [order[j] for j in np.argsort(-shares, kind="stable")]
    top: dict[int, dict[str, Any]] = {}
    for k in TOP_K:
        if k >= len(order):
            continue
        removed = set(by_share[:k])
        vo, ka = overhead_coupling(table, solver_workload(table, [x for x in order if x not in removed])[1])
        top[k] = {
            "removed": [table.models[m] for m in by_share[:k]],
            "vo": spearman(vo, vo_full),
            "kappa": spearman(ka, ka_full),
        }

    rho = np.full((n_splits, 2), np.nan)
    P = len(order)
    if P >= 2:
        for k in range(n_splits):
            perm = rng.permutation(P)
            ref_half = sorted(perm[: P // 2])  # positions, so the reference order is kept
            held = [order[j] for j in perm[P // 2 :]]
            vo, ka = overhead_coupling(table, solver_workload(table, [order[j] for j in ref_half])[1])
            rho[k] = spearman(vo[held], vo_full[held]), spearman(ka[held], ka_full[held])
    held_out = {}
    for j, name in enumerate(("vo", "kappa")):
        ok = rho[:, j][np.isfinite(rho[:, j])]
        if ok.size:
            med, p5, p95 = np.percentile(ok, [50, 5, 95])
        else:
            med = p5 = p95 = math.nan
        held_out[name] = SplitAudit(n_splits, int(ok.size), float(med), float(p5), float(p95))
    return SolverAudits(lso, top, held_out)


# =========================================================================== diagnosis

FAMILIES = {
    "ctx": "context-limited",
    "logic": "logic-limited",
    "length": "verbosity-limited",
    "overhead": "verbosity-limited",
    "coupling": "verbosity-limited",
}
LENGTH_TERMS = ("length", "overhead", "coupling")
TRACE_LENGTH_TERMS = ("q_trace", "overhead_sig", "coupling_sig", "length_sig")


def diagnose(model: str, reference: str, views: dict[str, ViewResult]) -> Signature:
    """Signature from the dominant (most negative) Δlog term.

    Step 1, on the workload view (else the outcome view): ``ctx`` → context-limited,
    ``logic`` → logic-limited, a length term (``length``/``overhead``/``coupling``) →
    verbosity-limited. Step 2, only for verbosity and when traces exist: the trace view
    splits the length penalty into redundancy (Δlog q_trace) and signal length
    (V̄O_sig, κ_sig or E[T_sig]); if q_trace is the most negative of these the model is
    redundancy-limited (long *because* repetitive), else it stays verbosity-limited."""
    if model == reference:
        return Signature("reference")
    primary = views.get("workload") or views["outcome"]
    dec = primary.decomposition.get(model)
    if dec is None or dec.n_shared == 0:
        return Signature("undetermined (no shared instances)")
    # −inf counts (e.g. a model that completes nothing: log r_ctx = −inf); NaN does not
    defined = {t: e for t, e in dec.terms.items() if not math.isnan(e.value)}
    if not defined:
        return Signature("undetermined (terms undefined)", primary.name)
    term = min(defined, key=lambda t: defined[t].value)
    est, view = defined[term], primary.name
    if est.value >= 0:
        return Signature("not limited (no term below the reference)", view, term, est.value)
    label = FAMILIES[term]
    trace = views.get("trace")
    if term in LENGTH_TERMS and trace is not None and model in trace.decomposition:
        tdec = trace.decomposition[model]
        split = {t: e for t, e in tdec.terms.items() if t in TRACE_LENGTH_TERMS and math.isfinite(e.value)}
        if split:
            worst = min(split, key=lambda t: split[t].value)
            if worst == "q_trace" and split[worst].value < 0:
                label, term, est, view = "redundancy-limited", worst, split[worst], "trace"
    significant = None if math.isnan(est.high) else bool(est.high < 0)
    return Signature(label, view, term, est.value, significant)


# =========================================================================== analysis


def analyze(
    table: EvalTable,
    reference: str,
    *,
    workload: str | None = None,
    pool: Sequence[str] | None = None,
    n_boot: int = DEFAULT_BOOTSTRAP,
    n_splits: int = DEFAULT_SPLITS,
    seed: int = 0,
) -> BenchmarkResult:
    """Decompose one benchmark against ``reference``.

    ``workload``: None (native W when the data has it, else no workload view), "native"
    (required) or "solver" (derived from ``pool``, default all models). Bootstrap over
    instances with ``n_boot`` resamples (0: point estimates only)."""
    if n_boot < 0 or n_splits < 0:
        raise AnalysisError("bootstrap and split counts must be >= 0")
    ref = table.index(reference)
    M, N = len(table.models), len(table.instances)
    notes: list[str] = []
    solver_idx = None
    pool_idx: list[int] = []
    if workload == "solver":
        names = list(pool) if pool else list(table.models)
        pool_idx = [table.index(m) for m in dict.fromkeys(names)]
        order = reference_order(table, pool_idx)
        solver_idx, W = solver_workload(table, order)
        source: str | None = "solver"
        if not np.isfinite(W).any():
            raise AnalysisError(f"{table.benchmark}: no pool model solved any instance")
    elif workload in (None, "native"):
        W = table.workload
        source = "native" if np.isfinite(W).any() else None
        if workload == "native" and source is None:
            raise AnalysisError(f"benchmark {table.benchmark!r} has no workload field; use --workload solver")
        if source is None:
            notes.append("no workload in the data: workload view omitted (see --workload solver)")
        elif not np.isfinite(W).all():
            notes.append(f"workload known for {int(np.isfinite(W).sum())} of {N} instances")
    else:
        raise AnalysisError(f"unknown workload source {workload!r} (native or solver)")

    if not (table.present == table.present[ref][None, :]).all():
        notes.append(
            "models answered different instance sets: Δlog terms use the instances "
            "each model shares with the reference"
        )

    def resamples() -> Iterator[np.ndarray]:
        """The count rows of the ``n_boot`` resamples, a bounded chunk at a time (all at once
        they are n_boot × N: 10 GiB for 10⁵ resamples of 14 000 instances); the same rows on
        every call, so every view and the solver shares see the same resamples."""
        return count_chunks(N, n_boot, _rng(seed, table.benchmark, 0), MAX_BOOT_ELEMS)

    ones = np.ones((1, N))
    has_w = source is not None
    has_trace = bool(np.isfinite(table.sigma[table.present]).any())
    view_specs = [("outcome", False, False)]
    if has_w:
        view_specs.append(("workload", True, False))
    if has_trace:
        view_specs.append(("trace", has_w, True))

    views: dict[str, ViewResult] = {}
    rows_self, rows_ref = np.arange(M), np.full(M, ref)
    for name, need_w, need_trace in view_specs:
        req = table.present.copy()
        if need_w:
            req &= np.isfinite(W)[None, :]
        if need_trace:
            req &= np.isfinite(table.sigma)
        shared = req & req[ref][None, :]
        # own set (tables), shared set for the model and, on the same set, the reference
        stack = np.concatenate(
            [
                _value_stack(table, W, rows_self, req),
                _value_stack(table, W, rows_self, shared),
                _value_stack(table, W, rows_ref, shared),
            ],
            axis=1,
        )
        point = _sums(ones, stack)
        boot = _sums(resamples(), stack) if n_boot else None
        del stack
        views[name] = _view_result(table, name, need_w, point, boot, M)
    for name in views:
        if name != "outcome" and any(d.n_shared == 0 for d in views[name].decomposition.values()):
            notes.append(f"{name} view: some models share no instance with the reference")

    solver_result = None
    if solver_idx is not None:
        solver_result = _solver_result(
            table, order, solver_idx, resamples if n_boot else None, n_splits, seed
        )
        notes.append(
            f"solver-derived workload: {solver_result.n_covered} of {N} instances solved by "
            "the pool; the others drop out of the workload and trace views"
        )
    signatures = {m: diagnose(m, reference, views) for m in table.models}
    return BenchmarkResult(
        table.benchmark,
        reference,
        table.models,
        N,
        source,
        views,
        solver_result,
        signatures,
        n_boot,
        seed,
        notes,
    )


def _split(s: dict[str, np.ndarray], part: int, M: int) -> dict[str, np.ndarray]:
    return {k: v[:, part * M : (part + 1) * M] for k, v in s.items()}


def _view_result(
    table: EvalTable,
    name: str,
    with_w: bool,
    point: dict[str, np.ndarray],
    boot: dict[str, np.ndarray] | None,
    M: int,
) -> ViewResult:
    terms = view_terms(name, with_w)

    def evaluate(s: dict[str, np.ndarray]):
        own = quantities(_split(s, 0, M))
        sm, sr = _split(s, 1, M), dict(_split(s, 2, M))
        sr["w"] = sm["w"]  # same instances, same W: keep E[W] bit-identical so it cancels
        dlog, parts = dlog_terms(terms, quantities(sm), quantities(sr))
        return own, dlog, parts, sm["n"]

    p_own, p_dlog, p_parts, p_n = evaluate(point)
    b_own, b_dlog, b_parts = (None, None, None)
    if boot is not None:
        b_own, b_dlog, b_parts, _ = evaluate(boot)
    qnames = VIEW_QUANTITIES[name]
    if name == "trace" and not with_w:
        qnames = tuple(q for q in qnames if q not in ("mean_workload", "vo_sig", "kappa_sig"))
    q_est = {q: _estimates(p_own[q][0], None if b_own is None else b_own[q]) for q in qnames}
    d_est = _estimates(p_dlog[0], b_dlog)
    t_est = {t: _estimates(p_parts[t][0], None if b_parts is None else b_parts[t]) for t in terms}
    with np.errstate(invalid="ignore"):
        residual = p_dlog[0] - sum(p_parts[t][0] for t in terms)
    quant = {m: {q: q_est[q][k] for q in qnames} for k, m in enumerate(table.models)}
    decomp = {
        m: Decomposition(int(p_n[0, k]), d_est[k], {t: t_est[t][k] for t in terms}, float(residual[k]))
        for k, m in enumerate(table.models)
    }
    return ViewResult(name, terms, quant, decomp)


def _solver_result(
    table: EvalTable,
    order: list[int],
    solver: np.ndarray,
    resamples: Callable[[], Iterable[np.ndarray]] | None,
    n_splits: int,
    seed: int,
) -> SolverResult:
    N = len(table.instances)
    covered, counts = _solver_shares(np.ones((1, N)), solver, order)
    p = _share_stats(covered, counts)
    b = None
    if resamples is not None:
        shares = [_solver_shares(w, solver, order) for w in resamples()]
        b_cov, b_counts = np.concatenate([c for c, _ in shares]), np.concatenate([k for _, k in shares])
        b = _share_stats(b_cov, b_counts)
        b["coverage"] = b_cov / N
    p["coverage"] = covered / N

    def est(key: str) -> Estimate:
        return _estimates(p[key], None if b is None else b[key][:, None])[0]

    share_est = _estimates(p["shares"][0], None if b is None else b["shares"])
    e0 = pooled_e0(table)
    audits = solver_audits(table, order, p["shares"][0], n_splits, _rng(seed, table.benchmark, 1))
    return SolverResult(
        ordering=tuple((table.models[m], float(e0[m])) for m in order),
        instance_solver={
            i: (table.models[k] if k >= 0 else None) for i, k in zip(table.instances, solver, strict=True)
        },
        n_covered=int((solver >= 0).sum()),
        coverage=est("coverage"),
        shares={table.models[m]: share_est[j] for j, m in enumerate(order)},
        top1_share=est("top1"),
        top3_share=est("top3"),
        effective_solvers=est("effective"),
        audits=audits,
    )
