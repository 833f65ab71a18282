"""The session store outlives the server: a restart between turns keeps every session's
turn numbering and shows the eviction tax the restart really cost (the KV cache died with
the engine); a SIGKILL under load leaves the store whole, losing at most the turns in flight;
two servers on one host keep their own default stores."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sqlite3
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from pte_instrument.devtools.serving import VllmServer
from pte_instrument.devtools.workload import AgentSession, WorkloadConfig
from tests.conftest import EAGER
from tests.e2e.test_sessions_e2e import reusable
from tests.e2e.test_vllm_plugin import words
from tests.helpers import wait

SESSIONS = 8
CFG = WorkloadConfig(turns=4, max_tokens=6, task_words=30, tool_result_words=60)
SYSTEM = "You are an agent. " + words(random.Random(3), 150)


def serve(tiny_model: Path, store: Path, log: Path) -> VllmServer:
    # One replica restarted: its name is kept (by default it is host:port, and each start here
    # takes a free port); a turn that finds its cache gone pays eviction tax, not routing tax
    env = {"VLLM_PLUGINS": "pte", "PTE_SESSION_STORE": str(store), "PTE_INSTANCE": "restarted"}
    return VllmServer(tiny_model, log_path=log, env=env, extra_args=["--enable-prefix-caching", EAGER])


def step(url: str, session: AgentSession):
    with httpx.Client(base_url=url, timeout=180) as client:
        return session.step(client, "tiny")


def stored_turns(url: str, sid: str) -> int:
    r = httpx.get(f"{url}/pte/sessions/{sid}", timeout=10)
    return r.json()["turns"] if r.status_code == 200 else 0


def test_the_store_outlives_a_restart_and_a_sigkill_under_load(tiny_model, tmp_path):
    """One store through three servers: a restart between turns, then a SIGKILL of the
    restarted server under load, then a server that opens what the kill left."""
    store = tmp_path / "sessions.sqlite3"
    with serve(tiny_model, store, tmp_path / "before.log") as before:
        sessions, results = begin_sessions(before)
    with serve(tiny_model, store, tmp_path / "after.log") as after:
        sessions_continue(after, sessions, results)
        rows = killed_under_load(after, store)
    time.sleep(0.5)
    with serve(tiny_model, store, tmp_path / "after-kill.log") as again:  # the store opens and serves
        sid, n_turns = rows[0][0], rows[0][1]
        assert stored_turns(again.url, sid) == n_turns


def begin_sessions(server: VllmServer) -> tuple[list[AgentSession], list[list]]:
    """Two turns of each session, committed."""
    sessions = [AgentSession(f"restart-{k}", CFG, SYSTEM, random.Random(k)) for k in range(SESSIONS)]
    results: list[list] = [[] for _ in sessions]
    for _ in range(2):
        for k, s in enumerate(sessions):
            results[k].append(step(server.url, s))
    assert wait(lambda: all(stored_turns(server.url, s.session_id) == 2 for s in sessions))
    return sessions, results


def sessions_continue(after: VllmServer, sessions: list[AgentSession], results: list[list]) -> None:
    """Turns 3 and 4 on the restarted server: numbered on, with the eviction tax the restart
    really cost (the KV cache died with the engine)."""
    for _ in range(2):
        for k, s in enumerate(sessions):
            results[k].append(step(after.url, s))
    assert wait(lambda: all(stored_turns(after.url, s.session_id) == 4 for s in sessions))
    views = [httpx.get(f"{after.url}/pte/sessions/{s.session_id}", timeout=10).json() for s in sessions]
    for k, (view, turns) in enumerate(zip(views, results, strict=True)):
        rows = view["turn_rows"]
        assert [r["turn"] for r in rows] == [1, 2, 3, 4]
        assert [r["request_id"].rpartition("-")[0] for r in rows] == [t.request_id for t in turns]
        # turn 3 is the first after the restart: the context turn 2 paid for was prefilled again,
        # all but what this session's neighbours had put back in the new cache (the system prompt)
        prev, first_after = turns[1], turns[2]
        assert rows[2]["pte_eviction_tax"] == max(0, reusable(prev) - first_after.cached_tokens)
        assert rows[3]["pte_eviction_tax"] == max(0, reusable(turns[2]) - turns[3].cached_tokens)
        assert rows[2]["pause_s"] > 0
        if k == 0:  # the first turn after the restart found an empty cache
            assert first_after.cached_tokens == 0 and rows[2]["pte_eviction_tax"] == reusable(prev) > 0


def killed_under_load(server: VllmServer, store: Path) -> list[tuple]:
    """16 agents load the server; SIGKILL mid-load (mid-write maybe). The store is whole and
    lost at most the turns in flight. The rows of the load's sessions, as the kill left them."""
    sent: Counter[str] = Counter()
    answered: Counter[str] = Counter()
    stop = threading.Event()

    def agent(k: int) -> None:
        session = AgentSession(
            f"load-{k}",
            WorkloadConfig(turns=100, max_tokens=4, task_words=20, tool_result_words=20),
            SYSTEM,
            random.Random(k),
        )
        while not stop.is_set():
            sent[session.session_id] += 1
            try:
                step(server.url, session)
            except httpx.HTTPError:
                return
            answered[session.session_id] += 1

    def committed() -> int:
        with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as db:
            query = "SELECT COALESCE(SUM(n_turns), 0) FROM sessions WHERE id LIKE 'load-%'"
            return db.execute(query).fetchone()[0]

    try:
        with ThreadPoolExecutor(16) as pool:
            for k in range(16):
                pool.submit(agent, k)
            assert wait(lambda: committed() >= 60, timeout_s=300)
            os.killpg(os.getpgid(server.proc.pid), signal.SIGKILL)
            stop.set()
    finally:
        server.stop()

    with sqlite3.connect(store) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        rows = db.execute(
            "SELECT id, n_turns, turns_dropped, pte_served FROM sessions WHERE id LIKE 'load-%'"
        ).fetchall()
        for sid, n_turns, dropped, served in rows:
            seqs = [
                r[0] for r in db.execute("SELECT seq FROM turns WHERE session_id = ? ORDER BY seq", (sid,))
            ]
            assert seqs == list(range(dropped + 1, n_turns + 1))  # every committed turn whole
            row_served = db.execute("SELECT row ->> '$.pte_served' FROM turns WHERE session_id = ?", (sid,))
            if not dropped:
                assert sum(r[0] for r in row_served) == served
            # nothing stored that was not sent; a turn priced as its answer was on its way counts
            assert n_turns <= sent[sid]
    stored = {sid: n_turns for sid, n_turns, *_ in rows}
    lost = sum(max(0, n - stored.get(sid, 0)) for sid, n in answered.items())
    # at most the turns in flight: answered, not yet priced and committed (one per session at most)
    assert lost <= 16, lost
    return rows


