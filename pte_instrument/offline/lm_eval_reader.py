"""lm-evaluation-harness outputs, read as they are written by ``lm_eval --output_path DIR
--log_samples``: ``results_<time>.json`` (the run: tasks, their metric lists, the model, its
start time and duration) and beside it one ``samples_<task>_<time>.jsonl`` per task (per
document and filter: ``doc_id``, ``arguments``, ``resps``, ``filtered_resps`` and each
metric's value).

A sample's requests are its ``arguments`` (one per request it needed), each sent as many
times as it has responses (a task's ``repeats``); each is named by the digest of what was
sent: the chat messages lm-eval logged as JSON (``local-chat-completions``,
``openai-chat-completions``) or the prompt text (the completion models). lm-eval logs no
response id, so the join is by digest alone.

The results file is named by the time it was written (after the last response), on the
evaluating machine's clock in that machine's zone, which the file does not name. The run's
end is that time read in the zone that fits the file's own times, not the zone of the
machine reading it: of the UTC offsets of whole quarter hours from −12 h to +14 h, the one
that puts the end at or after ``date`` (the unix time the run began) and closest to ``date +
total_evaluation_time_seconds`` (its duration, counted from a little earlier: a few seconds
off, where the offsets are 15 minutes apart). Without the duration (or the start), the
latest reading (UTC−12): no request of the run comes after it; with a start after every
reading, no end.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pte_instrument.offline.harness_runs import Call, HarnessError, Run, Sample
from pte_instrument.offline.records import Problem, json_loads
from pte_instrument.prompt_digest import chat_digest, completion_digest

HARNESS = "lm-eval"
CHAT_MODELS = ("local-chat-completions", "openai-chat-completions")


def results_files(path: Path) -> list[Path]:
    """The results files (one a run) that ``path`` is or holds."""
    if path.is_file():
        return [path] if path.name.startswith("results_") and path.suffix == ".json" else []
    if path.is_dir():
        return sorted(path.rglob("results_*.json"))
    return []


def is_output(path: str | Path) -> bool:
    return bool(results_files(Path(path)))


def read(
    path: str | Path, *, metric: str | None = None, filter_name: str | None = None, key: bytes | None = None
) -> list[Run]:
    """Every run whose results file is ``path`` or lies under it, in the order of their files;
    ``key``: the server's ``PTE_PROMPT_DIGEST_KEY``."""
    return [_read_run(f, metric, filter_name, key) for f in results_files(Path(path))]


def _load_json(path: Path) -> Any:
    try:
        return json_loads(path.read_text(encoding="utf-8"))  # too deep or too long: bad JSON
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HarnessError(f"cannot read {path}: {e}") from None


def _digest(argument: Any, chat: bool, key: bytes | None) -> str | None:
    """What one request sent, digested as the server did; None when it cannot be recomputed
    (token ids lm-eval tokenized itself, or messages that are not JSON)."""
    if isinstance(argument, list) and len(argument) == 1:  # a chat prompt is logged as [its JSON]
        argument = argument[0]
    if not isinstance(argument, str):
        return None
    if not chat:
        return completion_digest(argument, key)
    try:
        messages = json_loads(argument)
    except json.JSONDecodeError:
        return None
    return chat_digest(messages, key) if isinstance(messages, list) else None


def _calls(row: Mapping[str, Any], chat: bool, key: bytes | None) -> tuple[Call, ...]:
    args = row.get("arguments")
    if isinstance(args, Mapping):  # {"gen_args_0": {"arg_0": context, "arg_1": gen_kwargs}, …}
        firsts = [a.get("arg_0") if isinstance(a, Mapping) else None for a in args.values()]
    elif isinstance(args, list):  # older releases: [[context, gen_kwargs], …]
        firsts = [a[0] if isinstance(a, list) and a else None for a in args]
    else:
        raise ValueError("no 'arguments'")
    resps = row.get("resps")
    counts = [len(r) if isinstance(r, list) else 1 for r in resps] if isinstance(resps, list) else []
    if len(counts) != len(firsts):
        counts = [1] * len(firsts)
    return tuple(Call(_digest(a, chat, key)) for a, n in zip(firsts, counts, strict=True) for _ in range(n))


def _answer(row: Mapping[str, Any]) -> str | None:
    filtered = row.get("filtered_resps")
    while isinstance(filtered, list) and filtered:
        filtered = filtered[0]
    return filtered if isinstance(filtered, str) else None


