"""Agent trajectories priced in PTE, and the tool-integrated reasoning inefficiency patterns
of docs/cost-model.md §7.

Trajectory schema (JSONL, one trajectory per line; docs/efficiency.md has the full table)::

    {"model": "m", "task": "aime", "id": "t-17", "correct": true, "answer": "42",
     "turns": [{"reasoning": "...", "tool_calls": [{"type": "code", "name": "python",
                "code": "print(6*7)", "output": "42", "error": false}],
                "tool_output": null, "error": false, "parse_errors": 0,
                "prompt_tokens": 812, "cached_tokens": 512, "output_tokens": 96,
                "recomputed_tokens": 0}]}

``task`` may be spelled ``benchmark``; ``answer`` is optional (else the last stated answer
in the reasoning is used). Turns are priced with :func:`pte_instrument.cost.model.session_turns`
and :func:`~pte_instrument.cost.model.price_turn`: the live path's formula, not a copy.
"""

from __future__ import annotations

import math
import re
import zlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pte_instrument.cost.model import CostModel, TurnCost, price_turn, session_turns
from pte_instrument.offline.decomposition import DEFAULT_BOOTSTRAP, Estimate
from pte_instrument.offline.records import (
    LARGEST_VALUE,
    Problem,
    RecordError,
    drop_duplicates,
    json_lines,
    parse_rows,
    refuse_bad_load,
    text_lines,
)
from pte_instrument.offline.statistics import bootstrap_means, interval_bounds, spearman

PATTERNS = (
    "confirmatory_tool_use",
    "tool_mixing",
    "lack_of_tool_priors",
    "tool_format_collapse",
)
VARIANTS = ("served", "reference", "ideal")
# A call is a code call when it carries code or its type/name says so.
CODE_TOOLS = {"code", "python", "code_interpreter", "ipython", "execute_code", "run_code", "jupyter"}
# An execution error in a tool's output: a Python traceback or an "XxxError:" line.
_EXEC_ERROR = re.compile(
    r"Traceback \(most recent call last\)|^\s*\w*(?:Error|Exception)\b\s*:", re.MULTILINE
)
# Stated answers: \boxed{v}, "answer is v", "answer: v", "answer = v".
_CLAIM = re.compile(r"\\boxed\{([^{}]*)\}|\banswer\b\s*(?:is|:|=)\s*\$?\s*([^\s$,;]+)", re.IGNORECASE)


class TrajectoryError(ValueError):
    pass


# =========================================================================== records


@dataclass(frozen=True)
class ToolCall:
    tool: str  # the tool's identity: its name, else its type
    is_code: bool
    code: str | None = None
    output: str | None = None  # None: not recorded
    error: bool = False
    schema_ok: bool = True  # False: the call lacked a type/name or a code call lacked code


@dataclass(frozen=True)
class Turn:
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_output: str | None = None  # turn-level output when calls carry none
    error: bool = False  # turn-level execution-error flag
    parse_errors: int = 0  # tool-call parse errors reported by the harness


@dataclass(frozen=True)
class Trajectory:
    model: str
    task: str
    id: str
    correct: bool
    turns: tuple[Turn, ...]
    answer: str | None = None
    where: str = ""


def _int(v: Any, name: str, default: int | None = None) -> int:
    if v is None:
        if default is None:
            raise TrajectoryError(f"missing {name}")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TrajectoryError(f"{name} must be an integer, got {v!r}")
    if abs(v) > LARGEST_VALUE:  # compared before float(v), which overflows past 1e308
        raise TrajectoryError(f"{name} is too large")
    if not float(v).is_integer():
        raise TrajectoryError(f"{name} must be an integer, got {v!r}")
    if v < 0:
        raise TrajectoryError(f"{name} must be >= 0, got {v!r}")
    return int(v)


def _tool_call(raw: Any) -> ToolCall:
    # Lenient on purpose: a malformed call is data (format collapse), not a bad record.
    if not isinstance(raw, Mapping):
        return ToolCall("<malformed>", False, schema_ok=False)
    kind, name = raw.get("type"), raw.get("name")
    code = raw.get("code")
    code = code if isinstance(code, str) and code.strip() else None
    tool = str(name or kind or "<unnamed>")
    is_code = code is not None or str(kind).lower() in CODE_TOOLS or str(name).lower() in CODE_TOOLS
    output = raw.get("output")
    return ToolCall(
        tool=tool,
        is_code=is_code,
        code=code,
        output=None if output is None else str(output),
        error=bool(raw.get("error", False)),
        schema_ok=bool(kind or name) and (code is not None or not is_code),
    )


