"""Every PTE_* setting outside its documented range (docs/configuration.md) is reported in
one line and its default used: the plugin stays active, and γ stays finite."""

import math

import pytest

from pte_instrument.cost.devices import resolve_device
from pte_instrument.settings import Settings

DEFAULTS = Settings()


def test_unknown_device_falls_back_to_the_default_profile():
    s = Settings.from_env({"PTE_DEVICE": "nonexistent"})
    assert s.device == DEFAULTS.device == "auto"
    assert len(s.errors) == 1
    assert "PTE_DEVICE='nonexistent'" in s.errors[0] and "using auto" in s.errors[0]
    resolve_device(s.device, s.hoi)  # what the cost model is then built with


@pytest.mark.parametrize("name", ["h200", "H100-SXM", " measured ", "auto"])
def test_known_devices_are_accepted(name):
    s = Settings.from_env({"PTE_DEVICE": name})
    assert s.errors == () and s.device == name.strip()


@pytest.mark.parametrize(
    ("var", "raw", "field"),
    [
        ("PTE_HOI", "1e308", "hoi"),
        ("PTE_HOI", "100001", "hoi"),
        ("PTE_HOI", "inf", "hoi"),
        ("PTE_HOI", "nan", "hoi"),
        ("PTE_HOI", "0", "hoi"),
        ("PTE_N_ACTIVE", "1e308", "n_active"),
        ("PTE_N_ACTIVE", "1.1e14", "n_active"),
        ("PTE_N_ACTIVE", "0.5", "n_active"),
        ("PTE_N_ACTIVE", "-inf", "n_active"),
        ("PTE_MAX_SESSIONS", "1e308", "max_sessions"),
        ("PTE_MAX_SESSIONS", "1000001", "max_sessions"),
        ("PTE_MAX_TURNS", "1e308", "max_turns"),
        ("PTE_MAX_TURNS", "100001", "max_turns"),
        ("PTE_FEEDBACK_WINDOW", "1e308", "feedback_window"),
        ("PTE_FEEDBACK_WINDOW", "10000001", "feedback_window"),
        ("PTE_SESSION_IDLE_TTL_S", "1e308", "session_idle_ttl_s"),
        ("PTE_SESSION_IDLE_TTL_S", "31536001", "session_idle_ttl_s"),
        ("PTE_SESSION_IDLE_TTL_S", "nan", "session_idle_ttl_s"),
        ("PTE_MAX_LORA_NAMES", "0", "max_lora_names"),
        ("PTE_MAX_LORA_NAMES", "10001", "max_lora_names"),
        ("PTE_MAX_LORA_NAMES", "2.5", "max_lora_names"),
    ],
)
def test_out_of_range_numbers_fall_back_with_one_line(var, raw, field):
    s = Settings.from_env({var: raw})
    assert getattr(s, field) == getattr(DEFAULTS, field)
    assert len(s.errors) == 1 and s.errors[0].startswith(f"{var}={raw!r} ")


@pytest.mark.parametrize(
    ("var", "raw", "field", "value"),
    [
        ("PTE_HOI", "100000", "hoi", 1e5),
        ("PTE_HOI", "0.5", "hoi", 0.5),
        ("PTE_N_ACTIVE", "1", "n_active", 1.0),
        ("PTE_N_ACTIVE", "1e14", "n_active", 1e14),
        ("PTE_MAX_SESSIONS", "1000000", "max_sessions", 1_000_000),
        ("PTE_MAX_TURNS", "100000", "max_turns", 100_000),
        ("PTE_FEEDBACK_WINDOW", "10000000", "feedback_window", 10_000_000),
        ("PTE_SESSION_IDLE_TTL_S", "31536000", "session_idle_ttl_s", 31_536_000.0),
        ("PTE_MAX_LORA_NAMES", "1", "max_lora_names", 1),
        ("PTE_MAX_LORA_NAMES", "10000", "max_lora_names", 10_000),
    ],
)
def test_the_bounds_themselves_are_accepted(var, raw, field, value):
    s = Settings.from_env({var: raw})
    assert s.errors == () and getattr(s, field) == value


def test_device_hoi_bounds_hold_in_resolve_device_too():
    from pte_instrument.cost.devices import UnknownDeviceError

    for hoi in (math.inf, math.nan, 1e308, 0.0):
        with pytest.raises(UnknownDeviceError, match="HOI"):
            resolve_device("h100-sxm", hoi)
    assert resolve_device("h100-sxm", 1e5).hoi == pytest.approx(1e5)


def test_n_active_bounds_hold_in_parse_shape_too():
    from pte_instrument.cost.architecture import ArchitectureError, load_config, parse_shape
    from tests.cost.test_architecture import FIX

    cfg = load_config(FIX / "dense_mha.json")
    for n in (math.inf, math.nan, 1e308, 0.5):
        with pytest.raises(ArchitectureError, match="N_active"):
            parse_shape(cfg, n_active_override=n)
    assert parse_shape(cfg, n_active_override=1e14).n_active == 1e14
