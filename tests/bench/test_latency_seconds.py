"""The latency bench's engine-seconds metrics and four-term step model on synthetic request and
step logs with known relationships (no vLLM, no timing)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from bench.latency import driver as D
from pte_instrument.cost.devices import DeviceProfile
from pte_instrument.cost.step_time import StepTimeModel
from pte_instrument.validation import analysis as A
from pte_instrument.validation import seconds as S
from pte_instrument.validation import step_model as SM
from pte_instrument.validation.phases import Phase
from pte_instrument.validation.report import MATCHED_PRIMARY, analyse_logs, write_report
from tests.bench.logs import request_line, step_lines

REPO = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------- ratios


def test_ratio_summary_hand_computed() -> None:
    num = [0.9, 0.95, 0.97, 0.98, 1.0, 5.0]
    den = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]  # the last row has no time: dropped
    r = S.ratio_summary("x", num, den, threshold=0.97, n_boot=200, seed=1)
    assert r.n == 5
    assert r.median == pytest.approx(0.97)
    assert r.share_at_least == pytest.approx(3 / 5)  # 0.97, 0.98, 1.0
    assert r.quantiles["p25"] == pytest.approx(0.95) and r.quantiles["p75"] == pytest.approx(0.98)
    assert 0.9 <= r.median_ci[0] <= r.median <= r.median_ci[1] <= 1.0
    assert 0.0 <= r.share_ci[0] <= r.share_at_least <= r.share_ci[1] <= 1.0
    assert r == S.ratio_summary("x", num, den, threshold=0.97, n_boot=200, seed=1)  # seeded


def test_ratio_summary_empty_and_unbootstrapped() -> None:
    empty = S.ratio_summary("x", [np.nan], [1.0], 0.5)
    assert empty.n == 0 and math.isnan(empty.median)
    one = S.ratio_summary("x", [2.0, 4.0], [4.0, 4.0], 0.6, n_boot=0)
    assert one.median == pytest.approx(0.75) and one.share_at_least == pytest.approx(0.5)
    assert all(math.isnan(v) for v in one.median_ci)


def _req(**kw: Any) -> dict[str, Any]:
    """A request line with the step hook's seconds: 0.98 of its 1 s of inference on the GPU."""
    seconds = {
        "gpu_seconds": 0.98,
        "gpu_seconds_prefill": 0.2,
        "gpu_seconds_kv_read": 0.08,
        "gpu_seconds_weights": 0.3,
        "gpu_seconds_overhead": 0.4,
        "predicted_seconds": 1.0,
        "latency_explained_s": 0.98,
        "interference_s": 0.0,
    }
    return {**request_line(), **seconds, **kw}


def test_attribution_and_coverage_on_requests() -> None:
    # coverage divides by inference + queue: (0.5 + 0.4) / (0.6 + 0.4) = 0.9
    t = A.request_table(
        [
            _req(gpu_seconds=0.97, inference_s=1.0),
            _req(gpu_seconds=0.5, inference_s=0.6, queued_s=0.4, latency_explained_s=0.9),
            _req(gpu_seconds=None, inference_s=1.0),
        ]
    )
    att = S.attribution(t, 0.97, n_boot=0)
    assert att.n == 2 and att.median == pytest.approx((0.97 + 0.5 / 0.6) / 2)
    cov = S.coverage(t, 0.95, n_boot=0)
    assert sorted(S.ratios(t["latency_explained_s"], t["inference_s"] + t["queued_s"])) == pytest.approx(
        [0.9, 0.98, 0.98]
    )
    assert cov.n == 3 and cov.median == pytest.approx(0.98) and cov.share_at_least == pytest.approx(2 / 3)


def test_request_table_reads_the_seconds_fields() -> None:
    t = A.request_table([_req()])
    for k in A.SECONDS_FIELDS[:-1]:
        assert t.has(k), k
    assert not t.has("cost_usd")  # absent without a price
    names = {m.name: float(m.values[0]) for m in A.request_metrics(t)}
    assert names[A.PREDICTED] == 1.0 and names[A.GPU_SECONDS] == 0.98


# ----------------------------------------------------------------------------- matching