def test_two_servers_on_one_host_have_their_own_default_store_and_a_shared_one_says_so(tiny_model, tmp_path):
    def server(name: str, store: str) -> VllmServer:
        env = {"VLLM_PLUGINS": "pte", "PTE_SESSION_STORE": store}  # "": the default
        return VllmServer(tiny_model, log_path=tmp_path / f"{name}.log", env=env, extra_args=[EAGER])

    def summary(url: str) -> dict:
        return httpx.get(f"{url}/pte/summary", timeout=10).json()

    a, b = server("a", ""), server("b", "")
    with contextlib.ExitStack() as running:
        for vllm in (a, b):  # side by side: both start at once
            running.callback(vllm.stop)
            vllm.launch()
        a.wait_ready()
        b.wait_ready()
        stores = []
        try:
            for vllm, sid in ((a, "on-a"), (b, "on-b")):
                body = {"model": vllm.served_name, "prompt": "whose store", "max_tokens": 2}
                r = httpx.post(
                    f"{vllm.url}/v1/completions", json=body, headers={"X-Session-Id": sid}, timeout=60
                )
                assert r.status_code == 200
            for vllm, own, other in ((a, "on-a", "on-b"), (b, "on-b", "on-a")):
                assert wait(lambda v=vllm, s=own: stored_turns(v.url, s) == 1)
                assert stored_turns(vllm.url, other) == 0  # the other server's session is not here
                store = summary(vllm.url)["sessions"]["store"]
                assert Path(store).name == f"sessions-{vllm.port}.sqlite3", store
                stores.append(store)
            assert stores[0] != stores[1]
            shared_line = "is shared with 1 other running server"
            assert not any(shared_line in (tmp_path / f"{n}.log").read_text(errors="replace") for n in "ab")
            with server("c", stores[0]) as c:  # by choice: the same file as a
                assert stored_turns(c.url, "on-a") == 1
                text = (tmp_path / "c.log").read_text(errors="replace")
                assert sum(shared_line in line for line in text.splitlines()) == 1, text[-2000:]
        finally:
            for store in stores:
                for suffix in ("", "-wal", "-shm"):
                    Path(store + suffix).unlink(missing_ok=True)
