"""Concurrent streaming agent sessions, some of whose clients hang up mid-stream: the load
of the load/fault test and bench. Seeded; talks to any OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

import httpx

from pte_instrument.settings import Settings


@dataclass(frozen=True)
class StreamOutcome:
    session_id: str
    turn: int
    request_id: str | None  # None: the request failed before the first chunk
    status: int
    disconnected: bool  # the client hung up mid-stream
    chunks: int


async def _turn(
    client: httpx.AsyncClient,
    model: str,
    session_id: str,
    turn: int,
    prompt: str,
    max_tokens: int,
    hang_up_after: int | None,
) -> tuple[StreamOutcome, str]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    rid, chunks, text = None, 0, ""
    async with client.stream(
        "POST", "/v1/completions", json=body, headers={Settings.session_header: session_id}
    ) as r:
        if r.status_code != 200:
            return StreamOutcome(session_id, turn, None, r.status_code, False, 0), ""
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            rid = chunk["id"]
            chunks += 1
            text += chunk["choices"][0]["text"] if chunk.get("choices") else ""
            if hang_up_after is not None and chunks >= hang_up_after:
                return StreamOutcome(session_id, turn, rid, 200, True, chunks), text
    return StreamOutcome(session_id, turn, rid, 200, False, chunks), text


async def _session(
    client: httpx.AsyncClient,
    model: str,
    i: int,
    turns: int,
    max_tokens: int,
    disconnect_p: float,
    rng: random.Random,
) -> list[StreamOutcome]:
    words = "agent tool call result search value table error".split()
    sid = f"load-{i:04d}"
    prompt = f"Task {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(40, 160)))
    out = []
    for t in range(1, turns + 1):
        hang_up = rng.randint(1, max(1, max_tokens // 2)) if rng.random() < disconnect_p else None
        outcome, text = await _turn(client, model, sid, t, prompt, max_tokens, hang_up)
        out.append(outcome)
        if outcome.disconnected or outcome.status != 200:
            break  # the agent is gone
        prompt += text + "\nTool result: " + " ".join(rng.choice(words) for _ in range(rng.randint(10, 80)))
    return out


async def _run(
    base_url: str, model: str, sessions: int, turns: int, max_tokens: int, disconnect_p: float, seed: int
) -> list[StreamOutcome]:
    rng = random.Random(seed)
    # Every turn on a connection of its own. A kept connection closes on the server's
    # keep-alive timeout (uvicorn's 5 s), counted from the last byte it wrote, which a busy
    # client may read seconds later: reused then, it is closed under the request.
    limits = httpx.Limits(max_connections=sessions + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        results = await asyncio.gather(
            *(
                _session(client, model, i, turns, max_tokens, disconnect_p, random.Random(rng.random()))
                for i in range(sessions)
            )
        )
    return [o for session in results for o in session]


def run_streaming_sessions(
    base_url: str,
    model: str,
    sessions: int = 256,
    turns: int = 2,
    max_tokens: int = 24,
    disconnect_p: float = 0.1,
    seed: int = 0,
) -> list[StreamOutcome]:
    """All sessions at once; each turn streams, and a client hangs up after a random number
    of chunks with probability ``disconnect_p`` (then its session ends)."""
    return asyncio.run(_run(base_url, model, sessions, turns, max_tokens, disconnect_p, seed))
