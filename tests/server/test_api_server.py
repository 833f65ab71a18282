"""The API server's facade, driven as the stat logger drives it: configured from a served
model, handed finished requests on the caller's (vLLM's output loop's) thread, and priced on
its own thread, in one direction."""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from pte_instrument.cost.architecture import load_config
from pte_instrument.server import api_server
from pte_instrument.server.api_server import ApiServer, ServedModel
from pte_instrument.server.records import FinishedRequest, RequestRecord
from pte_instrument.server.request_tags import RequestTag
from pte_instrument.server.runtime import Runtime
from pte_instrument.server.turn_order import TURN_ORDER_WAIT_S
from pte_instrument.settings import Settings
from pte_instrument.vllm_adapter.compat import request_keys
from pte_instrument.wire import EngineHello, RequestTotals
from tests.cost.test_architecture import FIX
from tests.helpers import wait
from tests.server.builders import finished_request


class Probe:
    """An exporter that notes which thread delivered each record."""

    def __init__(self) -> None:
        self.records: list[tuple[RequestRecord, str]] = []

    def export(self, record: RequestRecord) -> None:
        self.records.append((record, threading.current_thread().name))


class ProbedRuntime(Runtime):
    def __init__(self, settings: Settings) -> None:
        self.registry = CollectorRegistry()
        super().__init__(settings, self.registry)
        self.probe = Probe()

    def exporters_for(self, model, engine, cost_model):
        return [*super().exporters_for(model, engine, cost_model), ("probe", self.probe)]


def served(architecture: dict | None = None, engines: tuple[int, ...] = (0,)) -> ServedModel:
    return ServedModel(
        name="m",
        engines=engines,
        architecture=architecture if architecture is not None else load_config(FIX / "dense_mha.json"),
        kv_cache_dtype="auto",
        kv_block_size=16,
        gpus_per_engine=2,
        lora=False,
        api_server=0,
        transport=None,
    )


def finished(rid: str, output: int = 3, engine: int = 0) -> FinishedRequest:
    """Finished just now, by the wall clock the runtime reads."""
    return finished_request(rid, output, arrived=time.time() - 1, engine=engine)


@pytest.fixture
def runtime(tmp_path):
    rt = ProbedRuntime(Settings(session_store=None, request_log=str(tmp_path / "r.jsonl")))
    yield rt
    rt.sessions.close()


def test_requests_are_priced_on_the_pricer_thread_not_the_callers(runtime, tmp_path):
    server = ApiServer(runtime)
    server.configure(served(), request_keys)
    assert server.active
    server.finished([finished("cmpl-a-0"), finished("cmpl-b-0", output=5)])
    assert wait(lambda: len(runtime.probe.records) == 2, timeout_s=5)
    threads = {name for _, name in runtime.probe.records}
    assert threads == {"pte-pricer"}
    assert sorted(r.output_tokens for r, _ in runtime.probe.records) == [3, 5]
    # every exporter got them, the request log as well
    lines = {x["request_id"]: x for x in map(json.loads, (tmp_path / "r.jsonl").read_text().splitlines())}
    assert {r.request_id: r.pte_served for r, _ in runtime.probe.records} == {
        rid: x["pte_served"] for rid, x in lines.items()
    }


def test_late_engine_totals_wake_the_pricer(runtime, monkeypatch):
    """Totals that arrive after their request finished wake the pricer thread: its periodic
    tick is an hour here, so nothing else could price the request."""
    monkeypatch.setattr(api_server, "TICK_S", 3600.0)
    server = ApiServer(runtime)
    server.configure(served(), request_keys)
    runtime.inbox.on_messages([EngineHello(0)])
    server.finished([finished("chatcmpl-late", output=2)])
    time.sleep(0.2)
    assert runtime.probe.records == []  # waits for the engine's totals
    totals = RequestTotals(
        "chatcmpl-late-0123abcd",
        "chatcmpl-late",
        0,
        "stop",
        prompt_tokens=10,
        output_tokens=2,
        scheduled=True,
    )
    runtime.inbox.on_messages([totals])
    assert wait(lambda: runtime.probe.records, timeout_s=10)
    record = runtime.probe.records[0][0]
    assert record.request_id == "chatcmpl-late" and record.engine_pte_served is not None


