"""Every request priced once, on time, under its session, on a real server with the step
hook: parallel sampling, a list of prompts, a reused X-Request-Id, a client abort, a
request aborted while still queued, and one aborted in the middle of its prefill. Uses only
HTTP and the request log."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from pte_instrument.server.engine_join import ORPHAN_AFTER_S
from tests.e2e.conftest import serving
from tests.helpers import jsonl

# Its slot holder keeps the engine decoding for as long as a test needs the slot taken.
pytestmark = pytest.mark.alone

HOOK = ["--scheduler-cls", "pte_instrument.vllm_adapter.scheduler.PteScheduler"]
CHUNK = 64  # --max-num-batched-tokens: the prefill tokens of one step
# The slot holder's length: minutes of decoding on two cores (about 300 tokens/s at 4k
# context, slower as the context grows), so it holds the slot until the test lets it go.
HOLD_TOKENS = 120_000


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("pricing")
    log = work / "requests.jsonl"
    env = {"PTE_REQUEST_LOG": str(log), "VLLM_PLUGINS": "pte", "PTE_DEVICE": "h100-sxm"}
    # one sequence at a time: a second request waits in the queue while the first runs; small
    # prefill chunks: a long prompt takes many steps, so a client can hang up in the middle. A
    # context long enough that the slot's holder (below) cannot finish before it is let go.
    long = [
        "--max-model-len",
        str(HOLD_TOKENS + 1024),
        "--hf-overrides",
        json.dumps({"max_position_embeddings": HOLD_TOKENS + 1024}),
    ]
    args = [
        *HOOK,
        "--max-num-seqs",
        "1",
        "--enable-chunked-prefill",
        "--max-num-batched-tokens",
        str(CHUNK),
        *long,
    ]
    with serving(tiny_model, work, env, args) as (vllm, client):
        yield vllm, log, client


def wait_for(log: Path, match, n: int, timeout_s: float = 20.0) -> list[dict]:
    """The log entries ``match`` accepts, once there are ``n`` (and a moment later, so that
    a late duplicate would show)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [e for e in jsonl(log) if match(e)]
        if len(found) >= n:
            time.sleep(1.0)
            return [e for e in jsonl(log) if match(e)]
        time.sleep(0.1)
    return [e for e in jsonl(log) if match(e)]


def faults(client: httpx.Client) -> dict[str, float]:
    return client.get("/pte/summary").json()["faults"]


def completion(served, session: str, **body: Any) -> str:
    """Post a completion in ``session``; its response's id."""
    vllm, _, client = served
    r = client.post(
        "/v1/completions", headers={"X-Session-Id": session}, json={"model": vllm.served_name, **body}
    )
    r.raise_for_status()
    return r.json()["id"]


def test_parallel_sampling_prices_each_child_once(served):
    _, log, client = served
    before = faults(client).get("engine_join", 0)
    session = f"n2-{uuid.uuid4().hex[:8]}"
    # cmpl-<id>; the prompt's request is cmpl-<id>-0
    rid = completion(served, session, prompt="agent tool call result", n=2, max_tokens=6, temperature=1.0)
    entries = wait_for(log, lambda e: rid in e["request_id"], 2)
    assert sorted(e["request_id"] for e in entries) == [f"0_{rid}-0", f"1_{rid}-0"]
    assert sorted(e["child_index"] for e in entries) == [0, 1]
    assert all(e["session_id"] == session and e["engine_pte_served"] is not None for e in entries)
    assert all(e["output_tokens"] == e["engine_decode_tokens"] for e in entries)  # each its own totals
    assert sorted(e["turn"] for e in entries) == [1, 2]
    assert faults(client).get("engine_join", 0) == before


def test_a_list_of_prompts_is_tagged_with_its_session(served):
    _, log, _ = served
    session = f"list-{uuid.uuid4().hex[:8]}"
    rid = completion(served, session, prompt=["agent tool", "call result", "search python"], max_tokens=3)
    entries = wait_for(log, lambda e: e["request_id"].startswith(rid), 3)
    assert sorted(e["request_id"] for e in entries) == [f"{rid}-{i}" for i in range(3)]
    assert [e["session_id"] for e in entries] == [session] * 3


def test_a_reused_request_id_keeps_every_turn_of_its_session(served):
    vllm, log, client = served
    session, same = f"dup-{uuid.uuid4().hex[:8]}", f"same-{uuid.uuid4().hex[:8]}"

    def send(_: int) -> int:  # both in flight at once: the second waits in the engine's queue
        return client.post(
            "/v1/chat/completions",
            headers={"X-Session-Id": session, "X-Request-Id": same},
            json={
                "model": vllm.served_name,
                "max_tokens": 40,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "agent tool call"}],
            },
        ).status_code

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(send, range(2))) == [200, 200]
    entries = wait_for(log, lambda e: same in e["request_id"], 2)
    assert len(entries) == 2
    assert [e["session_id"] for e in entries] == [session, session]
    assert sorted(e["turn"] for e in entries) == [1, 2]
    assert len({e["engine_request_id"] for e in entries}) == 2  # each its own engine request


