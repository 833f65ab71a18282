"""Cost per correct answer from the real evaluation harnesses: the ``lm_eval`` and ``inspect
eval`` commands run a local task (shipped in tests/fixtures/harness, nothing downloaded)
against a real server with the plugin, at two ``max_tokens`` limits each; ``pte efficiency``
then reads their own outputs and the request log. Every figure it reports is checked against
a computation made here from the harnesses' per-sample scores and the log alone."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import time
from pathlib import Path

import pytest

from pte_instrument.devtools.harnesses import BIN, offline_env, run_inspect, run_lm_eval
from tests.helpers import jsonl, wait

FIXTURES = Path(__file__).parents[1] / "fixtures" / "harness"
LIMITS = (4, 16)  # max_tokens of the two runs of each harness: the short one truncates more
UNITS = {
    "output_tokens": "output_tokens",
    "pte": "pte_served",
    "gpu_seconds": "gpu_seconds",
    "cost_usd": "cost_usd",
}


@pytest.fixture(scope="module")
def evaluated(timed_server, tmp_path_factory):
    """Both harnesses at both limits, one after the other; the time span they ran in."""
    vllm, work, _ = timed_server
    out = tmp_path_factory.mktemp("harness")
    env = offline_env(out)
    started = time.time()
    for n in LIMITS:
        run_lm_eval(vllm.url, vllm.served_name, FIXTURES, "letters", out / f"lm-{n}", n, env)
        run_inspect(
            vllm.url, vllm.served_name, FIXTURES, "letters_inspect.py", out / f"inspect-{n}", n, env, stop="e"
        )
    ended = time.time()
    log = work / "requests.jsonl"
    harness_requests = len(LIMITS) * 12 * 3  # lm-eval: one request a sample; Inspect: two
    assert wait(lambda: sum(started <= e["arrived_at"] <= ended for e in jsonl(log)) == harness_requests)
    report = out / "report"
    done = subprocess.run(
        [
            str(BIN / "pte"),
            "efficiency",
            *(str(out / f"{h}-{n}") for h in ("lm", "inspect") for n in LIMITS),
            "--request-log",
            str(log),
            "--labels",
            ",".join(f"{h}-{n}" for h in ("lm", "inspect") for n in LIMITS),
            "--bootstrap",
            "200",
            "--json",
            "--plots",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return out, log, (started, ended), json.loads(done.stdout), report


def chat_digest(messages: list[dict]) -> str:
    """The documented digest, computed here from its definition."""
    pairs = [[m["role"], m["content"]] for m in messages]
    return hashlib.sha256(
        json.dumps(["chat", pairs], ensure_ascii=False, separators=(",", ":")).encode()
    ).hexdigest()


def hand_join(out: Path, log: Path, window: tuple[float, float]) -> dict[str, list[tuple[float, list[dict]]]]:
    """Each run's samples as (score, the log lines that served it), joined here: Inspect's calls
    by their response ids, lm-eval's by digest (each question once a run, the runs in order)."""
    from inspect_ai.event import ModelEvent
    from inspect_ai.log import read_eval_log

    lines = [e for e in jsonl(log) if window[0] <= e["arrived_at"] <= window[1]]
    by_id = {e["request_id"]: e for e in lines}
    runs: dict[str, list[tuple[float, list[dict]]]] = {}
    taken: set[str] = set()
    for n in LIMITS:
        [path] = (out / f"inspect-{n}").glob("*.eval")
        samples = []
        for s in read_eval_log(str(path)).samples:
            ids = [e.output.response_id for e in s.events if isinstance(e, ModelEvent)]
            taken.update(ids)
            score = {"C": 1.0, "I": 0.0}[s.scores["includes"].value]
            samples.append((score, [by_id[i] for i in ids]))
        runs[f"inspect-{n}"] = samples
    rest = sorted((e for e in lines if e["request_id"] not in taken), key=lambda e: e["arrived_at"])
    for k, n in enumerate(LIMITS):
        [path] = (out / f"lm-{n}").rglob("samples_letters_*.jsonl")
        samples = []
        for row in jsonl(path):
            digest = chat_digest(json.loads(row["arguments"]["gen_args_0"]["arg_0"][0]))
            served = [e for e in rest if e["prompt_digest"] == digest]
            assert len(served) == len(LIMITS)  # the question, asked once by each lm-eval run
            samples.append((row["contains"], [served[k]]))
        runs[f"lm-{n}"] = samples
    return runs


def figures(samples: list[tuple[float, list[dict]]]) -> dict[str, float]:
    n = len(samples)
    correct = [s >= 1 for s, _ in samples]
    cut = [
        reqs[-1]["finish_reason"] == "length" and not c for c, (_, reqs) in zip(correct, samples, strict=True)
    ]
    sums = {u: sum(e[f] for _, reqs in samples for e in reqs) for u, f in UNITS.items()}
    S, C = sum(correct), sum(cut)
    return {
        "n": n,
        "S": S,
        "accuracy": S / n,
        "completion_rate": 1 - C / n,
        "conditional_correctness": S / (n - C),
        "e0": 1000 * S / sums["output_tokens"],
        "mean_output_tokens": sums["output_tokens"] / n,
        **{f"per_correct_{u}": v / S for u, v in sums.items()},
        **{f"sum_{u}": v for u, v in sums.items()},
    }


