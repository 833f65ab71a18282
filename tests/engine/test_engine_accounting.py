"""EngineAccounting driven by hand-made scheduler steps (the adapter's view of vLLM)."""

import importlib.util
import json
import os
import secrets

import msgspec
import numpy as np
import pytest

from pte_instrument.cost.architecture import KVGroup, ModelShape
from pte_instrument.cost.devices import DeviceProfile
from pte_instrument.cost.model import CostModel
from pte_instrument.engine.accounting import JOURNAL_STEPS, EngineAccounting
from pte_instrument.engine.kernels import reference as ref
from pte_instrument.wire import RequestTotals

# γ = 2 · 1 / (2 · 100) = 0.01; weights: n_total 100 · 2 B · HOI 1 / (2 · 100) = 1 PTE per step
SHAPE = ModelShape("unit", 1, 8, 1, 1, 8, "mha", 2, (KVGroup(1, 2.0, None),), 100.0, 100.0)
COST = CostModel(SHAPE, DeviceProfile("unit", 1.0, 1.0, "test"))


def flat(m: RequestTotals) -> dict:
    """A request's totals as one flat mapping (per-group contexts as ctx0, ctx1, …)."""
    d = msgspec.structs.asdict(m)
    d.update({f"ctx{g}": v for g, v in enumerate(d.pop("ctx"))})
    return d


def collect(into: list):
    return lambda messages: into.extend(map(flat, messages))


def run(tmp_path, steps, finish):
    sent = []
    ea = EngineAccounting(COST, collect(sent), step_log=str(tmp_path / "steps.jsonl"))
    for rows in steps:
        ea.on_schedule([r[0] for r in rows], [list(col) for col in zip(*(r[1:] for r in rows), strict=True)])
        ea.on_step_done()
    for rid, computed in finish:
        ea.on_finished(
            rid, "length", computed, {"prompt_tokens": 10, "output_tokens": 3, "num_preemptions": 0}
        )
    ea.flush()
    ea.close()
    lines = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    return {m["request_id"]: m for m in sent}, [x for x in lines if not x.get("header")], ea


def test_chunked_prefill_then_decode(tmp_path):
    # prompt 10 in chunks of 6 + 4, then 2 decode steps: outputs 0 (from the prompt), 1, 2
    steps = [[("a", 0, 6, 10, 0)], [("a", 6, 4, 10, 0)], [("a", 10, 1, 10, 0)], [("a", 11, 1, 10, 0)]]
    msgs, lines, ea = run(tmp_path, steps, [("a", 12)])
    m = msgs["a"]
    assert (m["prefill"], m["recompute"], m["decode_tokens"]) == (10, 0, 3)
    # contexts: first sample 10, position 10 reads 11, position 11 reads 12 → 33 = Σ_{j<3}(10+j)
    assert m["ctx0"] == 33 and m["pte_served"] == pytest.approx(10 + 0.01 * 33)
    assert sum(x["pte"] for x in lines) == pytest.approx(m["pte_served"])
    # every line is written once its outputs are back (dt_s is always a key: check its value)
    assert sum(x["prefill"] for x in lines) == 10 and all(x["dt_s"] is not None for x in lines)
    # roofline: prefill steps are compute-bound (6 and 4 tokens > 1 PTE of weights + KV);
    # the decode steps are memory-bound: 1 (weights) + 0.11 and 1 + 0.12
    assert m["pte_roofline"] == pytest.approx(6 + (4) + 1.11 + 1.12)
    assert ea.live == 0 and m["engine_live"] == 0


def test_preemption_counts_recompute_and_cache_hits_are_free(tmp_path):
    steps = [
        [("b", 4, 6, 10, 0)],  # 4 prefix-cache hits, prefill 6: samples output 0
        [("b", 10, 1, 10, 0)],  # decode: output 1
        [("b", 0, 12, 10, 0)],  # preempted, resumed: 11 recomputed, position 11 decodes output 2
    ]
    msgs, lines, _ = run(tmp_path, steps, [("b", 12)])
    m = msgs["b"]
    assert m["cached_tokens"] == 4
    assert (m["prefill"], m["recompute"], m["decode_tokens"]) == (6 + 11, 11, 3)
    assert m["pte_served"] == pytest.approx(17 + 0.01 * (10 + 11 + 12))
    assert sum(x["recompute"] for x in lines) == 11


