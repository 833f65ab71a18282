"""The join of harness samples to the request log, and the cost per correct answer, on small
hand-made runs and logs with hand-computed expectations."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from pte_instrument.offline.cost_per_correct import (
    LoggedRequest,
    compare,
    cost_report,
    eval_records,
    join_runs,
    read_request_log,
    task_cost,
)
from pte_instrument.offline.harness_runs import Call, Run, Sample


def req(
    rid: str, digest: str | None, at: float, tokens: int, reason: str = "stop", model: str = "m", **kw
) -> LoggedRequest:
    return LoggedRequest(
        request_id=rid,
        model=model,
        finish_reason=reason,
        output_tokens=tokens,
        pte_served=kw.get("pte", 10.0 * tokens),
        finished_at=at + 1,
        arrived_at=at,
        prompt_digest=digest,
        gpu_seconds=kw.get("gpu", 0.01 * tokens),
        cost_usd=kw.get("usd", 0.001 * tokens),
    )


def sample(sid: str, score: float, *calls: Call, task: str = "t", epoch: int = 1) -> Sample:
    return Sample(task, sid, epoch, score, tuple(calls), None, f"x#{sid}")


def run(
    label: str, samples: list[Sample], start: float | None = 0.0, end: float | None = 100.0, model: str = "m"
) -> Run:
    return Run(label, "lm-eval", model, f"{label}.json", {"t": "acc"}, start, end, tuple(samples))


def test_repeated_prompts_are_matched_in_order_and_each_request_once():
    requests = [req("r1", "d", 1, 5), req("r2", "d", 2, 7), req("r3", "d", 3, 9)]
    [j] = join_runs([run("a", [sample("0", 1, Call("d")), sample("1", 0, Call("d"))])], requests)
    assert [s.requests[0].request_id for s in j.joined] == ["r1", "r2"]
    assert j.requests_in_window == 3 and j.requests_unmatched == 1  # r3: in the window, no sample's


def test_a_response_id_wins_over_the_digest_and_a_sample_of_several_calls_sums_them():
    requests = [req("r1", "d1", 1, 5), req("r2", "d1", 2, 7, "length"), req("r3", "d2", 3, 9)]
    # the sample named r2 by its id: the digest match would have taken r1
    s = sample("0", 0, Call("d1", "r2"), Call("d2"))
    [j] = join_runs([run("a", [s])], requests)
    [joined] = j.joined
    assert [r.request_id for r in joined.requests] == ["r2", "r3"]
    assert joined.unit("output_tokens") == 16 and joined.unit("pte") == 160
    assert joined.unit("gpu_seconds") == pytest.approx(0.16)
    assert not joined.cut  # the last request (r3) stopped: the answer was complete


def test_what_cannot_be_matched_is_counted_by_reason_and_frees_what_it_took():
    requests = [req("r1", "d1", 1, 5), req("r2", "d2", 200, 5)]  # r2 arrived after the run
    samples = [
        sample("0", 1, Call("d1"), Call("d2")),  # its second call is outside the window
        sample("1", 1, Call(None)),  # nothing to match by
        sample("2", 1),  # no call logged
        sample("3", 1, Call("d1")),  # takes r1, which sample 0 gave back
    ]
    [j] = join_runs([run("a", samples)], requests)
    assert [s.sample.sample_id for s in j.joined] == ["3"]
    assert j.unmatched == Counter(
        {"not in the request log": 1, "no digest to match": 1, "no model call logged": 1}
    )
    assert j.summary()["samples"] == 4 and j.summary()["samples_unmatched"] == 3


def test_two_runs_of_the_same_prompts_take_the_requests_of_their_own_windows():
    requests = [req(f"a{k}", f"d{k}", 10 + k, 4) for k in range(3)] + [
        req(f"b{k}", f"d{k}", 50 + k, 8) for k in range(3)
    ]
    later = run("b", [sample(str(k), 1, Call(f"d{k}")) for k in range(3)], 48, 60)
    first = run("a", [sample(str(k), 1, Call(f"d{k}")) for k in range(3)], 9, 20)
    jb, ja = join_runs([later, first], requests)  # given out of order: joined in the order they ran
    assert [s.requests[0].request_id for s in ja.joined] == ["a0", "a1", "a2"]
    assert [s.requests[0].request_id for s in jb.joined] == ["b0", "b1", "b2"]
    assert ja.requests_in_window == 3 and ja.requests_unmatched == 0


def test_another_models_requests_are_not_joined_or_counted():
    requests = [req("x", "d", 1, 5, model="other"), req("y", "d", 2, 5)]
    [j] = join_runs([run("a", [sample("0", 1, Call("d"))])], requests)
    assert j.joined[0].requests[0].request_id == "y" and j.requests_in_window == 1


def test_figures_of_a_run_by_hand():
    # 4 samples: correct (4 tokens), wrong and cut (8, length), correct but cut (6, length: a
    # correct answer came before the cut, so it counts complete), wrong (2)
    requests = [
        req("r0", "d0", 1, 4),
        req("r1", "d1", 2, 8, "length"),
        req("r2", "d2", 3, 6, "length"),
        req("r3", "d3", 4, 2),
    ]
    scores = [1, 0, 1, 0]
    [j] = join_runs([run("a", [sample(str(k), scores[k], Call(f"d{k}")) for k in range(4)])], requests)
    t = task_cost("a", "t", "acc", j.joined, n_boot=300, seed=1)
    assert (t.samples, t.correct, t.cut, t.correct_but_cut) == (4, 2, 1, 1)
    assert t.accuracy.value == 0.5
    assert t.completion_rate.value == 0.75
    assert t.conditional_correctness.value == pytest.approx(2 / 3)
    assert t.e0.value == pytest.approx(1000 * 2 / 20)
    assert t.mean_output_tokens.value == 5
    assert t.per_correct["output_tokens"].value == 10
    assert t.per_correct["pte"].value == pytest.approx(100)
    assert t.per_correct["gpu_seconds"].value == pytest.approx(0.1)
    assert t.per_correct["cost_usd"].value == pytest.approx(0.01)
    assert t.per_sample["gpu_seconds"].value == pytest.approx(0.05)
    assert t.accuracy.low <= 0.5 <= t.accuracy.high and t.accuracy.low < t.accuracy.high


def test_a_unit_missing_from_one_request_is_not_reported():
    requests = [
        req("r0", "d0", 1, 4),
        LoggedRequest("r1", "m", "stop", 4, 40.0, 3.0, 2.0, "d1"),
    ]  # no hook, no price
    [j] = join_runs([run("a", [sample("0", 1, Call("d0")), sample("1", 1, Call("d1"))])], requests)
    t = task_cost("a", "t", "acc", j.joined, n_boot=0, seed=0)
    assert t.per_correct["gpu_seconds"] is None and t.per_correct["cost_usd"] is None
    assert t.per_correct["pte"].value == pytest.approx(40)
    assert math.isnan(t.accuracy.low)  # no bootstrap: no interval


def test_two_runs_compared_the_terms_sum_to_the_log_ratio():
    # a: 2 of 4 correct, one cut; b: 3 of 4 correct, none cut, twice as many tokens at a lower price
    a_req = [
        req(f"a{k}", f"d{k}", k, t, r, gpu=g)
        for k, (t, r, g) in enumerate(
            [(4, "stop", 0.1), (8, "length", 0.2), (4, "stop", 0.1), (4, "stop", 0.1)]
        )
    ]
    b_req = [req(f"b{k}", f"d{k}", 50 + k, 8, "stop", gpu=0.1) for k in range(4)]
    ra = run("a", [sample(str(k), s, Call(f"d{k}")) for k, s in enumerate([1, 0, 1, 0])], 0, 10)
    rb = run("b", [sample(str(k), s, Call(f"d{k}")) for k, s in enumerate([1, 1, 1, 0])], 49, 60)
    ja, jb = join_runs([ra, rb], a_req + b_req)
    c = compare("t", "b", "a", ja.joined, jb.joined, n_boot=200, seed=0)
    u = c.units["gpu_seconds"]
    # cost per correct: a 0.5 / 2 = 0.25 GPU s, b 0.4 / 3; E[T] 5 → 8; GPU s per token 0.025 → 0.0125
    assert u.ratio.value == pytest.approx((0.4 / 3) / 0.25)
    assert u.terms["verbosity"].value == pytest.approx(math.log(8 / 5))
    assert u.terms["price_per_token"].value == pytest.approx(math.log(0.0125 / 0.025))
    assert u.terms["truncation"].value == pytest.approx(-math.log(1 / 0.75))
    assert u.terms["logic"].value == pytest.approx(-math.log(0.75 / (2 / 3)))
    assert sum(t.value for t in u.terms.values()) == pytest.approx(math.log(u.ratio.value))
    assert u.dominant == "price_per_token" and c.cheaper == "b"
    tokens = c.units["output_tokens"]
    assert tokens.terms["price_per_token"].value == 0 and tokens.dominant == "verbosity"
    assert u.ratio.low <= u.ratio.value <= u.ratio.high


def test_the_report_compares_each_run_with_the_tasks_reference_and_builds_records():
    requests = [req("a0", "d0", 1, 4), req("b0", "d0", 51, 6)]
    ra = run("a", [sample("0", 1, Call("d0"))], 0, 10)
    rb = run("b", [sample("0", 1, Call("d0"))], 50, 60)
    joins = join_runs([ra, rb], requests)
    report = cost_report(joins, "b", "log.jsonl", n_boot=0)
    [c] = report.comparisons
    assert (c.run, c.reference) == ("a", "b")
    assert report.to_dict()["runs"][0]["requests_joined"] == 1
    records, problems = eval_records(joins)
    assert [(r.model, r.benchmark, r.instance_id, r.output_tokens) for r in records] == [
        ("a", "t", "0", 4),
        ("b", "t", "0", 6),
    ]
    assert problems == []


def test_the_cost_plots_are_written_and_leave_no_figure_open(tmp_path):
    """A long-lived process (a notebook, a server's report route) plots again and again:
    each figure is closed once its file is written."""
    pytest.importorskip("matplotlib")
    from pte_instrument.offline.cost_render import cost_plots
    from pte_instrument.offline.plots import pyplot

    requests = [req("a0", "d0", 1, 4), req("b0", "d0", 51, 6)]
    ra = run("a", [sample("0", 1, Call("d0"))], 0, 10)
    rb = run("b", [sample("0", 1, Call("d0"))], 50, 60)
    report = cost_report(join_runs([ra, rb], requests), "b", "log.jsonl", n_boot=0)
    plt = pyplot()
    open_before = set(plt.get_fignums())
    paths = cost_plots(report, tmp_path)
    assert [p.name for p in paths] == ["cost_per_correct.png", "cost_terms.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    assert set(plt.get_fignums()) == open_before


# a request-log line with the fields the join reads
LOGGED = {
    "request_id": "r",
    "model": "m",
    "finish_reason": "stop",
    "output_tokens": 3,
    "pte_served": 9.5,
    "finished_at": 2.0,
}


def test_the_request_log_reader_lists_bad_lines_and_keeps_the_rest(tmp_path):
    log = tmp_path / "requests.jsonl"
    good = {**LOGGED, "extra": [1]}  # a field the reader skips
    negative = {**good, "output_tokens": -3}
    log.write_text(
        json.dumps(good) + "\n" + '{"request_id": 5}\n' + "not json\n\n" + json.dumps(negative) + "\n"
    )
    requests, problems = read_request_log(log)
    assert [r.request_id for r in requests] == ["r"] and requests[0].at == 2.0  # no arrival: its finish
    assert [p.where for p in problems] == [f"{log}:2", f"{log}:3", f"{log}:5"]
    assert "output_tokens" in problems[2].reason


def test_the_request_log_reader_lists_numbers_past_2_53_and_deep_nesting_as_bad_lines(tmp_path):
    # past 2**53 a float stops counting by one, and two such PTEs sum to infinity (no cost)
    log = tmp_path / "requests.jsonl"
    good = LOGGED
    bad = [
        {**good, "pte_served": 1e308},
        {**good, "output_tokens": 2**53 + 2},
        {**good, "gpu_seconds": 1e300},
        {**good, "cost_usd": 2.0**60},
    ]
    deep = '{"extra": ' + "[" * 200_000 + "]" * 200_000 + "}"
    log.write_text("".join(json.dumps(x) + "\n" for x in [good, *bad]) + deep + "\n")
    requests, problems = read_request_log(log)
    assert [r.request_id for r in requests] == ["r"]
    assert [p.where for p in problems] == [f"{log}:{n}" for n in (2, 3, 4, 5, 6)]
    fields = ("pte_served", "output_tokens", "gpu_seconds", "cost_usd")
    assert all(f in p.reason for f, p in zip(fields, problems[:4], strict=True))
    assert "nested too deep" in problems[4].reason


def test_a_request_id_logged_twice_joins_by_digest_not_to_whichever_copy_came_last():
    """Two requests under one id (a client's reused X-Request-Id, two servers' logs together):
    the id names neither for certain, so the sample joins by what it sent and when."""
    requests = [req("r1", "d1", 1, 5), req("r1", "d2", 2, 7), req("r2", "d3", 3, 9)]
    [j] = join_runs(
        [run("a", [sample("0", 1, Call("d1", "r1")), sample("1", 1, Call("d3", "r2"))])], requests
    )
    assert [[r.output_tokens for r in s.requests] for s in j.joined] == [[5], [9]]
    assert j.requests_unmatched == 1  # the other r1


def test_the_request_log_reader_names_a_request_id_logged_more_than_once(tmp_path):
    log = tmp_path / "requests.jsonl"
    lines = [LOGGED, {**LOGGED, "request_id": "q"}, LOGGED, LOGGED]
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    requests, [problem] = read_request_log(log)
    assert len(requests) == 4  # every copy kept: each is a request the server served
    assert problem.where == f"{log}:1" and problem.action == "kept"
    assert (
        problem.reason
        == "request_id 'r' is logged 3 times (lines 1, 3, 4): joined by what it sent, not by its id"
    )


def test_the_terminal_report_prints_names_from_the_inputs_as_they_are_never_as_markup():
    """Run labels, task names and problems come from files anyone may write: text like
    ``[/x]`` is printed as it is (rich would take it as a closing tag, and raise)."""
    import io

    from pte_instrument.offline.cost_render import print_cost_report

    requests = [req("a0", "d0", 1, 4), req("b0", "d0", 51, 6)]
    ra = run("[bold]a[/x]", [sample("0", 1, Call("d0"), task="t[/y]")], 0, 10)
    rb = run("b", [sample("0", 1, Call("d0"), task="t[/y]")], 50, 60)
    report = cost_report(join_runs([ra, rb], requests), "b", "log.jsonl", n_boot=0)
    out = io.StringIO()
    print_cost_report(report, out)
    assert "│ [bold]a[/x] │" in out.getvalue()  # verbatim, not bold
