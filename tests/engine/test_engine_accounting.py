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
from pte_instrument.engine.accounting import CompletedSteps, EngineAccounting, StepLogFailed
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


def completed(steps, prompts=None, t0: float = 0.0, dt: float = 0.001) -> CompletedSteps:
    """Steps of rows (rid, c, n[, drafts, rejected]), each scheduled at t0 + 2k·dt and back
    dt later; ``prompts``: prompt length of requests first seen here."""
    batch = CompletedSteps()
    batch.prompts.update(prompts or {})
    for k, rows in enumerate(steps):
        rows = [(*r, 0, 0)[:5] for r in rows]
        batch.add(
            [r[0] for r in rows],
            [r[1] for r in rows],
            [r[2] for r in rows],
            t0 + 2 * k * dt,
            t0 + (2 * k + 1) * dt,
            drafts={r[0]: r[3] for r in rows if r[3]},
            rejected={r[0]: r[4] for r in rows if r[4]},
        )
    return batch


COUNTS = {"prompt_tokens": 10, "output_tokens": 3, "num_preemptions": 0}


def run(tmp_path, steps, finish, prompts):
    sent = []
    ea = EngineAccounting(COST, collect(sent), step_log=str(tmp_path / "steps.jsonl"))
    ea.price(completed(steps, prompts))
    for rid in finish:
        ea.on_finished(rid, "length", COUNTS)
    ea.flush()
    ea.close()
    lines = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    return {m["request_id"]: m for m in sent}, [x for x in lines if not x.get("header")], ea


def test_chunked_prefill_then_decode(tmp_path):
    # prompt 10 in chunks of 6 + 4, then 2 decode steps: outputs 0 (from the prompt), 1, 2
    steps = [[("a", 0, 6)], [("a", 6, 4)], [("a", 10, 1)], [("a", 11, 1)]]
    msgs, lines, ea = run(tmp_path, steps, ["a"], {"a": 10})
    m = msgs["a"]
    assert (m["prefill"], m["recompute"], m["decode_tokens"]) == (10, 0, 3)
    # contexts: first sample 10, position 10 reads 11, position 11 reads 12 → 33 = Σ_{j<3}(10+j)
    assert m["ctx0"] == 33 and m["pte_served"] == pytest.approx(10 + 0.01 * 33)
    assert sum(x["pte"] for x in lines) == pytest.approx(m["pte_served"])
    assert sum(x["prefill"] for x in lines) == 10 and [x["dt_s"] for x in lines] == pytest.approx([0.001] * 4)
    # roofline: prefill steps are compute-bound (6 and 4 tokens > 1 PTE of weights + KV);
    # the decode steps are memory-bound: 1 (weights) + 0.11 and 1 + 0.12
    assert m["pte_roofline"] == pytest.approx(6 + (4) + 1.11 + 1.12)
    assert ea.live == 0 and m["engine_live"] == 0 and ea.steps == 4


def test_a_requests_step_lines_are_in_the_file_when_its_totals_are_sent(tmp_path):
    """A reader that has a request's totals finds every step it ran in the step log."""
    log = tmp_path / "steps.jsonl"
    lines_at_send: list[int] = []

    def send(messages) -> None:
        lines_at_send.append(sum(1 for x in log.read_text().splitlines() if not json.loads(x).get("header")))

    ea = EngineAccounting(COST, send, step_log=str(log))
    ea.price(completed([[("a", 0, 6)], [("a", 6, 4)], [("a", 10, 1)]], {"a": 10}))
    ea.on_finished("a", "length", COUNTS)
    ea.flush()
    ea.close()
    assert lines_at_send == [3]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_step_log_that_cannot_be_written_loses_no_totals():
    """A full disk under the step log: its flush fails, the totals are sent all the same, and
    the log goes off, said once (the caller counts the fault); closing raises nothing."""
    sent: list[dict] = []
    ea = EngineAccounting(COST, collect(sent), step_log="/dev/full")
    ea.price(completed([[("a", 0, 6)], [("a", 6, 4)]], {"a": 10}))
    ea.on_finished("a", "length", COUNTS)
    with pytest.raises(StepLogFailed, match="No space left on device"):
        ea.flush()
    assert [m["request_id"] for m in sent] == ["a"]
    ea.price(completed([[("b", 0, 6)]], {"b": 6}))
    ea.on_finished("b", "length", COUNTS)
    ea.flush()  # the log is off: nothing more to say
    assert [m["request_id"] for m in sent] == ["a", "b"]
    ea.close()


