"""The join of engine totals to finished requests, driven by hand: every request priced
once, on time, under a unique id, whatever order the two sides arrive in."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from pte_instrument.cost.architecture import KVGroup, ModelShape
from pte_instrument.cost.devices import DeviceProfile
from pte_instrument.cost.model import CostModel
from pte_instrument.faults import FaultTracker
from pte_instrument.server.engine_join import (
    ABORT_GRACE_S,
    ENGINE_JOIN_MAX_WAIT_S,
    ENGINE_JOIN_TIMEOUT_S,
    ORPHAN_AFTER_S,
    TICK_S,
    EngineInbox,
    RequestJoin,
)
from pte_instrument.server.exporters.prometheus import PrometheusExporter, metrics_for
from pte_instrument.server.exporters.request_log import RequestLogWriter
from pte_instrument.server.pricer import RequestPricer
from pte_instrument.server.records import FinishedRequest, price_request
from pte_instrument.server.sessions import SessionLedger
from pte_instrument.vllm_adapter.compat import request_keys
from pte_instrument.wire import EngineFaults, EngineHello, RequestTotals
from tests.server.builders import finished_request

SHAPE = ModelShape("unit", 1, 8, 1, 1, 8, "mha", 2, (KVGroup(1, 2.0, None),), 100.0, 100.0)
COST = CostModel(SHAPE, DeviceProfile("unit", 1.0, 1.0, "test"))  # γ = 0.01


class SaidFaults(FaultTracker):
    """A fault tracker that keeps what each fault said."""

    def __init__(self) -> None:
        super().__init__()
        self.said: list[str] = []

    def record(self, stage: str, exc: BaseException, *, logged: bool = False) -> None:
        self.said.append(f"{stage}: {exc}")
        super().record(stage, exc, logged=logged)


def make_join(hook: bool = True) -> tuple[EngineInbox, RequestJoin, list[FinishedRequest], SaidFaults]:
    faults = SaidFaults()
    inbox = EngineInbox(faults, lambda stage, n: None)
    if hook:
        inbox.on_messages([EngineHello(0)])
    priced: list[FinishedRequest] = []
    join = RequestJoin(inbox, "m", request_keys, lambda r: r, faults)
    return inbox, join, priced, faults


def totals(external: str, output: int, child: int | None = None, reason: str = "stop", **kw) -> RequestTotals:
    engine_id = f"{external}-0123abcd" if child is None else f"{child}_{external}-0123abcd"
    return RequestTotals(
        engine_id,
        external,
        0,
        reason,
        child_index=child,
        prompt_tokens=10,
        output_tokens=output,
        scheduled=True,
        **kw,
    )


def test_parallel_sampling_children_are_priced_once_each_under_unique_ids():
    inbox, join, priced, faults = make_join()
    inbox.on_messages([totals("cmpl-x-0", 3, child=0), totals("cmpl-x-0", 5, child=1)])
    now = time.monotonic()
    join.finished(finished_request("cmpl-x-0", 5), now)  # vLLM reports both under the parent's id
    join.finished(finished_request("cmpl-x-0", 3), now)
    priced.extend(join.ready(now))
    assert sorted((r.request_id, r.child_index, r.output_tokens) for r in priced) == [
        ("0_cmpl-x-0", 0, 3),
        ("1_cmpl-x-0", 1, 5),
    ]
    assert all(r.engine_totals.output_tokens == r.output_tokens for r in priced)
    assert len(join) == 0  # none waits
    priced.extend(join.ready(now + 10))  # nothing left over to price as an orphan
    assert len(priced) == 2 and len(inbox) == 0 and faults.counts["engine_join"] == 0


def test_a_reused_request_id_joins_both_requests():
    inbox, join, priced, faults = make_join()
    inbox.on_messages([totals("chatcmpl-same", 4), totals("chatcmpl-same", 4)])
    now = time.monotonic()
    join.finished(finished_request("chatcmpl-same", 4), now)
    join.finished(finished_request("chatcmpl-same", 4), now)
    priced.extend(join.ready(now))
    assert len(priced) == 2 and all(r.engine_totals is not None for r in priced)
    assert len({r.engine_totals.request_id for r in priced}) == 1  # same engine id here: built alike
    assert faults.counts["engine_join"] == 0


def test_an_abort_is_priced_from_its_totals_at_once_and_never_twice():
    inbox, join, priced, _ = make_join()
    inbox.on_messages([totals("chatcmpl-a", 2, reason="abort", arrival_time=50.0, finished_at=50.7)])
    now = time.monotonic()
    priced.extend(join.ready(now))  # within the grace: vLLM could still report it
    assert priced == []
    priced.extend(join.ready(now + ABORT_GRACE_S + 0.01))
    [r] = priced
    assert (r.request_id, r.finish_reason, r.arrived_at, r.finished_at) == ("chatcmpl-a", "abort", 50.0, 50.7)
    assert r.e2e_s == pytest.approx(0.7)
    join.finished(finished_request("chatcmpl-a", 2, reason="abort"), now + 1)  # vLLM reports it after all
    priced.extend(join.ready(now + 1))
    assert len(priced) == 1


def test_a_request_aborted_while_queued_costs_nothing():
    inbox, join, priced, _ = make_join()
    never = RequestTotals("chatcmpl-q-0123abcd", "chatcmpl-q", 0, "abort", prompt_tokens=600, scheduled=False)
    inbox.on_messages([never])
    priced.extend(join.ready(time.monotonic() + 1))
    record = price_request(COST, priced[0], 0.0)
    assert (record.prompt_tokens, record.computed_prefill_tokens) == (600, 0)
    assert record.pte_served == record.pte_reference == record.pte_ideal == 0


def test_wasted_work_is_counted_beside_served():
    # aborted after 3 outputs: the engine also ran a 4th position (reads 13) the client never
    # got, and two drafts it rejected (0.25 PTE)
    served = 10 + 0.01 * (10 + 11 + 12)
    t = totals("chatcmpl-w", 3, reason="abort", pte_served=served + 0.13 + 0.25, pte_rejected=0.25)
    record = price_request(COST, FinishedRequest("chatcmpl-w", "m", 10, 0, 3, "abort", engine_totals=t), 0.0)
    assert record.pte_served == pytest.approx(served)  # unchanged
    assert record.pte_wasted_aborted == pytest.approx(0.13)
    assert record.pte_wasted_rejected_drafts == pytest.approx(0.25)
    done = FinishedRequest(
        "chatcmpl-d", "m", 10, 0, 3, "stop", engine_totals=totals("d", 3, pte_rejected=0.25)
    )
    assert price_request(COST, done, 0.0).pte_wasted_aborted == 0  # only an abort throws its last step away


def test_work_past_the_end_the_client_received_is_counted_beside_served():
    # a stop string the API server saw after output 3: the engine had already run a 4th
    # position (reads 13) before the abort reached it, and drafts past max_tokens alike
    served = 10 + 0.01 * (10 + 11 + 12)
    t = totals("chatcmpl-s", 3, reason="abort", pte_served=served + 0.13 + 0.25, pte_rejected=0.25)
    record = price_request(COST, FinishedRequest("chatcmpl-s", "m", 10, 0, 3, "stop", engine_totals=t), 0.0)
    assert record.pte_served == pytest.approx(served)  # unchanged
    assert record.pte_wasted_past_end == pytest.approx(0.13)
    assert (record.pte_wasted_aborted, record.pte_wasted_rejected_drafts) == (0, pytest.approx(0.25))
    # the engine's step sums round apart from the closed form: no waste of the order of rounding
    exact = totals("chatcmpl-e", 3, pte_served=served * (1 + 1e-13))
    record = price_request(
        COST, FinishedRequest("chatcmpl-e", "m", 10, 0, 3, "length", engine_totals=exact), 0.0
    )
    assert record.pte_wasted_past_end == 0
    # an abort's step in flight stays the abort's
    aborted = FinishedRequest("chatcmpl-a", "m", 10, 0, 3, "abort", engine_totals=t)
    assert price_request(COST, aborted, 0.0).pte_wasted_past_end == 0


def test_requests_ready_together_are_priced_in_arrival_order():
    _, join, priced, _ = make_join(hook=False)
    now = time.monotonic()
    for rid, arrived in (("c", 3.0), ("a", 1.0), ("b", 2.0)):
        join.finished(finished_request(rid, 1, arrived=arrived), now)
    priced.extend(join.ready(now))
    assert [r.request_id for r in priced] == ["a", "b", "c"]


def test_an_engine_whose_hook_never_reached_this_api_server_is_a_fault_after_the_least_wait():
    """Engine 0's hook said hello, engine 1's never did (a node whose transport cannot reach
    this process): engine 1's requests wait the least wait for it, then are priced without
    totals, each counted, in a line that says how to reach this process."""
    _, join, priced, faults = make_join(hook=True)
    join.finished(finished_request("cmpl-far-0", output=3, engine=1), now=0.0)
    priced.extend(join.ready(now=ENGINE_JOIN_TIMEOUT_S - 0.01))
    assert priced == [] and faults.counts["engine_join"] == 0
    priced.extend(join.ready(now=ENGINE_JOIN_TIMEOUT_S + 0.01))
    assert [r.request_id for r in priced] == ["cmpl-far-0"] and priced[0].engine_totals is None
    assert faults.counts["engine_join"] == 1 and "PTE_ENGINE_TRANSPORT=tcp" in faults.said[-1]


def test_a_request_of_an_engine_whose_hello_is_still_on_its_way_joins_its_totals():
    """An engine on another node connects to this API server when it can (its transport
    retries): its first requests can finish before its hook's hello arrives. They wait for
    it, and are priced with their exact totals, no fault."""
    inbox, join, priced, faults = make_join(hook=True)
    join.finished(finished_request("cmpl-early-0", output=3, engine=1), now=0.0)
    priced.extend(join.ready(now=0.1))
    assert priced == []
    inbox.on_messages([EngineHello(1), msgspec.structs.replace(totals("cmpl-early-0", 3), engine=1)])
    priced.extend(join.ready(now=0.2))
    assert [r.request_id for r in priced] == ["cmpl-early-0"] and priced[0].engine_totals is not None
    assert faults.counts["engine_join"] == 0


def mid_prefill(prompt: int, prefill: float, cached: int = 0, recompute: float = 0.0) -> RequestTotals:
    """Totals of a request aborted before its first token: the engine prefilled ``prefill``
    positions (``recompute`` of them a second time) above a ``cached`` prefix."""
    return RequestTotals(
        "chatcmpl-p-0123abcd",
        "chatcmpl-p",
        0,
        "abort",
        prompt_tokens=prompt,
        scheduled=True,
        cached_tokens=cached,
        prefill=prefill,
        recompute=recompute,
        pte_served=prefill,
        ctx=(0.0,),
    )


def test_a_request_aborted_mid_prefill_is_charged_the_prefill_that_ran(tmp_path):
    # a 1,000-token prompt aborted after 256 of it were prefilled (chunked prefill)
    inbox, join, priced, _ = make_join()
    inbox.on_messages([mid_prefill(1000, 256.0)])
    priced.extend(join.ready(time.monotonic() + 1))
    registry = CollectorRegistry()
    sessions = SessionLedger(tmp_path / "sessions.sqlite3")
    log = tmp_path / "requests.jsonl"
    pricer = RequestPricer(
        COST,
        [
            ("prometheus", PrometheusExporter("m", 0, metrics_for(registry))),
            ("request_log", RequestLogWriter(log)),
        ],
        FaultTracker(),
        sessions,
    )
    pricer.on_finished(replace(priced[0], session_id="s"))
    [entry] = [json.loads(line) for line in log.read_text().splitlines()]
    assert (entry["prompt_tokens"], entry["output_tokens"], entry["engine_prefill_tokens"]) == (1000, 0, 256)
    assert entry["computed_prefill_tokens"] == 256
    assert entry["pte_served"] == entry["pte_prefill"] == 256 and entry["pte_decode"] == 0
    assert entry["pte_reference"] == entry["pte_ideal"] == 256  # the same 256 tokens, without cache or reuse
    assert entry["pte_eviction_tax"] == entry["pte_recompute"] == entry["pte_wasted_aborted"] == 0
    # the counters and the session add what the log says
    labels = {"model_name": "m", "engine": "0", "tenant": "", "lora_name": ""}
    sample = registry.get_sample_value
    assert sample("pte_served_pte_total", {**labels, "phase": "prefill"}) == 256
    assert sample("pte_served_pte_total", {**labels, "phase": "decode"}) == 0
    assert sample("pte_reference_pte_total", {**labels, "phase": "prefill"}) == 256
    assert sample("pte_engine_estimate_gap_pte", {"model_name": "m", "engine": "0"}) == 0
    session = sessions.get("s")
    assert session is not None
    assert (session["pte_served"], session["pte_reference"], session["pte_ideal"]) == (256, 256, 256)
    sessions.close()


def test_a_mid_prefill_abort_is_priced_on_the_part_of_its_prompt_it_got_through():
    # 128 prompt tokens from the prefix cache, 256 prefilled, then preempted and 64 of those
    # recomputed before the abort: it got through 128 + 256 = 384 prompt tokens, of which the
    # session's previous turn had paid for 200
    t = mid_prefill(1000, 320.0, cached=128, recompute=64.0)
    req = FinishedRequest(
        "chatcmpl-p", "m", 1000, 128, 0, "abort", recomputed_tokens=64, reusable_tokens=200, engine_totals=t
    )
    r = price_request(COST, req, 0.0)
    assert (r.computed_prefill_tokens, r.recomputed_tokens) == (256, 64)
    assert r.pte_served == r.pte_prefill == 320 == r.engine_pte_served
    assert r.pte_recompute == 64 and r.pte_decode == 0
    assert r.pte_reference == r.pte_reference_prefill == 384
    assert r.pte_ideal == 384 - 200
    assert r.pte_eviction_tax == 320 - 64 - 184  # paid-for context prefilled again
    assert r.pte_wasted_aborted == 0


def test_a_hung_up_stream_the_engine_finished_keeps_its_session_tag_until_it_is_priced():
    """The client closed the stream; the engine finished the request (length), so vLLM's stat
    logger never reports it and it is priced from its totals once they are orphaned. Its tag
    was settled when the client hung up, just before: it must still be there then."""
    from pte_instrument.server.request_tags import PendingTags, RequestTag

    start = time.monotonic()
    clock = [start]
    pending = PendingTags(clock=lambda: clock[0])
    pending.put("cmpl-hangup", RequestTag("agent-7", "none"))
    pending.settle("cmpl-hangup")  # the HTTP exchange ended with the hang-up
    inbox, _, priced, faults = make_join()

    def tag(r: FinishedRequest) -> FinishedRequest:
        t = pending.claim(*request_keys(r.request_id))
        return replace(r, session_id=None if t is None else t.session_id)

    join = RequestJoin(inbox, "m", request_keys, tag, faults)
    inbox.on_messages([totals("cmpl-hangup", 16, reason="length")])
    late = (
        time.monotonic() + ORPHAN_AFTER_S + 2 * TICK_S
    )  # the timer's tick after the orphan wait, a little late
    clock[0] = late + 1.0  # and the transport a second slower still
    priced.extend(join.ready(late + 1.0))
    assert [(r.request_id, r.session_id) for r in priced] == [("cmpl-hangup", "agent-7")]
    assert pending.dropped == 0


def test_totals_that_arrive_after_the_join_gave_up_do_not_price_the_request_again():
    """A busy host held the engine's totals past the join's longest wait: the request is
    priced without them (a fault), and its late totals must not price it a second time."""
    inbox, join, priced, faults = make_join()
    join.finished(finished_request("cmpl-late-0", 4), now=0.0)
    join.finished(finished_request("chatcmpl-late", 4), now=0.0)
    priced.extend(join.ready(now=ENGINE_JOIN_MAX_WAIT_S - 0.01))
    assert priced == []  # the engine has sent nothing since: its totals are behind, not lost
    priced.extend(join.ready(now=ENGINE_JOIN_MAX_WAIT_S + 0.01))
    assert sorted(r.request_id for r in priced) == ["chatcmpl-late", "cmpl-late-0"]
    assert all(r.engine_totals is None for r in priced) and faults.counts["engine_join"] == 2
    inbox.on_messages([totals("cmpl-late-0", 4), totals("chatcmpl-late", 4)])  # at last
    priced.extend(join.ready(time.monotonic() + ORPHAN_AFTER_S + 1))
    assert len(priced) == 2 and len(inbox) == 0
    # a request reusing the id later is still joined with its own totals
    inbox.on_messages([totals("chatcmpl-late", 2)])
    join.finished(finished_request("chatcmpl-late", 2), now=100.0)
    priced.extend(join.ready(now=100.0))
    assert len(priced) == 3 and priced[-1].engine_totals is not None


# A request seen finished at unix time SEEN; its engine frees requests on the same clock.
SEEN = 1_000.0


def test_totals_later_than_the_least_wait_still_join_while_their_engine_sends_nothing_newer():
    """A busy host delays the engine's totals by seconds: the request keeps waiting, since
    its engine has sent no totals of a request freed after it."""
    inbox, join, priced, faults = make_join()
    join.finished(finished_request("cmpl-slow-0", 4), now=0.0, seen_at=SEEN)
    inbox.on_messages([totals("cmpl-before-0", 2, finished_at=SEEN - 3.0)])  # an older request's
    priced.extend(join.ready(now=ENGINE_JOIN_TIMEOUT_S + 1.0))
    assert [r.request_id for r in priced] == []
    inbox.on_messages([totals("cmpl-slow-0", 4, finished_at=SEEN - 0.01)])  # 3 s after its finish
    priced.extend(join.ready(now=ENGINE_JOIN_TIMEOUT_S + 1.0))
    assert [r.request_id for r in priced] == ["cmpl-slow-0"]
    assert priced[0].engine_totals is not None and faults.counts["engine_join"] == 0


def test_once_its_engine_sent_totals_of_a_request_freed_later_a_request_waits_the_least_only():
    """The engine sends totals in the order it freed the requests: totals of one freed after
    this request was seen finished mean this one's were lost (a dropped batch)."""
    inbox, join, priced, faults = make_join()
    join.finished(finished_request("cmpl-lost-0", 4), now=0.0, seen_at=SEEN)
    inbox.on_messages([totals("cmpl-next-0", 2, finished_at=SEEN + 0.5)])
    priced.extend(join.ready(now=ENGINE_JOIN_TIMEOUT_S - 0.01))
    assert priced == []  # the least wait covers a request the engine still holds for a step
    priced.extend(join.ready(now=ENGINE_JOIN_TIMEOUT_S + 0.01))
    assert [(r.request_id, r.engine_totals) for r in priced] == [("cmpl-lost-0", None)]
    assert faults.counts["engine_join"] == 1
    assert "has sent the totals of requests it freed after" in faults.said[-1]


