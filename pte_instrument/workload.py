"""A tool-integrated-agent workload against any OpenAI-compatible server: sessions of turns
whose prompts grow by the model's output plus a tool result, so later turns share the
earlier turns' prefix. Seeded and reproducible."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

_WORDS = (
    "search result table value compute python error retry answer file row column sum "
    "mean check plan step query output input tool agent context cache token "
).split()


@dataclass(frozen=True)
class WorkloadConfig:
    sessions: int = 3
    turns: int = 4
    max_tokens: int = 16  # reasoning length per turn
    system_words: int = 300  # shared system prompt: a prefix common to every session
    task_words: int = 60
    tool_result_words: int = 80
    tool_pause_s: float = 0.0
    seed: int = 0
    session_header: str = "X-Session-Id"


@dataclass
class TurnResult:
    session_id: str
    turn: int
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    finish_reason: str
    latency_s: float
    text: str = field(repr=False, default="")


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


class AgentSession:
    """One agent: a task, then per turn the model reasons and a tool answers."""

    def __init__(self, session_id: str, cfg: WorkloadConfig, system_prompt: str, rng: random.Random):
        self.session_id = session_id
        self.cfg = cfg
        self.rng = rng
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": f"Task {session_id}: {_words(rng, cfg.task_words)}"},
        ]
        self.turn = 0

    def step(self, client: httpx.Client, model: str) -> TurnResult:
        self.turn += 1
        body: dict[str, Any] = {
            "model": model,
            "messages": self.messages,
            "max_tokens": self.cfg.max_tokens,
            "ignore_eos": True,  # random weights: keep output lengths deterministic
            "temperature": 0.0,
        }
        t0 = time.perf_counter()
        r = client.post("/v1/chat/completions", json=body, headers={self.cfg.session_header: self.session_id})
        latency = time.perf_counter() - t0
        r.raise_for_status()
        data = r.json()
        usage = data["usage"]
        text = data["choices"][0]["message"]["content"] or ""
        self.messages.append({"role": "assistant", "content": text})
        self.messages.append(
            {"role": "user", "content": f"Tool result: {_words(self.rng, self.cfg.tool_result_words)}"}
        )
        return TurnResult(
            session_id=self.session_id,
            turn=self.turn,
            request_id=data["id"],
            prompt_tokens=usage["prompt_tokens"],
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            output_tokens=usage["completion_tokens"],
            finish_reason=data["choices"][0]["finish_reason"],
            latency_s=latency,
            text=text,
        )


def run_workload(base_url: str, model: str, cfg: WorkloadConfig) -> list[TurnResult]:
    """Round-robin over sessions, one turn each, so every session pauses between turns
    while the others run (the tool pause)."""
    rng = random.Random(cfg.seed)
    system_prompt = "You are an agent with tools. " + _words(rng, cfg.system_words)
    sessions = [
        AgentSession(f"s{i:03d}-{cfg.seed}", cfg, system_prompt, random.Random(rng.random()))
        for i in range(cfg.sessions)
    ]
    results: list[TurnResult] = []
    with httpx.Client(base_url=base_url, timeout=300) as client:
        for _ in range(cfg.turns):
            for s in sessions:
                results.append(s.step(client, model))
            if cfg.tool_pause_s:
                time.sleep(cfg.tool_pause_s)
    return results
