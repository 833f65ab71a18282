"""What a correct answer costs: an evaluation harness's scored samples joined to the
plugin's request log, priced in output tokens, PTE, GPU seconds and money.

**The join.** Each sample's calls (:class:`~pte_instrument.offline.harness_runs.Call`) are
found in the request log: by response id (the log's ``request_id``) where the harness kept
one, else by prompt digest among the requests of the run's model that arrived within the
run's time (± ``SLACK_S``), the earliest unclaimed first, so repeated identical prompts are
matched in order. A request is joined to one call at most. A sample is joined when every
call it made is; the others are counted (``samples_unmatched``, by reason), as are the
requests of the run's window that no sample claimed (``requests_unmatched``).

**A joined sample** costs the sum of its requests. It is *cut* (truncated) when the request
that gave its answer, its last, stopped on length and the harness did not score it correct
(a correct answer came before the cut: ``correct_but_cut`` counts these).

**Per run and task** (docs/efficiency.md): accuracy, completion rate r_ctx = 1 − mean(cut),
conditional correctness r_logic = Σ correct / Σ (1 − cut), E0 = 1000 · Σ correct / Σ T, and
for each unit u the cost per correct answer Σ u / Σ correct, each with a percentile bootstrap
interval over samples. For two runs, on the samples both joined (paired resampling):

    log(cost per correct, u)  =  log E[T] + log(Σu / ΣT) − log r_ctx − log r_logic

so the log-ratio of two runs' costs is exactly the sum of four terms: *verbosity* (Δlog E[T]),
*price per token* (Δlog Σu/ΣT: prompt length, cache hits, batching, hardware), *truncation*
(−Δlog r_ctx) and *logic* (−Δlog r_logic).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np

from pte_instrument.offline.decomposition import Estimate, _estimates, _rng
from pte_instrument.offline.harness_runs import Run, Sample, task_reference
from pte_instrument.offline.records import LARGEST_VALUE, EvalRecord, Problem, RecordError
from pte_instrument.offline.request_log import log_lines, repeated_ids
from pte_instrument.offline.statistics import count_chunks

SCHEMA = "pte-cost-per-correct/1"
SLACK_S = 2.0  # a run's window is widened by this on each side (harness clocks log whole seconds)
# The units a correct answer is priced in, and the request-log field each one sums.
UNIT_FIELDS = {
    "output_tokens": "output_tokens",
    "pte": "pte_served",
    "gpu_seconds": "gpu_seconds",
    "cost_usd": "cost_usd",
}
UNITS = tuple(UNIT_FIELDS)
UNIT_LABELS = {"output_tokens": "output tokens", "pte": "PTE", "gpu_seconds": "GPU s", "cost_usd": "USD"}
TERMS = ("verbosity", "price_per_token", "truncation", "logic")
MAX_BOOT_ELEMS = 4_000_000  # entries of one resample count matrix: memory stays bounded


# A count, PTE, second or dollar of one request: past 2**53 a float stops counting by one, and
# a few such values sum to infinity (a cost per correct answer that is silently missing).
_Amount = Annotated[float, msgspec.Meta(ge=0, le=LARGEST_VALUE)]


class LoggedRequest(msgspec.Struct):
    """The request-log fields the join reads (every other field is skipped unparsed)."""

    request_id: str
    model: str
    finish_reason: str
    output_tokens: Annotated[int, msgspec.Meta(ge=0, le=int(LARGEST_VALUE))]
    pte_served: _Amount
    finished_at: float
    arrived_at: float | None = None
    prompt_digest: str | None = None
    gpu_seconds: _Amount | None = None
    cost_usd: _Amount | None = None

    @property
    def at(self) -> float:
        return self.arrived_at if self.arrived_at else self.finished_at


_DECODER = msgspec.json.Decoder(LoggedRequest)


def read_request_log(path: str | Path) -> tuple[list[LoggedRequest], list[Problem]]:
    """Every request of the log (JSONL, gzipped or not); a line that is not a request is a
    problem naming it, never a silent loss."""
    p = Path(path)
    out: list[LoggedRequest] = []
    line_of: list[int] = []
    problems: list[Problem] = []
    for n, line in enumerate(log_lines(p), 1):
        if not line.strip():
            continue
        try:
            out.append(_DECODER.decode(line))
            line_of.append(n)
        except msgspec.DecodeError as e:
            problems.append(Problem(f"{p}:{n}", f"not a request-log line: {e}"))
        except RecursionError:  # msgspec's decoder recurses even into the fields it skips
            problems.append(Problem(f"{p}:{n}", "not a request-log line: JSON nested too deep"))
    if not out:
        raise RecordError(f"{p}: no request-log line (is it the plugin's PTE_REQUEST_LOG?)")
    return out, problems + _reused_ids(p, out, line_of)


def _reused_ids(path: Path, requests: list[LoggedRequest], line_of: list[int]) -> list[Problem]:
    """A request id logged more than once: every copy is kept, but the id names none of them
    for certain, so ``join_runs`` joins them by what they sent."""
    ids = ((r.request_id, n) for r, n in zip(requests, line_of, strict=True))
    return repeated_ids(path, ids, "joined by what it sent, not by its id")


# =========================================================================== join


@dataclass(frozen=True)
class JoinedSample:
    sample: Sample
    requests: tuple[LoggedRequest, ...]

    @property
    def cut(self) -> bool:
        return self.requests[-1].finish_reason == "length" and not self.sample.correct

    @cached_property
    def costs(self) -> dict[str, float | None]:
        """Its cost in each unit, summed over its requests; None where a request has no such
        figure (no step hook, no price)."""
        out: dict[str, float | None] = {}
        for unit, name in UNIT_FIELDS.items():
            values = [getattr(r, name) for r in self.requests]
            out[unit] = None if any(v is None for v in values) else float(sum(values))
        return out

    def unit(self, name: str) -> float | None:
        return self.costs[name]


@dataclass(frozen=True)
class RunJoin:
    run: Run
    joined: tuple[JoinedSample, ...]
    unmatched: Counter[str]  # reason → samples
    requests_in_window: int  # of the run's model, arrived in its window
    requests_unmatched: int  # of those, joined to no sample of any run
    problems: tuple[Problem, ...] = ()

    def summary(self) -> dict[str, Any]:
        r = self.run
        return {
            "label": r.label,
            "harness": r.harness,
            "model": r.model,
            "source": r.source,
            "metrics": r.metrics,
            "started_at": r.started_at,
            "ended_at": r.ended_at,
            "samples": len(self.joined) + sum(self.unmatched.values()),
            "samples_joined": len(self.joined),
            "samples_unmatched": sum(self.unmatched.values()),
            "samples_unmatched_by_reason": dict(self.unmatched),
            "requests_joined": sum(len(j.requests) for j in self.joined),
            "requests_in_window": self.requests_in_window,
            "requests_unmatched": self.requests_unmatched,
            "problems": [p.to_dict() for p in (*r.problems, *self.problems)],
        }


class _ByDigest:
    """The log's requests of one model by digest, each list in arrival order."""

    def __init__(self, requests: Iterable[tuple[int, LoggedRequest]]) -> None:
        lists: dict[str, list[tuple[float, int]]] = defaultdict(list)
        for k, r in requests:
            if r.prompt_digest:
                lists[r.prompt_digest].append((r.at, k))
        for v in lists.values():
            v.sort()
        self.lists = lists

    def earliest(self, digest: str, start: float, end: float, claimed: set[int]) -> int | None:
        items = self.lists.get(digest)
        if not items:
            return None
        for at, k in items[bisect.bisect_left(items, (start, -1)) :]:
            if at > end:
                return None
            if k not in claimed:
                return k
        return None


