"""What the API server keeps of the engine hooks' messages stays bounded, in count and in
bytes per entry, whatever an engine (a confused one, or anyone who reaches the transport)
sends: engine indices, fault stage names, ids and context columns of any size, totals by
the million."""

from __future__ import annotations

import time

from pte_instrument.faults import FaultTracker
from pte_instrument.server.engine_join import (
    HOOK_STAGES,
    MAX_ENGINE_ID_LEN,
    MAX_ENGINE_RESULTS,
    MAX_ENGINE_STAGES,
    MAX_ENGINES,
    MAX_KV_GROUPS,
    MAX_PER_ID,
    OTHER_ENGINE_STAGE,
    EngineInbox,
    RequestJoin,
    orphan_request,
)
from pte_instrument.vllm_adapter.compat import request_keys
from pte_instrument.wire import EngineCalibration, EngineFaults, EngineHello, RequestTotals


def _inbox() -> tuple[EngineInbox, FaultTracker, list[tuple[str, int]]]:
    faults = FaultTracker()
    told: list[tuple[str, int]] = []
    return EngineInbox(faults, lambda stage, n: told.append((stage, n))), faults, told


def _totals(external: str, engine: int = 0, reason: str = "stop", **kw) -> RequestTotals:
    return RequestTotals(f"{external}-0123abcd", external, engine, reason, **kw)


def test_state_is_kept_for_at_most_max_engines_and_the_rest_refused_counted():
    inbox, faults, _ = _inbox()
    n = MAX_ENGINES + 1000
    inbox.on_messages([EngineHello(i) for i in range(n)])
    inbox.on_messages([EngineCalibration(i, 0.0, 0.0, 0.0, 0.0, "theory", 1.0) for i in range(n)])
    inbox.on_messages([EngineFaults(i, {}) for i in range(n)])
    inbox.on_messages([_totals(f"r{i}", engine=i, finished_at=1.0) for i in range(n)])
    per_engine = (
        inbox.hooks,
        inbox.calibration,
        inbox.freed_through,
        inbox.fault_said,
        inbox.live,
        inbox.cost,
    )
    assert all(len(d) <= MAX_ENGINES for d in per_engine)
    assert len(inbox) == MAX_ENGINES  # the totals of the engines past the bound are not held
    assert inbox.engines_refused == 4 * 1000
    assert faults.counts["engine_join"] > 0
    assert len(inbox.summary()["step_model"]) <= MAX_ENGINES


def test_fault_stages_an_engine_reports_are_bounded_in_number_and_length():
    inbox, faults, told = _inbox()
    inbox.on_messages([EngineFaults(0, {"engine_step": 2})])
    inbox.on_messages([EngineFaults(0, {f"engine_x{i}": 1}) for i in range(10_000)])
    inbox.on_messages([EngineFaults(0, {"engine_" + "y" * 2**20: 1, "not_an_engine_stage": 1})])
    stages = {stage for stage, _ in told}
    others = MAX_ENGINE_STAGES - 1 - len(HOOK_STAGES)  # names left once the hook's are kept
    assert len(stages) == 1 + others + 1  # engine_step, the first others, OTHER_ENGINE_STAGE
    assert set(faults.counts) == stages and all(len(stage) <= 64 for stage in stages)
    assert faults.counts["engine_step"] == 2  # a stage the hook reports keeps its name
    assert sum(faults.counts.values()) == 2 + 10_000 + 2  # every fault still counted
    assert faults.counts[OTHER_ENGINE_STAGE] == 10_000 + 2 - others


def test_totals_with_an_over_long_id_or_context_are_refused_counted_and_not_kept():
    inbox, faults, _ = _inbox()
    join = RequestJoin(inbox, "m", request_keys, lambda r: r, faults)
    long_id = "a" * 2**20
    inbox.on_messages(
        [
            _totals(long_id),
            RequestTotals("r1", long_id, 0, "abort"),
            RequestTotals(long_id, "r2", 0, "stop"),
            _totals("r3", reason="x" * 2**20),
            _totals("r4", ctx=(1.0,) * (MAX_KV_GROUPS + 1)),
            _totals("ok", ctx=(1.0,) * MAX_KV_GROUPS),
        ]
    )
    assert inbox.refused == 5 and inbox.dropped == 5
    assert inbox.arrived_since(0)[0] == ["ok"]  # nothing of the refused ones kept for the join
    priced = join.ready(time.monotonic() + 60)
    assert [r.request_id for r in priced] == ["ok"]
    assert faults.counts["engine_join"] > 0
    inbox.on_messages([_totals("x" * (MAX_ENGINE_ID_LEN - len("-0123abcd")))])  # at the bound: kept
    assert inbox.refused == 5


def test_totals_held_are_bounded_in_number_not_only_in_ids():
    inbox, _, _ = _inbox()
    ids = 2 * MAX_ENGINE_RESULTS // MAX_PER_ID
    batch = [_totals(f"r{i}") for i in range(ids) for _ in range(MAX_PER_ID)]
    inbox.on_messages(batch)
    assert len(inbox) <= MAX_ENGINE_RESULTS
    assert len(inbox) + inbox.dropped == len(batch)  # every totals dropped is counted
    # the newest are the ones kept: the oldest ids went first
    assert inbox.take(("r0",), 0, "stop") is None
    assert inbox.take((f"r{ids - 1}",), 0, "stop") is not None


def test_an_orphan_of_a_finish_reason_vllm_never_gives_is_priced_under_a_bounded_one():
    reasons = {orphan_request(_totals(f"r{i}", reason=f"odd{i}"), "m").finish_reason for i in range(1000)}
    assert reasons == {"other"}
    for reason in ("stop", "length", "abort", "error", "repetition"):
        assert orphan_request(_totals("r", reason=reason), "m").finish_reason == reason


def test_a_negative_or_huge_fault_count_from_an_engine_loses_nothing_else_of_its_batch():
    from prometheus_client import Counter as PromCounter

    faults = FaultTracker()
    counter = PromCounter(
        "faults", "engine faults", ["stage"], registry=None
    )  # refuses negatives, as the runtime's
    inbox = EngineInbox(faults, lambda stage, n: counter.labels(stage=stage).inc(n))
    inbox.on_messages(
        [EngineFaults(0, {"engine_step": -5, "engine_finish": 10**30}), _totals("after", engine=0)]
    )
    assert inbox.take(("after",), 0, "stop") is not None  # the totals behind the bad counts arrived
    assert inbox.arrived.is_set()
    assert faults.counts["engine_step"] == 0 and 0 < faults.counts["engine_finish"] <= 2**53


def test_the_hooks_own_fault_stages_keep_their_names_whatever_was_sent_first():
    inbox, faults, _ = _inbox()
    inbox.on_messages([EngineFaults(0, {f"engine_bogus{i}": 1 for i in range(100)})])
    inbox.on_messages([EngineFaults(0, dict.fromkeys(HOOK_STAGES, 1))])
    assert all(faults.counts[s] == 1 for s in HOOK_STAGES)