def test_a_tick_prices_what_waited_past_its_deadline_without_totals(runtime):
    server = ApiServer(runtime, threaded=False)  # this test ticks by hand
    runtime.inbox.on_messages([EngineHello(0)])
    server.configure(served(), request_keys)
    server.finished([finished("cmpl-x-0")])
    server.tick(time.monotonic())
    assert runtime.probe.records == []
    server.tick(time.monotonic() + 10)
    [(record, _)] = runtime.probe.records
    assert record.request_id == "cmpl-x-0" and runtime.faults.counts["engine_join"] == 1


def test_an_unknown_architecture_leaves_the_server_inactive_with_one_setup_fault(runtime):
    server = ApiServer(runtime)
    server.configure(served({"model_type": "nothing-known"}), request_keys)
    assert not server.active and runtime.faults.counts["setup"] == 1
    assert runtime.receiver is None and runtime.joins == []


def test_disabled_configures_nothing(tmp_path):
    rt = ProbedRuntime(Settings(session_store=None, enabled=False))
    try:
        server = ApiServer(rt)
        server.configure(served(), request_keys)
        assert not server.active and rt.faults.counts == {}
    finally:
        rt.sessions.close()


def test_requests_of_an_unknown_model_or_engine_are_faults_not_records(runtime):
    server = ApiServer(runtime, threaded=False)
    server.configure(served(engines=(0,)), request_keys)
    server.finished([replace(finished("cmpl-o-0"), model="other")])
    assert runtime.faults.counts["adapter"] == 1
    server.finished([finished("cmpl-e-0", engine=7)])
    server.tick(time.monotonic())
    assert runtime.probe.records == [] and runtime.faults.counts["adapter"] == 2


def test_the_engine_time_gauges_follow_the_priced_requests_totals(runtime):
    server = ApiServer(runtime, threaded=False)
    server.configure(served(), request_keys)
    runtime.inbox.on_messages([EngineHello(0)])
    totals = RequestTotals(
        "cmpl-t-0-0123abcd",
        "cmpl-t-0",
        0,
        "stop",
        prompt_tokens=10,
        output_tokens=3,
        scheduled=True,
        engine_busy_s=4.5,
    )
    runtime.inbox.on_messages([totals])
    server.finished([finished("cmpl-t-0")])
    server.tick(time.monotonic())
    [(record, _)] = runtime.probe.records
    labels = {"model_name": "m", "engine": "0"}
    assert runtime.registry.get_sample_value("pte_engine_busy_seconds", labels) == 4.5
    unattributed = runtime.registry.get_sample_value("pte_gpu_seconds_unattributed", labels)
    assert unattributed == pytest.approx(4.5 - record.gpu_seconds)


def session_turn(
    runtime: ProbedRuntime, rid: str, prompt: int, arrived: float, session: str = "s"
) -> FinishedRequest:
    """Turn ``rid`` of ``session``, tagged as the middleware tags it: ``prompt`` tokens, none
    cached, 3 output tokens, from ``arrived`` to half a second later."""
    runtime.pending.put(rid, RequestTag(session, "none"))
    return replace(finished_request(rid, 3, arrived=arrived), prompt_tokens=prompt, finished_at=arrived + 0.5)


@pytest.fixture
def two_api_servers(tmp_path):
    """Two API servers' runtimes on one session store, each ticked by hand, A's engine hooked."""
    store = str(tmp_path / "sessions.sqlite3")
    runtimes = [ProbedRuntime(Settings(session_store=store)) for _ in range(2)]
    servers = [ApiServer(rt, threaded=False) for rt in runtimes]
    for server in servers:
        server.configure(served(), request_keys)
    runtimes[0].inbox.on_messages([EngineHello(0)])  # A waits for its engine's totals
    yield runtimes, servers
    for rt in runtimes:
        rt.sessions.close()


def turn_1_on_a_then_turn_2_on_b(two_api_servers) -> None:
    """Turn 1 of session "s" finishes on A (whose writer then says where it stands); turn 2
    arrives after it, and finishes on B."""
    (a, b), (server_a, server_b) = two_api_servers
    server_a.finished([session_turn(a, "cmpl-t1", 100, arrived=time.time() - 1)])
    assert a.sessions.flush()
    time.sleep(0.01)
    server_b.finished([session_turn(b, "cmpl-t2", 160, arrived=time.time())])