def join_runs(
    runs: Sequence[Run], requests: Sequence[LoggedRequest], slack_s: float = SLACK_S
) -> list[RunJoin]:
    """Each run's samples joined to the requests that served them (see the module's text);
    the runs are joined in the order they started, so each takes its own requests first."""
    ids = Counter(r.request_id for r in requests)  # an id logged twice names none of its copies
    by_id = {r.request_id: k for k, r in enumerate(requests) if ids[r.request_id] == 1}
    models = {r.model for r in requests}
    claimed: set[int] = set()
    indexes: dict[str | None, _ByDigest] = {}  # by model; None: every model's requests
    order = sorted(range(len(runs)), key=lambda i: (runs[i].started_at is None, runs[i].started_at or 0.0, i))
    out: dict[int, tuple[list[JoinedSample], Counter[str], list[Problem]]] = {}
    for i in order:
        run = runs[i]
        problems: list[Problem] = []
        model = run.model if run.model in models else None
        if model is None:
            problems.append(
                Problem(
                    run.source,
                    f"model {run.model!r} not in the request log: matched against every model",
                    action="kept",
                )
            )
        if model not in indexes:
            indexes[model] = _ByDigest((k, r) for k, r in enumerate(requests) if model in (None, r.model))
        start, end = _window(run, slack_s)
        joined: list[JoinedSample] = []
        unmatched: Counter[str] = Counter()
        for sample in run.samples:
            taken = _claim(sample, by_id, indexes[model], start, end, claimed)
            if isinstance(taken, str):
                unmatched[taken] += 1
            else:
                joined.append(JoinedSample(sample, tuple(requests[k] for k in taken)))
        out[i] = (joined, unmatched, problems)
    at = np.fromiter((r.at for r in requests), np.float64, len(requests))
    model_of = np.array([r.model for r in requests], dtype=object)
    free = np.ones(len(requests), bool)
    free[list(claimed)] = False
    results = []
    for i, run in enumerate(runs):
        start, end = _window(run, slack_s)
        window = (at >= start) & (at <= end)
        if run.model in models:
            window &= model_of == run.model
        joined, unmatched, problems = out[i]
        results.append(
            RunJoin(
                run, tuple(joined), unmatched, int(window.sum()), int((window & free).sum()), tuple(problems)
            )
        )
    return results


