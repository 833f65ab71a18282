"""Request shapes real clients send, against one real server with the plugin fully on (the
step hook, the routes, a request log): each request priced once, with vLLM's own counts
(its ``usage``), under its session, whatever route it came by; a request vLLM rejects
leaves nothing behind; hang-ups are priced once; ``/metrics`` agrees with the log."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import serving
from tests.exposition import metric_sum, samples
from tests.helpers import jsonl

HOOK = ["--scheduler-cls", "pte_instrument.vllm_adapter.scheduler.PteScheduler"]
MAX_MODEL_LEN = 512
PROMPT = "agent tool call result search python"


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("request-shapes")
    log = work / "requests.jsonl"
    env = {"PTE_REQUEST_LOG": str(log), "VLLM_PLUGINS": "pte"}
    args = [
        *HOOK,
        "--max-num-seqs",
        "4",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--scheduling-policy",
        "priority",
    ]
    with serving(tiny_model, work, env, args) as (vllm, client):
        yield vllm, log, client


def records(log: Path, match: Callable[[dict], bool], n: int, timeout_s: float = 15.0) -> list[dict]:
    """The log's records ``match`` accepts, once there are ``n`` (and half a second later,
    so that a late duplicate shows)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and sum(map(match, jsonl(log))) < n:
        time.sleep(0.1)
    time.sleep(0.5)
    return [e for e in jsonl(log) if match(e)]


def named(rid: str) -> Callable[[dict], bool]:
    """Records of the HTTP request sent with ``X-Request-Id: rid`` (vLLM's ``cmpl-<rid>-<i>``,
    ``chatcmpl-<rid>``, a child's ``<index>_`` before either)."""
    return lambda e: e["request_id"].split("_", 1)[-1].startswith((f"cmpl-{rid}-", f"chatcmpl-{rid}"))


def post(served, path: str, body: dict[str, Any], session: str, **headers: str) -> tuple[str, httpx.Response]:
    """Send ``body`` under ``session`` with an X-Request-Id of its own; (that id, the answer)."""
    vllm, _, client = served
    rid = uuid.uuid4().hex[:12]
    r = client.post(
        path,
        json={"model": vllm.served_name, **body},
        headers={"X-Session-Id": session, "X-Request-Id": rid, **headers},
    )
    return rid, r


