"""Inspect AI logs (``.eval`` archives and ``.json`` logs), read through Inspect's own log
reader: the task, the model, each sample's id, epoch and score, and every model call it
made (a solver may call the model several times; an agent, many).

A call is named by the server's response id (``output.response_id``: vLLM's request id, the
request log's ``request_id``) and by the digest of the messages it sent (``call.request``).
A call answered from Inspect's own cache never reached the server and is not one.
"""

from __future__ import annotations

import logging
import re
import zipfile
from pathlib import Path
from typing import Any

from pte_instrument.offline.harness_runs import Call, HarnessError, Run, Sample, iso_time
from pte_instrument.offline.records import Problem
from pte_instrument.prompt_digest import chat_digest

HARNESS = "inspect"
SUFFIXES = (".eval", ".json")


def logs(path: Path) -> list[Path]:
    """The logs (one a run) that ``path`` is or holds."""
    if path.is_file():
        return [path] if path.suffix == ".eval" or (path.suffix == ".json" and _is_json_log(path)) else []
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES and logs(p))
    return []


# A string (group 2 set where it is a key), or a bracket.
_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"(\s*:)?|[{}\[\]]')


def _is_json_log(path: Path) -> bool:
    """An Inspect ``.json`` log is one JSON object whose own keys include ``version``,
    ``status`` and ``eval``, the first three Inspect writes: told from its first
    kilobytes, without parsing the log (records in a JSON array, or lines of objects with a
    status and a version, are none)."""
    if path.name.startswith("results_"):  # lm-eval's results files are .json too
        return False
    try:
        with path.open("rb") as f:
            head = f.read(4096).decode("utf-8", "replace")
    except OSError:
        return False
    if not head.lstrip("\ufeff \t\r\n").startswith("{"):
        return False
    keys: set[str] = set()
    depth = 0
    for token in _TOKEN.finditer(head):
        text, is_key = token.group(1), token.group(2)
        if text is None:  # a bracket
            depth += 1 if token.group() in "{[" else -1
            if depth == 0:  # the first object ended without them (the next line's is another)
                return False
        elif depth == 1 and is_key:
            keys.add(text)
        if {"version", "status", "eval"} <= keys:
            return True
    return False


def is_output(path: str | Path) -> bool:
    return bool(logs(Path(path)))


def _reader() -> Any:
    try:
        from inspect_ai.log import read_eval_log
    except ImportError:
        raise HarnessError(
            "reading Inspect AI logs needs inspect-ai: pip install 'pte-instrument[harness]'"
        ) from None
    return read_eval_log


def read(path: str | Path, *, metric: str | None = None, key: bytes | None = None) -> list[Run]:
    """Every log at or under ``path``, one run each, in the order of their names; ``key``: the
    server's ``PTE_PROMPT_DIGEST_KEY``."""
    return [_read_log(p, metric, key) for p in logs(Path(path))]


def _score_value(value: Any) -> float:
    from inspect_ai.scorer import value_to_float

    if isinstance(value, dict):
        keys = ", ".join(map(str, value))
        raise ValueError(f"a score of several values: name one of them with --metric ({keys})")
    if isinstance(value, list):
        raise ValueError("a score of several values: name a scorer of one value with --metric")
    # Inspect's converter reads a value it does not know as 0, a wrong answer, and says so only
    # in a warning of its logger: its warning method is taken over for the call (a filter would
    # see nothing where the user's logging configuration turns warnings off), and not printed.
    logger, said = logging.getLogger(value_to_float.__module__), []
    logger.warning = lambda *args, **kwargs: said.append(args)  # type: ignore[method-assign]
    try:
        score = float(value_to_float()(value))
    finally:
        del logger.warning
    if said:
        raise ValueError("not a score Inspect can read")
    if not 0 <= score <= 1:  # 2 would be a full score, NaN a wrong answer: neither is a score
        raise ValueError("not a score in [0, 1]")
    return score


def _calls(sample: Any, key: bytes | None) -> tuple[Call, ...]:
    from inspect_ai.event import ModelEvent

    calls = []
    for event in sample.events or ():
        if not isinstance(event, ModelEvent) or event.cache == "read":
            continue
        request = event.call.request if event.call is not None else {}
        messages = request.get("messages") if isinstance(request, dict) else None
        response_id = getattr(event.output, "response_id", None)
        if response_id is None and event.call is not None and isinstance(event.call.response, dict):
            response_id = event.call.response.get("id")
        calls.append(Call(chat_digest(messages, key) if isinstance(messages, list) else None, response_id))
    return tuple(calls)


