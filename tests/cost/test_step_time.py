"""The four-term step-time model (pte_instrument/cost/step_time.py, docs/cost-model.md §5b):
theory per term, the robust non-negative fit, the fallback to the prior, the online window, and
the saved file."""

from __future__ import annotations

import json
import math
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

from pte_instrument.cost.architecture import load_config, parse_shape
from pte_instrument.cost.devices import PROFILES, DeviceProfile, resolve_device
from pte_instrument.cost.model import CostModel
from pte_instrument.cost.step_time import (
    FORMAT,
    FORMAT_VERSION,
    HostSpeed,
    OnlineStepFit,
    StepTimeModel,
    _nnls,
    bootstrap_intervals,
    fit,
    memory_bound,
    r_squared,
    score,
    theory,
    weighted_ctx,
)
from tests.cost.test_architecture import FIX

TRUE = StepTimeModel(a=2e-5, b=3e-8, w=8e-3, o=4e-3)


def synthetic(
    seed: int = 0, n: int = 8000, noise: float = 0.02, outliers: float = 0.05, model: StepTimeModel = TRUE
) -> tuple[np.ndarray, ...]:
    """Engine-like steps: 60% decode-only (1–63 requests, contexts to 8000), the rest with a
    log-uniform prefill of 16–4096 tokens; memory-bound by a roofline rule; 2% multiplicative
    noise; ``outliers`` of the steps stalled 1.5–4× (something outside the model)."""
    rng = np.random.default_rng(seed)
    decode = rng.random(n) < 0.6
    prefill = np.where(decode, 0.0, np.round(np.exp(rng.uniform(np.log(16), np.log(4096), n))))
    reqs = rng.integers(1, 64, n)
    ctx = np.where(decode, reqs * rng.integers(100, 8000, n), rng.integers(0, 4000, n)).astype(float)
    mb = memory_bound(prefill + reqs * decode, 0.001 * ctx, 300.0)
    dt = model.predict(prefill, ctx, mb) * (1 + noise * rng.standard_normal(n))
    stalled = rng.random(n) < outliers
    dt[stalled] *= rng.uniform(1.5, 4.0, stalled.sum())
    return prefill, ctx, mb, dt


def rel_err(m: StepTimeModel, ref: StepTimeModel) -> np.ndarray:
    return np.abs(m.coefficients() / ref.coefficients() - 1)


# =========================================================================== the model


def test_predict_floats_and_arrays():
    assert TRUE.predict(100, 1000, 1) == pytest.approx(2e-3 + 3e-5 + 8e-3 + 4e-3)
    assert isinstance(TRUE.predict(100, 1000, 1), float)
    out = TRUE.predict(np.array([0, 100]), np.array([0, 1000]), np.array([0, 1]))
    assert out.shape == (2,) and out[0] == pytest.approx(4e-3)
    assert TRUE.gamma_measured == pytest.approx(1.5e-3)  # b/a
    assert TRUE.weights_pte == pytest.approx(400.0)  # w/a
    assert math.isnan(StepTimeModel(0.0, 1.0, 1.0, 1.0).gamma_measured)


def test_theory_per_term_hand_checked():
    shape = parse_shape(load_config(FIX / "llama31_8b.json"))
    dev = PROFILES["h100-sxm"]
    m = theory(CostModel(shape, dev), weight_bytes=2.0)
    # a = 2·N/(989.4e12·0.8); b = 131,072 bytes/(3.35e12·0.85); w = 2·n_total/(3.35e12·0.85); o = 1 ms
    assert m.a == pytest.approx(2 * shape.n_active / (989.4e12 * 0.8), rel=1e-12)
    assert m.b == pytest.approx(131072 / (3.35e12 * 0.85), rel=1e-12)
    assert m.w == pytest.approx(2 * shape.n_total / (3.35e12 * 0.85), rel=1e-12)
    assert m.o == 1e-3
    # b/a = γ · flops_fraction / bandwidth_fraction; w/a = weights_pte at the same ratio
    gamma = CostModel(shape, dev).gamma
    assert m.gamma_measured == pytest.approx(gamma * 0.8 / 0.85, rel=1e-12)
    assert m.weights_pte == pytest.approx(shape.n_total * 2 * dev.hoi / (2 * shape.n_active) * 0.8 / 0.85)
    assert "h100-sxm" in m.source and "0.8" in m.source


