"""The latency bench's analysis on synthetic data with known answers (no vLLM, no timing)."""

from __future__ import annotations

import gzip
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.latency.driver import DriverConfig, plan_session
from pte_instrument.offline import statistics as S
from pte_instrument.validation import analysis as A
from pte_instrument.validation.calibrate import calibrate_requests, calibrate_steps, fit_linear, gamma_at_hoi
from pte_instrument.validation.phases import Phase
from pte_instrument.validation.report import analyse_logs, write_report
from tests.bench.logs import request_line, step_lines

# ----------------------------------------------------------------------------- statistics


def test_pearson_spearman_hand_computed() -> None:
    x = [1, 2, 3, 4, 5]
    y = [2, 4, 5, 4, 5]
    # Σdxdy = 6, Σdx² = 10, Σdy² = 6 → 6/√60; ranks of y (1, 2.5, 4.5, 2.5, 4.5) → 7/√90
    assert A.pearson(x, y) == pytest.approx(6 / math.sqrt(60), abs=1e-12)
    assert A.spearman(x, y) == pytest.approx(7 / math.sqrt(90), abs=1e-12)
    cube = np.arange(1.0, 11.0)
    assert A.spearman(cube, cube**3) == pytest.approx(1.0)
    assert A.pearson(cube, cube**3) < 0.95
    assert A.pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(A.pearson([1, 1, 1], [1, 2, 3]))  # constant: undefined, not 0


def test_rankdata_ties_and_rows() -> None:
    np.testing.assert_array_equal(A.rankdata([10, 20, 20, 30]), [1, 2.5, 2.5, 4])
    np.testing.assert_array_equal(A.rankdata([5, 5, 5]), [2, 2, 2])
    rows = A.rankdata(np.array([[3, 1, 2, 2], [1, 1, 9, 0]]))
    np.testing.assert_array_equal(rows, [[4, 1, 2.5, 2.5], [2.5, 2.5, 4, 1]])


def test_non_finite_pairs_are_dropped() -> None:
    c = A.bootstrap_corr([1, 2, np.nan, 4, 5, 6], [1, 2, 3, np.inf, 5, 7], n_boot=50)
    assert c.n == 4


def test_bootstrap_reproducible_with_seed() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=200)
    y = 0.6 * x + rng.normal(size=200)
    a = A.bootstrap_corr(x, y, n_boot=300, seed=7)
    b = A.bootstrap_corr(x, y, n_boot=300, seed=7)
    c = A.bootstrap_corr(x, y, n_boot=300, seed=8)
    assert a == b
    assert a.pearson_ci != c.pearson_ci
    assert a.pearson_ci[0] < a.pearson < a.pearson_ci[1]
    assert a.spearman_ci[0] < a.spearman < a.spearman_ci[1]
    # Chunking the resamples differently gives the same rows, hence the same interval.
    d = A.bootstrap_corr(x, y, n_boot=300, seed=7, max_elems=1000)
    assert d == a


def test_count_weighted_resamples_equal_gathered_ones() -> None:
    """The bootstrap works on resample counts; it must equal ranking each resample."""
    rng = np.random.default_rng(9)
    x = rng.integers(0, 15, 60).astype(float)  # many ties
    y = x + rng.integers(0, 5, 60)
    idx = next(S.index_chunks(60, 4, np.random.default_rng(3), 10_000))
    W = next(S.count_chunks(60, 4, np.random.default_rng(3), 10_000))
    want_r = A.pearson_rows(x[idx], y[idx])
    want_rho = A.pearson_rows(A.rankdata(x[idx]), A.rankdata(y[idx]))
    np.testing.assert_allclose(S.weighted_pearson(W, x, y), want_r, rtol=1e-9)
    got_rho = S.weighted_pearson(W, S.resample_ranks(W, x), S.resample_ranks(W, y))
    np.testing.assert_allclose(got_rho, want_rho, rtol=1e-9)