def _turn(raw: Any, k: int) -> Turn:
    if not isinstance(raw, Mapping):
        raise TrajectoryError(f"turn {k} is not an object")
    prompt = _int(raw.get("prompt_tokens"), f"turn {k} prompt_tokens")
    cached = _int(raw.get("cached_tokens"), f"turn {k} cached_tokens", 0)
    if cached > prompt:
        raise TrajectoryError(f"turn {k}: cached_tokens {cached} > prompt_tokens {prompt}")
    calls = raw.get("tool_calls") or []
    if not isinstance(calls, list):
        calls = [calls]
    pe = raw.get("parse_errors", 0)
    parse_errors = len(pe) if isinstance(pe, list) else _int(pe, f"turn {k} parse_errors", 0)
    out = raw.get("tool_output")
    return Turn(
        prompt_tokens=prompt,
        output_tokens=_int(raw.get("output_tokens"), f"turn {k} output_tokens"),
        cached_tokens=cached,
        recomputed_tokens=_int(raw.get("recomputed_tokens"), f"turn {k} recomputed_tokens", 0),
        reasoning=str(raw.get("reasoning") or ""),
        tool_calls=tuple(_tool_call(c) for c in calls),
        tool_output=None if out is None else str(out),
        error=bool(raw.get("error", False)),
        parse_errors=parse_errors,
    )


def parse_trajectory(raw: Mapping[str, Any], where: str = "") -> Trajectory:
    for key in ("model", "id", "correct", "turns"):
        if raw.get(key) is None:
            raise TrajectoryError(f"missing field {key!r}")
    task = raw.get("task", raw.get("benchmark"))
    if task is None:
        raise TrajectoryError("missing field 'task' (or 'benchmark')")
    correct = raw["correct"]
    if not isinstance(correct, bool) and correct not in (0, 1):
        raise TrajectoryError(f"correct must be true/false, got {correct!r}")
    turns = raw["turns"]
    if not isinstance(turns, list) or not turns:
        raise TrajectoryError("turns must be a non-empty list")
    answer = raw.get("answer")
    return Trajectory(
        model=str(raw["model"]),
        task=str(task),
        id=str(raw["id"]),
        correct=bool(correct),
        turns=tuple(_turn(t, k) for k, t in enumerate(turns, 1)),
        answer=None if answer is None else str(answer),
        where=where,
    )


@dataclass
class TrajectoryLoad:
    trajectories: list[Trajectory]
    problems: list[Problem] = field(default_factory=list)
    rows_read: int = 0
    source: str = ""

    def summary(self) -> dict[str, Any]:
        return {
            "sources": [self.source],
            "rows_read": self.rows_read,
            "rows_used": len(self.trajectories),
            "rows_dropped": len(self.problems),
            "problems": [p.to_dict() for p in self.problems],
        }


def load_trajectories(path: str | Path, strict: bool = False) -> TrajectoryLoad:
    """Read a trajectory JSONL file; bad lines are dropped and listed (``strict``: raise)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark is not the first line's
    except (OSError, UnicodeDecodeError) as e:
        raise RecordError(f"cannot read {p}: {getattr(e, 'strerror', None) or e}") from None
    trajs, problems, rows = parse_rows(
        json_lines(p, text_lines(text)),
        parse_trajectory,
        TrajectoryError,
        lambda raw: (_s(raw.get("model")), _s(raw.get("task", raw.get("benchmark"))), _s(raw.get("id"))),
    )
    trajs, dups = drop_duplicates(trajs, lambda t: (t.model, t.task, t.id), "trajectory id within model+task")
    problems += dups
    refuse_bad_load(problems, strict, bool(trajs), "trajectory record", "trajectories", str(p))
    return TrajectoryLoad(trajs, problems, rows, str(p))


def _s(v: Any) -> str | None:
    return None if v is None else str(v)


# =========================================================================== detectors


def _norm(value: str) -> str:
    return value.strip().strip("$").rstrip(".,;:").strip().lower()


def stated_answers(text: str) -> list[str]:
    """Answers the text states (\\boxed{v}, "answer is/:/= v"), normalized, in order."""
    return [_norm(a or b) for a, b in _CLAIM.findall(text) if _norm(a or b)]


def final_answer(traj: Trajectory) -> str | None:
    """The trajectory's ``answer`` field, else the last answer its reasoning states."""
    if traj.answer is not None and _norm(traj.answer):
        return _norm(traj.answer)
    for turn in reversed(traj.turns):
        stated = stated_answers(turn.reasoning)
        if stated:
            return stated[-1]
    return None


