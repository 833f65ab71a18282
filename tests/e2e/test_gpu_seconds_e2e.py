"""GPU seconds on a real server with the step hook: every step's measured time is charged to
its requests exactly (Σ over requests = the engine's busy time), a request's latency is
explained by the steps it sat through, money follows GPU seconds, and the step-time model is
fitted online and exported."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import PRICE
from tests.e2e.test_vllm_plugin import words
from tests.exposition import metric_sum, samples
from tests.helpers import jsonl, wait


def test_gpu_seconds_add_up_to_the_engines_busy_time(timed_server):
    vllm, work, client = timed_server
    rng = random.Random()
    sessions = [f"s{i}-{rng.randrange(10**6)}" for i in range(6)]

    def agent(session: str) -> list[str]:
        ids, history = [], words(rng, rng.randint(20, 120))
        for _ in range(3):
            r = client.post(
                "/v1/completions",
                headers={"X-Session-Id": session},
                json={
                    "model": vllm.served_name,
                    "prompt": history,
                    "max_tokens": rng.randint(8, 40),
                    "ignore_eos": True,
                },
            )
            r.raise_for_status()
            ids.append(r.json()["id"])
            history += r.json()["choices"][0]["text"] + " " + words(rng, rng.randint(5, 30))
        return ids

    with ThreadPoolExecutor(6) as pool:
        ids = {i for batch in pool.map(agent, sessions) for i in batch}
    log = work / "requests.jsonl"
    assert wait(lambda: len([e for e in jsonl(log) if e["request_id"].rpartition("-")[0] in ids]) == len(ids))

    def quiet() -> bool:
        hook = client.get("/pte/summary").json()["engine_hook"]
        return hook["requests_waiting"] == 0 and not any(hook["live_requests"].values())

    assert wait(quiet)
    entries = jsonl(log)  # every request this server ran: the charge covers them all
    m = samples(client.get("/metrics").text)
    busy = metric_sum(m, "pte_engine_busy_seconds")
    charged = sum(e["gpu_seconds"] for e in entries)
    assert busy > 0 and charged == pytest.approx(busy, rel=1e-3)
    assert metric_sum(m, "pte_gpu_seconds_total") == pytest.approx(charged, rel=1e-9)
    steps = [json.loads(x) for x in (work / "steps.jsonl").read_text().splitlines()[1:]]
    assert sum(s["dt_s"] for s in steps) == pytest.approx(busy, rel=1e-3)  # busy time is the steps' time
    assert all(s["model_s"] > 0 for s in steps)  # each step's price before its time was known
    for e in entries:
        parts = (
            e["gpu_seconds_prefill"]
            + e["gpu_seconds_kv_read"]
            + e["gpu_seconds_weights"]
            + e["gpu_seconds_overhead"]
        )
        assert parts == pytest.approx(e["gpu_seconds"], rel=1e-9)
        assert 0 < e["gpu_seconds"] <= e["latency_explained_s"] + 1e-9
        assert e["interference_s"] == pytest.approx(e["latency_explained_s"] - e["gpu_seconds"], abs=1e-9)
        assert e["cost_usd"] == pytest.approx(e["gpu_seconds"] * PRICE / 3600, rel=1e-9)  # one GPU per engine
        assert e["latency_explained_s"] <= e["e2e_s"] + 0.05  # the steps it was in, inside its lifetime
    assert metric_sum(m, "pte_cost_usd_total") == pytest.approx(charged * PRICE / 3600, rel=1e-9)
    # per session: the turns and the totals carry seconds and money
    s = client.get(f"/pte/sessions/{sessions[0]}").json()
    assert len(s["turn_rows"]) == 3 and all(t["gpu_seconds"] > 0 for t in s["turn_rows"])
    assert s["gpu_seconds"] == pytest.approx(sum(t["gpu_seconds"] for t in s["turn_rows"]), rel=1e-9)
    assert s["cost_usd"] == pytest.approx(s["gpu_seconds"] * PRICE / 3600, rel=1e-9)


def test_the_step_time_model_is_fitted_online_and_exported(timed_server):
    vllm, _, client = timed_server
    body = {"model": vllm.served_name, "prompt": "agent tool call", "max_tokens": 300, "ignore_eos": True}
    for _ in range(2):  # enough steps for a refit
        client.post("/v1/completions", json=body).raise_for_status()
    deadline = time.monotonic() + 30
    while True:
        model = client.get("/pte/summary").json()["engine_hook"]["step_model"]["0"]
        if model["source"] == "online" or time.monotonic() > deadline:
            break
        client.post("/v1/completions", json=body).raise_for_status()
    assert model["source"] == "online" and model["steps"] >= 256
    assert model["r2"] is not None and model["mape"] is not None
    m = {k: v for k, v in model.items() if k in "abwo"}
    assert all(v >= 0 for v in m.values()) and sum(m.values()) > 0
    text = client.get("/metrics").text
    assert "pte_step_model_coefficient{" in text and 'source="online"' in text
    assert "pte_gamma_measured{" in text
    # the host's speed against the fit, exported beside it
    assert 0 < model["speed"] < 100
    (speed,) = [v for (name, _), v in samples(text).items() if name == "pte_step_model_speed_ratio"]
    assert speed > 0