def test_rejected_drafts_and_unscheduled_aborts(tmp_path):
    sent = []
    ea = EngineAccounting(COST, collect(sent))
    ea.on_schedule(["c"], [[0], [10], [10], [0]])
    ea.on_schedule(["c"], [[10], [3], [10], [2]])  # 1 + 2 drafts
    ea.accepted("c", 11)  # both drafts rejected: vLLM rolled back to 11
    ea.on_finished("c", "stop", 11, {"prompt_tokens": 10, "output_tokens": 2, "num_preemptions": 0})
    ea.on_finished("never", "abort", 0, {"prompt_tokens": 7, "output_tokens": 0, "num_preemptions": 0})
    ea.flush()
    c, never = sent
    assert (c["spec_tokens"], c["rejected_tokens"]) == (2, 2)
    assert never["external_id"] == "never" and never["pte_served"] == 0 and never["finish_reason"] == "abort"


# --- the step journal against a per-step oracle -------------------------------------------

# 1.373 PTE of weights per step, γ = 0.01 (and 0.005, window 16): a step is never exactly
# balanced between compute and memory (where float rounding could pick either side).
UNIT = DeviceProfile("unit", 1.0, 1.0, "test")
ONE_GROUP = (KVGroup(1, 2.0, None),)
TWO_GROUPS = (KVGroup(1, 2.0, None), KVGroup(1, 1.0, 16))
JOURNAL_COSTS = [CostModel(ModelShape("j", len(g), 8, 1, 1, 8, "mha", 2, g, 100.0, 137.3), UNIT)
                 for g in (ONE_GROUP, TWO_GROUPS)]  # fmt: skip
TIMINGS = ("t", "hook_s", "dt_s", "model_s")
NEEDS_TORCH = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")


@pytest.fixture
def seed() -> int:
    """A fresh seed per test (printed in failures), or PTE_TEST_SEED to replay one."""
    return int(os.environ.get("PTE_TEST_SEED") or secrets.randbits(63))


def same(got, want) -> bool:
    """Equal, numbers to float tolerance (dicts and lists compared item by item)."""
    if isinstance(want, dict):
        return (
            isinstance(got, dict) and got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
        )
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(same, got, want))
    if isinstance(want, str):
        return got == want
    return got == pytest.approx(want, rel=1e-12, abs=1e-12)


class PerStepOracle:
    """The accounting priced one step at a time, straight from the reference kernel: what
    EngineAccounting computed before it journaled steps (docs/cost-model.md §4–5)."""

    def __init__(self, cost: CostModel) -> None:
        self.gammas = np.array([g.gamma for g in cost.groups])
        self.windows = ref.window_array([g.window for g in cost.groups])
        self.weights = cost.shape.n_total * 2.0 * cost.device.hoi / (2 * cost.shape.n_active)
        self.req: dict[str, dict] = {}
        self.lines: list[dict] = []
        self.messages: list[dict] = []
        self.steps = 0

    def schedule(self, rids: list[str], columns: list[list[int]]) -> None:
        c, n, prompt, spec = (np.array(col, dtype=np.int64) for col in columns)
        rows = []
        for j, rid in enumerate(rids):
            r = self.req.setdefault(rid, {"h": 0, "rej": 0, "end": 0, "spec": 0, "cached": int(c[j]),
                                          "cols": np.zeros(ref.n_columns(len(self.gammas))), "roof": 0.0})  # fmt: skip
            rows.append((j, c[j], n[j], prompt[j], r["h"], spec[j], r["rej"]))
            r.update(rej=0, end=int(c[j] + n[j]), spec=int(spec[j]), h=max(r["h"], int(c[j] + n[j])))
        packed = np.array(rows, dtype=np.int64).T.copy()
        contrib = ref.step_contributions(packed, self.windows)
        kv = (contrib[ref.CTX0 :] * self.gammas[:, None]).sum(axis=0)
        tokens = float(n.sum())
        memory = self.weights + float(kv.sum())
        share = n.astype(float) if tokens >= memory else self.weights / len(rids) + kv
        for j, rid in enumerate(rids):
            self.req[rid]["cols"] += contrib[:, j]
            self.req[rid]["roof"] += share[j]
        sums = contrib.sum(axis=1)
        self.lines.append({
            "engine": 0, "step": self.steps, "n_reqs": len(rids), "tokens": int(tokens),
            "prefill": int(sums[ref.PREFILL]), "recompute": int(sums[ref.RECOMPUTE]),
            "decode_tokens": int(sums[ref.DECODE_TOKENS]), "spec_tokens": int(sums[ref.SPEC_TOKENS]),
            "ctx": sums[ref.CTX0 :].tolist(), "pte": float(sums[ref.PREFILL] + self.gammas @ sums[ref.CTX0 :]),
            "roofline_pte": max(tokens, memory), "weights_pte": self.weights,
        })  # fmt: skip
        self.steps += 1

    def settle(self, rid: str, computed: int) -> None:
        r = self.req.get(rid)
        if r is not None and r["spec"]:
            r["rej"] += max(0, r["end"] - computed)
            r.update(h=computed, spec=0)

    def finished(self, rid: str, reason: str, computed: int) -> None:
        self.settle(rid, computed)
        r = self.req.pop(rid, None)
        msg = {"request_id": rid, "finish_reason": reason, "engine_steps": self.steps, "engine_live": None}
        if r is None:
            msg.update(dict.fromkeys(ref.column_names(len(self.gammas)), 0.0))
            msg.update(cached_tokens=0, pte_served=0.0, pte_recompute=0.0, pte_roofline=0.0)
        else:
            cols = r["cols"]
            msg.update(zip(ref.column_names(len(self.gammas)), cols.tolist(), strict=True))
            msg["rejected_tokens"] += r["rej"]
            msg.update(cached_tokens=r["cached"], pte_recompute=cols[ref.RECOMPUTE], pte_roofline=r["roof"],
                       pte_served=cols[ref.PREFILL] + self.gammas @ cols[ref.CTX0 :])  # fmt: skip
        self.messages.append(msg)