def test_known_correlation_recovered() -> None:
    rng = np.random.default_rng(0)
    n, rho = 4000, 0.8
    x = rng.normal(size=n)
    y = rho * x + math.sqrt(1 - rho**2) * rng.normal(size=n)
    c = A.bootstrap_corr(x, y, n_boot=200)
    assert c.pearson_ci[0] < rho < c.pearson_ci[1]
    assert abs(c.pearson - rho) < 0.03


def test_paired_difference() -> None:
    rng = np.random.default_rng(2)
    t = rng.uniform(1, 2, 300)
    good = t + rng.normal(0, 0.02, 300)
    bad = t + rng.normal(0, 0.5, 300)
    d, lo, hi = A.bootstrap_pearson_diff(good, bad, t, n_boot=300)
    assert d > 0 and lo > 0 and hi >= d


def test_turn_level_means_over_sessions() -> None:
    sessions = ["a", "a", "a", "b", "b", "b", "c", "c"]
    turns = np.array([1, 2, 3, 1, 2, 3, 1, 2])
    vals = np.array([1.0, 2, 3, 3, 4, 5, 2, 3])
    M, keys = A.turn_matrix(sessions, turns, vals)
    assert keys == ["a", "b", "c"]
    np.testing.assert_array_equal(M[2], [2, 3, np.nan])
    # time = 2·cost per turn exactly → the per-turn means are perfectly correlated
    c = A.bootstrap_turn_corr(M, 2 * M, n_boot=100)
    assert c.n == 3 and c.pearson == pytest.approx(1.0)
    prof = A.turn_profile(sessions, turns, {"v": vals})
    assert prof["turn"] == [1, 2, 3] and prof["sessions"] == [3, 3, 2]
    assert prof["v"] == [2.0, 3.0, 4.0]


# ----------------------------------------------------------------------------- baselines


def _request(**kw: Any) -> dict[str, Any]:
    """40 of the 100 prompt tokens from the prefix cache (60 prefilled, 70.5 PTE served), on an
    H100 (HOI 295), in 0.3 s of inference."""
    line = request_line(cached=40, decode_pte=10.5, request_id="cmpl-x-0", hoi=295.0, device="h100-sxm")
    return {**line, "decode_s": 0.2, "inference_s": 0.3, "e2e_s": 0.31, **kw}


def test_baselines_on_a_hand_example() -> None:
    t = A.request_table([_request()])
    m = {x.name: float(x.values[0]) for x in A.request_metrics(t, gamma_calibrated=0.02)}
    assert m["output tokens"] == 10
    assert m["total tokens"] == 110
    assert m["uncached tokens"] == 70  # 100 − 40 + 10
    assert m["price 1:1.5"] == 115
    assert m["price 1:3"] == 130  # prompt + 3·output
    assert m["price 1:4"] == 140
    assert m["PTE served"] == 70.5
    assert m["PTE reference"] == 110
    # Σ context = pte_decode/γ = 1050; at γ 0.02: 60 + 21
    assert m["PTE served (γ calibrated)"] == pytest.approx(81.0)
    assert "roofline (engine)" not in m  # only with the engine hook


def test_engine_fields_used_when_present_either_spelling() -> None:
    for key in ("engine_roofline_pte", "engine_pte_roofline"):
        t = A.request_table([_request(**{key: 99.0, "engine_pte_served": 70.5})])
        m = {x.name: float(x.values[0]) for x in A.request_metrics(t)}
        assert m["roofline (engine)"] == 99.0 and m["PTE served (engine)"] == 70.5


def test_unusable_requests_dropped() -> None:
    t = A.request_table([_request(), _request(finish_reason="abort"), _request(inference_s=0.0)])
    assert len(A.usable_requests(t)) == 1


# ----------------------------------------------------------------------------- calibration