def _rows(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield n, json_loads(line)
                    except json.JSONDecodeError as e:
                        yield n, e
    except (OSError, UnicodeDecodeError) as e:
        raise HarnessError(f"cannot read {path}: {e}") from None


def _read_run(results_file: Path, metric: str | None, filter_name: str | None, key: bytes | None) -> Run:
    results = _load_json(results_file)
    if not isinstance(results, dict) or not isinstance(results.get("configs"), dict):
        raise HarnessError(f"{results_file}: not an lm-eval results file (no 'configs')")
    config = _object(results.get("config"))
    model_args = config.get("model_args")
    if isinstance(model_args, str):  # "model=…,base_url=…" as given on the command line
        model_args = dict(kv.split("=", 1) for kv in model_args.split(",") if "=" in kv)
    model_args = _object(model_args)
    chat = config.get("model") in CHAT_MODELS
    model = str(model_args.get("model") or results.get("model_name") or "unknown")
    stamp = results_file.stem.removeprefix("results_")
    samples: list[Sample] = []
    problems: list[Problem] = []
    metrics: dict[str, str] = {}
    for task, task_config in results["configs"].items():
        metric_list = task_config.get("metric_list") if isinstance(task_config, dict) else None
        listed = [
            m["metric"]
            for m in (metric_list if isinstance(metric_list, list) else ())
            if isinstance(m, dict) and isinstance(m.get("metric"), str)
        ]
        # Its exact name (a task's name may hold glob characters), beside the results file.
        samples_file = results_file.parent / f"samples_{task}_{stamp}.jsonl"
        files = (
            [samples_file] if samples_file.parent == results_file.parent and samples_file.is_file() else []
        )
        chosen = metric or (listed[0] if listed else _first_logged_metric(files))
        if chosen is None or not files:
            why = "no metric listed" if chosen is None else "no samples file (run lm_eval with --log_samples)"
            problems.append(Problem(str(results_file), f"task {task!r} skipped: {why}", model, task))
            continue
        try:
            read, bad = _read_samples(files[0], task, chosen, filter_name, chat, model, key)
        except _NoScores as e:  # a --metric or --filter another task of the run has
            problems.append(Problem(str(files[0]), f"task {task!r} skipped: {e}", model, task))
            continue
        metrics[task] = chosen
        samples += read
        problems += bad
    if not metrics:
        first = f" ({problems[0].reason})" if problems else ""
        raise HarnessError(f"{results_file}: no task with logged samples and a metric{first}")
    started = results.get("date")  # unix time the evaluation began
    start = float(started) if _is_time(started) else None
    end = _end_time(stamp, start, _duration(results.get("total_evaluation_time_seconds")))
    return Run(model, HARNESS, model, str(results_file), metrics, start, end, tuple(samples), tuple(problems))


class _NoScores(ValueError):
    """A task's samples file has no score of the metric (and filter) asked for."""


def _object(v: Any) -> dict[str, Any]:
    """A JSON object of the results file; anything else there reads as an empty one."""
    return v if isinstance(v, dict) else {}


def _is_time(v: Any) -> bool:
    """A unix time: a number from 0 to the year 5000 (a float holds it; 10**400 does not)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1e11


def _first_logged_metric(files: list[Path]) -> str | None:
    """A task whose config lists no metric: the first its samples name (their ``metrics``)."""
    for _, row in _rows(files[0]) if files else ():
        if isinstance(row, dict) and isinstance(row.get("metrics"), list) and row["metrics"]:
            return str(row["metrics"][0])
    return None


def _duration(v: Any) -> float | None:
    """Seconds the evaluation took: lm-eval writes them as text ("99.0")."""
    if isinstance(v, bool) or not isinstance(v, str | int | float):
        return None
    try:
        seconds = float(v)
    except ValueError:
        return None
    return seconds if 0 <= seconds < 1e11 else None


QUARTER_HOUR = 900
OFFSETS = range(-12 * 4, 14 * 4 + 1)  # quarter hours east of UTC, every zone's


def _end_time(stamp: str, start: float | None, duration: float | None) -> float | None:
    """Unix seconds of lm-eval's file time stamp (``2026-12-05T03-14-20.691863``, the
    evaluating machine's wall clock), in the zone that fits the run's start and duration (see
    the module's text)."""
    day, _, clock = stamp.partition("T")
    try:
        wall = (
            datetime.fromisoformat(f"{day}T{clock.replace('-', ':')}")
            .replace(tzinfo=timezone.utc)
            .timestamp()
        )
    except (ValueError, OverflowError):
        return None
    readings = [wall - k * QUARTER_HOUR for k in OFFSETS]
    if start is not None:
        readings = [t for t in readings if t >= start]  # written after the run began
    if not readings:
        return None
    if start is None or duration is None:
        return max(readings)
    return min(readings, key=lambda t: (abs(t - (start + duration)), t))


def _read_samples(
    path: Path, task: str, metric: str, filter_name: str | None, chat: bool, model: str, key: bytes | None
) -> tuple[list[Sample], list[Problem]]:
    samples: list[Sample] = []
    problems: list[Problem] = []
    chosen_filter = filter_name
    seen_metric = False
    for n, row in _rows(path):
        where = f"{path}:{n}"
        if isinstance(row, Exception) or not isinstance(row, dict):
            problems.append(Problem(where, f"not a JSON object: {row}", model, task))
            continue
        if chosen_filter is None:  # the first filter of the file: each filter repeats every document
            chosen_filter = str(row.get("filter", "none"))
        if str(row.get("filter", "none")) != chosen_filter:
            continue
        doc = str(row.get("doc_id", ""))
        try:
            value = row[metric]
            seen_metric = True
            if isinstance(value, bool):
                value = float(value)
            if not isinstance(value, int | float) or not 0 <= value <= 1:
                raise ValueError(f"metric {metric!r} is {value!r}, not a score in [0, 1]")
            calls = _calls(row, chat, key)
        except KeyError:
            problems.append(Problem(where, f"no value of metric {metric!r}", model, task, doc))
            continue
        except ValueError as e:
            problems.append(Problem(where, str(e), model, task, doc))
            continue
        samples.append(Sample(task, doc, 1, float(value), calls, _answer(row), where))
    if not seen_metric:
        raise _NoScores(f"no sample with filter {chosen_filter!r} has metric {metric!r}")
    return samples, problems