def test_preemption_counts_recompute_and_cache_hits_are_free(tmp_path):
    steps = [
        [("b", 4, 6)],  # 4 prefix-cache hits, prefill 6: samples output 0
        [("b", 10, 1)],  # decode: output 1
        [("b", 0, 12)],  # preempted, resumed: 11 recomputed, position 11 decodes output 2
    ]
    msgs, lines, _ = run(tmp_path, steps, ["b"], {"b": 10})
    m = msgs["b"]
    assert m["cached_tokens"] == 4
    assert (m["prefill"], m["recompute"], m["decode_tokens"]) == (6 + 11, 11, 3)
    assert m["pte_served"] == pytest.approx(17 + 0.01 * (10 + 11 + 12))
    assert sum(x["recompute"] for x in lines) == 11


def test_rejected_drafts_are_priced_as_wasted_work_and_queued_aborts_as_unscheduled():
    sent = []
    ea = EngineAccounting(COST, collect(sent), external_id=lambda rid: (rid.rpartition("_")[2], 1))
    # positions 10, 11, 12: 1 + 2 drafts, both rejected (vLLM rolled back to 11); the next
    # step decodes position 11 again: not recompute, as no valid KV was left there
    ea.price(completed([[("1_c", 0, 10)], [("1_c", 10, 3, 2, 2)], [("1_c", 11, 1)]], {"1_c": 10}))
    ea.on_finished("1_c", "stop", {"prompt_tokens": 10, "arrival_time": 5.0})
    ea.on_finished("never", "abort", {"prompt_tokens": 7})
    ea.flush()
    c, never = sent
    assert (c["spec_tokens"], c["rejected_tokens"], c["recompute"]) == (2, 2, 0)
    # 11 and 12 rejected: they read 12 and 13 entries, γ = 0.01
    assert c["pte_rejected"] == pytest.approx(0.01 * (12 + 13)) and c["scheduled"] is True
    assert (c["external_id"], c["child_index"], c["arrival_time"]) == ("c", 1, 5.0) and c["finished_at"] > 0
    assert never["scheduled"] is False and never["pte_rejected"] == 0 and never["pte_served"] == 0


def test_a_held_request_is_sent_after_its_last_step_and_a_late_row_is_nobodys():
    sent = []
    ea = EngineAccounting(COST, collect(sent), calibrate_online=False)
    ea.price(completed([[("a", 0, 10), ("b", 0, 10)]], {"a": 10, "b": 10}))
    ea.on_finished("a", "stop", COUNTS)
    ea.on_finished("b", "stop", COUNTS)
    ea.flush(hold=lambda rid: rid == "a")  # a step still running has "a"
    assert [m["request_id"] for m in sent] == ["b"] and [f.rid for f in ea.finished] == ["a"]
    ea.price(completed([[("a", 10, 1), ("b", 10, 1)]], t0=0.002))  # that step; "b" was sent already
    ea.flush()
    a = sent[1]
    assert (a["request_id"], a["prefill"], a["decode_tokens"], a["ctx0"]) == ("a", 10, 2, 10 + 11)
    # the late row of "b": in the engine's busy time, charged to no one, its slot freed
    seconds = sum(m["gpu_prefill_s"] + m["gpu_kv_s"] + m["gpu_weights_s"] + m["gpu_overhead_s"] for m in sent)
    assert ea.timing.busy_s == pytest.approx(0.002) and ea.timing.unattributed_s > 0
    assert seconds + ea.timing.unattributed_s == pytest.approx(0.002, rel=1e-12)
    assert ea.live == 0 and ea.acc.in_use == 0