def stream(served, path: str, body: dict[str, Any], session: str) -> tuple[str, dict]:
    """Stream ``body``; (its X-Request-Id, the usage of its last chunk that has one)."""
    vllm, _, client = served
    rid = uuid.uuid4().hex[:12]
    usage = None
    with client.stream(
        "POST",
        path,
        json={"model": vllm.served_name, "stream": True, **body},
        headers={"X-Session-Id": session, "X-Request-Id": rid},
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                usage = chunk.get("usage") or usage
    assert usage is not None
    return rid, usage


def prompts_in(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def check_priced_as_answered(entries: list[dict], usage: dict, prompts: int, n: int, session: str) -> None:
    """One record per prompt and sample, each once, summing to vLLM's usage: the prompt
    counted once per prompt (vLLM's usage does not repeat it per sample)."""
    assert len(entries) == prompts * n
    assert len({e["engine_request_id"] for e in entries}) == len(entries)  # none twice
    assert sum(e["output_tokens"] for e in entries) == usage["completion_tokens"]
    firsts = [e for e in entries if e["child_index"] in (None, 0)]
    assert sum(e["prompt_tokens"] for e in firsts) == usage["prompt_tokens"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if n == 1:
        assert sum(e["cached_tokens"] for e in entries) == cached
    assert {e["session_id"] for e in entries} == {session}
    if n > 1:
        assert sorted(e["child_index"] for e in entries) == sorted(list(range(n)) * prompts)
    else:
        assert [e["child_index"] for e in entries] == [None] * prompts
    for e in entries:
        assert e["engine_pte_served"] is not None and e["pte_served"] > 0
        prefilled = e["engine_prefill_tokens"] - e["engine_recompute_tokens"]
        assert prefilled == e["prompt_tokens"] - e["cached_tokens"]


COMPLETIONS = {
    "a list of prompts": {"prompt": [PROMPT, "agent", "x y z"], "max_tokens": 3},
    "token ids": {"prompt": [11, 12, 13, 14, 15], "max_tokens": 3},
    "lists of token ids": {"prompt": [[11, 12, 13], [14, 15, 16, 17]], "max_tokens": 3},
    "echo": {"prompt": PROMPT, "max_tokens": 3, "echo": True},
    "logprobs": {"prompt": PROMPT, "max_tokens": 3, "logprobs": 2},
    "prompt logprobs": {"prompt": PROMPT, "max_tokens": 3, "prompt_logprobs": 1},
    "n=3": {"prompt": PROMPT, "max_tokens": 4, "n": 3, "temperature": 1.0},
    "n=2 over two prompts": {"prompt": [PROMPT, "agent"], "max_tokens": 4, "n": 2, "temperature": 1.0},
    "best_of": {"prompt": PROMPT, "max_tokens": 4, "best_of": 2, "temperature": 1.0},
    "max_tokens 1": {"prompt": PROMPT, "max_tokens": 1},
    "min_tokens": {"prompt": PROMPT, "max_tokens": 8, "min_tokens": 6},
    "ignore_eos": {"prompt": PROMPT, "max_tokens": 20, "ignore_eos": True},
    "a stop string hit at once": {"prompt": PROMPT, "max_tokens": 40, "stop": [" ", "a", "e", "t"]},
}


@pytest.mark.parametrize("shape", COMPLETIONS)
def test_a_completion_shape_is_priced_as_vllm_counted_it(served, shape):
    _, log, _ = served
    body = COMPLETIONS[shape]
    session = f"shape-{uuid.uuid4().hex[:8]}"
    rid, r = post(served, "/v1/completions", body, session)
    assert r.status_code == 200, r.text
    n = body.get("n", 1)
    entries = records(log, named(rid), prompts_in(body) * n)
    check_priced_as_answered(entries, r.json()["usage"], prompts_in(body), n, session)


def test_the_work_a_stop_string_request_ran_past_its_end_is_counted_as_waste(served):
    """vLLM's API server sees a stop string and then aborts the request in the engine, which
    has meanwhile run on: what it ran past the client's last token is waste, not served."""
    _, log, _ = served
    body = COMPLETIONS["a stop string hit at once"]
    rids = [post(served, "/v1/completions", body, f"stop-{k}")[0] for k in range(6)]
    entries = [e for rid in rids for e in records(log, named(rid), 1)]
    assert len(entries) == len(rids) and all(e["finish_reason"] == "stop" for e in entries)
    for e in entries:
        beyond = e["engine_pte_served"] - e["pte_wasted_rejected_drafts"] - e["pte_served"]
        assert beyond >= -1e-9 * e["engine_pte_served"]
        assert e["pte_wasted_past_end"] == pytest.approx(max(beyond, 0.0), abs=1e-9 * e["engine_pte_served"])
        assert (e["pte_wasted_past_end"] > 0) == (e["engine_decode_tokens"] > e["output_tokens"])
    assert any(e["engine_decode_tokens"] > e["output_tokens"] for e in entries)  # the engine ran on


STREAMED = {
    "completions, n=3": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "n": 3, "temperature": 1.0}),
    "completions, two prompts": ("/v1/completions", {"prompt": [PROMPT, "agent"], "max_tokens": 4}),
    "chat, continuous usage": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 5,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    "chat, n=2": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "n": 2, "temperature": 1.0},
    ),
}


@pytest.mark.parametrize("shape", STREAMED)
def test_a_streamed_shape_is_priced_as_its_usage_chunk_says(served, shape):
    _, log, _ = served
    path, body = STREAMED[shape]
    body = {"stream_options": {"include_usage": True}, **body}
    session = f"stream-{uuid.uuid4().hex[:8]}"
    rid, usage = stream(served, path, body, session)
    n = body.get("n", 1)
    entries = records(log, named(rid), prompts_in(body) * n)
    check_priced_as_answered(entries, usage, prompts_in(body), n, session)


TOOL_TURN = [
    {"role": "user", "content": "search python"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "result 42"},
]
CHATS = {
    "n=2": {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "n": 2, "temperature": 1.0},
    "a tool result": {"messages": TOOL_TURN, "max_tokens": 4},
    "a priority": {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "priority": -5},
    "a long shared prefix": {
        "messages": [{"role": "user", "content": "agent tool call result " * 30}],
        "max_tokens": 2,
    },
}