def _claim(
    sample: Sample, by_id: dict[str, int], index: _ByDigest, start: float, end: float, claimed: set[int]
) -> list[int] | str:
    """The requests (log positions) that served ``sample``'s calls, now claimed; or why it
    cannot be joined, and then nothing is claimed (a sample joined in part costs nothing known)."""
    if not sample.calls:
        return "no model call logged"
    taken: list[int] = []
    for call in sample.calls:
        k = by_id.get(call.response_id) if call.response_id else None
        if k is None or k in claimed:
            k = index.earliest(call.digest, start, end, claimed) if call.digest else None
        if k is None:
            claimed.difference_update(taken)
            return "not in the request log" if call.digest or call.response_id else "no digest to match"
        claimed.add(k)
        taken.append(k)
    return taken


def _window(run: Run, slack_s: float) -> tuple[float, float]:
    start = -math.inf if run.started_at is None else run.started_at - slack_s
    end = math.inf if run.ended_at is None else run.ended_at + slack_s
    return start, end


def eval_records(joins: Sequence[RunJoin]) -> tuple[list[EvalRecord], list[Problem]]:
    """The joined samples as evaluation records (one model per run, one benchmark per task)
    for the reasoning-efficiency decomposition; a sample that generated no token cannot be
    one (T > 0) and is listed."""
    records, problems = [], []
    for j in joins:
        for s in j.joined:
            t = int(s.unit("output_tokens") or 0)
            if t <= 0:
                problems.append(
                    Problem(
                        s.sample.where,
                        "no generated token: not in the decomposition",
                        j.run.label,
                        s.sample.task,
                        s.sample.key,
                    )
                )
                continue
            records.append(
                EvalRecord(
                    model=j.run.label,
                    benchmark=s.sample.task,
                    instance_id=s.sample.key,
                    correct=s.sample.correct,
                    output_tokens=t,
                    truncated=s.cut,
                    trace=s.sample.answer or None,
                    pte_served=s.unit("pte"),
                    where=s.sample.where,
                )
            )
    return records, problems


# =========================================================================== figures


@dataclass(frozen=True)
class TaskCost:
    """One run's figures on one task."""

    run: str
    task: str
    metric: str
    samples: int
    correct: int
    cut: int
    correct_but_cut: int
    accuracy: Estimate
    completion_rate: Estimate
    conditional_correctness: Estimate
    e0: Estimate
    mean_output_tokens: Estimate
    per_correct: dict[str, Estimate | None]  # unit → cost per correct answer (None: not in the log)
    per_sample: dict[str, Estimate | None]  # unit → mean cost of a sample

    def to_dict(self) -> dict[str, Any]:
        est = {k: v.to_dict() if v is not None else None for k, v in self.per_correct.items()}
        mean = {k: v.to_dict() if v is not None else None for k, v in self.per_sample.items()}
        return {
            "run": self.run,
            "task": self.task,
            "metric": self.metric,
            "samples": self.samples,
            "correct": self.correct,
            "cut": self.cut,
            "correct_but_cut": self.correct_but_cut,
            "accuracy": self.accuracy.to_dict(),
            "completion_rate": self.completion_rate.to_dict(),
            "conditional_correctness": self.conditional_correctness.to_dict(),
            "e0": self.e0.to_dict(),
            "mean_output_tokens": self.mean_output_tokens.to_dict(),
            "cost_per_correct": est,
            "cost_per_sample": mean,
        }