def _synthetic_steps(
    n: int, a: float, b: float, c: float, noise: float, seed: int = 0, gamma_header: float = 0.01
) -> list[dict]:
    """Steps of a mixed batch: some prefill chunks, decode samples with varying context."""
    rng = np.random.default_rng(seed)
    prefill = np.where(rng.random(n) < 0.3, rng.integers(16, 2048, n), 0)
    decode = rng.integers(1, 64, n)
    ctx = decode * rng.integers(100, 8000, n)
    t = a * prefill + b * ctx + c
    t = t * (1 + noise * rng.normal(size=n))
    header = {"header": True, "gammas": [gamma_header], "windows": [None], "weights_pte": 300.0}
    return [header, *step_lines(prefill, decode, ctx, t, decode + 1, 300.0, gamma_header)]


def test_calibration_recovers_gamma_within_2_percent() -> None:
    a, b, c = 2e-5, 1.5e-7, 4e-3  # γ = b/a = 0.0075; c/a = 200 prefill tokens per step
    steps = A.step_table(_synthetic_steps(3000, a, b, c, noise=0.03))
    cal = calibrate_steps(steps, n_boot=200)
    assert cal.gamma_measured == pytest.approx(b / a, rel=0.02)
    assert cal.gamma_ci[0] < b / a < cal.gamma_ci[1]
    assert cal.const_pte == pytest.approx(c / a, rel=0.05)
    assert cal.gamma_theory == pytest.approx(0.01)
    assert cal.r2 > 0.95
    assert abs(sum(cal.shares.values()) - 1) < 1e-9
    # The fitted step model predicts time: r with dt_s near 1.
    assert A.pearson(cal.predict_steps(steps), steps["dt_s"]) > 0.97


def test_fit_linear_exact_and_bootstrap_reproducible() -> None:
    rng = np.random.default_rng(3)
    x1, x2 = rng.uniform(0, 1e3, 200), rng.uniform(0, 1e6, 200)
    y = 3e-5 * x1 + 2e-8 * x2 + 1e-3
    f = fit_linear({"x1": x1, "x2": x2, "const": np.ones(200)}, y, n_boot=50, seed=1)
    np.testing.assert_allclose(f.coef, [3e-5, 2e-8, 1e-3], rtol=1e-8)
    g = fit_linear({"x1": x1, "x2": x2, "const": np.ones(200)}, y, n_boot=50, seed=1)
    np.testing.assert_array_equal(f.boot, g.boot)


def test_multi_group_context_is_gamma_weighted() -> None:
    recs = [
        {"header": True, "gammas": [0.03, 0.01]},
        {"dt_s": 1.0, "tokens": 1, "prefill": 0, "decode_tokens": 1, "ctx": [100.0, 20.0], "t": 0.0},
    ]
    s = A.step_table(recs)
    assert s.gamma == pytest.approx(0.04)
    assert s.ctx_w[0] == pytest.approx((0.03 * 100 + 0.01 * 20) / 0.04)


def test_request_calibration_recovers_coefficients() -> None:
    rng = np.random.default_rng(4)
    n, gamma = 400, 0.01
    prefill = rng.integers(20, 2000, n).astype(float)
    out = rng.integers(2, 200, n).astype(float)
    ctx = out * rng.integers(100, 6000, n)
    a, b, c, e = 5e-5, 5e-7, 3e-3, 0.01
    inf = a * prefill + b * ctx + c * (out - 1) + e
    recs = [
        _request(
            pte_prefill=float(p),
            pte_decode=float(gamma * x),
            output_tokens=int(o),
            gamma=gamma,
            inference_s=float(t),
        )
        for p, x, o, t in zip(prefill, ctx, out, inf, strict=True)
    ]
    cal = calibrate_requests(A.request_table(recs), n_boot=50)
    assert cal.gamma_measured == pytest.approx(b / a, rel=1e-6)
    assert cal.coef["decode_steps"] == pytest.approx(c, rel=1e-6)
    assert cal.dominant()[0] in cal.terms


def test_gamma_scales_with_hoi() -> None:
    assert gamma_at_hoi(0.0062, 756.5, 378.25) == pytest.approx(0.0031)


