"""Agent trajectories: PTE pricing through the core cost model, the four inefficiency
detectors of docs/cost-model.md §7 on hand-made trajectories, and the per-group report."""

import json
import math

import numpy as np
import pytest

from pte_instrument.cost.architecture import KVGroup, ModelShape
from pte_instrument.cost.devices import DeviceProfile
from pte_instrument.cost.model import CostModel
from pte_instrument.offline.patterns import (
    confirmatory_tool_use,
    detect_patterns,
    final_answer,
    group_report,
    lack_of_tool_priors,
    load_trajectories,
    parse_trajectory,
    price,
    tool_format_collapse,
    tool_mixing,
    trajectory_report,
)
from pte_instrument.offline.records import RecordError


def gamma_001() -> CostModel:
    # γ = bytes · HOI / (2 · N_active) = 2 · 1 / (2 · 100) = 0.01
    shape = ModelShape("unit", 1, 8, 1, 1, 8, "mha", 2, (KVGroup(1, 2.0, None),), 100.0, 100.0)
    return CostModel(shape, DeviceProfile("unit", 1.0, 1.0, "test"))


def turn(prompt=100, out=0, cached=0, reasoning="", calls=(), **kw):
    return {
        "prompt_tokens": prompt,
        "output_tokens": out,
        "cached_tokens": cached,
        "reasoning": reasoning,
        "tool_calls": list(calls),
        **kw,
    }


def traj(turns, correct=True, model="m", task="t", id="x", **kw):
    return parse_trajectory(
        {"model": model, "task": task, "id": id, "correct": correct, "turns": turns, **kw}
    )


PY = {"type": "code", "name": "python", "code": "print(6*7)", "output": "42"}


# ----------------------------------------------------------------------------- pricing


def test_pricing_by_hand():
    t = traj([turn(100, 10), turn(150, 20, cached=100, calls=[PY])])
    p = price(t, gamma_001())
    # served: turn 1 = 100 + .01·(100·10 + 45) = 110.45; turn 2 = (150 − 100) + .01·(150·20 + 190)
    # = 81.9 → 192.35
    assert p.pte("served") == pytest.approx(192.35)
    # reference: 100 + .01·100·10 = 110; 150 + .01·150·20 = 180 → 290
    assert p.pte("reference") == pytest.approx(290)
    # ideal: turn 2 reuses what turn 1 computed, its prompt and all outputs but the last
    # (core.cost.reusable_prefix): min(100 + 10 − 1, 150) = 109 → 41 + 31.9 = 72.9;
    # total 110.45 + 72.9 = 183.35
    assert p.pte("ideal") == pytest.approx(183.35)
    np.testing.assert_allclose(p.turn_pte("served"), [110.45, 81.9])
    assert p.uncached_tokens == (100 + 10) + (150 - 100 + 20)  # 180
    assert p.tool_calls == 1


# ----------------------------------------------------------------------------- detectors


def test_confirmatory_tool_use():
    stated_then_checked = traj(
        [
            turn(reasoning="So the answer is 42. Let me verify with code.", calls=[PY]),
            turn(reasoning="Confirmed: \\boxed{42}"),
        ]
    )
    assert final_answer(stated_then_checked) == "42"
    assert confirmatory_tool_use(stated_then_checked)
    computed_first = traj(
        [
            turn(reasoning="Let me compute the product.", calls=[PY]),
            turn(reasoning="The tool says 42, so \\boxed{42}"),
        ]
    )
    assert not confirmatory_tool_use(computed_first)
    # the value appears earlier in free text (not a claim) before a code check: still counts
    free_text = traj([turn(reasoning="6 times 7 gives 42; double-check.", calls=[PY])], answer="42")
    assert confirmatory_tool_use(free_text)
    # a one-character answer must be stated ("= 7"), not just occur ("step 7")
    assert not confirmatory_tool_use(traj([turn(reasoning="At step 7 we run it.", calls=[PY])], answer="7"))
    assert confirmatory_tool_use(traj([turn(reasoning="so x = 7, check it", calls=[PY])], answer="7"))
    assert not confirmatory_tool_use(traj([turn(reasoning="no tools here, answer: 5")]))
    # "417" contains 7 but is not the token 7; "42.5" is not "42"
    assert not confirmatory_tool_use(traj([turn(reasoning="so n = 417", calls=[PY])], answer="7"))
    assert not confirmatory_tool_use(traj([turn(reasoning="we got 42.5", calls=[PY])], answer="42"))


def test_tool_mixing():
    search = {"type": "function", "name": "search", "output": "results"}
    assert tool_mixing(traj([turn(calls=[PY]), turn(calls=[search])]))
    assert not tool_mixing(traj([turn(calls=[PY]), turn(calls=[PY, PY])]))
    assert not tool_mixing(traj([turn()]))