def test_after_its_engine_reported_a_fault_a_request_waits_the_least_only():
    """The engine's latest word is a fault (a batch it could not send, a hook switched off):
    its totals may be lost, and no request is held longer than it was before."""
    inbox, join, priced, faults = make_join()
    join.finished(finished_request("cmpl-f-0", 4), now=0.0, seen_at=SEEN)
    inbox.on_messages([EngineFaults(0, {"engine_transport": 1})])
    priced.extend(join.ready(now=ENGINE_JOIN_TIMEOUT_S + 0.01))
    assert [(r.request_id, r.engine_totals) for r in priced] == [("cmpl-f-0", None)]
    assert faults.counts["engine_join"] == 1 and "reported a fault" in faults.said[-1]
    # totals flowing again: the next late request waits for its own
    inbox.on_messages([totals("cmpl-older-0", 2, finished_at=SEEN - 1.0)])
    join.finished(finished_request("cmpl-g-0", 4), now=10.0, seen_at=SEEN + 10)
    priced.extend(join.ready(now=10.0 + ENGINE_JOIN_TIMEOUT_S + 0.01))
    assert len(priced) == 1
    priced.extend(join.ready(now=10.0 + ENGINE_JOIN_MAX_WAIT_S + 0.01))
    assert [r.request_id for r in priced][1:] == ["cmpl-g-0"] and faults.counts["engine_join"] == 2