# ----------------------------------------------------------------------------- robustness


@dataclass(frozen=True)
class _P:
    hoi: float


PROFILES = {"base": _P(300.0), "low": _P(100.0), "high": _P(900.0)}


def test_robustness_rank_is_one_when_only_gamma_scales() -> None:
    pre = np.array([100.0, 250.0, 40.0, 900.0])
    dec = 0.7 * pre  # the same prefill/decode ratio everywhere
    scores = A.robustness(pre, dec, gamma=0.01, hoi=300.0, profiles=PROFILES, default="base")
    assert all(p.spearman_vs_default == pytest.approx(1.0) for p in scores)
    assert {p.device: p.gamma for p in scores}["low"] == pytest.approx(0.01 / 3)


def test_robustness_below_one_on_a_planted_case() -> None:
    # A: all prefill; B: all decode. B outranks A at the base HOI, not at a third of it.
    pre = np.array([1000.0, 0.0, 500.0])
    dec = np.array([0.0, 1500.0, 100.0])
    scores = {
        p.device: p for p in A.robustness(pre, dec, 0.01, 300.0, PROFILES, "base", time=[1.0, 1.4, 0.6])
    }
    assert scores["base"].spearman_vs_default == pytest.approx(1.0)
    assert scores["low"].spearman_vs_default < 1.0
    assert math.isfinite(scores["low"].pearson_vs_time)


# ----------------------------------------------------------------------------- logs and report


def test_load_jsonl_skips_torn_lines_and_reads_gzip(tmp_path: Path) -> None:
    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps({"a": 1}) + "\n\n" + '{"a": 2, "b"\n')
    assert A.load_jsonl(p) == [{"a": 1}]
    gz = tmp_path / "r.jsonl.gz"
    with gzip.open(gz, "wt") as fh:
        fh.write(json.dumps({"a": 3}) + "\n")
    assert A.load_jsonl(gz) == [{"a": 3}]
    assert A.load_jsonl(tmp_path / "missing.jsonl") == []


def _write_run(tmp: Path) -> list[Phase]:
    """A synthetic run: 2 phases of sessions whose time follows a known model."""
    rng = np.random.default_rng(5)
    reqs = []
    phases = []
    t0 = 1000.0
    for c in (1, 4):
        for s in range(6):
            ctx = 300.0
            for turn in range(1, 6):
                out = int(rng.integers(4, 80))
                pre = float(rng.integers(20, 600))
                dec = 0.02 * (ctx * out + out * (out - 1) / 2)
                inf = 5e-5 * pre + 2e-3 * out + 4e-6 * ctx * out + rng.normal(0, 1e-3)
                reqs.append(
                    _request(
                        session_id=f"c{c}-s{s:03d}",
                        turn=turn,
                        prompt_tokens=int(ctx),
                        output_tokens=out,
                        pte_prefill=pre,
                        pte_decode=dec,
                        pte_served=pre + dec,
                        pte_reference=ctx + 0.02 * ctx * out,
                        gamma=0.02,
                        inference_s=max(inf, 1e-3),
                        finished_at=t0 + c * 100 + turn,
                    )
                )
                ctx += out + pre
        phases.append(Phase(f"c{c}", c, t0 + c * 100 - 50, t0 + c * 100 + 50, f"c{c}"))
    (tmp / "requests.jsonl").write_text("\n".join(json.dumps(r) for r in reqs) + "\n")
    steps = _synthetic_steps(400, 2e-5, 1.5e-7, 4e-3, 0.05)
    for i, s in enumerate(steps[1:]):
        s["t"] = t0 + 50 + (i % 2) * 400 * 0 + (i / 400) * 100 + (0 if i < 200 else 300)
    (tmp / "steps.jsonl").write_text("\n".join(json.dumps(s) for s in steps) + "\n")
    return phases