def test_lack_of_tool_priors():
    def with_output(**call):
        return traj([turn(calls=[{**PY, **call}])])

    assert lack_of_tool_priors(with_output(output=""))  # forgot to print
    assert lack_of_tool_priors(with_output(output="   \n"))
    assert lack_of_tool_priors(
        with_output(
            output="Traceback (most recent call last):\n  File ...\nZeroDivisionError: division by zero"
        )
    )
    assert lack_of_tool_priors(with_output(output="NameError: name 'x' is not defined"))
    assert lack_of_tool_priors(with_output(output="1", error=True))
    assert not lack_of_tool_priors(with_output(output="42"))
    assert not lack_of_tool_priors(with_output(output="the word Error alone is fine"))
    no_output = {"type": "code", "code": "x = 1"}
    assert not lack_of_tool_priors(traj([turn(calls=[no_output])]))  # not recorded
    assert lack_of_tool_priors(traj([turn(calls=[no_output], tool_output="")]))  # turn-level
    assert lack_of_tool_priors(traj([turn(calls=[no_output], error=True)]))
    assert not lack_of_tool_priors(traj([turn(tool_output="")]))  # no call, no tool failure


def test_tool_format_collapse():
    assert tool_format_collapse(traj([turn(parse_errors=1)]))
    assert tool_format_collapse(traj([turn(parse_errors=["unterminated JSON"])]))
    assert tool_format_collapse(traj([turn(calls=[{"code": "print(1)"}])]))  # no type/name
    assert tool_format_collapse(traj([turn(calls=[{"type": "code", "code": "  "}])]))  # no code
    assert tool_format_collapse(traj([turn(calls=["<tool_call>oops"])]))  # not an object
    assert not tool_format_collapse(traj([turn(calls=[PY], parse_errors=0)]))


def test_detect_patterns_on_a_clean_trajectory():
    assert detect_patterns(traj([turn(calls=[PY]), turn(reasoning="\\boxed{42}")])) == dict.fromkeys(
        ["confirmatory_tool_use", "tool_mixing", "lack_of_tool_priors", "tool_format_collapse"], False
    )


# ----------------------------------------------------------------------------- report


def hand_group():
    """Single-turn trajectories with no output: served PTE = prompt tokens exactly.
    T1 100 clean ✓, T2 300 clean ✗, T3 1000 mixing ✓, T4 600 empty output ✗."""
    search = {"type": "function", "name": "search", "output": "hits"}
    m = gamma_001()
    return [
        price(traj([turn(100)], True, id="1"), m),
        price(traj([turn(300)], False, id="2"), m),
        price(traj([turn(1000, calls=[PY, search])], True, id="3"), m),
        price(traj([turn(600, calls=[{**PY, "output": ""}])], False, id="4"), m),
    ]


def test_group_report_by_hand():
    g = group_report(hand_group(), n_boot=200, seed=1)
    assert (g.n, g.accuracy) == (4, 0.5)
    assert g.tool_calls_per_trajectory == pytest.approx(0.75)  # (0 + 0 + 2 + 1)/4
    assert g.avg_pte["served"] == pytest.approx(500)  # 2000/4
    assert g.avg_uncached_tokens == pytest.approx(500)
    # pattern-free: T1, T2 → mean 200; mixing 1000/200 = 5; lack of priors 600/200 = 3
    assert (g.pattern_free_n, g.pattern_free_mean_pte) == (2, 200)
    assert g.patterns["tool_mixing"].multiplier == pytest.approx(5.0)
    assert g.patterns["tool_mixing"].frequency == pytest.approx(0.25)
    assert g.patterns["lack_of_tool_priors"].multiplier == pytest.approx(3.0)
    assert g.patterns["confirmatory_tool_use"].count == 0
    assert math.isnan(g.patterns["confirmatory_tool_use"].multiplier)
    c = g.correct_vs_incorrect
    # correct: (100 + 1000)/2 = 550; incorrect: (300 + 600)/2 = 450; ratio 450/550
    assert c.mean_correct.value == pytest.approx(550)
    assert c.mean_incorrect.value == pytest.approx(450)
    assert c.ratio.value == pytest.approx(450 / 550)
    assert 100 <= c.mean_correct.low <= 550 <= c.mean_correct.high <= 1000
    again = group_report(hand_group(), n_boot=200, seed=1)
    assert again.correct_vs_incorrect == c  # seeded → reproducible


