"""Scale-out serving: two API servers (prometheus_client multiprocess mode) in front of two
data-parallel engines, each engine with the step hook. The merged /metrics must equal an
independent computation from the responses, per engine label; each API server receives
the engine totals of its own requests; gauges are one series, not one per process; agent
sessions whose turns reach either API server (a fresh connection per turn, tool pauses past
the keep-alive) are one session, the same from both."""

from __future__ import annotations

import itertools
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pte_instrument.devtools.workload import AgentSession, WorkloadConfig
from tests.conftest import scrape, start_server
from tests.e2e.test_sessions_e2e import reusable
from tests.e2e.test_vllm_plugin import independent_gamma, words
from tests.exposition import metric_sum

HOOK = ["--scheduler-cls", "pte_instrument.vllm_adapter.scheduler.PteScheduler"]
SESSIONS, TURNS = 2, 3


@pytest.fixture(scope="module")
def scaled(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("scale-out")
    log = work / "requests.jsonl"
    env = {"PTE_REQUEST_LOG": str(log), "PTE_DEVICE": "h100-sxm", "VLLM_PLUGINS": "pte"}
    args = ["--data-parallel-size", "2", "--api-server-count", "2", *HOOK]
    vllm = start_server(tiny_model, work, env, args)
    try:
        yield vllm, log
    finally:
        vllm.stop()


def complete(url: str, prompt: str, max_tokens: int, client: httpx.Client | None = None, **headers) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    if client is not None:
        r = client.post("/v1/completions", json=body, headers=headers)
    else:  # a connection of its own: the kernel spreads those over the API servers
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    r.raise_for_status()
    return r.json()


def from_each_api_server(url: str, path: str) -> dict[int, dict]:
    """``path`` as each API server answers it: fresh connections until both have."""
    seen: dict[int, dict] = {}
    for _ in range(200):
        r = httpx.get(f"{url}{path}", timeout=10)
        seen[int(r.headers["X-PTE-API-Server"])] = (
            r.json() if r.status_code == 200 else {"status": r.status_code}
        )
        if len(seen) == 2:
            break
    return seen


def summaries(url: str) -> dict[int, dict]:
    return from_each_api_server(url, "/pte/summary")


def test_two_api_servers_two_engines_match_the_responses(scaled, tiny_model):
    vllm, log = scaled
    gamma = independent_gamma(json.loads((tiny_model / "config.json").read_text()))
    rng = random.Random()
    shared = words(rng, 300)
    prompts = [(shared if i % 2 else "") + words(rng, rng.randint(20, 200)) for i in range(16)]
    lengths = [rng.randint(1, 24) for _ in prompts]
    with ThreadPoolExecutor(8) as pool:  # concurrent: the DP balancer uses both engines
        responses = list(pool.map(lambda p: complete(vllm.url, *p), zip(prompts, lengths, strict=True)))

    # agent sessions: one keep-alive connection each, so every turn reaches the same API server
    session_clients = [httpx.Client(base_url=vllm.url, timeout=120) for _ in range(SESSIONS)]
    for turn in range(TURNS):
        for k, client in enumerate(session_clients):
            prompt = f"session {k} " + words(random.Random(k), 150) + f" turn {turn}"
            responses.append(complete(vllm.url, prompt, 4, client, **{"X-Session-Id": f"agent-{k}"}))

    expected = dict(prompt=0, cached=0, output=0, prefill=0.0, decode=0.0)
    for r in responses:
        u = r["usage"]
        L, D = u["prompt_tokens"], u["completion_tokens"]
        c = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        expected["prompt"] += L
        expected["cached"] += c
        expected["output"] += D
        expected["prefill"] += L - c
        expected["decode"] += gamma * (L * D + D * (D - 1) / 2)

    metrics_client = httpx.Client(base_url=vllm.url, timeout=10)
    deadline = time.monotonic() + 20  # the stat loggers record just after each response
    while (
        metric_sum(scrape(metrics_client), "pte_requests_total") < len(responses)
        and time.monotonic() < deadline
    ):
        time.sleep(0.3)
    m = scrape(metrics_client)
    assert metric_sum(m, "pte_requests_total") == len(responses)
    assert metric_sum(m, "pte_prompt_tokens_total") == expected["prompt"]
    assert metric_sum(m, "pte_cached_tokens_total") == expected["cached"]
    assert metric_sum(m, "pte_output_tokens_total") == expected["output"]
    assert metric_sum(m, "pte_served_pte_total", phase="prefill") == expected["prefill"]
    assert metric_sum(m, "pte_served_pte_total", phase="decode") == pytest.approx(
        expected["decode"], rel=1e-9
    )
    # the hooks' exact totals reached the API server of each request: every request joined
    served = expected["prefill"] + expected["decode"]
    assert metric_sum(m, "pte_engine_served_pte_total") == pytest.approx(served, rel=1e-9)
    for engine in ("0", "1"):  # both engines served, and each engine's two sources agree
        assert metric_sum(m, "pte_requests_total", engine=engine) > 0
        assert metric_sum(m, "pte_engine_served_pte_total", engine=engine) == pytest.approx(
            metric_sum(m, "pte_served_pte_total", engine=engine), rel=1e-9
        )
    # each engine's busy time is charged whole, whichever API server priced its requests:
    # nothing runs now, so nothing of it is unattributed
    for engine in ("0", "1"):
        busy = metric_sum(m, "pte_engine_busy_seconds", engine=engine)
        assert busy > 0
        assert metric_sum(m, "pte_gpu_seconds_total", engine=engine) == pytest.approx(busy, rel=1e-6)
        assert abs(metric_sum(m, "pte_gpu_seconds_unattributed", engine=engine)) < 1e-6 * busy, engine
    faults = {dict(k[1])["stage"]: v for k, v in m.items() if k[0] == "pte_plugin_faults_total"}
    assert faults and not any(faults.values()), faults
    # gauges merge to one series per engine (no pid label), with the right value
    gammas = {labels: v for (name, labels), v in m.items() if name == "pte_gamma"}
    assert len(gammas) == 2 and all("pid" not in dict(labels) for labels in gammas), gammas
    assert all(v == pytest.approx(gamma, rel=1e-9) for v in gammas.values())
    # the live count is the store's as the latest commit of either API server read it (each
    # commits at least once a second)
    deadline = time.monotonic() + 5
    while metric_sum(scrape(metrics_client), "pte_sessions_live") != SESSIONS and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric_sum(scrape(metrics_client), "pte_sessions_live") == SESSIONS

    # every request priced once, in the one store both API servers read
    per_server = summaries(vllm.url)
    assert sorted(per_server) == [0, 1]
    counts = [sum(t["requests"] for t in s["models"].values()) for s in per_server.values()]
    assert counts == [len(responses)] * 2, counts
    for s in per_server.values():
        hook = s["engine_hook"]
        assert hook["engines"] == [0, 1]  # both engines said hello to both API servers
        assert hook["results_unjoined"] == 0 and hook["requests_waiting"] == 0
    for k, client in enumerate(session_clients):
        assert client.get(f"/pte/sessions/agent-{k}").json()["turns"] == TURNS
        client.close()

    lines = [json.loads(line) for line in log.read_text().splitlines()]  # both servers append
    ids = sorted(rec["request_id"].rpartition("-")[0] for rec in lines)
    assert ids == sorted(r["id"] for r in responses)


FRESH_SESSIONS, FRESH_TURNS = 32, 4
KEEP_ALIVE_S = 5  # uvicorn's: a pause past it closes a kept connection, so the turn lands anywhere


def test_sessions_on_fresh_connections_are_one_session_from_either_api_server(scaled):
    """Every turn on a connection of its own, some after pauses past the keep-alive: each
    session's turn table and eviction tax, read from either API server, equal an
    independent computation from its responses."""
    vllm, _ = scaled
    cfg = WorkloadConfig(turns=FRESH_TURNS, max_tokens=6, task_words=30, tool_result_words=60)
    system = "You are an agent. " + words(random.Random(7), 150)

    def run(k: int) -> list:
        rng = random.Random(k)
        session = AgentSession(f"fresh-{k}", cfg, system, rng)
        results = []
        for t in range(FRESH_TURNS):
            if t:  # a tool pause: every fourth session waits past the keep-alive
                time.sleep(KEEP_ALIVE_S + 1.5 if k % 4 == 0 and t == 2 else rng.uniform(0.05, 0.5))
            with httpx.Client(base_url=vllm.url, timeout=180) as fresh:
                results.append(session.step(fresh, "tiny"))
        return results

    before = priced_requests(vllm.url)
    with ThreadPoolExecutor(FRESH_SESSIONS) as pool:
        sessions = list(pool.map(run, range(FRESH_SESSIONS)))

    assert wait_for_requests(vllm.url, at_least=before + sum(len(turns) for turns in sessions))
    for k, turns in enumerate(sessions):
        views = from_each_api_server(vllm.url, f"/pte/sessions/fresh-{k}")
        assert sorted(views) == [0, 1], views
        assert views[0] == views[1]  # one store: the same answer from both processes
        rows = views[0]["turn_rows"]
        assert [r["turn"] for r in rows] == list(range(1, FRESH_TURNS + 1))
        assert [r["request_id"].rpartition("-")[0] for r in rows] == [t.request_id for t in turns]
        assert [r["cached_tokens"] for r in rows] == [t.cached_tokens for t in turns]
        taxes = [0] + [max(0, reusable(prev) - cur.cached_tokens) for prev, cur in itertools.pairwise(turns)]
        assert [r["pte_eviction_tax"] for r in rows] == taxes
        assert views[0]["pte_eviction_tax"] == sum(taxes)
        pauses = [r["pause_s"] for r in rows]
        assert pauses[0] is None and all(p >= 0 for p in pauses[1:])
        if k % 4 == 0:
            assert pauses[2] > KEEP_ALIVE_S

    # a label reaches a session whichever API server takes it, and only once, host-wide
    def label(k: int) -> httpx.Response:
        body = {"session_id": f"fresh-{k}", "correct": True}
        return httpx.post(f"{vllm.url}/pte/feedback", json=body, timeout=10)

    answered_by = set()
    for k in range(8):
        for expected in (200, 409):
            r = label(k)
            assert r.status_code == expected, r.text
            answered_by.add(r.headers["X-PTE-API-Server"])
    # Which API server accepts a fresh connection is the host's scheduling (a busy one may
    # take none of 16): the label again, refused wherever it lands, until both have answered
    for _ in range(200):
        if answered_by == {"0", "1"}:
            break
        r = label(0)
        assert r.status_code == 409, r.text
        answered_by.add(r.headers["X-PTE-API-Server"])
    assert answered_by == {"0", "1"}
    efficiency = {i: s["efficiency"] for i, s in summaries(vllm.url).items()}
    assert efficiency[0] == efficiency[1] and sum(c["labeled"] for c in efficiency[0]) == 8
    models = {i: s["models"] for i, s in summaries(vllm.url).items()}
    assert models[0] == models[1]  # the per-model totals too: one store


def priced_requests(url: str) -> int:
    """Requests priced so far, as the API server that answers reads the host's store."""
    return sum(t["requests"] for t in httpx.get(f"{url}/pte/summary", timeout=10).json()["models"].values())


def wait_for_requests(url: str, at_least: int, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if priced_requests(url) >= at_least:
            return True
        time.sleep(0.3)
    return False