def _one_line(e: Exception) -> str:
    """The reader's error in one line: a schema error (pydantic's) puts each field, and a link,
    on lines of their own; the first field names the fault."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        first = e.errors()[0]
        field = ".".join(str(x) for x in first["loc"])
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        return f"not an Inspect log: {field + ': ' if field else ''}{first['msg']}{more}"
    return " ".join(str(e).split())


def _scores(log: Any) -> dict[str, tuple[str, str | None]]:
    """Each score the log names → (its scorer, the key of its value): a scorer of one value
    is named by itself (key None); one whose values are dicts (``{"x": …, "y": …}``) by each
    key. From the results, or, where the evaluation did not finish, the task's scorers."""
    if log.results is not None and log.results.scores:
        return {s.name: (s.scorer, None if s.name == s.scorer else s.name) for s in log.results.scores}
    out: dict[str, tuple[str, str | None]] = {}
    for scorer in log.eval.scorers or ():
        if isinstance(scorer.metrics, dict):  # a dict of metrics per key of its values
            out.update({k: (scorer.name, k) for k in scorer.metrics})
        else:
            out[scorer.name] = (scorer.name, None)
    return out


def _one_value(value: Any, key: str | None) -> Any:
    if key is None:
        return value
    if not isinstance(value, dict) or key not in value:
        raise ValueError(f"no value {key!r} in it")
    return value[key]


def _read_log(path: Path, metric: str | None, key: bytes | None) -> Run:
    if path.suffix == ".eval" and not zipfile.is_zipfile(path):
        raise HarnessError(
            f"cannot read Inspect log {path}: not a whole .eval archive (cut short, or still being written)"
        )
    try:
        log = _reader()(str(path), resolve_attachments=True)
    except HarnessError:
        raise
    except Exception as e:  # Inspect's reader: a zip, JSON or schema error
        raise HarnessError(f"cannot read Inspect log {path}: {_one_line(e)}") from None
    task = str(log.eval.task)
    model = str(log.eval.model).rpartition("/")[2]  # "openai-api/<provider>/<model>": the name sent
    scores = _scores(log)
    chosen = metric or next(iter(scores), None)
    if chosen is None:
        raise HarnessError(f"{path}: the log has no scores (was the evaluation scored?)")
    scorer, value_key = scores.get(chosen, (chosen, None))
    samples: list[Sample] = []
    problems: list[Problem] = []
    if log.status != "success":  # an error or a cancel stopped it: what it logged still counts
        why = f": {' '.join(str(log.error.message).split())}" if log.error is not None else ""
        problems.append(
            Problem(
                str(path),
                f"the evaluation did not finish (status {log.status}{why})",
                model,
                task,
                action="kept",
            )
        )
    unscored = failed = 0
    for k, s in enumerate(log.samples or ()):
        where = f"{path}#sample {k + 1}"
        sid = str(s.id)
        score = (s.scores or {}).get(scorer)
        if score is None:
            if s.error is not None:  # it never reached its scorer
                reason, failed = f"the sample failed: {' '.join(str(s.error.message).split())}", failed + 1
            else:
                reason, unscored = f"no score of {chosen!r}", unscored + 1
            problems.append(Problem(where, reason, model, task, sid))
            continue
        try:
            value = _score_value(_one_value(score.value, value_key))
        except Exception as e:  # Inspect's own conversion of a value it does not know
            problems.append(Problem(where, f"score {score.value!r}: {e}", model, task, sid))
            continue
        answer = s.output.completion if s.output is not None else None
        samples.append(Sample(task, sid, int(s.epoch), value, _calls(s, key), answer, where))
    if not log.samples:
        raise HarnessError(f"{path}: the log holds no samples (status {log.status})")
    if not samples and unscored and unscored + failed == len(log.samples):  # a score of no name here
        raise HarnessError(f"{path}: no sample has a score of {chosen!r} (scores: {', '.join(scores)})")
    return Run(
        model,
        HARNESS,
        model,
        str(path),
        {task: chosen},
        iso_time(log.stats.started_at),
        iso_time(log.stats.completed_at),
        tuple(samples),
        tuple(problems),
    )