def test_a_turn_waits_for_the_turn_before_it_that_another_api_server_has_not_priced(two_api_servers):
    """Turn 1 finished on API server A, whose engine totals are late; turn 2, sent after turn 1's
    answer, finished on B. B prices turn 2 once turn 1 is in the store: turn 2 is the session's
    turn 2, its pause and reusable prefix from turn 1, and the rows are in that order."""
    (a, b), (server_a, server_b) = two_api_servers
    turn_1_on_a_then_turn_2_on_b(two_api_servers)
    server_a.tick()
    server_b.tick()
    assert a.probe.records == [] and b.probe.records == []  # turn 1 waits for totals, turn 2 for turn 1

    totals = RequestTotals(
        "cmpl-t1-0123abcd",
        "cmpl-t1",
        0,
        "stop",
        scheduled=True,
        prompt_tokens=100,
        output_tokens=3,
        prefill=100,
    )
    a.inbox.on_messages([totals])
    server_a.tick()
    [(first, _)] = a.probe.records
    assert a.sessions.flush()
    assert wait(lambda: (server_b.tick(), b.probe.records)[1], timeout_s=2)  # A's next beat lets it go
    [(second, _)] = b.probe.records
    assert (first.turn, second.turn) == (1, 2)
    assert second.pause_s == pytest.approx(second.arrived_at - first.finished_at)
    assert second.pte_eviction_tax == 96  # turn 1 computed 100 + 2 → 96 in whole blocks, none cached
    rows = b.sessions.get("s")["turn_rows"]
    assert [r["request_id"] for r in rows] == ["cmpl-t1", "cmpl-t2"] and [r["turn"] for r in rows] == [1, 2]
    assert a.faults.counts == {} and b.faults.counts == {}


def test_a_turn_waits_for_the_turn_before_it_on_the_same_api_server(runtime):
    """Turn 1's engine totals are late, turn 2's are not: turn 2 is priced after turn 1, as
    turn 2, in the same pass."""
    server = ApiServer(runtime, threaded=False)
    server.configure(served(), request_keys)
    runtime.inbox.on_messages([EngineHello(0)])
    server.finished([session_turn(runtime, "cmpl-t1", 100, arrived=time.time() - 1)])
    time.sleep(0.01)
    t2 = session_turn(runtime, "cmpl-t2", 160, arrived=time.time())
    runtime.inbox.on_messages([RequestTotals("cmpl-t2-0123abcd", "cmpl-t2", 0, "stop", scheduled=True)])
    server.finished([t2])
    server.tick()
    assert runtime.probe.records == []
    runtime.inbox.on_messages([RequestTotals("cmpl-t1-0123abcd", "cmpl-t1", 0, "stop", scheduled=True)])
    server.tick()
    assert [(r.request_id, r.turn) for r, _ in runtime.probe.records] == [("cmpl-t1", 1), ("cmpl-t2", 2)]


def test_the_turn_after_a_parallel_sampling_turn_is_not_held_once_its_samples_are_priced(runtime):
    """Turn 1 asked for two samples (n = 2): vLLM reports each finished under the parent's id,
    the engine sends each one's totals, and each is priced as a record of its own. Once both
    are, nothing of turn 1 is on its way, and the session's next turn is priced in the next
    pass (the samples were the session's turns 1 and 2: it is turn 3)."""
    server = ApiServer(runtime, threaded=False)
    server.configure(served(), request_keys)
    runtime.inbox.on_messages([EngineHello(0)])
    turn_1 = session_turn(runtime, "cmpl-p", 100, arrived=time.time() - 1)
    runtime.inbox.on_messages(
        [
            RequestTotals(f"{i}_cmpl-p-0123abcd", "cmpl-p", 0, "stop", child_index=i, output_tokens=3 + i)
            for i in (0, 1)
        ]
    )
    server.finished([turn_1, replace(turn_1, output_tokens=4)])  # sample 0 (3 tokens), sample 1 (4)
    server.tick()
    assert [(r.request_id, r.turn) for r, _ in runtime.probe.records] == [("0_cmpl-p", 1), ("1_cmpl-p", 2)]
    assert runtime.sessions.flush() and len(runtime.sessions.unlanded) == 0
    time.sleep(0.01)
    runtime.inbox.on_messages([RequestTotals("cmpl-t2-0123abcd", "cmpl-t2", 0, "stop", scheduled=True)])
    server.finished([session_turn(runtime, "cmpl-t2", 160, arrived=time.time())])
    server.tick()
    assert [(r.request_id, r.turn) for r, _ in runtime.probe.records[2:]] == [("cmpl-t2", 3)]
    assert runtime.faults.counts == {}