def test_session_index() -> None:
    assert S.session_index("c16-s003") == 3
    assert S.session_index("warmup-s011") == 11
    assert S.session_index(f"c64-{D.session_name(42)}") == 42
    for bad in ("foo", "c1-sx", None, "c1-s"):
        assert S.session_index(bad) is None


def test_match_requests_by_session_index_and_turn() -> None:
    alone = A.request_table([_req(session_id=f"c1-s{s:03d}", turn=t) for s in range(3) for t in (1, 2)])
    load_recs = [_req(session_id=f"c16-s{s:03d}", turn=t) for s in range(5) for t in (1, 2, 3)]
    load_recs += [
        _req(session_id="c16-s001", turn=2),
        _req(session_id="other", turn=1),
    ]  # a duplicate key; no index
    load = A.request_table(load_recs)
    il, ia = S.match_requests(load, alone)
    # sessions 0–2, turns 1–2, less (1, 2), seen twice under load
    got = [(S.session_index(load.session_id[i]), int(load.turn[i])) for i in il]
    assert got == [(0, 1), (0, 2), (1, 1), (2, 1), (2, 2)]
    assert [(S.session_index(alone.session_id[i]), int(alone.turn[i])) for i in ia] == got


def test_matched_spearman_is_one_for_a_monotone_relation(tmp_path: Path) -> None:
    phases = _write_seconds_run(tmp_path)
    a = analyse_logs(tmp_path / "requests.jsonl", None, phases, n_boot=100)
    lv = a.level("matched", "c16")
    assert lv is not None and lv.n == 40
    m = lv.get(MATCHED_PRIMARY)  # predicted seconds under load = inference alone
    assert m.kind == "model" and m.corr.spearman == pytest.approx(1.0)
    facts = a.seconds["c16"]["matched"]
    assert facts["prompt_tokens_equal"] == 1.0 and facts["n"] == 40


# ----------------------------------------------------------------------------- gaps, drift, residual terms


def test_gaps_between_steps_hand_computed() -> None:
    t = np.array([2.0, 0.0, 1.0, 10.0])  # out of order; the 10 s gap is idle time
    dt = np.array([0.5, 0.9, 0.8, 0.1])
    g = S.gaps_between_steps(t, dt)
    # gaps: 1.0 − 0.9 = 0.1, 2.0 − 1.8 = 0.2 (the 7.5 s one is left out)
    assert g["n"] == 2 and g["median_s"] == pytest.approx(0.15)
    assert g["share_of_step_time"] == pytest.approx(0.3 / (0.3 + 2.3), rel=1e-5)  # dt of every step


def test_alone_step_sums_take_the_steps_inside_each_request() -> None:
    t = A.request_table(
        [_req(arrived_at=10.0, e2e_s=1.0), _req(arrived_at=12.0, e2e_s=0.5), _req(arrived_at=None)]
    )
    step_t = np.array([12.5, 9.9, 10.0, 10.4, 11.0, 11.5, 12.2])
    vals = np.array([100.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0])
    got = S.alone_step_sums(t, step_t, vals)
    # [10, 11]: 2 + 4 + 8; [12, 12.5]: 32 + 100; no arrival time: NaN
    assert got[:2].tolist() == [14.0, 132.0] and math.isnan(got[2])


def test_drift_tells_a_slowing_host_from_independent_errors() -> None:
    rng = np.random.default_rng(0)
    n = 200
    measured = rng.uniform(0.5, 2.0, n)
    when = np.arange(n, dtype=float)
    slow = 1.0 + 0.5 * np.sin(when / 20)  # the host's speed drifts
    assert S.drift(measured / slow, measured, when) > 0.9
    assert abs(S.drift(measured * rng.uniform(0.8, 1.2, n), measured, when)) < 0.2


def test_residual_terms_name_the_term_the_error_follows() -> None:
    rng = np.random.default_rng(1)
    recs = [
        _req(pte_prefill=float(p), pte_decode=float(0.01 * c), output_tokens=int(o))
        for p, c, o in zip(
            rng.integers(10, 1000, 50), rng.integers(100, 9000, 50), rng.integers(5, 90, 50), strict=True
        )
    ]
    t = A.request_table(recs)
    shares = S.residual_terms(t, 3e-4 * t["pte_prefill"])
    assert shares["prefill"] == pytest.approx(1.0, abs=1e-6)
    shares = S.residual_terms(t, 2e-3 * t["output_tokens"])
    assert shares["steps"] == pytest.approx(1.0, abs=1e-6)


