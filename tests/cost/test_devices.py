import pytest

from pte_instrument.cost.devices import (
    PROFILES,
    UnknownDeviceError,
    measure_profile,
    profile_for_gpu_name,
    resolve_device,
)


def test_required_profiles_with_sources():
    for name in (
        "h100-sxm",
        "h100-pcie",
        "h200",
        "b200",
        "a100-40gb",
        "a100-80gb",
        "l40s",
        "rtx-4090",
        "v100",
        "mi300x",
        "h100-pcie-sparse",
    ):
        p = PROFILES[name]
        assert p.source and p.peak_flops > 0 and p.mem_bandwidth > 0


def test_hoi_values():
    assert PROFILES["h100-pcie-sparse"].hoi == pytest.approx(756.5)
    assert PROFILES["h100-sxm"].hoi == pytest.approx(989.4 / 3.35)
    assert PROFILES["h200"].hoi == pytest.approx(989.4 / 4.8)


def test_gpu_name_detection():
    assert profile_for_gpu_name("NVIDIA H100 PCIe").name == "h100-pcie"
    assert profile_for_gpu_name("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    assert profile_for_gpu_name("NVIDIA H200").name == "h200"
    assert profile_for_gpu_name("NVIDIA A100-SXM4-40GB").name == "a100-40gb"
    assert profile_for_gpu_name("AMD Instinct MI300X").name == "mi300x"
    assert profile_for_gpu_name("Some Future GPU") is None


def test_hoi_override_and_errors():
    p = resolve_device("h200", hoi=500)
    assert p.hoi == pytest.approx(500)
    with pytest.raises(UnknownDeviceError, match="unknown device"):
        resolve_device("tpu-v9")
    with pytest.raises(UnknownDeviceError, match="positive"):
        resolve_device("h200", hoi=-1)


def test_measured_profile_on_this_host():
    p = measure_profile("cpu", size=256, repeats=1)
    assert p.measured and p.peak_flops > 0 and p.mem_bandwidth > 0
    assert p.hoi == pytest.approx(p.peak_flops / p.mem_bandwidth)
