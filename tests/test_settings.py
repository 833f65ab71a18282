from pte_instrument.cost.step_time import StepTimeModel
from pte_instrument.settings import Settings


def test_defaults():
    s = Settings.from_env({})
    assert s.enabled and s.device == "auto" and s.hoi is None and s.request_log is None
    assert s.errors == ()


def test_values():
    s = Settings.from_env(
        {
            "PTE_ENABLED": "0",
            "PTE_DEVICE": "h200",
            "PTE_HOI": "300",
            "PTE_N_ACTIVE": "8e9",
            "PTE_REQUEST_LOG": "/tmp/x.jsonl",
        }
    )
    assert (s.enabled, s.device, s.hoi, s.n_active, s.request_log) == (
        False,
        "h200",
        300.0,
        8e9,
        "/tmp/x.jsonl",
    )


def test_bad_values_fall_back_with_a_named_error():
    s = Settings.from_env({"PTE_ENABLED": "maybe", "PTE_HOI": "banana", "PTE_N_ACTIVE": "-3"})
    assert s.enabled is True and s.hoi is None and s.n_active is None
    assert len(s.errors) == 3
    assert any("PTE_HOI='banana'" in e for e in s.errors)
    assert any("PTE_ENABLED='maybe'" in e for e in s.errors)


def test_feedback_window():
    assert Settings.from_env({}).feedback_window == 50_000
    assert Settings.from_env({"PTE_FEEDBACK_WINDOW": "1000"}).feedback_window == 1000
    bad = Settings.from_env({"PTE_FEEDBACK_WINDOW": "2.5"})
    assert bad.feedback_window == 50_000 and "PTE_FEEDBACK_WINDOW='2.5'" in bad.errors[0]


def test_gpu_price_and_calibration(tmp_path):
    fit = tmp_path / "fit.json"
    StepTimeModel(1e-5, 1e-8, 1e-3, 1e-3).save(fit)
    s = Settings.from_env({"PTE_GPU_HOURLY_PRICE": "2.5", "PTE_CALIBRATION": str(fit)})
    assert (s.gpu_hourly_price, s.calibration, s.errors) == (2.5, str(fit), ())
    assert Settings.from_env({}).gpu_hourly_price is None and Settings.from_env({}).calibration == "online"
    assert Settings.from_env({"PTE_CALIBRATION": "OFF"}).calibration == "off"
    bad = Settings.from_env(
        {"PTE_GPU_HOURLY_PRICE": "inf", "PTE_CALIBRATION": str(tmp_path / "missing.json")}
    )
    assert (bad.gpu_hourly_price, bad.calibration) == (None, "online") and len(bad.errors) == 2
    assert sorted(e.split("=")[0] for e in bad.errors) == ["PTE_CALIBRATION", "PTE_GPU_HOURLY_PRICE"]