# ----------------------------------------------------------------------------- the four-term step model

TRUE = StepTimeModel(a=2e-4, b=3e-6, w=0.010, o=0.005)
HEADER = {
    "header": True,
    "engine": 0,
    "gammas": [0.01],
    "windows": [None],
    "n_active": 8e7,
    "n_total": 9e7,
    "hoi": 3.0,
    "device": "h100-sxm@hoi=3",
    "weights_pte": 6.75,
}


def _steps(
    n: int,
    noise: float = 0.0,
    seed: int = 0,
    model: StepTimeModel = TRUE,
    drift: bool = False,
    per_decode: float = 0.0,
) -> list[dict[str, Any]]:
    """Steps of mixed batches whose dt follows ``model`` (+ optional noise, a host drifting in
    speed, a per-decode-token term the model does not have). Memory-bound as the engine logs
    it: roofline_pte > tokens."""
    rng = np.random.default_rng(seed)
    prefill = np.where(rng.random(n) < 0.25, rng.integers(16, 2048, n), 0)
    decode = rng.integers(1, 32, n)
    ctx = decode * rng.integers(100, 4000, n).astype(float)
    tokens = prefill + decode
    kv_pte = 0.01 * ctx
    mb = tokens < HEADER["weights_pte"] + kv_pte
    n_reqs = decode + (prefill > 0) + rng.integers(0, 8, n)  # some requests sit a step out
    dt = model.predict(prefill, ctx, mb) + per_decode * decode
    dt = dt * (1 + noise * rng.normal(size=n))
    if drift:
        dt = dt * (1 + 0.3 * np.sin(np.arange(n) / 50))
    return [dict(HEADER), *step_lines(prefill, decode, ctx, dt, n_reqs, HEADER["weights_pte"], 0.01)]


def test_step_columns_classify_memory_bound_as_the_engine() -> None:
    s = A.step_table(_steps(300))
    c = SM.step_columns(s)
    want = (s["tokens"] < HEADER["weights_pte"] + 0.01 * s.ctx_w).astype(float)
    np.testing.assert_array_equal(c.memory_bound, want)
    assert 0 < c.memory_bound.mean() < 1  # both kinds present: w and o are told apart


def test_four_term_fit_recovers_the_model_and_scores_zero_error() -> None:
    s = A.step_table(_steps(2000))
    subsets = {"all": np.ones(len(s), bool), "decode-only": s["prefill"] == 0}
    a = SM.analyse_step_model(s, subsets, None, None, n_boot=50)
    for t in ("a", "b", "w", "o"):
        assert getattr(a.fit.model, t) == pytest.approx(getattr(TRUE, t), rel=1e-6)
    for subset in subsets:
        sc = a.get(SM.FITTED, subset)
        assert sc.mape == pytest.approx(0.0, abs=1e-9) and sc.corr.pearson == pytest.approx(1.0)
    shares = sum(e.ape_share for e in a.errors["all"])
    assert math.isnan(shares) or shares == pytest.approx(1.0)


def test_four_term_mape_with_known_noise() -> None:
    # multiplicative N(0, 0.05) noise: E|pred − dt|/dt = E|ε|/(1+ε) ≈ 0.05·√(2/π) ≈ 0.040
    s = A.step_table(_steps(6000, noise=0.05, seed=3))
    a = SM.analyse_step_model(s, {"all": np.ones(len(s), bool)}, None, None, n_boot=50)
    sc = a.get(SM.FITTED, "all")
    assert sc.mape == pytest.approx(0.05 * math.sqrt(2 / math.pi), rel=0.08)
    assert sc.mape_ci[0] < sc.mape < sc.mape_ci[1]
    assert sum(e.ape_share for e in a.errors["all"]) == pytest.approx(1.0)
    assert sum(e.sq_share for e in a.errors["all"]) == pytest.approx(1.0)