@dataclass(frozen=True)
class UnitComparison:
    ratio: Estimate  # run's cost per correct answer ÷ the reference's
    terms: dict[str, Estimate]  # the four Δlog terms; they sum to log(ratio)
    dominant: str  # the term that moves the ratio most in its direction

    def to_dict(self) -> dict[str, Any]:
        return {
            "ratio": self.ratio.to_dict(),
            "dlog": math.log(self.ratio.value) if self.ratio.value > 0 else None,
            "terms": {k: v.to_dict() for k, v in self.terms.items()},
            "dominant": self.dominant,
        }


@dataclass(frozen=True)
class Comparison:
    task: str
    run: str
    reference: str
    shared_samples: int
    units: dict[str, UnitComparison]  # only units both runs have
    notes: tuple[str, ...] = ()

    @property
    def cheaper(self) -> str | None:
        """The run with the lower GPU seconds per correct answer (tokens where unpriced)."""
        for unit in ("gpu_seconds", "output_tokens"):
            c = self.units.get(unit)
            if c is not None and math.isfinite(c.ratio.value) and c.ratio.value != 1:
                return self.run if c.ratio.value < 1 else self.reference
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "run": self.run,
            "reference": self.reference,
            "shared_samples": self.shared_samples,
            "cheaper_per_correct": self.cheaper,
            "units": {k: v.to_dict() for k, v in self.units.items()},
            "notes": list(self.notes),
        }


@dataclass
class CostReport:
    joins: list[RunJoin]
    tasks: list[TaskCost]
    comparisons: list[Comparison]
    reference: str
    request_log: str
    log_problems: list[Problem] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "reference": self.reference,
            "request_log": self.request_log,
            "runs": [j.summary() for j in self.joins],
            "tasks": [t.to_dict() for t in self.tasks],
            "comparisons": [c.to_dict() for c in self.comparisons],
            "request_log_problems": [p.to_dict() for p in self.log_problems],
        }


def _columns(samples: Sequence[JoinedSample]) -> tuple[np.ndarray, list[str]]:
    """(n, 3 + units) per-sample columns: correct, cut, output tokens, then each unit that every
    sample has (its name listed)."""
    units = [u for u in UNITS[1:] if all(s.unit(u) is not None for s in samples)]
    cols = [
        [float(s.sample.correct) for s in samples],
        [float(s.cut) for s in samples],
        [s.unit("output_tokens") for s in samples],
        *([s.unit(u) for s in samples] for u in units),
    ]
    return np.array(cols, dtype=np.float64).T.reshape(len(samples), len(cols)), units


def _resampled_sums(x: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray | None:
    """(n_boot, columns) sums of resamples of x's rows (None without bootstrap)."""
    if n_boot <= 0 or x.shape[0] == 0:
        return None
    return np.concatenate([w @ x for w in count_chunks(x.shape[0], n_boot, rng, MAX_BOOT_ELEMS)])


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1.0), np.nan)


def _figures(sums: np.ndarray, n: int) -> np.ndarray:
    """(..., 5 + units): accuracy, r_ctx, r_logic, E0, E[T], then each unit per correct
    answer, then each unit per sample, from (..., columns) sums over n samples."""
    s, c, t, u = sums[..., 0], sums[..., 1], sums[..., 2], sums[..., 3:]
    return np.concatenate(
        [
            np.stack([s / n, 1 - c / n, _ratio(s, n - c), 1000 * _ratio(s, t), t / n], axis=-1),
            _ratio(np.concatenate([t[..., None], u], axis=-1), s[..., None]),
            np.concatenate([t[..., None], u], axis=-1) / n,
        ],
        axis=-1,
    )


def task_cost(
    run: str, task: str, metric: str, samples: Sequence[JoinedSample], n_boot: int, seed: int
) -> TaskCost:
    x, units = _columns(samples)
    n = len(samples)
    point = _figures(x.sum(axis=0), n)
    boot = _resampled_sums(x, n_boot, _rng(seed, f"{run}/{task}", 0))
    est = _estimates(point, None if boot is None else _figures(boot, n))
    names = ["output_tokens", *units]
    k = len(names)
    per_correct: dict[str, Estimate | None] = dict.fromkeys(UNITS)
    per_sample: dict[str, Estimate | None] = dict.fromkeys(UNITS)
    for j, u in enumerate(names):
        per_correct[u] = est[5 + j]
        per_sample[u] = est[5 + k + j]
    correct = sum(s.sample.correct for s in samples)
    return TaskCost(
        run,
        task,
        metric,
        n,
        correct,
        sum(s.cut for s in samples),
        sum(s.sample.correct and s.requests[-1].finish_reason == "length" for s in samples),
        *est[:5],
        per_correct,
        per_sample,
    )