# --- batches of steps against a per-step oracle -------------------------------------------

# 1.373 PTE of weights per step, γ = 0.01 (and 0.005, window 16): a step is never exactly
# balanced between compute and memory (where float rounding could pick either side).
UNIT = DeviceProfile("unit", 1.0, 1.0, "test")
ONE_GROUP = (KVGroup(1, 2.0, None),)
TWO_GROUPS = (KVGroup(1, 2.0, None), KVGroup(1, 1.0, 16))
BATCH_COSTS = [
    CostModel(ModelShape("j", len(g), 8, 1, 1, 8, "mha", 2, g, 100.0, 137.3), UNIT)
    for g in (ONE_GROUP, TWO_GROUPS)
]
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
    """The accounting priced one step at a time, position by position where it can be: what
    docs/cost-model.md §4–5 defines, written without the vectorized pass."""

    def __init__(self, cost: CostModel) -> None:
        self.gammas = np.array([g.gamma for g in cost.groups])
        self.windows = [g.window for g in cost.groups]
        self.weights = cost.shape.n_total * 2.0 * cost.device.hoi / (2 * cost.shape.n_active)
        self.req: dict[str, dict] = {}
        self.lines: list[dict] = []
        self.messages: list[dict] = []
        self.steps = 0

    def step(self, rows: list[tuple], prompts: dict[str, int]) -> None:
        ncol = ref.n_columns(len(self.gammas))
        contrib = []
        for rid, c, n, spec, rej in rows:
            r = self.req.setdefault(
                rid,
                {"h": 0, "P": prompts[rid], "cached": c, "cols": np.zeros(ncol), "roof": 0.0, "wasted": 0.0},
            )
            h, P, end = r["h"], r["P"], c + n
            col = np.zeros(ncol)
            E = max(P, h)
            for p in range(c, end):
                if p < E:
                    col[ref.PREFILL] += 1
                    col[ref.RECOMPUTE] += p < h
                else:
                    col[ref.DECODE_TOKENS] += 1
                    for g, w in enumerate(self.windows):
                        col[ref.CTX0 + g] += min(p + 1, w or p + 1)
            if max(h, c) < P <= end:  # the first sample reads the prompt
                col[ref.DECODE_TOKENS] += 1
                for g, w in enumerate(self.windows):
                    col[ref.CTX0 + g] += min(P, w or P)
            col[ref.SPEC_TOKENS], col[ref.REJECTED_TOKENS] = spec, rej
            for p in range(end - rej, end):  # rejected draft positions: wasted reads
                r["wasted"] += sum(
                    g * min(p + 1, w or p + 1) for g, w in zip(self.gammas, self.windows, strict=True)
                )
            r["h"] = max(h, end - rej)
            contrib.append(col)
        contrib = np.array(contrib).T
        n = np.array([row[2] for row in rows], dtype=float)
        kv = (contrib[ref.CTX0 :] * self.gammas[:, None]).sum(axis=0)
        tokens = float(n.sum())
        memory = self.weights + float(kv.sum())
        share = n if tokens >= memory else self.weights / len(rows) + kv
        for j, row in enumerate(rows):
            self.req[row[0]]["cols"] += contrib[:, j]
            self.req[row[0]]["roof"] += share[j]
        sums = contrib.sum(axis=1)
        self.lines.append(
            {
                "engine": 0,
                "step": self.steps,
                "n_reqs": len(rows),
                "tokens": int(tokens),
                "prefill": int(sums[ref.PREFILL]),
                "recompute": int(sums[ref.RECOMPUTE]),
                "decode_tokens": int(sums[ref.DECODE_TOKENS]),
                "spec_tokens": int(sums[ref.SPEC_TOKENS]),
                "ctx": sums[ref.CTX0 :].tolist(),
                "pte": float(sums[ref.PREFILL] + self.gammas @ sums[ref.CTX0 :]),
                "roofline_pte": max(tokens, memory),
                "weights_pte": self.weights,
            }
        )
        self.steps += 1

    def finished(self, rid: str, reason: str) -> None:
        r = self.req.pop(rid, None)
        msg = {"request_id": rid, "finish_reason": reason, "engine_steps": self.steps}
        if r is None:
            msg.update(dict.fromkeys(ref.column_names(len(self.gammas)), 0.0))
            msg.update(cached_tokens=0, pte_served=0.0, pte_recompute=0.0, pte_roofline=0.0, pte_rejected=0.0)
        else:
            cols = r["cols"]
            msg.update(zip(ref.column_names(len(self.gammas)), cols.tolist(), strict=True))
            msg.update(
                cached_tokens=r["cached"],
                pte_recompute=cols[ref.RECOMPUTE],
                pte_roofline=r["roof"],
                pte_served=cols[ref.PREFILL] + self.gammas @ cols[ref.CTX0 :],
                pte_rejected=r["wasted"],
            )
        self.messages.append(msg)