@pytest.mark.parametrize("shape", CHATS)
def test_a_chat_shape_is_priced_as_vllm_counted_it(served, shape):
    _, log, _ = served
    body = CHATS[shape]
    session = f"chat-{uuid.uuid4().hex[:8]}"
    for _ in range(2 if shape == "a long shared prefix" else 1):  # the second hits the prefix cache
        rid, r = post(served, "/v1/chat/completions", body, session)
        assert r.status_code == 200, r.text
        n = body.get("n", 1)
        check_priced_as_answered(records(log, named(rid), n), r.json()["usage"], 1, n, session)
    if shape == "a long shared prefix":
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_requests_of_mixed_priorities_contending_for_the_slots_are_each_priced_once(served):
    _, log, _ = served
    session = f"prio-{uuid.uuid4().hex[:8]}"

    def send(i: int) -> tuple[str, httpx.Response]:
        body = {
            "messages": [{"role": "user", "content": f"{PROMPT} {i}"}],
            "max_tokens": 12,
            "ignore_eos": True,
            "priority": [5, -5, 0][i % 3],
        }
        return post(served, "/v1/chat/completions", body, session)

    with ThreadPoolExecutor(9) as pool:
        sent = list(pool.map(send, range(9)))
    for rid, r in sent:
        assert r.status_code == 200, r.text
        check_priced_as_answered(records(log, named(rid), 1), r.json()["usage"], 1, 1, session)


def summary(client: httpx.Client) -> dict:
    return client.get("/pte/summary").json()


REJECTED = {
    "a prompt past the context": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi " * 600}]},
    ),
    "max_tokens past the context": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_MODEL_LEN * 10},
    ),
    "a negative temperature": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
    ),
    "n=0": ("/v1/completions", {"prompt": "hi", "n": 0}),
    "one prompt of a list past the context": ("/v1/completions", {"prompt": ["hi", "hi " * 600]}),
    "a token id out of the vocabulary": ("/v1/completions", {"prompt": [10**7]}),
    "an unknown model": ("/v1/completions", {"prompt": "hi", "model": "nope"}),
}


def test_a_rejected_request_leaves_no_record_and_no_state_and_later_ones_are_priced(served):
    _, log, client = served
    session = f"rejected-{uuid.uuid4().hex[:8]}"
    rids = []
    for path, body in REJECTED.values():
        rid, r = post(served, path, {"max_tokens": 3, **body}, session)
        assert r.status_code in (400, 404), r.text
        rids.append(rid)
    rid, r = post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3}, session)
    entries = records(log, named(rid), 1)
    check_priced_as_answered(entries, r.json()["usage"], 1, 1, session)
    assert entries[0]["turn"] == 1  # the rejected ones were no turns of the session
    assert not any(named(x)(e) for x in rids for e in jsonl(log))
    hook = summary(client)["engine_hook"]
    assert set(hook["live_requests"].values()) <= {0}
    assert hook["results_unjoined"] == 0 and hook["requests_waiting"] == 0


