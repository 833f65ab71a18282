"""Evaluation harness outputs told apart and read: every run in the paths given, named, with
the tasks of two harnesses that share a name told apart."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from pte_instrument.offline import inspect_reader, lm_eval_reader
from pte_instrument.offline.harness_runs import HarnessError, Run
from pte_instrument.offline.records import drop_duplicates


def is_harness_output(path: str | Path) -> bool:
    """An lm-eval output (a ``results_*.json`` file or a directory holding some) or an
    Inspect AI log (``.eval``, or a ``.json`` log, or a directory of them)."""
    return lm_eval_reader.is_output(path) or inspect_reader.is_output(path)


def harness_files(path: str | Path) -> list[Path]:
    """The files a harness output is read from: lm-eval's results files and Inspect AI's
    logs at or under ``path``."""
    return lm_eval_reader.results_files(Path(path)) + inspect_reader.logs(Path(path))


def load_runs(
    paths: Sequence[str | Path],
    *,
    metric: str | None = None,
    lm_eval_filter: str | None = None,
    labels: Sequence[str] | None = None,
    key: bytes | None = None,
) -> list[Run]:
    """Every run in ``paths``, in order (a folder's lm-eval runs, then its Inspect AI logs');
    ``labels`` names them (default: the model, made unique by the run's position where two
    runs share one); ``key``: the server's ``PTE_PROMPT_DIGEST_KEY``, under which the digests
    are recomputed."""
    runs: list[Run] = []
    for path in paths:
        found = [  # a folder may hold both harnesses' outputs: each kind is read
            *lm_eval_reader.read(path, metric=metric, filter_name=lm_eval_filter, key=key),
            *inspect_reader.read(path, metric=metric, key=key),
        ]
        runs += found
        if found:
            continue
        if not Path(path).exists():
            raise HarnessError(f"cannot read {path}: no such file or directory")
        else:
            raise HarnessError(
                f"{path}: neither an lm-eval output (results_*.json) nor an Inspect AI log (.eval, .json)"
            )
    runs = _qualified_tasks([_without_duplicates(r) for r in runs])
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


def _without_duplicates(run: Run) -> Run:
    """A sample of one task, id and epoch twice in a run (a hand-merged log): which copy
    counts would be arbitrary, so every copy is dropped and listed, as records' duplicates are."""
    samples, problems = drop_duplicates(
        run.samples, lambda s: (run.model, s.task, s.key), "sample id in the run"
    )
    return replace(run, samples=tuple(samples), problems=(*run.problems, *problems)) if problems else run


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