def test_dominant_terms_and_theory_error_by_term_hand_computed() -> None:
    m = StepTimeModel(a=1.0, b=0.1, w=5.0, o=2.0)
    c = SM.StepColumns(
        np.array([10.0, 0, 0, 1]), np.array([0.0, 100, 1, 0]), np.array([0.0, 1, 1, 0]), np.ones(4)
    )
    # step 0: a·10 = 10 (a); 1: b·100 = 10 > w 5 (b); 2: w 5 (w); 3: o 2 > a·1 (o)
    np.testing.assert_array_equal(SM.dominant_terms(m, c), [0, 1, 2, 3])
    th = StepTimeModel(a=1.0, b=0.1, w=5.0, o=3.0)  # only o differs, by 1 s per step
    assert SM.theory_term_errors(th, m, c) == {"a": 0.0, "b": 0.0, "w": 0.0, "o": 1.0}


def test_residual_leads_find_a_missing_decode_term_and_drift() -> None:
    s = A.step_table(_steps(3000, per_decode=2e-3, seed=4))
    leads = SM.residual_leads(TRUE, s, s["prefill"] == 0)  # decode-only: prefill² is constant there
    assert math.isnan(leads["prefill_squared"])
    assert max((k for k in leads if math.isfinite(leads[k])), key=lambda k: abs(leads[k])) == "decode_tokens"
    assert leads["decode_tokens"] > 0.2
    s = A.step_table(_steps(3000, drift=True, seed=5))
    leads = SM.residual_leads(TRUE, s)
    assert leads["previous_residual"] > 0.9 and abs(leads["decode_tokens"]) < 0.2
    a = SM.analyse_step_model(s, {"all": np.ones(len(s), bool)}, None, None, n_boot=0)
    assert "previous step's residual" in SM.explain_step_miss(a, "all", "mape")


def test_theory_from_the_header_and_the_host() -> None:
    shape, weight_bytes = SM.shape_from_header(HEADER)
    per_gamma = 2 * HEADER["n_active"] / HEADER["hoi"]
    assert shape.kv_bytes_per_token == pytest.approx(0.01 * per_gamma)
    assert weight_bytes == pytest.approx(HEADER["weights_pte"] * per_gamma / HEADER["n_total"])
    host = DeviceProfile("measured:host", peak_flops=8e10, mem_bandwidth=2e10, source="test")
    th = SM.build_theory(HEADER, None, "float32", host)
    assert th is not None and th.shape_source == "step log header"
    assert th.model.a == pytest.approx(2 * HEADER["n_active"] / 8e10)  # fractions 1 on a measured host
    assert th.model.b == pytest.approx(0.01 * per_gamma / 2e10)
    assert th.model.w == pytest.approx(HEADER["n_total"] * weight_bytes / 2e10)
    assert th.model.o == pytest.approx(12e-3)  # the measured CPU overhead
    # without a host: the header's profile, HOI overridden
    th2 = SM.build_theory(HEADER, None)
    assert th2 is not None and "h100-sxm" in th2.device and th2.notes
    assert SM.build_theory(None, None) is None


def test_theory_from_the_model_dir(tmp_path: Path) -> None:
    cfg = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
        "torch_dtype": "float32",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    host = DeviceProfile("measured:host", peak_flops=1e11, mem_bandwidth=1e10, source="test")
    th = SM.build_theory(None, tmp_path, "float32", host)
    assert th is not None and th.shape_source == "model dir"
    # KV: 2 layers × 2 heads × 16 dims × K,V × 4 bytes = 512 bytes per token
    assert th.model.b == pytest.approx(512 / 1e10)


def test_engine_online_model_from_the_summary() -> None:
    m = SM.engine_online_model({"0": {"a": 1e-4, "b": 2e-7, "w": 0.0, "o": 3e-3, "source": "online"}})
    assert m is not None and m.o == 3e-3 and "online" in m.source
    assert SM.engine_online_model(None) is None and SM.engine_online_model({"0": {"a": None}}) is None


# ----------------------------------------------------------------------------- the whole report


