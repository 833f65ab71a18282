"""An evaluation harness's run as the cost-per-correct analysis reads it: its samples, each
scored, with the model requests that served it named by what the harness logged of them.

One reader per harness fills these records (:mod:`.lm_eval_reader`, :mod:`.inspect_reader`);
:mod:`.harness_outputs` tells the outputs apart. Nothing is dropped silently: a sample that
cannot be read becomes a :class:`~pte_instrument.offline.records.Problem` naming where it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

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


def task_reference(reference: str | None, runs_of_task: Sequence[str]) -> str:
    """The run a task's others are compared with: ``reference`` where it ran the task, else
    the first run (in the order read) that did."""
    return reference if reference in runs_of_task else runs_of_task[0]
