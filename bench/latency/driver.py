"""Tool-integrated-reasoning agent sessions for the latency bench, against any
OpenAI-compatible server that has ``/tokenize`` and ``/v1/completions`` (vLLM does).

Built on ``pte_instrument.devtools.workload.AgentSession`` (token-id prompts, exact prefixes across
turns, ``X-Session-Id``), by composition: before each turn the session gets a per-turn
config with that turn's reasoning length and tool-result length.

What decorrelates PTE from token counts is that the two things PTE weighs differently vary
independently: the context (grows every turn; some tool results are long, unfiltered dumps)
and the output length (drawn per turn from a range). Sessions run concurrently (a thread
each, ``concurrency`` at a time); turns within a session are sequential, with a tool pause
between them. Every length and word is drawn from a per-session generator seeded by (seed,
session index), and the prompts do not name the phase, so a run is reproducible whatever the
thread scheduling and each phase replays the same sessions: session i's turn t has the same
prompt and output lengths at every concurrency (greedy decoding, ignore_eos).
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

import httpx

from pte_instrument.devtools.workload import AgentSession, TurnResult, WorkloadConfig, random_words


@dataclass(frozen=True)
class DriverConfig:
    sessions: int = 8
    turns: int = 6
    concurrency: int = 1
    output_tokens: tuple[int, int] = (8, 96)  # reasoning length per turn (max_tokens, ignore_eos)
    tool_short_words: tuple[int, int] = (8, 60)  # a filtered tool result
    tool_long_words: tuple[int, int] = (300, 900)  # an unfiltered dump (a file, a search page)
    p_long: float = 0.3  # chance a tool result is long
    task_words: tuple[int, int] = (20, 300)  # first-turn prompts differ in length too
    system_words: int = 150  # a system prompt shared by every session (a common prefix)
    tool_pause_s: tuple[float, float] = (0.0, 0.05)
    max_model_len: int = 4096  # a turn never asks for more than fits; a full session ends
    seed: int = 0
    session_prefix: str = "c1"  # session ids are <prefix>-s<index>; phases keep them apart
    session_header: str = "X-Session-Id"
    timeout_s: float = 900.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TurnRecord(TurnResult):
    """One turn as the client saw it (the server's view is in the request log): the workload's
    turn result plus the plan that shaped it and its wall-clock span."""

    max_tokens: int = 0
    tool_words: int = 0  # the tool result appended after this turn's output
    tool_long: bool = False
    t_start: float = 0.0
    t_end: float = 0.0
    error: str | None = None


@dataclass
class PhaseResult:
    config: DriverConfig
    turns: list[TurnRecord]
    t_start: float
    t_end: float
    sessions_cut_short: int  # sessions that hit max_model_len before their last turn
    errors: int

    @property
    def wall_s(self) -> float:
        return self.t_end - self.t_start

    def summary(self) -> dict[str, Any]:
        ok = [t for t in self.turns if t.error is None]
        return {
            "concurrency": self.config.concurrency,
            "sessions": self.config.sessions,
            "turns_done": len(ok),
            "errors": self.errors,
            "sessions_cut_short": self.sessions_cut_short,
            "wall_s": round(self.wall_s, 3),
            "prompt_tokens": sum(t.prompt_tokens for t in ok),
            "cached_tokens": sum(t.cached_tokens for t in ok),
            "output_tokens": sum(t.output_tokens for t in ok),
            "max_prompt_tokens": max((t.prompt_tokens for t in ok), default=0),
            "t_start": self.t_start,
            "t_end": self.t_end,
        }


@dataclass(frozen=True)
class TurnPlan:
    max_tokens: int
    tool_words: int
    tool_long: bool
    pause_s: float


def session_name(index: int) -> str:
    """A session's name within a phase; its id is ``<prefix>-<name>``."""
    return f"s{index:03d}"


def plan_session(cfg: DriverConfig, index: int) -> tuple[int, list[TurnPlan]]:
    """Task length and per-turn lengths of session ``index``: a pure function of (seed, index)."""
    rng = random.Random(f"pte-latency-{cfg.seed}-{index}")
    task_words = rng.randint(*cfg.task_words)
    plan = []
    for _ in range(cfg.turns):
        long = rng.random() < cfg.p_long
        plan.append(
            TurnPlan(
                max_tokens=rng.randint(*cfg.output_tokens),
                tool_words=rng.randint(*(cfg.tool_long_words if long else cfg.tool_short_words)),
                tool_long=long,
                pause_s=rng.uniform(*cfg.tool_pause_s),
            )
        )
    return task_words, plan


class _Progress:
    """A rich progress bar on a terminal; a line per 10% otherwise (logs stay readable)."""

    def __init__(self, total: int, label: str, enabled: bool = True) -> None:
        self.total, self.label, self.done = total, label, 0
        self.lock = threading.Lock()
        self.bar = None
        self.next_pct = 10
        self.enabled = enabled
        if enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                transient=False,
            )
            self.task = self.bar.add_task(label, total=total)
            self.bar.start()

    def advance(self) -> None:
        with self.lock:
            self.done += 1
            if self.bar is not None:
                self.bar.update(self.task, advance=1)
            elif self.enabled and self.total and 100 * self.done / self.total >= self.next_pct:
                print(f"  {self.label}: {self.done}/{self.total} turns", file=sys.stderr, flush=True)
                self.next_pct += 10

    def skip(self, n: int) -> None:
        """Turns a session will not run (it reached the context limit)."""
        with self.lock:
            self.done += n
            if self.bar is not None:
                self.bar.update(self.task, advance=n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def run_phase(
    base_url: str,
    model: str,
    cfg: DriverConfig,
    progress: bool = True,
    on_turn: Callable[[TurnRecord], None] | None = None,
) -> PhaseResult:
    """Run ``cfg.sessions`` agent sessions, ``cfg.concurrency`` at a time."""
    rng = random.Random(cfg.seed)
    system_prompt = "You are an agent with tools. " + random_words(rng, cfg.system_words)
    bar = _Progress(cfg.sessions * cfg.turns, f"concurrency {cfg.concurrency}", progress)
    records: list[TurnRecord] = []
    lock = threading.Lock()
    cut_short = [0]
    stop = threading.Event()  # set on Ctrl-C: sessions end after their current turn
    # idle connections dropped before vLLM's 5 s keep-alive timeout closes them under a request
    limits = httpx.Limits(
        max_connections=cfg.concurrency + 4,
        max_keepalive_connections=cfg.concurrency + 4,
        keepalive_expiry=1.0,
    )

    def one_session(client: httpx.Client, index: int) -> None:
        task_words, plan = plan_session(cfg, index)
        sid = f"{cfg.session_prefix}-{session_name(index)}"
        base = WorkloadConfig(
            sessions=1,
            turns=cfg.turns,
            task_words=task_words,
            seed=cfg.seed,
            session_header=cfg.session_header,
        )
        # The task text names the session by its index alone: every phase then sends the same
        # prompts (lengths and token ids), whatever its session prefix.
        session = AgentSession(
            session_name(index), base, system_prompt, random.Random(f"pte-latency-words-{cfg.seed}-{index}")
        )
        session.session_id = sid
        for i, p in enumerate(plan):
            if stop.is_set():
                return
            room = cfg.max_model_len - len(session.context) - 1
            if session.context and room < cfg.output_tokens[0]:
                with lock:
                    cut_short[0] += 1
                bar.skip(cfg.turns - i)
                return
            max_tokens = min(p.max_tokens, room) if session.context else p.max_tokens
            # The tool result appended after this turn's output is the plan's; a session's
            # last turn gets one too (it is never sent), which keeps the code simple.
            session.cfg = replace(base, max_tokens=max_tokens, tool_result_words=p.tool_words)
            t0 = time.time()
            try:
                r = session.step(client, model)
            except (httpx.HTTPError, KeyError, ValueError) as e:
                r = TurnResult(sid, i + 1, "", 0, 0, 0, "error", time.time() - t0)
                error = f"{type(e).__name__}: {e}"
            else:
                error = None
            rec = TurnRecord(
                **asdict(r),
                max_tokens=max_tokens,
                tool_words=p.tool_words,
                tool_long=p.tool_long,
                t_start=t0,
                t_end=time.time(),
                error=error,
            )
            with lock:
                records.append(rec)
            if error is not None:
                bar.advance()
                return
            if on_turn is not None:
                on_turn(rec)
            bar.advance()
            if i + 1 < len(plan) and p.pause_s > 0:
                time.sleep(p.pause_s)

    t_start = time.time()
    with (
        httpx.Client(base_url=base_url, timeout=cfg.timeout_s, limits=limits) as client,
        ThreadPoolExecutor(max_workers=cfg.concurrency, thread_name_prefix="agent") as pool,
    ):
        futures = [pool.submit(one_session, client, i) for i in range(cfg.sessions)]
        try:
            for f in futures:
                f.result()
        except BaseException:
            stop.set()
            for f in futures:
                f.cancel()
            raise
    t_end = time.time()
    bar.close()
    records.sort(key=lambda r: (r.session_id, r.turn))
    return PhaseResult(cfg, records, t_start, t_end, cut_short[0], sum(r.error is not None for r in records))