def test_profiles_state_their_achieved_figures():
    for p in PROFILES.values():
        assert 0 < p.flops_fraction <= 1 and 0 < p.bandwidth_fraction <= 1 and p.step_overhead_s >= 0
        assert "no public measured figure" in p.achieved_source
    # an HOI override keeps them; a measured profile's rates are already achieved ones
    o = resolve_device("h200", hoi=500)
    assert (o.flops_fraction, o.bandwidth_fraction, o.step_overhead_s) == (0.8, 0.85, 1e-3)
    from pte_instrument.cost.devices import measured_achieved

    cpu = measured_achieved("cpu")
    assert cpu["flops_fraction"] == cpu["bandwidth_fraction"] == 1.0 and cpu["step_overhead_s"] == 12e-3


def test_theory_of_a_sliding_window_model_weights_ctx_like_gamma():
    # b·(Σ_g γ_g/γ · ctx_g) must equal Σ_g KV_g·ctx_g / bandwidth: KV_g ∝ γ_g
    shape = parse_shape(load_config(FIX / "sliding_gemma2.json"))
    cm = CostModel(shape, DeviceProfile("unit", 1e15, 1e12, "test", bandwidth_fraction=1.0))
    m = theory(cm, 2.0)
    ctx = np.array([[1000.0, 4096.0], [10.0, 10.0]])  # (steps, groups)
    assert len(shape.kv_groups) == 2
    kv_seconds = ctx @ np.array([g.bytes_per_token for g in shape.kv_groups]) / 1e12
    np.testing.assert_allclose(m.b * weighted_ctx(ctx, [g.gamma for g in cm.groups]), kv_seconds, rtol=1e-12)


def test_memory_bound_is_the_roofline_classification():
    # T < weights_pte + kv_pte; equality is compute-bound, as in the engine's attribution
    np.testing.assert_array_equal(memory_bound([10, 300, 299.5, 1000], [0, 0, 0, 800], 300.0), [1, 0, 1, 1])


# =========================================================================== the fit


def test_recovers_known_coefficients_with_noise_and_outliers():
    r = fit(*synthetic(seed=0))
    assert r.n == 8000 and r.from_prior == ()
    assert (rel_err(r.model, TRUE) < 0.02).all(), r.model
    assert r.median_ape < 0.03  # a typical step is within its 2% noise
    assert r.mape > r.median_ape  # the stalled steps are in the mean


def test_plain_least_squares_would_be_pulled_by_the_outliers():
    # the robust weights are what keeps the fit: least squares on seconds is off by > 5%
    p, c, m, dt = synthetic(seed=1)
    assert (rel_err(fit(p, c, m, dt).model, TRUE) < 0.02).all()
    ols = np.linalg.lstsq(np.column_stack([p, c, m, np.ones_like(p)]), dt, rcond=None)[0]
    assert np.abs(ols / TRUE.coefficients() - 1).max() > 0.05


def test_exact_steps_fit_exactly():
    p, c, m, _ = synthetic(seed=2, n=500, noise=0.0, outliers=0.0)
    r = fit(p, c, m, TRUE.predict(p, c, m))
    assert (rel_err(r.model, TRUE) < 1e-8).all()
    assert r.r2 == pytest.approx(1.0) and r.mape < 1e-9


def test_nnls_never_negative_and_meets_kkt():
    rng = np.random.default_rng(5)
    for _ in range(300):
        k = int(rng.integers(1, 5))
        Z = rng.standard_normal((40, k)) * rng.uniform(0.1, 10, k)
        t = rng.standard_normal(40)
        c = _nnls(Z.T @ Z, Z.T @ t, float(t @ t))
        assert (c >= 0).all()
        g = Z.T @ (Z @ c - t)  # gradient of ½‖Zc − t‖²
        tol = 1e-7 * (1 + np.abs(Z.T @ t).max())
        assert (g >= -tol).all() and (np.abs(g[c > 0]) <= tol).all()
        # and no feasible support does better (brute force over supports)
        best = float(((Z @ c - t) ** 2).sum())
        for s in range(1, k + 1):
            for idx in combinations(range(k), s):
                cs = np.linalg.lstsq(Z[:, idx], t, rcond=None)[0]
                if (cs >= 0).all():
                    assert best <= float(((Z[:, idx] @ cs - t) ** 2).sum()) + 1e-9