def random_traffic(rng: np.random.Generator, n_requests: int, max_batch: int) -> list[tuple]:
    """A toy continuous-batching scheduler's completed steps and finishes: arrivals with
    prefix-cache hits, chunked prefill, decode, speculative steps (drafts rejected at random),
    preemptions that rewind c below the high-water mark, finishes and aborts (some never
    scheduled). Events: ("step", rows (rid, c, n, drafts, rejected), prompts of new ones),
    ("finished", rid, reason)."""
    events: list[tuple] = []
    waiting = []
    for i in range(n_requests):
        prompt = int(rng.integers(1, 40))
        hit = int(rng.integers(0, prompt)) if rng.random() < 0.3 else 0
        waiting.append(
            {"rid": f"q{i}", "P": prompt, "D": int(rng.integers(1, 12)), "c": hit, "out": 0, "seen": False}
        )
    running: list[dict] = []
    while waiting or running:
        while waiting and len(running) < max_batch and rng.random() < 0.5:
            running.append(waiting.pop(0))
        if waiting and rng.random() < 0.03:  # aborted before it was ever scheduled
            events.append(("finished", waiting.pop()["rid"], "abort"))
        budget, drafts = int(rng.integers(1, 60)), rng.random() < 0.25
        rows, prompts = [], {}
        for r in running:
            if budget <= 0 or rng.random() < 0.1:  # no budget left, or skipped this step
                continue
            known = r["P"] + r["out"]
            n = min(budget, known - r["c"])
            k = int(rng.integers(1, 4)) if drafts and r["c"] + n == known and r["c"] >= r["P"] else 0
            rejected = int(rng.integers(0, k + 1)) if k else 0
            rows.append((r, r["c"], n + k, k, rejected))
            if not r["seen"]:
                prompts[r["rid"]], r["seen"] = r["P"], True
            budget -= n
        if not rows:
            continue
        events.append(("step", [(r["rid"], c, n, k, rej) for r, c, n, k, rej in rows], prompts))
        for r, c, n, k, rejected in rows:
            if c + n - k == r["P"] + r["out"]:  # the verified part reaches the end: it samples
                r["out"] = min(r["D"], r["out"] + 1 + k - rejected)
            r["c"] = c + n - rejected
            if r["out"] >= r["D"] or rng.random() < 0.02:
                events.append(("finished", r["rid"], "length" if r["out"] >= r["D"] else "abort"))
                running.remove(r)
        for r in running:
            if rng.random() < 0.04:  # preempted: resumes from a partial prefix-cache hit
                r["c"] = int(rng.integers(0, r["c"] + 1)) // 2
    return events


