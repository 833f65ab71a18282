"""A fleet of two replicas (two vLLM servers, each with its own engine and KV cache) sharing a
real redis-server as their session store (replica b through a relay that can stop answering):
a client that sticks to one replica and one that alternates. Every session reads whole from
either replica; each turn's routing and eviction tax equal an independent computation from
the responses; a store that stops answering leaves request latency as it was; a store killed
mid-run stops no request, its losses are counted, and sessions continue once it is back."""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path

import httpx
import pytest

from pte_instrument.devtools.redis_server import RedisServer
from pte_instrument.devtools.serving import VllmServer
from pte_instrument.devtools.workload import AgentSession, WorkloadConfig
from tests.conftest import EAGER
from tests.e2e.test_session_store_e2e import step, stored_turns
from tests.e2e.test_sessions_e2e import reusable
from tests.e2e.test_vllm_plugin import words
from tests.exposition import metric_sum, samples
from tests.helpers import wait
from tests.server.test_fleet_store import REDIS, HoldingProxy

pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (make test installs it)")

CFG = WorkloadConfig(turns=6, max_tokens=6, task_words=30, tool_result_words=60)
SYSTEM = "You are an agent. " + words(random.Random(5), 150)
# Which replica each turn of each session goes to.
ROUTES = {"sticky": "aaaa", "moving": "abba"}


# Replica b's store commands time out after this long (the default is 0.25 s): a request that
# waited on its held store would take at least this long, far beyond any scheduling delay.
HELD_TIMEOUT_S = 10.0
# Replica a's: a command that waits for a host busy starting two servers beside other tests is
# not a store that failed (at the default, one such timeout at start-up holds a's turns back for
# a second of back-off, and a turn b prices meanwhile would not see them); a stopped store still
# fails at once (connection refused).
TIMEOUT_S = 5.0


def replica(tiny_model: Path, workdir: Path, name: str, store: str) -> VllmServer:
    env = {
        "VLLM_PLUGINS": "pte",
        "PTE_SESSION_STORE": store,
        "PTE_INSTANCE": name,
        "PTE_SESSION_STORE_TIMEOUT_S": str(HELD_TIMEOUT_S if name == "b" else TIMEOUT_S),
    }
    return VllmServer(
        tiny_model, log_path=workdir / f"{name}.log", env=env, extra_args=["--enable-prefix-caching", EAGER]
    )