def test_a_turn_does_not_wait_for_another_sessions_turn_on_the_same_api_server(runtime):
    server = ApiServer(runtime, threaded=False)
    server.configure(served(), request_keys)
    runtime.inbox.on_messages([EngineHello(0)])
    server.finished([session_turn(runtime, "cmpl-x1", 100, arrived=time.time() - 1, session="x")])
    time.sleep(0.01)
    runtime.inbox.on_messages([RequestTotals("cmpl-y1-0123abcd", "cmpl-y1", 0, "stop", scheduled=True)])
    server.finished([session_turn(runtime, "cmpl-y1", 100, arrived=time.time(), session="y")])
    server.tick()
    assert [(r.request_id, r.turn) for r, _ in runtime.probe.records] == [("cmpl-y1", 1)]


def test_a_turn_waits_for_another_api_server_only_so_long_and_the_wait_is_a_fault(two_api_servers):
    """A's turn 1 never comes (its engine totals lost, A's pricing stalled): B prices turn 2
    after ``TURN_ORDER_WAIT_S``, as the store holds the session, and counts a fault."""
    (_, b), (_, server_b) = two_api_servers
    turn_1_on_a_then_turn_2_on_b(two_api_servers)
    start = time.monotonic()
    server_b.tick(start)
    server_b.tick(start + TURN_ORDER_WAIT_S - 0.1)
    assert b.probe.records == [] and b.faults.counts == {}
    server_b.tick(start + TURN_ORDER_WAIT_S + 0.1)
    [(record, _)] = b.probe.records
    assert record.turn == 1 and b.faults.counts == {"sessions": 1}


def test_at_exit_a_turn_held_for_the_turns_before_it_is_priced_not_dropped(two_api_servers):
    """The process exits while B holds turn 2 for A's turn 1: the last tick prices it as the
    store holds the session (a fault says so) rather than dropping it."""
    (_, b), (_, server_b) = two_api_servers
    turn_1_on_a_then_turn_2_on_b(two_api_servers)
    server_b.tick()
    assert b.probe.records == []
    server_b.tick(final=True)
    [(record, _)] = b.probe.records
    assert record.request_id == "cmpl-t2" and b.faults.counts == {"sessions": 1}


