"""An evaluation harness's run as the cost-per-correct analysis reads it: its samples, each
scored, with the model requests that served it named by what the harness logged of them.

One reader per harness fills these records (:mod:`.lm_eval_reader`, :mod:`.inspect_reader`);
:func:`load_runs` tells the outputs apart and reads every run in them. Nothing is dropped
silently: a sample that cannot be read becomes a
:class:`~pte_instrument.offline.records.Problem` naming where it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from pte_instrument.offline.records import Problem, RecordError


class HarnessError(RecordError):
    """A harness output that cannot be read at all (no such file, not a harness's, the harness
    not installed, no metric of that name)."""


@dataclass(frozen=True)
class Call:
    """One model request a sample made, as the harness logged it: the server's response id
    (the request log's ``request_id``) when it kept one, and the digest of what it sent."""

    digest: str | None
    response_id: str | None = None


@dataclass(frozen=True)
class Sample:
    """One scored sample: a task's document (``sample_id``) at one repeat (``epoch``)."""

    task: str
    sample_id: str
    epoch: int
    score: float  # the primary metric's value, as the harness scored it
    calls: tuple[Call, ...]
    answer: str | None  # the scored response text (the trace layer's input)
    where: str

    @property
    def correct(self) -> bool:
        """A full score: 1 of a 0/1 metric (a partial credit is not a correct answer)."""
        return self.score >= 1.0

    @property
    def key(self) -> str:
        return self.sample_id if self.epoch <= 1 else f"{self.sample_id}#{self.epoch}"


@dataclass(frozen=True)
class Run:
    """One harness run: its samples, the metric each task was scored by, and the time it ran
    (unix seconds; None where the harness did not log it)."""

    label: str
    harness: str  # "lm-eval" or "inspect"
    model: str  # the model name the harness sent (the request log's ``model``)
    source: str
    metrics: dict[str, str]  # task → the metric that says correct
    started_at: float | None
    ended_at: float | None
    samples: tuple[Sample, ...]
    problems: tuple[Problem, ...] = ()


def iso_time(text: str | None) -> float | None:
    """Unix seconds of an ISO 8601 time (None: not given, or not a time)."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(str(text)).timestamp()
    except ValueError:
        return None


def is_harness_output(path: str | Path) -> bool:
    """An lm-eval output (a ``results_*.json`` file or a directory holding some) or an
    Inspect AI log (``.eval``, or a ``.json`` log, or a directory of them)."""
    from pte_instrument.offline import inspect_reader, lm_eval_reader

    return lm_eval_reader.is_output(path) or inspect_reader.is_output(path)


def load_runs(
    paths: Sequence[str | Path],
    *,
    metric: str | None = None,
    lm_eval_filter: str | None = None,
    labels: Sequence[str] | None = None,
    key: bytes | None = None,
) -> list[Run]:
    """Every run in ``paths``, in order; ``labels`` names them (default: the model, made
    unique by the run's position where two runs share one); ``key``: the server's
    ``PTE_PROMPT_DIGEST_KEY``, under which the digests are recomputed."""
    from pte_instrument.offline import inspect_reader, lm_eval_reader

    runs: list[Run] = []
    for path in paths:
        if lm_eval_reader.is_output(path):
            runs += lm_eval_reader.read(path, metric=metric, filter_name=lm_eval_filter, key=key)
        elif inspect_reader.is_output(path):
            runs += inspect_reader.read(path, metric=metric, key=key)
        elif not Path(path).exists():
            raise HarnessError(f"cannot read {path}: no such file or directory")
        else:
            raise HarnessError(
                f"{path}: neither an lm-eval output (results_*.json) nor an Inspect AI log (.eval, .json)"
            )
    runs = _qualified_tasks(runs)
    if labels:
        if len(labels) != len(runs):
            raise HarnessError(f"{len(labels)} label(s) given for {len(runs)} run(s) read")
        if len(set(labels)) != len(labels):
            raise HarnessError("run labels must differ")
        return [replace(r, label=name) for r, name in zip(runs, labels, strict=True)]
    models = [r.model for r in runs]
    return [
        replace(r, label=r.model if models.count(r.model) == 1 else f"{r.model}#{k + 1}")
        for k, r in enumerate(runs)
    ]


def _qualified_tasks(runs: list[Run]) -> list[Run]:
    """Tasks of one name from two harnesses are two tasks (their samples are numbered apart):
    named ``<harness>:<task>`` then."""
    harnesses: dict[str, set[str]] = {}
    for r in runs:
        for task in r.metrics:
            harnesses.setdefault(task, set()).add(r.harness)
    clash = {t for t, h in harnesses.items() if len(h) > 1}
    if not clash:
        return runs

    def name(run: Run, task: str) -> str:
        return f"{run.harness}:{task}" if task in clash else task

    return [
        replace(
            r,
            metrics={name(r, t): m for t, m in r.metrics.items()},
            samples=tuple(replace(s, task=name(r, s.task)) for s in r.samples),
        )
        for r in runs
    ]


def task_reference(reference: str | None, runs_of_task: Sequence[str]) -> str:
    """The run a task's others are compared with: ``reference`` where it ran the task, else
    the first run (in the order read) that did."""
    return reference if reference in runs_of_task else runs_of_task[0]