def test_report_writer_produces_files_with_provenance(tmp_path: Path) -> None:
    phases = _write_run(tmp_path)
    a = analyse_logs(tmp_path / "requests.jsonl", tmp_path / "steps.jsonl", phases, n_boot=50)
    assert a.step_fit is not None and a.request_fit is not None
    assert {lv.level for lv in a.levels} == {"step", "request", "turn"}
    assert a.targets and all(t.name for t in a.targets)
    meta = {
        "date": "2026-11-30T00:00:00+00:00",
        "git_commit": "abc",
        "machine": {"platform": "x", "cpu_count": 2},
        "config": {"model_preset": "synthetic"},
    }
    pytest.importorskip("matplotlib")
    files = write_report(a, meta, tmp_path / "out")
    names = {f.name for f in files}
    assert {"report.json", "report.md", "scatter-step.png", "turns.png"} <= names
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    for key in ("machine", "date", "git_commit", "config", "analysis"):
        assert key in data
    assert data["machine"]["cpu_count"] == 2
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Targets" in md and "Request level" in md
    missed = [t for t in a.targets if t.met is False]
    assert all(t.diagnosis for t in missed)  # every miss says why


def test_the_targets_find_their_metrics_by_identifier_not_by_label(tmp_path: Path, monkeypatch) -> None:
    """A metric's display label renamed where it is declared: every target still finds it."""
    phases = _write_run(tmp_path)

    def step_targets() -> dict[str, float]:
        a = analyse_logs(tmp_path / "requests.jsonl", tmp_path / "steps.jsonl", phases, n_boot=20)
        return {t.name: t.value for t in a.targets if t.name.startswith("step r(")}

    before = step_targets()
    assert len(before) == 2 and all(math.isfinite(v) for v in before.values())
    monkeypatch.setattr(A, "STEP_MODEL", "the step model, renamed")
    monkeypatch.setattr(A, "STEP_PTE", "PTE, renamed")
    assert step_targets() == before


def test_report_degrades_without_step_log(tmp_path: Path) -> None:
    phases = _write_run(tmp_path)
    a = analyse_logs(tmp_path / "requests.jsonl", tmp_path / "nope.jsonl", phases, n_boot=20)
    assert a.steps is None and a.step_fit is None
    assert any("no step log" in n for n in a.notes)
    assert {lv.level for lv in a.levels} == {"request", "turn"}
    assert a.cost_model["gamma_calibrated_source"] == "requests at concurrency 1"
    write_report(a, {"config": {}}, tmp_path / "out", plots=False)
    assert "no step log" in (tmp_path / "out" / "report.md").read_text()


# ----------------------------------------------------------------------------- driver plan, CLI hook


def test_session_plans_are_seeded_and_vary() -> None:
    cfg = DriverConfig(turns=20, output_tokens=(8, 96), p_long=0.3, seed=3)
    a, b = plan_session(cfg, 5), plan_session(cfg, 5)
    assert a == b
    assert plan_session(cfg, 6) != a
    _, plan = a
    assert len({p.max_tokens for p in plan}) > 5
    assert all(8 <= p.max_tokens <= 96 for p in plan)
    assert any(p.tool_long for p in plan) and not all(p.tool_long for p in plan)


def test_bench_cli_passes_arguments_through() -> None:
    import argparse

    from pte_instrument.cli.bench import add_bench_parser, bench_command, bench_env, repo_root

    p = argparse.ArgumentParser()
    add_bench_parser(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(["bench", "latency", "--model-preset", "tiny", "--help"])
    assert args.bench_args == ["--model-preset", "tiny", "--help"]
    root = repo_root()
    assert root is not None
    cmd = bench_command("latency", args.bench_args, root)
    # the bench runs as a module of the checkout: the root first on the child's sys.path and PYTHONPATH
    assert cmd[3:6] == [str(root), "bench.latency.run", "--model-preset"]
    assert cmd[6:] == ["tiny", "--help"]
    assert bench_env(root, {})["PYTHONPATH"].split(os.pathsep)[0] == str(root)