def test_fit_never_negative_even_when_the_truth_is():
    # a step time that falls with context: least squares would make b negative
    p, c, m, _ = synthetic(seed=3, n=2000, noise=0.0, outliers=0.0)
    dt = np.maximum(TRUE.predict(p, c, m) - 5e-8 * c, 1e-4)  # b = −2e-8
    r = fit(p, c, m, dt)
    assert (r.model.coefficients() >= 0).all()
    assert r.model.b == 0.0


def test_no_memory_bound_step_takes_w_from_the_prior():
    p, c, m, dt = synthetic(seed=4, n=3000)
    keep = m == 0
    prior = StepTimeModel(1e-5, 1e-8, 0.123, 1e-3)
    r = fit(p[keep], c[keep], m[keep], dt[keep], prior)
    assert r.from_prior == ("w",) and r.model.w == 0.123
    assert any("memory_bound has no variation (all 0)" in n for n in r.notes)
    assert (rel_err(r.model, TRUE)[[0, 3]] < 0.03).all()  # b: compute-bound steps read little context


def test_every_step_memory_bound_takes_w_from_the_prior_and_fits_o():
    p, c, _, _ = synthetic(seed=6, n=3000, noise=0.0, outliers=0.0)
    ones = np.ones_like(p)
    dt = TRUE.predict(p, c, ones)
    r = fit(p, c, ones, dt, prior=TRUE)
    assert r.from_prior == ("w",) and r.model.w == TRUE.w
    assert r.model.o == pytest.approx(TRUE.o, rel=1e-8)  # w from the prior: o is what is left
    none = fit(p, c, ones, dt)  # no prior: w is 0, o absorbs the weight read, and it is said
    assert none.model.w == 0.0 and none.model.o == pytest.approx(TRUE.o + TRUE.w, rel=1e-8)
    assert any("no prior" in n for n in none.notes)


def test_decode_only_steps_take_a_from_the_prior():
    p, c, m, dt = synthetic(seed=7, n=3000, noise=0.0, outliers=0.0)
    dec = p == 0
    m2 = m.copy()
    m2[dec & (np.arange(p.size) % 2 == 0)] = 0.0  # keep the 0/1 column varying
    dt = TRUE.predict(p, c, m2)
    r = fit(p[dec], c[dec], m2[dec], dt[dec], prior=TRUE)
    assert r.from_prior == ("a",) and r.model.a == TRUE.a
    assert (rel_err(r.model, TRUE) < 1e-8).all()


def test_collinear_columns_give_up_w_first():
    # memory-bound exactly when there is no prefill and prefill takes one value: w, a and o
    # are collinear; w is taken from the prior
    n = 400
    p = np.where(np.arange(n) % 2 == 0, 512.0, 0.0)
    c = np.arange(n) * 10.0
    m = (p == 0).astype(float)
    dt = TRUE.predict(p, c, m)
    r = fit(p, c, m, dt, prior=TRUE)
    assert r.from_prior == ("w",)
    assert any("collinear" in note for note in r.notes)
    assert (rel_err(r.model, TRUE) < 1e-6).all()


def test_unusable_steps_are_left_out():
    p, c, m, dt = synthetic(seed=8, n=1000, noise=0.0, outliers=0.0)
    dt = TRUE.predict(p, c, m)
    dt[:10] = np.nan
    dt[10:20] = 0.0
    r = fit(p, c, m, dt)
    assert r.n == 980 and (rel_err(r.model, TRUE) < 1e-8).all()
    assert score(TRUE, p, c, m, dt)[1] < 1e-12


def test_too_few_steps_return_the_prior():
    r = fit([1.0], [1.0], [1.0], [0.1], prior=TRUE)
    assert r.model is TRUE and r.from_prior == ("a", "b", "w", "o") and r.n == 1