def stream_then_hang_up(url: str, model: str, session: str, after_chunks: int) -> None:
    """Stream a chat completion and hang up after ``after_chunks`` chunks: closing the
    connection makes vLLM abort the request. Long enough that the abort lands: when other
    work shares the cores, vLLM's API server may act on a hang-up seconds later, while the
    engine goes on decoding (thousands of tokens seen here, with and without the plugin)."""
    body = {
        "model": model,
        "max_tokens": HOLD_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "messages": [{"role": "user", "content": "agent tool call result"}],
    }
    with (
        httpx.Client(base_url=url, timeout=60) as c,
        c.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": session}) as r,
    ):
        for i, _ in enumerate(r.iter_lines()):
            if i >= after_chunks:
                break


def test_a_client_abort_is_priced_promptly_and_turns_follow_arrival(served):
    vllm, log, client = served
    session = f"abort-{uuid.uuid4().hex[:8]}"
    chat = {"model": vllm.served_name, "max_tokens": 3, "messages": [{"role": "user", "content": "agent"}]}
    client.post("/v1/chat/completions", json=chat, headers={"X-Session-Id": session}).raise_for_status()
    stream_then_hang_up(vllm.url, vllm.served_name, session, after_chunks=5)
    hung_up = time.time()
    mine = lambda e: e["session_id"] == session  # noqa: E731
    aborted = wait_for(log, lambda e: mine(e) and e["finish_reason"] == "abort", 1, timeout_s=120)
    seen = time.time()
    assert len(aborted) == 1, "the hang-up never aborted the request"
    # priced within the join's abort grace of the engine's finish, not after the orphan wait
    # (wait_for itself looks one second more for a duplicate)
    assert seen - aborted[0]["finished_at"] < 1.0 + ORPHAN_AFTER_S / 2
    time.sleep(0.7)  # the client's tool pause
    retry_sent = time.time()
    client.post("/v1/chat/completions", json=chat, headers={"X-Session-Id": session}).raise_for_status()
    entries = sorted(wait_for(log, mine, 3), key=lambda e: e["turn"])
    assert [e["finish_reason"] == "abort" for e in entries] == [False, True, False]
    assert [e["turn"] for e in entries] == [1, 2, 3]
    assert entries[1]["e2e_s"] > 0 and entries[1]["arrived_at"] < entries[2]["arrived_at"]
    # the retry's pause: from the abort's real finish to the retry's arrival
    true_pause = entries[2]["arrived_at"] - entries[1]["finished_at"]
    assert entries[2]["pause_s"] == pytest.approx(true_pause, abs=1e-6)
    assert 0.6 < true_pause < (retry_sent - hung_up) + 0.5


# A completion longer than any test, until killed: holds the server's only sequence slot
# until the test lets it go. A process of its own, so that nothing it does can delay the
# test's own client.
RUNNER = """
import sys, time, httpx
body = {"model": sys.argv[2], "max_tokens": int(sys.argv[3]), "ignore_eos": True, "stream": True,
        "messages": [{"role": "user", "content": "agent tool call result"}]}
with httpx.Client(base_url=sys.argv[1], timeout=600) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
    for i, _ in enumerate(r.iter_lines()):
        if i == 1:
            print("generating", flush=True)  # the engine runs it: the slot is taken
        time.sleep(0.002)  # read slowly: leave the CPU to the server
print("finished", flush=True)  # never before the test kills it
"""


def metric_sum(client: httpx.Client, name: str, having: str = "") -> float:
    """A sample of ``/metrics`` (vLLM's own, ``vllm:num_requests_waiting``, or the plugin's),
    summed over its series whose labels include ``having`` (``phase="prefill"``)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in client.get("/metrics").text.splitlines()
        if line.startswith(name + "{") and having in line.split("}", 1)[0]
    )


async def abort_once_queued(url: str, body: dict, headers: dict, queued, holding) -> None:
    """Send ``body``; once ``queued()`` says the engine holds it in its queue, hang up.
    ``holding()``: whether the slot's holder still runs (else nothing keeps the request
    queued, and the test would race the holder's end)."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        sent = asyncio.create_task(c.post("/v1/chat/completions", json=body, headers=headers))
        deadline = time.monotonic() + 60
        while not await asyncio.to_thread(queued):
            assert holding(), "the slot's holder finished: nothing kept the request queued"
            assert time.monotonic() < deadline and not sent.done(), "the request was never queued"
            await asyncio.sleep(0.05)
        assert holding() and not sent.done()
        sent.cancel()  # closes the connection: vLLM aborts the request
        with contextlib.suppress(asyncio.CancelledError):
            await sent


