"""Each step's measured time split over its requests, worked out by hand."""

import numpy as np
import pytest

from pte_instrument.cost.step_time import OnlineStepFit, StepTimeModel
from pte_instrument.engine.timing import (
    KV_S,
    LATENCY_S,
    OVERHEAD_S,
    PREDICTED_S,
    PREFILL_S,
    WEIGHTS_S,
    TimeAttribution,
)

# 1 ms per prefill token, 0.1 ms per context token, 5 ms of weights, 2 ms of overhead per step
MODEL = StepTimeModel(a=1e-3, b=1e-4, w=5e-3, o=2e-3)


def prefill_beside_decode(
    t: TimeAttribution, prefill: float, ctx: float, memory_bound: bool, measured_s: float
) -> None:
    """One step of two rows: slot 0 prefills ``prefill`` tokens, slot 1 decodes reading ``ctx``
    context (alone, only the decode would be memory-bound)."""
    t.steps(
        np.array([0, 1]),
        [2],
        None,
        np.array([prefill, 0.0]),
        np.array([0.0, ctx]),
        np.array([False, True]),
        np.array([memory_bound]),
        [measured_s],
    )


def test_a_step_is_split_by_the_model_and_sums_to_its_measured_time():
    t = TimeAttribution(MODEL, None, capacity=4)
    prefill_beside_decode(t, prefill=10.0, ctx=100.0, memory_bound=True, measured_s=0.040)
    # modelled: 10 ms + 10 ms + 5 ms weights + 2 ms overhead = 27 ms; measured 40 ms: × 40/27
    scale = 0.040 / 0.027
    a, b = t.read(0), t.read(1)
    assert a[PREFILL_S] == pytest.approx(0.010 * scale) and a[KV_S] == 0
    assert b[KV_S] == pytest.approx(0.010 * scale) and b[PREFILL_S] == 0
    for r in (a, b):  # weights and overhead evenly
        assert r[WEIGHTS_S] == pytest.approx(0.0025 * scale) and r[OVERHEAD_S] == pytest.approx(0.001 * scale)
        assert r[LATENCY_S] == pytest.approx(0.040)
    assert a[:4].sum() + b[:4].sum() == pytest.approx(0.040) and t.busy_s == pytest.approx(0.040)
    # alone: slot 0 compute-bound (no weight term), slot 1 memory-bound
    assert a[PREDICTED_S] == pytest.approx(0.010 + 0.002) and b[PREDICTED_S] == pytest.approx(
        0.010 + 0.005 + 0.002
    )
    assert t.read(0).sum() == 0  # read zeroes the slot


def test_several_steps_at_once_conserve_busy_time():
    t = TimeAttribution(MODEL, None, capacity=4)
    rng = np.random.default_rng(1)
    sizes = [2, 3, 1]
    slots = np.array([0, 1, 0, 1, 2, 2])
    prefill, ctx = rng.integers(0, 50, 6).astype(float), rng.integers(0, 500, 6).astype(float)
    t.steps(
        slots,
        sizes,
        [0, 2, 5],
        prefill,
        ctx,
        np.zeros(6, bool),
        np.array([True, False, True]),
        [0.01, 0.02, 0.005],
    )
    total = sum(t.read(s)[:4].sum() for s in range(3))
    assert total == pytest.approx(0.035) and t.busy_s == pytest.approx(0.035)


def test_a_model_that_predicts_nothing_splits_evenly():
    t = TimeAttribution(StepTimeModel(0.0, 0.0, 0.0, 0.0), None, capacity=2)
    prefill_beside_decode(t, prefill=5.0, ctx=9.0, memory_bound=False, measured_s=0.008)
    assert t.read(0)[OVERHEAD_S] == pytest.approx(0.004) and t.read(1)[OVERHEAD_S] == pytest.approx(0.004)


def test_predicted_seconds_follow_the_host_speed_and_gpu_seconds_do_not_change():
    online = OnlineStepFit(MODEL, min_steps=1000)  # no refit: the speed alone moves
    online.speed.alpha = 1.0  # the last step's speed, for hand-computed values (clip 0.5)
    t = TimeAttribution(MODEL, online, capacity=2)
    one = (np.array([0]), [1], None, np.array([0.0]), np.array([100.0]), np.array([True]), np.array([True]))
    # modelled 10 + 5 + 2 = 17 ms; the first step is priced at speed 1 and takes 17·e^0.4 ms
    first = t.steps(*one, [0.017 * np.exp(0.4)])
    assert first == pytest.approx([0.017])
    assert t.read(0)[PREDICTED_S] == pytest.approx(0.017)
    # the next is priced at the speed of the one before: e^0.4, and takes twice the model (a stall)
    second = t.steps(*one, [0.034])
    assert second == pytest.approx([0.017 * np.exp(0.4)])
    r = t.read(0)
    assert r[PREDICTED_S] == pytest.approx(0.017 * np.exp(0.4))
    assert r[:4].sum() == pytest.approx(0.034)  # its GPU seconds: the measured time, as without
    assert online.speed.ratio == pytest.approx(np.exp(0.4 + min(np.log(2) - 0.4, 0.5)))


def test_without_the_online_fit_predicted_seconds_are_the_model_alone():
    t = TimeAttribution(MODEL, None, capacity=1)
    out = t.steps(
        np.array([0]),
        [1],
        None,
        np.array([0.0]),
        np.array([100.0]),
        np.array([True]),
        np.array([True]),
        [0.1],
    )
    assert out == pytest.approx([0.017]) and t.read(0)[PREDICTED_S] == pytest.approx(0.017)


def test_the_first_online_refit_waits_for_steps_only_and_later_ones_for_the_interval():
    online = OnlineStepFit(MODEL, min_steps=64)
    t = TimeAttribution(MODEL, online, capacity=1)
    rng = np.random.default_rng(2)

    def steps(k: int) -> None:  # k one-row decode steps whose time follows the model ×1.5
        ctx = rng.integers(100, 5000, k).astype(float)
        dts = 1.5 * (MODEL.b * ctx + MODEL.w + MODEL.o)
        t.steps(
            np.zeros(k, dtype=np.int64),
            [1] * k,
            list(range(k)),
            np.zeros(k),
            ctx,
            np.ones(k, bool),
            np.ones(k, bool),
            dts,
        )

    steps(255)
    assert online.last_fit is None  # fewer than 256 steps since the start
    steps(1)
    first = online.last_fit
    assert first is not None and t.model is online.model  # at 256 steps, with no wait
    steps(512)  # within the interval: no second refit
    assert online.last_fit is first
