"""A tool-integrated-agent workload against any OpenAI-compatible server: sessions of turns
whose prompts grow by the model's output plus a tool result, so later turns share the
earlier turns' prefix. Seeded and reproducible."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from pte_instrument.settings import Settings

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
    session_header: str = Settings.session_header  # the plugin's default header


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


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def tokenize(client: httpx.Client, model: str, text: str, special: bool = False) -> list[int]:
    r = client.post("/tokenize", json={"model": model, "prompt": text, "add_special_tokens": special})
    r.raise_for_status()
    return r.json()["tokens"]


class AgentSession:
    """One agent. Like an agent framework that keeps token ids, each turn's prompt is the
    previous prompt + the model's output ids + the tool result: an exact prefix, so the
    prefix cache (and the eviction tax) behave as they would for a real agent loop."""

    def __init__(self, session_id: str, cfg: WorkloadConfig, system_prompt: str, rng: random.Random):
        self.session_id = session_id
        self.cfg = cfg
        self.rng = rng
        self.opening = f"{system_prompt}\nTask {session_id}: {random_words(rng, cfg.task_words)}\n"
        self.context: list[int] = []
        self.turn = 0

    def step(self, client: httpx.Client, model: str) -> TurnResult:
        if not self.context:
            self.context = tokenize(client, model, self.opening, special=True)
        self.turn += 1
        body: dict[str, Any] = {
            "model": model,
            "prompt": self.context,
            "max_tokens": self.cfg.max_tokens,
            "ignore_eos": True,  # random weights: keep output lengths deterministic
            "temperature": 0.0,
            "return_token_ids": True,
        }
        t0 = time.perf_counter()
        r = client.post("/v1/completions", json=body, headers={self.cfg.session_header: self.session_id})
        latency = time.perf_counter() - t0
        r.raise_for_status()
        data = r.json()
        usage, choice = data["usage"], data["choices"][0]
        tool_result = f"\nTool result: {random_words(self.rng, self.cfg.tool_result_words)}\n"
        self.context = [*self.context, *choice["token_ids"], *tokenize(client, model, tool_result)]
        return TurnResult(
            session_id=self.session_id,
            turn=self.turn,
            request_id=data["id"],
            prompt_tokens=usage["prompt_tokens"],
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            output_tokens=usage["completion_tokens"],
            finish_reason=choice["finish_reason"],
            latency_s=latency,
        )


def run_workload(
    base_url: str | Sequence[str],
    model: str,
    cfg: WorkloadConfig,
    between_rounds: Callable[[httpx.Client, int], None] | None = None,
) -> list[TurnResult]:
    """Round-robin over sessions, one turn each, so every session pauses between turns
    while the others run (the tool pause). ``between_rounds(client, round)`` runs after
    each round but the last (the demo drops the prefix cache there), once per server.
    Several servers (replicas behind a router without session affinity): the first session
    stays on the first server, and turn ``r`` of session ``i`` > 0 goes to server ``(i + r)
    mod n``, so that it moves at every turn."""
    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    rng = random.Random(cfg.seed)
    system_prompt = "You are an agent with tools. " + random_words(rng, cfg.system_words)
    sessions = [
        AgentSession(f"s{i:03d}-{cfg.seed}", cfg, system_prompt, random.Random(rng.random()))
        for i in range(cfg.sessions)
    ]
    results: list[TurnResult] = []
    clients = [httpx.Client(base_url=url, timeout=300) for url in urls]
    try:
        for round_ in range(cfg.turns):
            for i, s in enumerate(sessions):
                results.append(s.step(clients[(i + round_) % len(clients) if i else 0], model))
            if round_ + 1 < cfg.turns:
                if between_rounds is not None:
                    for client in clients:
                        between_rounds(client, round_)
                time.sleep(cfg.tool_pause_s)
    finally:
        for client in clients:
            client.close()
    return results