@pytest.mark.parametrize("cost", BATCH_COSTS, ids=["1group", "2groups"])
@pytest.mark.parametrize("backend", ["numpy", pytest.param("torch", marks=NEEDS_TORCH)])
def test_batches_of_steps_equal_per_step_accounting(tmp_path, seed, cost, backend):
    """Random scheduler traffic priced in batches of random sizes (and through the torch
    backend, whose contributions the pass recomputes on the host) prices every request and
    every step as the per-step oracle does."""
    rng = np.random.default_rng(seed)
    for trial in range(4):
        events = random_traffic(rng, n_requests=int(rng.integers(5, 40)), max_batch=int(rng.integers(1, 12)))
        msg = f"seed={seed} trial={trial}"
        log = tmp_path / f"steps-{trial}.jsonl"
        sent: list[dict] = []
        ea = EngineAccounting(cost, collect(sent), backend=backend, step_log=str(log))
        oracle = PerStepOracle(cost)
        batch, t = CompletedSteps(), 0.0
        for event in events:
            if event[0] == "step":
                _, rows, prompts = event
                batch.prompts.update(prompts)
                batch.add(
                    [r[0] for r in rows],
                    [r[1] for r in rows],
                    [r[2] for r in rows],
                    t,
                    t + 0.001,
                    drafts={r[0]: r[3] for r in rows if r[3]},
                    rejected={r[0]: r[4] for r in rows if r[4]},
                )
                t += 0.002
                oracle.step(rows, {**oracle_prompts(oracle), **prompts})
            else:
                ea.on_finished(event[1], event[2], {"prompt_tokens": 0})
                oracle.finished(event[1], event[2])
            if event[0] == "finished" or rng.random() < 0.2:  # price, then send
                ea.price(batch)
                batch = CompletedSteps()
                ea.flush()
            if rng.random() < 0.05:
                requests, per_update = ea.conservation()
                np.testing.assert_array_equal(requests, per_update, err_msg=msg)
        ea.price(batch)
        ea.flush()
        ea.close()
        assert ea.live == 0 and ea.steps == oracle.steps, msg
        assert [m["request_id"] for m in sent] == [m["request_id"] for m in oracle.messages], msg
        for got, want in zip(sent, oracle.messages, strict=True):
            assert same({k: got[k] for k in want}, want), f"{msg} {want['request_id']}"
        lines = [json.loads(x) for x in log.read_text().splitlines()][1:]
        assert len(lines) == len(oracle.lines), msg
        for got, want in zip(lines, oracle.lines, strict=True):
            assert list(got) == [*list(want)[:2], "t", *list(want)[2:], "hook_s", "dt_s", "model_s"], (
                msg
            )  # field order
            assert all(got[k] >= 0 for k in TIMINGS), msg
            assert same({k: v for k, v in got.items() if k not in TIMINGS}, want), f"{msg} {want}"
        requests, per_update = ea.conservation()
        np.testing.assert_array_equal(requests, per_update, err_msg=msg)
        assert ea.acc.step <= ea.steps, msg  # one update per pass, not per step


def oracle_prompts(oracle: PerStepOracle) -> dict[str, int]:
    return {rid: r["P"] for rid, r in oracle.req.items()}