def _write_seconds_run(tmp: Path, with_steps: bool = False) -> list[Phase]:
    """c1: 8 sessions × 5 turns, gpu = 0.98·inference, predicted = gpu + 1% noise;
    c16: 16 sessions × 5 turns (the first 8 replay c1's), gpu = 0.4·(inference alone) and
    latency explained = 0.9·(inference + queue)."""
    rng = np.random.default_rng(7)
    plan = {
        (s, t): (int(rng.integers(20, 800)), int(rng.integers(8, 90))) for s in range(16) for t in range(1, 6)
    }

    def turn(phase: str, s: int, t: int, **kw: Any) -> dict[str, Any]:
        """Session ``s``'s turn ``t`` in ``phase``: the plan's prompt, all of it prefilled."""
        pre, out = plan[(s, t)]
        return _req(
            session_id=f"{phase}-s{s:03d}",
            turn=t,
            prompt_tokens=pre,
            pte_prefill=float(pre),
            output_tokens=out,
            **kw,
        )

    recs = []
    alone = {}
    for (s, t), (pre, out) in plan.items():
        inf = 1e-4 * pre + 3e-3 * out + 1e-6 * pre * out
        alone[(s, t)] = inf
        if s < 8:
            gpu = 0.98 * inf
            recs.append(
                turn(
                    "c1",
                    s,
                    t,
                    pte_served=pre + 0.01 * pre * out,
                    inference_s=inf,
                    gpu_seconds=gpu,
                    latency_explained_s=gpu,
                    predicted_seconds=gpu * (1 + 0.01 * rng.normal()),
                    finished_at=100.0 + s * 10 + t,
                )
            )
    for s, t in plan:
        inf, queued = 3.0 * alone[(s, t)], 0.05
        recs.append(
            turn(
                "c16",
                s,
                t,
                inference_s=inf,
                queued_s=queued,
                gpu_seconds=0.4 * alone[(s, t)] + 1e-9 * s,
                latency_explained_s=0.9 * (inf + queued),
                predicted_seconds=alone[(s, t)],
                finished_at=500.0 + s + t,
            )
        )
    (tmp / "requests.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    phases = [Phase("c1", 1, 50.0, 400.0, "c1"), Phase("c16", 16, 450.0, 700.0, "c16")]
    if with_steps:
        steps = _steps(1500, noise=0.002, seed=9)
        for i, st in enumerate(steps[1:]):
            st["t"] = 60.0 + i * 0.2 if i < 1000 else 460.0 + (i - 1000) * 0.2
        (tmp / "steps.jsonl").write_text("\n".join(json.dumps(s) for s in steps) + "\n")
    return phases


def test_targets_on_a_synthetic_run(tmp_path: Path) -> None:
    phases = _write_seconds_run(tmp_path, with_steps=True)
    host = DeviceProfile("measured:host", peak_flops=8e10, mem_bandwidth=2e10, source="test")
    a = analyse_logs(
        tmp_path / "requests.jsonl", tmp_path / "steps.jsonl", phases, n_boot=100, host_profile=host
    )
    t = {x.name: x for x in a.targets}
    pred = t["c=1 r(predicted_seconds, inference_s)"]
    assert pred.met is True and pred.value > 0.99 and pred.ci[0] <= pred.value <= pred.ci[1]
    above = t["c=1 predicted_seconds above every token baseline and PTE served"]
    assert above.met is True and above.value > 0 and "of 7" in above.detail  # 6 token baselines + PTE served
    att = t["c=1 gpu_seconds / inference_s (median)"]
    assert att.value == pytest.approx(0.98) and att.met is True
    cov = t["c=16 latency explained / (inference_s + queued_s) (median)"]
    assert cov.value == pytest.approx(0.9) and cov.met is False and cov.diagnosis
    rho = t["c=16 Spearman(predicted_seconds under load, inference_s alone)"]
    assert rho.value == pytest.approx(1.0) and rho.met is True
    mape = t["step MAPE, four-term fit, all steps"]
    assert mape.value < 0.01 and mape.met is True
    dec = t["step r, four-term fit, decode-only steps"]
    assert dec.value > 0.98 and dec.met is True
    assert all(x.diagnosis for x in a.targets if x.met is False)  # every miss says why
    meta = {
        "config": {"model_preset": "synthetic"},
        "machine": {"load_avg_1m": 3.5, "cpu_count": 2},
        "load_avg_1m_end": 1.0,
    }
    write_report(a, meta, tmp_path / "out", plots=False)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Engine seconds per request" in md and "## Step-time model (four terms)" in md
    assert "under load vs the same request alone" in md and "r(predicted seconds) − r(metric)" in md
    assert "other load on the machine" in md  # load average 3.5 > 3
    # the run's own server and client keep a 2-core host at about 2: that is no other load
    quiet = {**meta, "machine": {"load_avg_1m": 2.3, "cpu_count": 2}}
    write_report(a, quiet, tmp_path / "quiet", plots=False)
    assert "other load on the machine" not in (tmp_path / "quiet" / "report.md").read_text()
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    an = data["analysis"]
    assert an["seconds"]["c1"]["attribution"]["median"] == pytest.approx(0.98)
    assert an["step_model"]["fit"]["n"] == 1500
    assert {x["name"] for x in an["targets"]} >= set(t)


def test_seconds_targets_say_when_the_log_has_no_engine_seconds(tmp_path: Path) -> None:
    recs = [
        _req(
            session_id=f"c1-s{i:03d}",
            gpu_seconds=None,
            predicted_seconds=None,
            latency_explained_s=None,
            inference_s=0.1 + i / 10,
        )
        for i in range(10)
    ]
    (tmp_path / "requests.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    a = analyse_logs(tmp_path / "requests.jsonl", None, [Phase("c1", 1, 0.0, 10.0, "c1")], n_boot=20)
    t = next(x for x in a.targets if x.name.startswith("c=1 r(predicted"))
    assert t.met is None and "engine hook" in t.detail
    assert any("no engine seconds" in n for n in a.notes)


# ----------------------------------------------------------------------------- the driver replays sessions


def test_every_phase_sends_the_same_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Session i's turn t sends the same prompt token ids whatever the phase's prefix."""
    sent: list[tuple[str, tuple[int, ...]]] = []
    real = httpx.Client

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            return httpx.Response(
                200, json={"tokens": [sum(map(ord, w)) % 997 for w in body["prompt"].split()]}
            )
        sent.append((request.headers["X-Session-Id"], tuple(body["prompt"])))
        n = body["max_tokens"]
        return httpx.Response(
            200,
            json={
                "id": "cmpl-1",
                "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n},
                "choices": [{"token_ids": [5] * n, "finish_reason": "length"}],
            },
        )

    def client(**kw: Any) -> httpx.Client:
        return real(base_url=kw["base_url"], transport=httpx.MockTransport(handler))

    monkeypatch.setattr(D.httpx, "Client", client)
    for prefix, conc in (("c1", 1), ("c16", 3)):
        cfg = D.DriverConfig(
            sessions=3, turns=3, concurrency=conc, tool_pause_s=(0, 0), session_prefix=prefix
        )
        res = D.run_phase("http://x", "m", cfg, progress=False)
        assert res.errors == 0 and len(res.turns) == 9
    by_phase: dict[str, dict[tuple[int, int], tuple[int, ...]]] = {"c1": {}, "c16": {}}
    for sid, prompt in sent:
        turns = by_phase[sid.split("-")[0]]
        idx = S.session_index(sid)
        turn = 1 + sum(1 for k in turns if k[0] == idx)
        turns[(idx, turn)] = prompt
    assert by_phase["c1"] == by_phase["c16"] and len(by_phase["c1"]) == 9
    assert len({p for p in by_phase["c1"].values()}) == 9  # and the sessions differ


# ----------------------------------------------------------------------------- the GPU bench's CPU smoke mode


def test_gpu_latency_cpu_smoke_mode(tmp_path: Path) -> None:
    """``python -m bench.gpu_latency --device cpu --tiny`` runs end to end and fits the four terms."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    cmd = [
        sys.executable,
        "-m",
        "bench.gpu_latency",
        "--device",
        "cpu",
        "--tiny",
        "--reps",
        "2",
        "--warmup",
        "1",
        "--bootstrap",
        "20",
        "--out",
        str(tmp_path),
    ]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    (path,) = tmp_path.glob("gpu-latency-tiny-*.json")
    data = json.loads(path.read_text())
    four = data["four_term"]
    assert four["fit"]["n"] == len(data["points"]) >= 4
    assert set(four["fit"]["model"]) >= {"a", "b", "w", "o"} and four["theory"]
    assert "Four-term step-time model" in path.with_suffix(".md").read_text()