class CountingInbox(EngineInbox):
    """An inbox that counts the join's lookups of totals."""

    def __init__(self) -> None:
        super().__init__(FaultTracker(), lambda stage, n: None)
        self.takes = 0

    def take(self, keys: tuple[str, ...], output_tokens: int, finish_reason: str) -> RequestTotals | None:
        self.takes += 1
        return super().take(keys, output_tokens, finish_reason)


def test_a_tick_looks_up_only_the_requests_whose_totals_arrived():
    """A lagging engine leaves seconds of requests waiting: a tick must not look each one up
    again (at 1,000 requests a second that took half a core), only those new, and those whose
    totals came since the last tick."""
    inbox = CountingInbox()
    inbox.on_messages([EngineHello(0)])
    join = RequestJoin(inbox, "m", request_keys, lambda r: r, inbox.faults)
    for i in range(1000):
        join.finished(finished_request(f"chatcmpl-{i}", 4), now=0.0, seen_at=SEEN)
    assert join.ready(now=0.0) == [] and inbox.takes == 1000  # each new request: once
    for k in range(1, 50):  # ticks with nothing new: no lookup
        assert join.ready(now=0.02 * k) == []
    assert inbox.takes == 1000 and len(join) == 1000
    inbox.on_messages([totals("chatcmpl-7", 4, finished_at=SEEN - 0.1)])
    [joined] = join.ready(now=1.0)
    assert joined.request_id == "chatcmpl-7" and joined.engine_totals is not None
    assert inbox.takes <= 1002 and len(join) == 999
    # the rest are given up together at the longest wait, without a lookup each
    assert len(join.ready(now=ENGINE_JOIN_MAX_WAIT_S + 0.01)) == 999
    assert inbox.takes <= 1002 and len(join) == 0 and inbox.faults.counts["engine_join"] == 999