def test_a_label_sent_as_the_answer_arrives_waits_for_its_request_to_be_priced(runtime):
    """A harness that scores an answer at once posts its label while the request still waits
    for its engine's totals (here 0.3 s): the label waits for the request to be priced and
    lands, instead of a 404 for a request that finished. An id no request had is a 404 at
    once when nothing is waiting."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    server = ApiServer(runtime)
    runtime.inbox.on_messages([EngineHello(0)])  # a hook: the join waits for its totals
    server.configure(served(), request_keys)
    app = FastAPI()
    app.include_router(server.router())
    client = TestClient(app)
    server.finished([finished("cmpl-race-0", output=2)])
    totals = RequestTotals(
        "cmpl-race-0-0123abcd", "cmpl-race-0", 0, "stop", prompt_tokens=10, output_tokens=2, scheduled=True
    )
    threading.Timer(0.3, runtime.inbox.on_messages, args=([totals],)).start()
    t0 = time.monotonic()
    r = client.post("/pte/feedback", json={"request_id": "cmpl-race", "correct": True})
    assert r.status_code == 200, r.text
    assert r.json()["requests"] == 1 and r.json()["output_tokens"] == 2
    assert 0.25 < time.monotonic() - t0 < 5
    record = runtime.probe.records[0][0]
    assert record.request_id == "cmpl-race-0" and record.engine_pte_served is not None
    t0 = time.monotonic()
    r = client.post("/pte/feedback", json={"request_id": "cmpl-never", "correct": True})
    assert r.status_code == 404 and time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("by", ["request", "session"])
def test_a_label_sent_to_another_api_server_than_its_request_waits_for_it_to_be_stored(tmp_path, by):
    """Several API servers share the host's store, and a harness's label may reach another one
    than its answer came from: posted the moment the answer arrived, while API server A's
    request still waits for its engine's totals (0.3 s), the label sent to B waits for A to
    price and store it, then lands (not a 404 for a request that finished). An id no request
    had is a 404 at once."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    store = str(tmp_path / "sessions.sqlite3")
    a, b = (ProbedRuntime(Settings(session_store=store)) for _ in range(2))
    servers = [ApiServer(rt) for rt in (a, b)]
    try:
        for server in servers:
            server.configure(served(), request_keys)
        a.inbox.on_messages([EngineHello(0)])  # A's request waits for its engine's totals
        app = FastAPI()
        app.include_router(servers[1].router())
        client = TestClient(app)
        assert wait(lambda: a.sessions.others_caught_up_to() < math.inf, timeout_s=5)  # each hears the other
        assert wait(lambda: b.sessions.others_caught_up_to() < math.inf, timeout_s=5)
        a.pending.put("cmpl-race-0", RequestTag("s", "none"))
        servers[0].finished([finished("cmpl-race-0", output=2)])
        totals = RequestTotals(
            "cmpl-race-0-0123abcd",
            "cmpl-race-0",
            0,
            "stop",
            prompt_tokens=10,
            output_tokens=2,
            scheduled=True,
        )
        threading.Timer(0.3, a.inbox.on_messages, args=([totals],)).start()
        t0 = time.monotonic()
        target = {"request_id": "cmpl-race"} if by == "request" else {"session_id": "s"}
        r = client.post("/pte/feedback", json={**target, "correct": True})
        assert r.status_code == 200, r.text
        assert r.json()["requests"] == 1 and r.json()["output_tokens"] == 2
        assert 0.25 < time.monotonic() - t0 < 5
        t0 = time.monotonic()
        r = client.post("/pte/feedback", json={"request_id": "cmpl-never", "correct": True})
        assert r.status_code == 404 and time.monotonic() - t0 < 1.0
    finally:
        for rt in (a, b):
            rt.sessions.close()


def test_labels_waiting_for_another_api_server_read_the_shared_store_a_bounded_number_of_times(
    tmp_path, monkeypatch
):
    """40 labels for ids no request had, posted at once while another API server's request
    is on its way to the store (0.5 s): each is a 404 once that request is stored, and the
    other API servers' watermark is read from the store about once per 50 ms for all of them,
    not once per label per poll."""
    import asyncio

    import httpx
    from fastapi import FastAPI

    from pte_instrument.server.records import price_request

    store = str(tmp_path / "sessions.sqlite3")
    a, b = (ProbedRuntime(Settings(session_store=store)) for _ in range(2))
    try:
        servers = [ApiServer(rt) for rt in (a, b)]
        for server in servers:
            server.configure(served(), request_keys)
        assert wait(lambda: b.sessions.others_caught_up_to() < math.inf, timeout_s=5)
        reads = []
        read = b.sessions.others_caught_up_to
        monkeypatch.setattr(b.sessions, "others_caught_up_to", lambda **kw: (reads.append(1), read(**kw))[1])
        app = FastAPI()
        app.include_router(servers[1].router())
        a.sessions.told_finished("cmpl-on-a", None)
        request = finished("cmpl-on-a")
        record = price_request(a.cost_models[("m", 0)], request, request.finished_at)
        threading.Timer(0.5, a.sessions.add, args=(record,)).start()

        async def labels() -> list[int]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://b") as client:
                answers = await asyncio.gather(
                    *(
                        client.post("/pte/feedback", json={"request_id": f"cmpl-never-{i}", "correct": True})
                        for i in range(40)
                    )
                )
            return [r.status_code for r in answers]

        t0 = time.monotonic()
        assert asyncio.run(labels()) == [404] * 40
        took = time.monotonic() - t0
        assert 0.4 < took < 5, took
        assert len(reads) <= took / 0.05 + 5, (len(reads), took)
    finally:
        for rt in (a, b):
            rt.sessions.close()