def test_bootstrap_intervals_cover_the_truth_and_are_seeded():
    x = synthetic(seed=9, n=2000)
    ci = bootstrap_intervals(*x, n_boot=60, seed=1)
    assert ci == bootstrap_intervals(*x, n_boot=60, seed=1)
    for k in ("a", "b", "w", "o"):
        lo, hi = ci[k]
        assert lo <= getattr(TRUE, k) * 1.02 and hi >= getattr(TRUE, k) * 0.98, k
    assert ci["gamma"][0] < TRUE.gamma_measured * 1.02 and ci["gamma"][1] > TRUE.gamma_measured * 0.98
    assert all(math.isnan(v) for v in bootstrap_intervals(*x, n_boot=5)["a"])  # < 10 resamples


# =========================================================================== the online fit


def test_online_fit_converges_to_the_offline_fit():
    p, c, m, dt = synthetic(seed=10, n=4000)
    online = OnlineStepFit(TRUE.__class__(1e-6, 1e-9, 1e-3, 1e-3, "prior"), window=4096)
    assert online.model.source == "prior" and math.isnan(online.mape)
    for i in range(0, 4000, 37):  # the engine's batches, refit every 256 steps
        online.add(p[i : i + 37], c[i : i + 37], m[i : i + 37], dt[i : i + 37])
        if (i // 37) % 7 == 0:
            online.refit()
    online.refit()
    offline = fit(p, c, m, dt)
    assert online.n == 4000 and online.steps_seen == 4000
    assert (rel_err(online.model, offline.model) < 0.05).all(), (online.model, offline.model)
    assert online.mape == pytest.approx(offline.mape, rel=0.05)
    assert online.r2 == pytest.approx(offline.r2, abs=0.01)


def test_online_window_keeps_the_newest_steps():
    p, c, m, dt = synthetic(seed=11, n=7000)
    online = OnlineStepFit(TRUE, window=4096, iterations=10)
    for i in range(0, 7000, 100):
        online.add(p[i : i + 100], c[i : i + 100], m[i : i + 100], dt[i : i + 100])
    online.refit()
    newest = fit(p[-4096:], c[-4096:], m[-4096:], dt[-4096:], TRUE)
    np.testing.assert_allclose(online.model.coefficients(), newest.model.coefficients(), rtol=1e-6)
    big = OnlineStepFit(TRUE, window=100, iterations=10)
    big.add(p, c, m, dt)  # one batch larger than the window: its newest 100 steps
    big.refit()
    np.testing.assert_allclose(
        big.model.coefficients(),
        fit(p[-100:], c[-100:], m[-100:], dt[-100:], TRUE).model.coefficients(),
        rtol=1e-6,
    )


def test_online_warm_start_and_auto_refit():
    p, c, m, dt = synthetic(seed=12, n=300)
    online = OnlineStepFit(TRUE, min_steps=64, refit_every=50)
    online.add(p[:40], c[:40], m[:40], dt[:40])
    assert online.model is TRUE and online.refit() is None  # below min_steps: the prior
    online.add(p[40:100], c[40:100], m[40:100], dt[40:100])  # 100 steps, 60 since the last refit
    assert online.last_fit is not None and online.last_fit.n == 100
    online.add([1.0, 2.0], [1.0, 2.0], [0.0, 1.0], [float("nan"), -1.0])  # unusable: dropped
    assert online.n == 100
    with pytest.raises(ValueError):
        OnlineStepFit(TRUE, window=1)


# =========================================================================== the host's speed


def test_host_speed_prices_each_step_at_the_speed_of_the_steps_before_it():
    speed = HostSpeed(steps=4, clip=0.5)
    assert speed.ratio == 1.0
    # every step takes three times the model: log 3 − the current value stays above the clip,
    # so the log ratio moves 0.5/4 per step: 0, 0.125, 0.25 before each of the three
    before = speed.advance(np.ones(3), np.full(3, 3.0))
    np.testing.assert_allclose(before, np.exp([0.0, 0.125, 0.25]))
    assert speed.ratio == pytest.approx(math.exp(0.375))
    # one step at exactly the current speed leaves it; one stalled 100× moves it by clip/steps only
    speed.advance(np.array([1.0]), np.array([math.exp(0.375)]))
    assert speed.ratio == pytest.approx(math.exp(0.375))
    speed.advance(np.array([1.0]), np.array([100.0]))
    assert speed.ratio == pytest.approx(math.exp(0.375 + 0.125))
    # steps the model prices at nothing, or that did not run, are skipped
    assert speed.advance(np.array([0.0, 1.0]), np.array([1.0, float("nan")])).tolist() == [speed.ratio] * 2
    assert speed.ratio == pytest.approx(math.exp(0.5))
    with pytest.raises(ValueError):
        HostSpeed(steps=0.5)


def test_host_speed_follows_a_drifting_host_one_step_ahead():
    p, c, m, dt = synthetic(seed=13, n=4000, outliers=0.0)
    drift = 1.0 + 0.4 * np.sin(np.arange(4000) / 150.0)  # the host slows and speeds up over ~1,000 steps
    dt = dt * drift
    modelled = TRUE.predict(p, c, m)
    before = HostSpeed().advance(modelled, dt)
    static = np.mean(np.abs(modelled / dt - 1))
    tracked = np.mean(np.abs(modelled * before / dt - 1))
    assert static > 0.2 and tracked < 0.05, (static, tracked)


def test_the_online_fit_rebases_the_host_speed_on_its_new_coefficients():
    p, c, m, dt = synthetic(seed=14, n=512, noise=0.0, outliers=0.0)
    half = StepTimeModel(TRUE.a / 2, TRUE.b / 2, TRUE.w / 2, TRUE.o / 2, "prior")
    online = OnlineStepFit(half, min_steps=64)
    online.speed.advance(half.predict(p, c, m), dt)  # steps take twice the prior's time
    online.add(p, c, m, dt)
    assert online.speed.ratio == pytest.approx(2.0, rel=0.01)
    online.refit()  # the fit now prices them right: the host is at the model's speed
    assert rel_err(online.model, TRUE).max() < 0.01
    assert online.speed.ratio == pytest.approx(1.0, abs=0.01)


# =========================================================================== the saved file


def test_save_load_round_trip(tmp_path: Path):
    m = StepTimeModel(1.5e-5, 2.5e-8, 7e-3, 1.25e-3, "fit: 100 steps")
    path = tmp_path / "fit.json"
    m.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["version"] == FORMAT_VERSION
    assert StepTimeModel.load(path) == m
    assert StepTimeModel.from_dict(m.to_dict()) == m


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{nope", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"format": "other", "version": 1}', "not a step-time model"),
        (json.dumps({"format": FORMAT, "version": 99}).encode(), "version 99"),
        (json.dumps({"format": FORMAT, "version": 1, "a": 1, "b": 1, "w": 1}).encode(), "term 'o'"),
        (json.dumps({"format": FORMAT, "version": 1, "a": -1, "b": 1, "w": 1, "o": 1}).encode(), "term 'a'"),
        (b'{"format": "pte-step-time", "version": 1, "a": NaN, "b": 1, "w": 1, "o": 1}', "NaN"),
        (
            json.dumps({"format": FORMAT, "version": 1, "a": True, "b": 1, "w": 1, "o": 1}).encode(),
            "term 'a'",
        ),
        (bytes(range(256)), "cannot read"),
        (
            b'{"format": "pte-step-time", "version": 1, "a": 1' + b"0" * 400 + b', "b": 1, "w": 1, "o": 1}',
            "term 'a'",
        ),
    ],
)
def test_load_rejects_a_bad_file(tmp_path: Path, content: bytes, message: str):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as e:
        StepTimeModel.load(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_load_a_missing_file(tmp_path: Path):
    with pytest.raises(ValueError, match="cannot read step-time model"):
        StepTimeModel.load(tmp_path / "absent.json")


def test_r2_of_steps_that_all_took_the_same_time_is_undefined():
    """Identical measured times have no variance to explain (their mean's rounding leaves
    ~1e-36, not 0): R² is undefined, not a number in the millions."""
    y = np.full(10, 0.01)
    assert math.isnan(r_squared(y, y * (1 + 1e-9)))
    varied = np.array([0.01, 0.02, 0.04])
    assert r_squared(varied, varied) == 1.0
    assert r_squared(varied, np.full(3, varied.mean())) == 0.0