def _mentions(text: str, value: str) -> bool:
    """``value`` appears in ``text`` as a whole token. A one-character answer ("2") occurs
    by chance in most reasoning, so it must appear as a statement: after "=", "is",
    "answer" or inside \\boxed{}."""
    v = re.escape(value)
    if len(value) > 1:
        return re.search(rf"(?<![\w.]){v}(?![\w]|\.\d)", text, re.IGNORECASE) is not None
    return (
        re.search(
            rf"(?:=|\bis|\banswer\b[^\n]{{0,20}}?|\\boxed\{{)\s*\$?{v}(?![\w]|\.\d)", text, re.IGNORECASE
        )
        is not None
    )


def confirmatory_tool_use(traj: Trajectory) -> bool:
    """The final answer already appears in the reasoning of a turn at or before one that
    calls a code tool (a turn's reasoning precedes its calls): the code only confirms."""
    answer = final_answer(traj)
    if answer is None:
        return False
    seen = False
    for turn in traj.turns:
        seen = seen or _mentions(turn.reasoning, answer)
        if seen and any(c.is_code for c in turn.tool_calls):
            return True
    return False


def tool_mixing(traj: Trajectory) -> bool:
    """More than one tool (by name, else type) used in one trajectory."""
    return len({c.tool for t in traj.turns for c in t.tool_calls if c.schema_ok}) > 1


def _failed(output: str | None, error: bool) -> bool:
    if error:
        return True
    if output is None:
        return False  # not recorded: no evidence either way
    return output.strip() == "" or _EXEC_ERROR.search(output) is not None


def lack_of_tool_priors(traj: Trajectory) -> bool:
    """A tool call returns empty output or an execution error (a missing print, a syntax
    error): the model did not know how the tool behaves."""
    for t in traj.turns:
        if not t.tool_calls:
            continue
        if any(_failed(c.output, c.error) for c in t.tool_calls):
            return True
        if all(c.output is None for c in t.tool_calls) and _failed(t.tool_output, t.error):
            return True
    return False


def tool_format_collapse(traj: Trajectory) -> bool:
    """Tool-call parse errors reported by the harness, or calls that violate the schema."""
    return any(t.parse_errors > 0 or any(not c.schema_ok for c in t.tool_calls) for t in traj.turns)


DETECTORS = {
    "confirmatory_tool_use": confirmatory_tool_use,
    "tool_mixing": tool_mixing,
    "lack_of_tool_priors": lack_of_tool_priors,
    "tool_format_collapse": tool_format_collapse,
}


def detect_patterns(traj: Trajectory) -> dict[str, bool]:
    return {name: fn(traj) for name, fn in DETECTORS.items()}


# =========================================================================== pricing


@dataclass(frozen=True)
class PricedTrajectory:
    trajectory: Trajectory
    turn_costs: tuple[TurnCost, ...]
    patterns: dict[str, bool]

    def turn_pte(self, variant: str = "served") -> np.ndarray:
        return np.array([getattr(c, variant) for c in self.turn_costs])

    def pte(self, variant: str = "served") -> float:
        return float(sum(getattr(c, variant) for c in self.turn_costs))

    @property
    def uncached_tokens(self) -> int:
        """Prompt tokens not served from the prefix cache, plus generated tokens."""
        return sum(t.prompt_tokens - t.cached_tokens + t.output_tokens for t in self.trajectory.turns)

    @property
    def tool_calls(self) -> int:
        return sum(len(t.tool_calls) for t in self.trajectory.turns)


def price(traj: Trajectory, model: CostModel) -> PricedTrajectory:
    ts = traj.turns
    tokens = session_turns(
        [t.prompt_tokens for t in ts],
        [t.output_tokens for t in ts],
        [t.cached_tokens for t in ts],
        [t.recomputed_tokens for t in ts],
    )
    return PricedTrajectory(traj, tuple(price_turn(model, t) for t in tokens), detect_patterns(traj))


# =========================================================================== report


@dataclass(frozen=True)
class PatternStat:
    count: int
    frequency: float
    mean_pte: float  # mean PTE of trajectories with the pattern (NaN: none)
    multiplier: float  # mean_pte ÷ mean PTE of pattern-free trajectories (NaN: undefined)


@dataclass(frozen=True)
class StepStat:
    turn: int  # 1-based turn index
    n: int  # trajectories with at least this many turns
    mean_pte: float