def test_a_request_aborted_while_queued_costs_nothing(served):
    """The holder takes the only slot and keeps it until the test kills it, so the request
    stays queued until it is aborted, however fast the engine runs; "queued" is read from
    the engine's own counts (vLLM's waiting gauge, set from the scheduler's stats at every
    step the holder's decoding makes)."""
    vllm, log, client = served
    session = f"queued-{uuid.uuid4().hex[:8]}"
    runner = subprocess.Popen(
        [sys.executable, "-c", RUNNER, vllm.url, vllm.served_name, str(HOLD_TOKENS)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert runner.stdout is not None and runner.stdout.readline().strip() == "generating"
        deadline = time.monotonic() + 30
        while metric_sum(client, "vllm:num_requests_running") < 1:  # the engine runs the holder
            assert time.monotonic() < deadline and runner.poll() is None
            time.sleep(0.05)
        body = {
            "model": vllm.served_name,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "agent tool call result " * 40}],
        }
        asyncio.run(
            abort_once_queued(
                vllm.url,
                body,
                {"X-Session-Id": session},
                lambda: metric_sum(client, "vllm:num_requests_waiting") > 0,
                lambda: runner.poll() is None,
            )
        )
        # the holder keeps the slot until the engine has dropped the aborted request from its
        # queue: freed before the abort arrives, the slot would take the request in
        deadline = time.monotonic() + 30
        while metric_sum(client, "vllm:num_requests_waiting") > 0:
            assert time.monotonic() < deadline and runner.poll() is None
            time.sleep(0.05)
    finally:
        runner.kill()
        runner.wait()
    [entry] = wait_for(log, lambda e: e["session_id"] == session, 1, timeout_s=15)
    assert entry["finish_reason"] == "abort" and entry["prompt_tokens"] > 100
    assert entry["computed_prefill_tokens"] == 0 and entry["engine_prefill_tokens"] == 0
    assert entry["pte_served"] == 0 and entry["pte_ideal"] == 0 and entry["pte_reference"] == 0


def hang_up_once_scheduled(vllm, client: httpx.Client, log: Path, session: str, words: int) -> dict:
    """Send a prompt of about ``words`` tokens (one a word) that the prefix cache cannot hold
    (the session comes first), for one token; hang up once the engine has scheduled its first
    prefill chunk. Its request-log entry."""
    rng = random.Random(session)
    prompt = " ".join(
        [session, *(rng.choice("agent tool call result search python value".split()) for _ in range(words))]
    )
    body = {"model": vllm.served_name, "prompt": prompt, "max_tokens": 1, "stream": True}
    admitted = metric_sum(client, "vllm:prefix_cache_queries_total")
    with (
        httpx.Client(base_url=vllm.url, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body, headers={"X-Session-Id": session}) as r,
    ):
        r.raise_for_status()
        # the engine counts a request's prefix-cache lookup once it schedules its first chunk
        deadline = time.monotonic() + 30
        while metric_sum(client, "vllm:prefix_cache_queries_total") == admitted:
            assert time.monotonic() < deadline, "the request was never scheduled"
            time.sleep(0.01)
    # the connection is closed before the first token: vLLM aborts the request mid-prefill
    [entry] = wait_for(log, lambda e: e["session_id"] == session, 1, timeout_s=120)
    return entry


def test_a_request_aborted_mid_prefill_is_charged_the_prefill_that_ran(served):
    vllm, log, client = served
    # vLLM acts on a hang-up within milliseconds on a quiet host, and seconds later when
    # other work shares the cores: each try's prompt takes twice as long to prefill, until
    # the abort lands during it (3,800 tokens: some 60 steps, half a second here)
    for words in (3800, 7600, 15200, 30400):
        session = f"prefill-{uuid.uuid4().hex[:8]}"
        served_prefill = metric_sum(client, "pte_served_pte_total", 'phase="prefill"')
        gap = metric_sum(client, "pte_engine_estimate_gap_pte")
        entry = hang_up_once_scheduled(vllm, client, log, session, words)
        if entry["finish_reason"] == "abort":
            break
    assert entry["finish_reason"] == "abort", "the prefill ended before vLLM acted on the hang-up"
    assert entry["output_tokens"] == 0 and entry["cached_tokens"] == 0
    ran = entry["engine_prefill_tokens"]
    assert CHUNK <= ran < entry["prompt_tokens"], "aborted during its prefill"
    assert entry["engine_recompute_tokens"] == 0
    assert entry["pte_served"] == entry["pte_prefill"] == ran == entry["engine_pte_served"]
    assert entry["computed_prefill_tokens"] == ran and entry["pte_decode"] == 0
    assert entry["pte_reference"] == entry["pte_ideal"] == ran  # a first turn: no cache, nothing reusable
    assert entry["pte_wasted_aborted"] == 0
    # the session's totals and the counters add what the request log says
    totals = client.get(f"/pte/sessions/{session}").json()
    assert (totals["pte_served"], totals["pte_reference"], totals["pte_ideal"]) == (ran, ran, ran)
    assert metric_sum(client, "pte_served_pte_total", 'phase="prefill"') - served_prefill == ran
    assert metric_sum(client, "pte_engine_estimate_gap_pte") == gap