async def hang_up(url: str, body: dict, headers: dict, after_chunks: int | None) -> None:
    """Stream ``body`` and close the connection after ``after_chunks`` chunks (None: as
    soon as the request is written, before any answer)."""
    if after_chunks is None:
        host, port = httpx.URL(url).host, httpx.URL(url).port
        data = json.dumps(body).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        _, writer = await asyncio.open_connection(host, port)
        writer.write(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{head}\r\n".encode()
            + data
        )
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        return
    async with (
        httpx.AsyncClient(base_url=url, timeout=60) as c,
        c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= after_chunks:
                break


def test_hang_ups_before_during_and_after_the_stream_are_each_priced_once(served):
    """Many at once. A hang-up before any answer may come before vLLM hands the request to
    its engine (then nothing ran, and nothing is priced); every other is priced once."""
    vllm, log, client = served
    session = f"hangup-{uuid.uuid4().hex[:8]}"
    body = {
        "model": vllm.served_name,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_MODEL_LEN - 64,
        "ignore_eos": True,
        "stream": True,
    }
    early: list[tuple[dict, int | None]] = [(body, None)] * 3
    # mid-stream at several points, and once the last chunk came (the role chunk, 4 tokens)
    later: list[tuple[dict, int | None]] = [(body, k) for k in (2, 5, 9)] * 3 + [
        ({**body, "max_tokens": 4}, 5)
    ] * 3
    plan = early + later
    rids = [uuid.uuid4().hex[:12] for _ in plan]

    async def all_at_once() -> None:
        await asyncio.gather(
            *(
                hang_up(vllm.url, b, {"X-Session-Id": session, "X-Request-Id": rid}, k)
                for rid, (b, k) in zip(rids, plan, strict=True)
            )
        )

    asyncio.run(all_at_once())
    records(log, lambda e: e["session_id"] == session, len(later), timeout_s=30)
    entries = records(log, lambda e: e["session_id"] == session, len(plan), timeout_s=2)
    ids = [e["request_id"] for e in entries]
    assert len(ids) == len(set(ids))  # none priced twice
    assert set(ids) >= {f"chatcmpl-{rid}" for rid in rids[len(early) :]}
    assert set(ids) <= {f"chatcmpl-{rid}" for rid in rids}
    assert sorted(e["turn"] for e in entries) == list(range(1, len(entries) + 1))
    for e in entries:
        b, k = plan[rids.index(e["request_id"].removeprefix("chatcmpl-"))]
        assert e["output_tokens"] <= b["max_tokens"] and e["engine_pte_served"] is not None
        ran_out = e["finish_reason"] == "length" and e["output_tokens"] == b["max_tokens"]
        if b["max_tokens"] == 4:
            assert ran_out, e
        else:  # cut short, unless the engine ran it out first: on a loaded host the API server
            # can hear of a hang-up seconds after it (once 300 tokens' worth, ~3 s)
            assert e["finish_reason"] == "abort" or ran_out, (e, k)
    assert any(e["finish_reason"] == "abort" for e in entries)
    assert set(summary(client)["engine_hook"]["live_requests"].values()) <= {0}


def test_concurrent_requests_reusing_one_x_request_id_are_each_priced_from_their_own_usage(served):
    vllm, log, client = served
    session, same = f"reuse-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex[:12]
    bodies = [
        {"prompt": PROMPT, "max_tokens": 3},
        {"prompt": "agent", "max_tokens": 5, "n": 2, "temperature": 1.0},
        {"prompt": [PROMPT, "agent x"], "max_tokens": 7},
        {"prompt": "x y", "max_tokens": 9, "ignore_eos": True},
    ]

    def send(body: dict) -> dict:
        r = client.post(
            "/v1/completions",
            json={"model": vllm.served_name, **body},
            headers={"X-Session-Id": session, "X-Request-Id": same},
        )
        r.raise_for_status()
        return r.json()["usage"]

    with ThreadPoolExecutor(len(bodies)) as pool:
        usages = list(pool.map(send, bodies))
    entries = records(log, named(same), 6)
    assert len(entries) == 6 and len({e["engine_request_id"] for e in entries}) == 6
    assert sum(e["output_tokens"] for e in entries) == sum(u["completion_tokens"] for u in usages)
    # each request's own outputs: its max_tokens (none of these stops early: the tiny model's
    # end-of-text is one of its rarest tokens)
    assert sorted(e["output_tokens"] for e in entries) == [3, 5, 5, 7, 7, 9]
    assert sorted(e["turn"] for e in entries) == list(range(1, 7))


def test_odd_but_legal_session_header_values(served):
    _, log, client = served
    tracked = [f"s-{uuid.uuid4().hex[:6]}" + "!#$%&'*+-.^_`|~", f"{uuid.uuid4().hex[:6]},a;b=c", "z" * 128]
    untracked = ["sess\tion", "x" * 129]
    before = samples(client.get("/metrics").text)
    sent = []
    for value in tracked + untracked:
        rid, r = post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, value)
        assert r.status_code == 200
        sent.append(rid)
    entries = [records(log, named(rid), 1)[0] for rid in sent]
    assert [e["session_id"] for e in entries] == [*tracked, None, None]
    after = samples(client.get("/metrics").text)
    rejected = {
        reason: metric_sum(after, "pte_session_ids_rejected_total", reason=reason)
        - metric_sum(before, "pte_session_ids_rejected_total", reason=reason)
        for reason in ("invalid_chars", "too_long")
    }
    assert rejected == {"invalid_chars": 1, "too_long": 1}


def test_a_responses_api_request_is_priced_under_its_session(served):
    vllm, log, client = served
    session = f"responses-{uuid.uuid4().hex[:8]}"
    mine = lambda e: e["session_id"] == session  # noqa: E731
    answers = []
    for extra in (
        {},
        {"request_id": f"mine-{uuid.uuid4().hex[:6]}"},
        {"request_id": "7_" + uuid.uuid4().hex[:6]},
    ):
        r = client.post(
            "/v1/responses",
            json={"model": vllm.served_name, "input": PROMPT, "max_output_tokens": 4, **extra},
            headers={"X-Session-Id": session, "X-Request-Id": uuid.uuid4().hex},
        )
        assert r.status_code == 200, r.text
        answers.append(r.json())
    entries = records(log, mine, 3)
    assert sorted(e["request_id"] for e in entries) == sorted(f"{a['id']}_0" for a in answers)
    assert [e["turn"] for e in entries] == [1, 2, 3]
    for e, a in zip(entries, answers, strict=True):
        assert (e["prompt_tokens"], e["output_tokens"]) == (
            a["usage"]["input_tokens"],
            a["usage"]["output_tokens"],
        )
        assert e["child_index"] is None and e["engine_pte_served"] is not None
    assert len(records(log, lambda e: any(e["request_id"].endswith(a["id"] + "_0") for a in answers), 3)) == 3
    # feedback names a response by the id its answer carried
    for a in answers:
        r = client.post("/pte/feedback", json={"request_id": a["id"], "correct": True})
        assert r.status_code == 200, r.text