def _terms(sa: np.ndarray, sb: np.ndarray, n: int) -> np.ndarray:
    """(..., 5): Δlog cost per correct (b over a) and its four terms, from (..., 4) sums of
    (correct, cut, tokens, unit)."""

    def logs(s: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            S, C, T, U = s[..., 0], s[..., 1], s[..., 2], s[..., 3]
            return np.stack(
                [np.log(U / S), np.log(T / n), np.log(U / T), np.log(1 - C / n), np.log(S / (n - C))], -1
            )

    la, lb = logs(sa), logs(sb)
    with np.errstate(invalid="ignore"):
        d = lb - la
    return np.stack([d[..., 0], d[..., 1], d[..., 2], -d[..., 3], -d[..., 4]], axis=-1)


def compare(
    task: str,
    run: str,
    reference: str,
    a: Sequence[JoinedSample],
    b: Sequence[JoinedSample],
    n_boot: int,
    seed: int,
) -> Comparison:
    """``run`` (b) against ``reference`` (a) on the samples both joined, paired."""
    by_key = {s.sample.key: s for s in a}
    pairs = [(by_key[s.sample.key], s) for s in b if s.sample.key in by_key]
    notes: list[str] = []
    if len(pairs) < max(len(a), len(b)):
        notes.append(f"compared on the {len(pairs)} samples both runs joined")
    xa, ua = _columns([p[0] for p in pairs])
    xb, ub = _columns([p[1] for p in pairs])
    units = ["output_tokens", *[u for u in ua if u in ub]]
    n = len(pairs)
    rng = _rng(seed, f"{reference}/{run}/{task}", 1)
    boot = None
    if n_boot > 0 and n:
        both = np.concatenate([xa, xb], axis=1)
        boot = _resampled_sums(both, n_boot, rng)
    out: dict[str, UnitComparison] = {}
    width = xa.shape[1]
    sa, sb = xa.sum(axis=0), xb.sum(axis=0)
    for unit in units:
        ca = 2 if unit == "output_tokens" else 3 + ua.index(unit)
        cb = 2 if unit == "output_tokens" else 3 + ub.index(unit)
        point = _terms(_pick(sa, ca), _pick(sb, cb), n)
        if not np.isfinite(point).all():
            notes.append(
                f"{UNIT_LABELS[unit]}: a run has no correct answer (or no completed one) on the shared samples"
            )
            continue
        bt = None
        if boot is not None:
            bt = _terms(_pick(boot[:, :width], ca), _pick(boot[:, width:], cb), n)
        est = _estimates(point, bt)
        ratio = Estimate(*(math.exp(v) for v in (est[0].value, est[0].low, est[0].high)))
        terms = dict(zip(TERMS, est[1:], strict=True))
        sign = 1 if point[0] >= 0 else -1
        dominant = max(TERMS, key=lambda t: sign * terms[t].value)
        out[unit] = UnitComparison(ratio, terms, dominant)
    return Comparison(task, run, reference, n, out, tuple(notes))


def _pick(sums: np.ndarray, unit_col: int) -> np.ndarray:
    """Sums as (correct, cut, tokens, unit)."""
    return np.stack([sums[..., 0], sums[..., 1], sums[..., 2], sums[..., unit_col]], axis=-1)


def cost_report(
    joins: list[RunJoin],
    reference: str,
    request_log: str,
    *,
    n_boot: int = 500,
    seed: int = 0,
    log_problems: Sequence[Problem] = (),
) -> CostReport:
    """Every run's figures per task, and each run against the task's reference
    (:func:`~pte_instrument.offline.harness_runs.task_reference`) on the samples both joined."""
    by_task: dict[str, dict[str, list[JoinedSample]]] = defaultdict(dict)
    metrics: dict[tuple[str, str], str] = {}
    for j in joins:
        for task, metric in j.run.metrics.items():
            by_task[task][j.run.label] = [s for s in j.joined if s.sample.task == task]
            metrics[(j.run.label, task)] = metric
    tasks, comparisons = [], []
    for task, runs in sorted(by_task.items()):
        for label, samples in runs.items():
            if samples:
                tasks.append(task_cost(label, task, metrics[(label, task)], samples, n_boot, seed))
        ref_label = task_reference(reference, list(runs))
        ref = runs[ref_label]
        if not ref:
            continue
        for label, samples in runs.items():
            if label != ref_label and samples:
                comparisons.append(compare(task, label, ref_label, ref, samples, n_boot, seed))
    return CostReport(joins, tasks, comparisons, reference, request_log, list(log_problems))