def test_every_steps_time_is_charged_and_the_model_is_reported(tmp_path):
    from pte_instrument.cost.step_time import StepTimeModel, theory

    sent: list[dict] = []
    log = tmp_path / "steps.jsonl"
    ea = EngineAccounting(COST, collect(sent), calibrate_online=False, step_log=str(log))
    # ten decode steps of two requests, each 1 ms from schedule to outputs, in two passes
    steps = [[("a", 10 + k, 1), ("b", 20 + k, 1)] for k in range(10)]
    ea.price(completed(steps[:4], {"a": 10, "b": 20}))
    ea.price(completed(steps[4:], t0=0.008))
    ea.on_finished("a", "length", {})
    ea.on_finished("b", "length", {})
    ea.flush()
    assert ea.timing.busy_s == pytest.approx(0.010)
    assert all(m["engine_busy_s"] == pytest.approx(0.010) for m in sent)
    charged = sum(m["gpu_prefill_s"] + m["gpu_kv_s"] + m["gpu_weights_s"] + m["gpu_overhead_s"] for m in sent)
    assert charged == pytest.approx(0.010, rel=1e-12)
    assert all(m["engine_latency_s"] == pytest.approx(0.010) for m in sent)  # both in every step
    # decode only, and compute-bound (2 tokens > 1 PTE of weights + 0.01·(32 + 2k) of KV):
    # no prefill time, no weight time
    assert all(m["gpu_prefill_s"] == 0 and m["gpu_weights_s"] == 0 and m["gpu_kv_s"] > 0 for m in sent)
    ea.close()
    lines = [json.loads(x) for x in log.read_text().splitlines()][1:]
    assert [x["dt_s"] for x in lines] == pytest.approx([0.001] * 10) and [x["step"] for x in lines] == list(
        range(10)
    )
    c = ea.calibration()
    assert (c.source, c.r2, c.steps) == ("theory", None, 0)  # off: theory, never refitted
    assert [c.a, c.b, c.w, c.o] == theory(COST, 2.0).coefficients().tolist()
    saved = StepTimeModel(1e-3, 1e-5, 2e-3, 1e-3)
    c = EngineAccounting(COST, collect([]), step_model=saved, step_model_source="file").calibration()
    assert ([c.a, c.b, c.w, c.o], c.source) == ([1e-3, 1e-5, 2e-3, 1e-3], "file")  # not yet refitted


@pytest.mark.parametrize(
    ("scheduled", "done", "durations"),
    [
        # synchronous: each step is scheduled after the previous one's outputs
        ([0.0, 3.0, 7.0], [2.0, 5.0, 8.0], [2.0, 2.0, 1.0]),
        # asynchronous: step k+1 is scheduled while step k runs; its time starts when k's ends
        ([0.0, 0.5, 2.5, 4.2], [2.0, 4.0, 4.5, 6.0], [2.0, 2.0, 0.5, 1.5]),
        # an idle gap, then a step scheduled late: the gap is nobody's
        ([0.0, 0.5, 9.0], [2.0, 4.0, 10.0], [2.0, 2.0, 1.0]),
    ],
    ids=["sync", "async", "idle"],
)
def test_a_steps_time_starts_when_it_or_the_step_before_it_ended(scheduled, done, durations):
    ea = EngineAccounting(COST, collect([]), calibrate_online=False)
    batch = CompletedSteps()
    for k, (s, d) in enumerate(zip(scheduled, done, strict=True)):
        batch.add(["a"], [k], [1], s, d)
    batch.prompts["a"] = 1
    assert ea._durations(batch) == pytest.approx(durations)
    union = sum(durations)  # the measure of ∪ [scheduled, done], worked out by hand
    ea._last_done = None
    ea.price(batch)
    assert ea.timing.busy_s == pytest.approx(union)


def test_a_step_model_fitted_on_steps_of_one_duration_reports_its_r2_undefined():
    """Every step took 1 ms: the online fit has no variance to explain. Its R² is reported as
    unknown (None), never NaN, which the API server's JSON routes cannot encode."""
    import msgspec

    ea = EngineAccounting(COST, collect([]))
    steps = [[("a", 10 + k, 1)] for k in range(300)]  # past the engine's first refit (256 steps)
    ea.price(completed(steps, {"a": 10}))
    c = ea.calibration()
    assert c.source == "online" and c.r2 is None
    json.dumps(msgspec.structs.asdict(c), allow_nan=False)
    ea.close()
