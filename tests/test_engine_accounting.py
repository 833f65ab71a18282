"""EngineAccounting driven by hand-made scheduler steps (the adapter's view of vLLM)."""

import json

import pytest

from pte_instrument.core.architecture import KVGroup, ModelShape
from pte_instrument.core.cost import CostModel
from pte_instrument.core.devices import DeviceProfile
from pte_instrument.engine_accounting import EngineAccounting

# γ = 2 · 1 / (2 · 100) = 0.01; weights: n_total 100 · 2 B · HOI 1 / (2 · 100) = 1 PTE per step
SHAPE = ModelShape("unit", 1, 8, 1, 1, 8, "mha", 2, (KVGroup(1, 2.0, None),), 100.0, 100.0)
COST = CostModel(SHAPE, DeviceProfile("unit", 1.0, 1.0, "test"))


def run(tmp_path, steps, finish):
    sent = []
    ea = EngineAccounting(COST, sent.extend, step_log=str(tmp_path / "steps.jsonl"))
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
    assert sum(x["prefill"] for x in lines) == 10 and all("dt_s" in x for x in lines)
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
    ea = EngineAccounting(COST, sent.extend)
    ea.on_schedule(["c"], [[0], [10], [10], [0]])
    ea.on_schedule(["c"], [[10], [3], [10], [2]])  # 1 + 2 drafts
    ea.accepted("c", 11)  # both drafts rejected: vLLM rolled back to 11
    ea.on_finished("c", "stop", 11, {"prompt_tokens": 10, "output_tokens": 2, "num_preemptions": 0})
    ea.on_finished("never", "abort", 0, {"prompt_tokens": 7, "output_tokens": 0, "num_preemptions": 0})
    ea.flush()
    c, never = sent
    assert (c["spec_tokens"], c["rejected_tokens"]) == (2, 2)
    assert never["external_id"] == "never" and never["pte_served"] == 0 and never["finish_reason"] == "abort"