def test_both_harnesses_outputs_are_joined_and_priced_as_computed_by_hand(evaluated):
    out, log, window, report, plots = evaluated
    cost = report["cost_per_correct"]
    by_hand = {label: figures(samples) for label, samples in hand_join(out, log, window).items()}
    # every sample joined, every request of the window joined to one
    for r in cost["runs"]:
        assert r["samples"] == r["samples_joined"] == 12 and r["samples_unmatched"] == 0, r
        assert r["requests_unmatched"] == 0 and r["requests_joined"] == (
            24 if r["harness"] == "inspect" else 12
        )
    # the joined requests' totals are the log's over the window the harnesses ran in
    lines = [e for e in jsonl(log) if window[0] <= e["arrived_at"] <= window[1]]
    tasks = {(t["run"]): t for t in cost["tasks"]}
    for unit, field in UNITS.items():
        joined = sum(t["cost_per_sample"][unit]["value"] * t["samples"] for t in tasks.values())
        assert joined == pytest.approx(sum(e[field] for e in lines), rel=1e-9)
    # the data makes some answers right and some wrong, and the short limit truncates
    assert all(0 < f["S"] < f["n"] for f in by_hand.values())
    assert tasks["lm-4"]["completion_rate"]["value"] < tasks["lm-16"]["completion_rate"]["value"]
    for label, f in by_hand.items():
        t = tasks[label]
        for name in ("accuracy", "completion_rate", "conditional_correctness", "e0", "mean_output_tokens"):
            assert t[name]["value"] == pytest.approx(f[name], rel=1e-9), (label, name)
            assert t[name]["low"] <= t[name]["value"] <= t[name]["high"]
        for unit in UNITS:
            assert t["cost_per_correct"][unit]["value"] == pytest.approx(f[f"per_correct_{unit}"], rel=1e-9)
    # the harnesses' own aggregate scores agree with what was read of their samples
    from inspect_ai.log import read_eval_log

    for n in LIMITS:
        [results] = (out / f"lm-{n}").rglob("results_*.json")
        assert json.loads(results.read_text())["results"]["letters"]["contains,none"] == pytest.approx(
            by_hand[f"lm-{n}"]["accuracy"]
        )
        [path] = (out / f"inspect-{n}").glob("*.eval")
        own = read_eval_log(str(path), header_only=True).results.scores[0].metrics["accuracy"].value
        assert own == pytest.approx(by_hand[f"inspect-{n}"]["accuracy"])
    # each longer-limit run against its harness's shorter one: the ratio and its four terms
    comparisons = {c["run"]: c for c in cost["comparisons"]}
    for h in ("lm", "inspect"):
        a, b = by_hand[f"{h}-4"], by_hand[f"{h}-16"]
        c = comparisons[f"{h}-16"]
        assert c["reference"] == f"{h}-4" and c["shared_samples"] == 12
        for unit in UNITS:
            u = c["units"][unit]
            ratio = b[f"per_correct_{unit}"] / a[f"per_correct_{unit}"]
            terms = {
                "verbosity": math.log(b["mean_output_tokens"] / a["mean_output_tokens"]),
                "price_per_token": math.log(
                    (b[f"sum_{unit}"] / b["sum_output_tokens"]) / (a[f"sum_{unit}"] / a["sum_output_tokens"])
                ),
                "truncation": -math.log(b["completion_rate"] / a["completion_rate"]),
                "logic": -math.log(b["conditional_correctness"] / a["conditional_correctness"]),
            }
            assert u["ratio"]["value"] == pytest.approx(ratio, rel=1e-9)
            for term, value in terms.items():
                assert u["terms"][term]["value"] == pytest.approx(value, rel=1e-9, abs=1e-12), (h, unit, term)
            assert sum(terms.values()) == pytest.approx(math.log(ratio), abs=1e-12)
            sign = 1 if ratio >= 1 else -1
            assert u["dominant"] == max(terms, key=lambda t: sign * terms[t])
    # the decomposition ran on the same samples, and the plots were written
    decomposition = report["decomposition"]
    assert set(decomposition["benchmarks"]) == {"lm-eval:letters", "inspect:letters"}
    for h in ("lm", "inspect"):
        outcome = decomposition["benchmarks"][f"{'lm-eval' if h == 'lm' else 'inspect'}:letters"]["views"][
            "outcome"
        ]
        for n in LIMITS:
            q = outcome["models"][f"{h}-{n}"]["quantities"]
            f = by_hand[f"{h}-{n}"]
            assert q["e0"]["value"] == pytest.approx(f["e0"], rel=1e-9)
            assert q["accuracy"]["value"] == pytest.approx(f["accuracy"], rel=1e-9)
        # the decomposition's Δlog E0 is the token comparison's, with its sign turned
        d = outcome["models"][f"{h}-16"]["decomposition"]["dlog_e0"]["value"]
        assert d == pytest.approx(
            -math.log(comparisons[f"{h}-16"]["units"]["output_tokens"]["ratio"]["value"]), rel=1e-9
        )
    assert (plots / "cost_per_correct.png").stat().st_size > 0 and (
        plots / "cost_terms.png"
    ).stat().st_size > 0