def test_the_other_generation_routes_are_priced_under_their_session(served):
    """The Anthropic Messages API, SageMaker's /invocations (chat and completion bodies), and
    the chat batch API."""
    vllm, log, client = served
    session = f"routes-{uuid.uuid4().hex[:8]}"
    chat = {"model": vllm.served_name, "max_tokens": 3, "messages": [{"role": "user", "content": PROMPT}]}
    sent = [
        ("/v1/messages", chat, lambda a: (a["usage"]["input_tokens"], a["usage"]["output_tokens"])),
        ("/invocations", chat, lambda a: (a["usage"]["prompt_tokens"], a["usage"]["completion_tokens"])),
        (
            "/invocations",
            {"model": vllm.served_name, "max_tokens": 3, "prompt": PROMPT},
            lambda a: (a["usage"]["prompt_tokens"], a["usage"]["completion_tokens"]),
        ),
    ]
    counts = []
    for path, body, usage in sent:
        r = client.post(path, json=body, headers={"X-Session-Id": session})
        assert r.status_code == 200, r.text
        counts.append(usage(r.json()))
    batch = {**chat, "messages": [chat["messages"], [{"role": "user", "content": "agent"}]]}
    r = client.post("/v1/chat/completions/batch", json=batch, headers={"X-Session-Id": session})
    assert r.status_code == 200, r.text
    entries = records(log, lambda e: e["session_id"] == session, 5)
    assert [(e["prompt_tokens"], e["output_tokens"]) for e in entries[:3]] == counts
    assert sum(e["output_tokens"] for e in entries[3:]) == r.json()["usage"]["completion_tokens"]
    assert sum(e["prompt_tokens"] for e in entries[3:]) == r.json()["usage"]["prompt_tokens"]
    assert [e["turn"] for e in entries] == [1, 2, 3, 4, 5]


def test_routes_that_generate_nothing_leave_no_record(served):
    vllm, log, client = served
    session = f"nothing-{uuid.uuid4().hex[:8]}"
    before = len(jsonl(log))
    headers = {"X-Session-Id": session}
    for path, body in [
        ("/tokenize", {"model": vllm.served_name, "prompt": PROMPT}),
        ("/detokenize", {"model": vllm.served_name, "tokens": [11, 12]}),
        (
            "/v1/messages/count_tokens",
            {"model": vllm.served_name, "messages": [{"role": "user", "content": "hi"}]},
        ),
    ]:
        assert client.post(path, json=body, headers=headers).status_code == 200
    assert client.get("/v1/models", headers=headers).status_code == 200
    rid, _ = post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, session)
    assert records(log, named(rid), 1)[0]["turn"] == 1
    assert [e["session_id"] for e in jsonl(log)[before:]].count(session) == 1


def test_the_metrics_agree_with_the_request_log(served):
    """Last: every record of this module's server, against its counters."""
    _, log, client = served
    time.sleep(1.0)
    entries = jsonl(log)
    metrics = samples(client.get("/metrics").text)
    assert metric_sum(metrics, "pte_requests_total") == len(entries)
    assert metric_sum(metrics, "pte_output_tokens_total") == sum(e["output_tokens"] for e in entries)
    assert metric_sum(metrics, "pte_prompt_tokens_total") == sum(e["prompt_tokens"] for e in entries)
    assert metric_sum(metrics, "pte_served_pte_total") == pytest.approx(sum(e["pte_served"] for e in entries))
    for reason in ("rejected_drafts", "aborted", "past_end"):
        wasted = sum(e[f"pte_wasted_{reason}"] for e in entries)
        assert metric_sum(metrics, "pte_wasted_pte_total", reason=reason) == pytest.approx(wasted)
    assert len({e["engine_request_id"] for e in entries}) == len(entries)  # none priced twice
    s = summary(client)
    assert s["request_log"]["written"] == len(entries) and s["request_log"]["lost"] == 0
    assert s["faults"] == {}