def test_per_step_pte_and_escalation():
    m = gamma_001()
    group = [
        price(traj([turn(10), turn(20), turn(30)], id="x"), m),
        price(traj([turn(20), turn(40)], id="y"), m),
    ]
    g = group_report(group, n_boot=0)
    # turn 1: (10 + 20)/2 = 15; turn 2: (20 + 40)/2 = 30; turn 3: 30 (one trajectory)
    assert [(s.turn, s.n, s.mean_pte) for s in g.per_step] == [(1, 2, 15), (2, 2, 30), (3, 1, 30)]
    # ρ over (1,10) (2,20) (3,30) (1,20) (2,40): ranks idx 1.5 3.5 5 1.5 3.5, PTE 1 2.5 4 2.5 5;
    # centred Σxy = 6.5, Σx² = 9, Σy² = 9.5 → ρ = 6.5/√85.5
    assert g.step_rho == pytest.approx(6.5 / math.sqrt(85.5))


def test_trajectory_report_groups_by_model_and_task():
    m = gamma_001()
    ts = [
        traj([turn(10)], model=mm, task=tt, id=i)
        for mm, tt, i in [("b", "t1", "1"), ("a", "t2", "1"), ("a", "t1", "1"), ("a", "t1", "2")]
    ]
    groups = trajectory_report(ts, m, n_boot=0)
    assert [(g.model, g.task, g.n) for g in groups] == [("a", "t1", 2), ("a", "t2", 1), ("b", "t1", 1)]
    with pytest.raises(ValueError, match="unknown PTE variant"):
        trajectory_report(ts, m, variant="cheap")


# ----------------------------------------------------------------------------- loading


def test_a_count_past_what_a_float_holds_is_a_bad_line(tmp_path):
    """10**400 overflows a float (the check raised OverflowError), and 1e300 tokens summed
    over turns overflow the averages: both are bad lines, named."""
    good = {"model": "m", "task": "t", "id": "1", "correct": True, "turns": [turn(10, 1)]}
    lines = [
        json.dumps(good),
        json.dumps({**good, "id": "2", "turns": [turn(10**400, 1)]}),
        json.dumps({**good, "id": "3", "turns": [turn(10, 1e300)]}),
        json.dumps({**good, "id": "4", "turns": [{**turn(10, 1), "parse_errors": 10**400}]}),
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    res = load_trajectories(path)
    assert [t.id for t in res.trajectories] == ["1"]
    assert [(p.where.rsplit(":", 1)[1], p.reason) for p in res.problems] == [
        ("2", "turn 1 prompt_tokens is too large"),
        ("3", "turn 1 output_tokens is too large"),
        ("4", "turn 1 parse_errors is too large"),
    ]


def test_load_trajectories_names_bad_lines(tmp_path):
    good = {"model": "m", "task": "t", "id": "1", "correct": True, "turns": [turn(10, 1)]}
    lines = [
        json.dumps(good),
        json.dumps({**good, "id": "2", "turns": []}),  # line 2: empty turns
        json.dumps({**good, "id": "3", "turns": [turn(10, 1, cached=11)]}),  # line 3
        "{oops",  # line 4
        json.dumps({**good, "id": "5", "correct": "yes"}),  # line 5
        json.dumps({k: v for k, v in good.items() if k != "task"} | {"id": "6"}),  # line 6
        json.dumps({**good, "id": "7", "turns": [{"prompt_tokens": 5}]}),  # line 7
        "",
        json.dumps({**good, "benchmark": "t2", "id": "9"}),  # line 9: task wins over benchmark
        json.dumps(good),  # line 10: duplicate of line 1
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    res = load_trajectories(path)
    reasons = {p.where.rsplit(":", 1)[1]: p.reason for p in res.problems}
    assert "non-empty" in reasons["2"]
    assert "cached_tokens 11 > prompt_tokens 10" in reasons["3"]
    assert "invalid JSON" in reasons["4"]
    assert "correct must be" in reasons["5"]
    assert "'task'" in reasons["6"]
    assert "output_tokens" in reasons["7"]
    assert "duplicate" in reasons["1"] and "duplicate" in reasons["10"]
    assert [t.id for t in res.trajectories] == ["9"]
    assert res.rows_read == 9
    with pytest.raises(RecordError, match="bad trajectory"):
        load_trajectories(path, strict=True)
    with pytest.raises(RecordError, match="cannot read"):
        load_trajectories(tmp_path / "none.jsonl")


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"])
def test_a_trajectory_line_holding_a_unicode_line_separator_is_one_trajectory(tmp_path, separator):
    """json.dumps(ensure_ascii=False) writes U+2028, U+2029 and U+0085 raw inside strings (a
    model's reasoning may hold them): one valid line, which str.splitlines() would cut."""
    good = {
        "model": "m",
        "task": "t",
        "id": "1",
        "correct": True,
        "turns": [turn(10, 1, reasoning=f"a{separator}b")],
    }
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(good, ensure_ascii=False) + "\n", encoding="utf-8")
    res = load_trajectories(path)
    assert res.problems == [] and [t.id for t in res.trajectories] == ["1"]