def random_calls(
    rng: np.random.Generator, n_requests: int, max_batch: int, asynchronous: bool
) -> list[tuple]:
    """The hook calls of a toy continuous-batching scheduler: arrivals with prefix-cache
    hits, chunked prefill, decode, speculative steps (drafts rejected at random, settled by
    ``accepted``; with ``asynchronous`` only after the next step is scheduled, as with
    async scheduling), preemptions that rewind c below the high-water mark, finishes,
    aborts (some never scheduled), a flush after every step and some in between."""
    calls: list[tuple] = []
    waiting = []
    for i in range(n_requests):
        prompt = int(rng.integers(1, 40))
        hit = int(rng.integers(0, prompt)) if rng.random() < 0.3 else 0
        waiting.append({"rid": f"q{i}", "P": prompt, "D": int(rng.integers(1, 12)), "c": hit, "out": 0})
    running: list[dict] = []
    deferred: list[tuple] = []
    while waiting or running:
        while waiting and len(running) < max_batch and rng.random() < 0.5:
            running.append(waiting.pop(0))
        if waiting and rng.random() < 0.03:  # aborted before it was ever scheduled
            calls += [("finished", waiting.pop()["rid"], "abort", 0), ("flush",)]
        budget, drafts = int(rng.integers(1, 60)), rng.random() < 0.25
        rows = []
        for r in running:
            if budget <= 0 or rng.random() < 0.1:  # no budget left, or skipped this step
                continue
            known = r["P"] + r["out"]
            n = min(budget, known - r["c"])
            k = int(rng.integers(1, 4)) if drafts and r["c"] + n == known and r["c"] >= r["P"] else 0
            rows.append((r, r["c"], n + k, k))
            budget -= n
        if not rows:
            calls += deferred
            deferred = []
            continue
        calls.append(("schedule", [r["rid"] for r, *_ in rows],
                      [[c for _, c, _, _ in rows], [n for _, _, n, _ in rows], [r["P"] for r, *_ in rows],
                       [k for *_, k in rows]]))  # fmt: skip
        calls += deferred
        deferred = []
        if rng.random() < 0.05:  # a flush before the outputs are back (an abort lands)
            calls.append(("flush",))
        calls.append(("done",))
        for r, c, n, k in rows:
            rejected = int(rng.integers(0, k + 1)) if k else 0
            if c + n - k == r["P"] + r["out"]:  # the verified part reaches the end: it samples
                r["out"] = min(r["D"], r["out"] + 1 + k - rejected)
            r["c"] = c + n - rejected
            if r["out"] >= r["D"] or rng.random() < 0.02:
                calls.append(("finished", r["rid"], "length" if r["out"] >= r["D"] else "abort", r["c"]))
                running.remove(r)
            elif k:
                (deferred if asynchronous else calls).append(("accepted", r["rid"], r["c"]))
        for r in running:
            if rng.random() < 0.04:  # preempted: resumes from a partial prefix-cache hit
                r["c"] = int(rng.integers(0, r["c"] + 1)) // 2
        calls.append(("flush",))
        if rng.random() < 0.05:
            calls.append(("conservation",))
    return [*calls, *deferred, ("flush",)]