def session(url: str, sid: str) -> dict:
    r = httpx.get(f"{url}/pte/sessions/{sid}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def faults(url: str) -> float:
    return metric_sum(
        samples(httpx.get(f"{url}/metrics", timeout=10).text), "pte_plugin_faults_total", stage="sessions"
    )


def test_two_replicas_share_whole_sessions_and_charge_routing_tax_where_a_turn_moved(tiny_model, tmp_path):
    redis = RedisServer(tmp_path, fsync="always").start()
    proxy = HoldingProxy(redis.port)
    replicas = {
        name: replica(tiny_model, tmp_path, name, url) for name, url in (("a", redis.url), ("b", proxy.url))
    }
    with contextlib.ExitStack() as running:
        running.callback(redis.stop)
        running.callback(proxy.close)
        for vllm in replicas.values():  # side by side: both start at once
            running.callback(vllm.stop)
            vllm.launch()
        for vllm in replicas.values():
            vllm.wait_ready()
        agents = {sid: AgentSession(sid, CFG, SYSTEM, random.Random(k)) for k, sid in enumerate(ROUTES)}
        turns: dict[str, list] = {sid: [] for sid in ROUTES}
        for i in range(4):
            for sid, route in ROUTES.items():
                turns[sid].append(step(replicas[route[i]].url, agents[sid]))
        for vllm in replicas.values():
            assert wait(lambda v=vllm: all(stored_turns(v.url, sid) == 4 for sid in ROUTES))
        views = {name: {sid: session(v.url, sid) for sid in ROUTES} for name, v in replicas.items()}
        assert views["a"] == views["b"]  # either replica reads the whole session
        for name, url in (("a", redis.url), ("b", proxy.url)):
            assert (
                httpx.get(f"{replicas[name].url}/pte/summary", timeout=10).json()["sessions"]["store"] == url
            )

        for sid, route in ROUTES.items():
            rows = views["a"][sid]["turn_rows"]
            assert [r["turn"] for r in rows] == [1, 2, 3, 4]
            assert [r["replica"] for r in rows] == list(route)
            assert [r["request_id"].rpartition("-")[0] for r in rows] == [t.request_id for t in turns[sid]]
            for i in range(1, 4):
                # what this turn could have reused and did not find in its replica's cache
                missed = max(0, reusable(turns[sid][i - 1]) - turns[sid][i].cached_tokens)
                moved = route[i] != route[i - 1]
                assert rows[i]["pte_routing_tax"] == (missed if moved else 0), (sid, i, rows[i])
                assert rows[i]["pte_eviction_tax"] == (0 if moved else missed), (sid, i, rows[i])
            assert views["a"][sid]["pte_routing_tax"] == sum(r["pte_routing_tax"] for r in rows)
        # turn 2 of the moving session went to a replica that had never seen it: a real tax
        assert turns["moving"][1].cached_tokens < reusable(turns["moving"][0])
        assert views["a"]["moving"]["pte_routing_tax"] > 0
        assert views["a"]["sticky"]["pte_routing_tax"] == 0
        per_replica = {
            name: metric_sum(
                samples(httpx.get(f"{v.url}/metrics", timeout=10).text), "pte_routing_tax_pte_total"
            )
            for name, v in replicas.items()
        }
        assert sum(per_replica.values()) == views["a"]["moving"]["pte_routing_tax"]

        # b's store stops answering: none of b's requests waits for it, its failures are counted
        def timed_block(tag: str) -> list[float]:
            took = []
            for k in range(8):
                body = {"model": "tiny", "prompt": f"{tag} {k}", "max_tokens": 8, "ignore_eos": True}
                t0 = time.perf_counter()
                r = httpx.post(
                    f"{replicas['b'].url}/v1/completions",
                    json=body,
                    headers={"X-Session-Id": f"{tag}-{k}"},
                    timeout=60,
                )
                took.append(time.perf_counter() - t0)
                assert r.status_code == 200
            return took

        proxy.hold()
        before = faults(replicas["b"].url)
        held = timed_block("held")
        assert wait(lambda: faults(replicas["b"].url) > before, timeout_s=6 * HELD_TIMEOUT_S)
        assert max(held) < HELD_TIMEOUT_S / 2, held  # no request waited on the store
        proxy.release()
        assert wait(lambda: stored_turns(replicas["b"].url, "sticky") == 4, timeout_s=60)

        # The store dies mid-run: every request is still answered, the failure is counted, and
        # the turn the store missed is kept.
        redis.stop()
        before = faults(replicas["a"].url)
        kept_turn = step(replicas["a"].url, agents["sticky"])
        assert kept_turn.output_tokens > 0
        assert wait(lambda: faults(replicas["a"].url) > before)
        redis.start()
        # Back (once the replica's back-off has run out), the kept turn lands, and the session
        # goes on after it.
        assert wait(lambda: stored_turns(replicas["a"].url, "sticky") == 5, timeout_s=60)
        after = step(replicas["a"].url, agents["sticky"])
        assert wait(lambda: stored_turns(replicas["b"].url, "sticky") == 6, timeout_s=60)
        rows = session(replicas["b"].url, "sticky")["turn_rows"]
        ids = [r["request_id"].rpartition("-")[0] for r in rows]
        assert ids[-2:] == [kept_turn.request_id, after.request_id]
        assert [r["turn"] for r in rows] == [1, 2, 3, 4, 5, 6]