@dataclass(frozen=True)
class CorrectnessStat:
    n_correct: int
    n_incorrect: int
    mean_correct: Estimate
    mean_incorrect: Estimate
    ratio: Estimate  # incorrect ÷ correct mean PTE


@dataclass(frozen=True)
class GroupReport:
    """One model × task row: the published table columns plus the pattern analysis."""

    model: str
    task: str
    n: int
    accuracy: float
    avg_uncached_tokens: float
    tool_calls_per_trajectory: float
    avg_pte: dict[str, float]  # variant -> mean PTE per trajectory
    patterns: dict[str, PatternStat]
    pattern_free_n: int
    pattern_free_mean_pte: float
    per_step: tuple[StepStat, ...]
    step_rho: float  # Spearman ρ of (turn index, turn PTE): > 0 means cost escalates
    correct_vs_incorrect: CorrectnessStat


def _mean(x: np.ndarray) -> float:
    return float(x.mean()) if x.size else math.nan


def group_report(
    priced: Sequence[PricedTrajectory],
    variant: str = "served",
    n_boot: int = DEFAULT_BOOTSTRAP,
    seed: int = 0,
) -> GroupReport:
    """Statistics of one model × task group (all trajectories must share them)."""
    first = priced[0].trajectory
    pte = np.array([p.pte(variant) for p in priced])
    correct = np.array([p.trajectory.correct for p in priced])
    flags = np.array([[p.patterns[k] for k in PATTERNS] for p in priced], dtype=bool)
    free = ~flags.any(axis=1)
    free_mean = _mean(pte[free])
    patterns = {}
    for j, name in enumerate(PATTERNS):
        with_p = pte[flags[:, j]]
        m = _mean(with_p)
        mult = m / free_mean if with_p.size and free.any() and free_mean > 0 else math.nan
        patterns[name] = PatternStat(int(with_p.size), with_p.size / len(priced), m, mult)

    turn_pte = [p.turn_pte(variant) for p in priced]
    depth = max(len(x) for x in turn_pte)
    grid = np.full((len(priced), depth), np.nan)
    for r, x in enumerate(turn_pte):
        grid[r, : len(x)] = x
    counts = np.isfinite(grid).sum(axis=0)
    means = np.nansum(grid, axis=0) / counts
    steps = tuple(StepStat(k + 1, int(counts[k]), float(means[k])) for k in range(depth))
    idx = np.broadcast_to(np.arange(1, depth + 1), grid.shape)[np.isfinite(grid)]
    rho = spearman(idx, grid[np.isfinite(grid)])

    rng = np.random.default_rng([seed, zlib.crc32(first.model.encode()), zlib.crc32(first.task.encode())])
    bc, bi = bootstrap_means(pte[correct], n_boot, rng), bootstrap_means(pte[~correct], n_boot, rng)
    with np.errstate(invalid="ignore", divide="ignore"):
        br = bi / bc
    mc, mi = _mean(pte[correct]), _mean(pte[~correct])

    def est(value: float, boot: np.ndarray) -> Estimate:
        return Estimate(value, *interval_bounds(boot))

    ratio = mi / mc if mc > 0 else math.nan
    return GroupReport(
        model=first.model,
        task=first.task,
        n=len(priced),
        accuracy=float(correct.mean()),
        avg_uncached_tokens=float(np.mean([p.uncached_tokens for p in priced])),
        tool_calls_per_trajectory=float(np.mean([p.tool_calls for p in priced])),
        avg_pte={v: float(np.mean([p.pte(v) for p in priced])) for v in VARIANTS},
        patterns=patterns,
        pattern_free_n=int(free.sum()),
        pattern_free_mean_pte=free_mean,
        per_step=steps,
        step_rho=rho,
        correct_vs_incorrect=CorrectnessStat(
            int(correct.sum()),
            int((~correct).sum()),
            est(mc, bc),
            est(mi, bi),
            est(ratio, br),
        ),
    )


def trajectory_report(
    trajectories: Iterable[Trajectory],
    model: CostModel,
    variant: str = "served",
    n_boot: int = DEFAULT_BOOTSTRAP,
    seed: int = 0,
) -> list[GroupReport]:
    """Price every trajectory and report each model × task group, sorted by (model, task)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown PTE variant {variant!r}; one of {', '.join(VARIANTS)}")
    groups: dict[tuple[str, str], list[PricedTrajectory]] = defaultdict(list)
    for t in trajectories:
        groups[(t.model, t.task)].append(price(t, model))
    return [group_report(groups[k], variant, n_boot, seed) for k in sorted(groups)]