@pytest.mark.parametrize("cost", JOURNAL_COSTS, ids=["1group", "2groups"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("backend", ["numpy", pytest.param("torch", marks=NEEDS_TORCH)])
def test_journal_equals_per_step_accounting(tmp_path, seed, cost, asynchronous, backend):
    """Random scheduler traffic through the journal (and through the torch backend, whose
    contributions the hook recomputes on the host) prices every request and every step as
    the per-step oracle does."""
    rng = np.random.default_rng(seed)
    for trial in range(4):
        journal_steps = int(rng.choice([1, 2, 5, JOURNAL_STEPS]))
        calls = random_calls(rng, n_requests=int(rng.integers(5, 40)), max_batch=int(rng.integers(1, 12)),
                             asynchronous=asynchronous)  # fmt: skip
        msg = f"seed={seed} trial={trial} journal_steps={journal_steps}"
        log = tmp_path / f"steps-{trial}.jsonl"
        sent: list[dict] = []
        ea = EngineAccounting(
            cost, collect(sent), backend=backend, step_log=str(log), journal_steps=journal_steps
        )
        oracle = PerStepOracle(cost)
        for call in calls:
            if call[0] == "schedule":
                ea.on_schedule(call[1], call[2])
                oracle.schedule(call[1], call[2])
            elif call[0] == "done":
                ea.on_step_done()
            elif call[0] == "accepted":
                ea.accepted(call[1], call[2])
                oracle.settle(call[1], call[2])
            elif call[0] == "finished":
                ea.on_finished(call[1], call[2], call[3], {"prompt_tokens": 0})
                oracle.finished(call[1], call[2], call[3])
            elif call[0] == "flush":
                ea.flush()
            else:
                requests, per_update = ea.conservation()
                np.testing.assert_array_equal(requests, per_update, err_msg=msg)
        ea.close()
        assert ea.live == 0 and ea.steps == oracle.steps, msg
        assert [m["request_id"] for m in sent] == [m["request_id"] for m in oracle.messages], msg
        for got, want in zip(sent, oracle.messages, strict=True):
            del want["engine_live"]
            assert same({k: got[k] for k in want}, want), f"{msg} {want['request_id']}"
        lines = [json.loads(x) for x in log.read_text().splitlines()][1:]
        assert len(lines) == len(oracle.lines), msg
        for got, want in zip(lines, oracle.lines, strict=True):
            assert list(got) == [*list(want)[:2], "t", *list(want)[2:], "hook_s", "dt_s", "model_s"], msg  # field order
            assert all(got[k] >= 0 for k in TIMINGS), msg
            assert same({k: v for k, v in got.items() if k not in TIMINGS}, want), f"{msg} {want}"
        # the journal's accumulator updates conserve what the requests were charged
        requests, per_update = ea.conservation()
        np.testing.assert_array_equal(requests, per_update, err_msg=msg)
        assert ea.acc.step <= ea.steps, msg  # one update per journal pass, not per step


def test_journal_processes_when_full_and_before_totals_are_read(tmp_path):
    sent = []
    ea = EngineAccounting(COST, collect(sent), step_log=str(tmp_path / "s.jsonl"), journal_steps=4)
    ea.on_schedule(["a"], [[0], [10], [10], [0]])
    for k in range(6):
        ea.on_schedule(["a"], [[10 + k], [1], [10], [0]])
        ea.on_step_done()
    assert ea.acc.step == 1  # steps 0–3 in one update; 4–6 wait in the journal
    assert ea.conservation()[0][ref.PREFILL] == 10 and ea.acc.step == 2
    ea.on_finished("a", "stop", 16, {})
    ea.flush()
    assert sent[0]["decode_tokens"] == 7 and sent[0]["engine_steps"] == 7 and ea.hook_s > 0
    ea.close()
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines[1:]] == list(range(7))


def test_rejected_drafts_are_priced_as_wasted_work_and_queued_aborts_as_unscheduled():
    sent = []
    ea = EngineAccounting(COST, collect(sent), external_id=lambda rid: (rid.rpartition("_")[2], 1))
    ea.on_schedule(["1_c"], [[0], [10], [10], [0]])
    ea.on_schedule(["1_c"], [[10], [3], [10], [2]])  # positions 10, 11, 12: 1 + 2 drafts
    ea.accepted("1_c", 11)  # 11 and 12 rejected: they read 12 and 13 entries, γ = 0.01
    ea.on_finished("1_c", "stop", 11, {"prompt_tokens": 10, "arrival_time": 5.0})
    ea.on_finished("never", "abort", 0, {"prompt_tokens": 7})
    ea.flush()
    c, never = sent
    assert c["pte_rejected"] == pytest.approx(0.01 * (12 + 13)) and c["scheduled"] is True
    assert (c["external_id"], c["child_index"], c["arrival_time"]) == ("c", 1, 5.0) and c["finished_at"] > 0
    assert never["scheduled"] is False and never["pte_rejected"] == 0 and never["pte_served"] == 0


def test_every_steps_time_is_charged_and_the_model_is_reported(tmp_path):
    from pte_instrument.cost.step_time import StepTimeModel, theory

    # every clock read advances 1 ms; Python floats, as time.perf_counter returns (the step
    # log's encoder takes no numpy scalars)
    clock = iter(np.arange(0.0, 100.0, 0.001).tolist()).__next__
    sent: list[dict] = []
    log = tmp_path / "steps.jsonl"
    ea = EngineAccounting(
        COST, collect(sent), clock=clock, journal_steps=4, calibrate_online=False, step_log=str(log)
    )
    for k in range(10):
        ea.on_schedule(["a", "b"], [[10 + k, 20 + k], [1, 1], [10, 20], [0, 0]])
        ea.on_step_done()
    ea.on_finished("a", "length", 20, {})
    ea.on_finished("b", "length", 30, {})
    ea.flush()
    # Each step reads the clock at its hook's start and end and when its outputs are back:
    # 1 ms of hook, 1 ms of wall time. The flush's journal pass (steps 8, 9) reads it twice
    # more: 1 ms, counted in the hook time and in the latest step's line.
    assert ea.timing.busy_s == pytest.approx(0.010) and ea.hook_s == pytest.approx(0.011)
    assert all((m["engine_busy_s"], m["engine_hook_s"]) == pytest.approx((0.010, 0.011)) for m in sent)
    charged = sum(m["gpu_prefill_s"] + m["gpu_kv_s"] + m["gpu_weights_s"] + m["gpu_overhead_s"] for m in sent)
    assert charged == pytest.approx(0.010, rel=1e-12)
    assert all(m["engine_latency_s"] == pytest.approx(0.010) for m in sent)  # both in every step
    # decode only, and compute-bound (2 tokens > 1 PTE of weights + 0.01·(32 + 2k) of KV):
    # no prefill time, no weight time
    assert all(m["gpu_prefill_s"] == 0 and m["gpu_weights_s"] == 0 and m["gpu_kv_s"] > 0 for m in sent)
    ea.close()
    lines = [json.loads(x) for x in log.read_text().splitlines()][1:]
    assert [x["dt_s"] for x in lines] == pytest.approx([0.001] * 10)
    assert [x["hook_s"] for x in lines] == pytest.approx([0.001] * 9 + [0.002])
    c = ea.calibration()
    assert (c.source, c.r2, c.steps) == ("theory", None, 0)  # off: theory, never refitted
    assert [c.a, c.b, c.w, c.o] == theory(COST, 2.0).coefficients().tolist()
    saved = StepTimeModel(1e-3, 1e-5, 2e-3, 1e-3)
    c = EngineAccounting(COST, collect([]), step_model=saved, step_model_source="file").calibration()
    assert ([c.a, c.b, c.w, c.o], c.source) == ([1e-3, 1e-5, 2e-3, 1e-3], "file")  # not yet refitted
