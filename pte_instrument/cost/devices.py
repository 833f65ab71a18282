"""Device profiles: peak dense bf16 FLOP/s and memory bandwidth, and their ratio, the
hardware operational intensity HOI (FLOP per byte at the roofline ridge point).

Datasheet figures are dense (no 2:4 sparsity) unless a preset says otherwise.

Each profile also carries what the step-time model (``cost/step_time.py``,
docs/cost-model.md §5b) needs to turn peaks into seconds: the fractions of peak FLOP/s and
bandwidth that served kernels achieve, and the engine's fixed work per step. No public
measured figure is used for any datasheet profile: all take the stated defaults below, and
``achieved_source`` says so. They are starting points for the fit, not measurements.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# Defaults of the achieved fractions and the per-step overhead, for every datasheet profile.
# No public measured figure is used: round values, not tuned to any data set. Served GEMMs
# reach well under peak FLOP/s, and streaming reads stay under the datasheet bandwidth; the
# step-time fit measures both (docs/cost-model.md §5b).
DEFAULT_FLOPS_FRACTION = 0.8
DEFAULT_BANDWIDTH_FRACTION = 0.85
# A GPU engine's host work per step (scheduling, input preparation, kernel launches): a round
# 1 ms, no public measured figure.
DEFAULT_STEP_OVERHEAD_S = 1e-3
DEFAULT_ACHIEVED_SOURCE = (
    "no public measured figure: stated defaults (FLOP/s fraction 0.8, bandwidth fraction 0.85, "
    "1 ms per step), to be calibrated"
)
# A measured profile times the achieved rates themselves, so its fractions are 1. Its overhead
# on a CPU is this project's own measurement: the latency bench's per-step constant of 25.1 ms
# on the 2-core development VM (bench/results/latency-small-vm-2026-11-30/report.json,
# analysis.calibration.step) less the small model's weight read at the measured bandwidth
# (327 MB / 24.9 GB/s = 13.2 ms): 12 ms. One VM, one model: a starting point, not a constant.
MEASURED_CPU_STEP_OVERHEAD_S = 12e-3


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    peak_flops: float  # FLOP/s, dense bf16 tensor core
    mem_bandwidth: float  # bytes/s
    source: str
    measured: bool = False
    flops_fraction: float = DEFAULT_FLOPS_FRACTION  # of peak_flops, reached by served matmuls
    bandwidth_fraction: float = DEFAULT_BANDWIDTH_FRACTION  # of mem_bandwidth, by weight and KV reads
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S  # fixed engine work per step
    achieved_source: str = DEFAULT_ACHIEVED_SOURCE  # where the three figures above come from

    @property
    def hoi(self) -> float:
        return self.peak_flops / self.mem_bandwidth


TF = 1e12
TB = 1e12

PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile(
            "h100-sxm",
            989.4 * TF,
            3.35 * TB,
            "NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity -> 989.4 dense; HBM3 3.35 TB/s",
        ),
        DeviceProfile(
            "h100-pcie",
            756.5 * TF,
            2.0 * TB,
            "NVIDIA H100 Tensor Core GPU datasheet (PCIe): BF16 1,513 TFLOPS with sparsity -> 756.5 dense; HBM2e 2.0 TB/s",
        ),
        DeviceProfile(
            "h100-pcie-sparse",
            1513.0 * TF,
            2.0 * TB,
            "Published PTE reference: H100 PCIe 2:4-sparse BF16 peak 1,513 TFLOPS / 2.0 TB/s = HOI 756.5",
        ),
        DeviceProfile(
            "h200",
            989.4 * TF,
            4.8 * TB,
            "NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity -> 989.4 dense; HBM3e 4.8 TB/s",
        ),
        DeviceProfile(
            "b200",
            2250.0 * TF,
            8.0 * TB,
            "NVIDIA HGX B200 datasheet: FP16/BF16 4.5 PFLOPS with sparsity per GPU -> 2.25 dense; HBM3e 8 TB/s",
        ),
        DeviceProfile(
            "a100-40gb",
            312.0 * TF,
            1.555 * TB,
            "NVIDIA A100 Tensor Core GPU datasheet (40GB SXM): BF16 312 TFLOPS dense; HBM2 1,555 GB/s",
        ),
        DeviceProfile(
            "a100-80gb",
            312.0 * TF,
            2.039 * TB,
            "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): BF16 312 TFLOPS dense; HBM2e 2,039 GB/s",
        ),
        DeviceProfile(
            "l40s",
            362.05 * TF,
            0.864 * TB,
            "NVIDIA L40S datasheet: BF16 733 TFLOPS with sparsity -> 362.05 dense; GDDR6 864 GB/s",
        ),
        DeviceProfile(
            "rtx-4090",
            165.2 * TF,
            1.008 * TB,
            "NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): BF16 tensor, FP32 accumulate 165.2 TFLOPS dense; GDDR6X 1,008 GB/s",
        ),
        DeviceProfile(
            "v100",
            125.0 * TF,
            0.9 * TB,
            "NVIDIA V100 datasheet (SXM2): no bf16; FP16 tensor 125 TFLOPS used; HBM2 900 GB/s",
        ),
        DeviceProfile(
            "mi300x",
            1307.4 * TF,
            5.3 * TB,
            "AMD Instinct MI300X datasheet: BF16 1,307.4 TFLOPS dense; HBM3 5.3 TB/s",
        ),
    )
}

# Substrings of torch.cuda.get_device_name() mapped to profiles, most specific first.
_NAME_HINTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("h100", "pcie"), "h100-pcie"),
    (("h100",), "h100-sxm"),
    (("h200",), "h200"),
    (("gh200",), "h200"),
    (("b200",), "b200"),
    (("a100", "40gb"), "a100-40gb"),
    (("a100",), "a100-80gb"),
    (("l40s",), "l40s"),
    (("4090",), "rtx-4090"),
    (("v100",), "v100"),
    (("mi300x",), "mi300x"),
)
DEFAULT_DEVICE = "h100-sxm"
# An HOI override beyond this is no hardware: datasheet GPUs sit near 100–1,000 FLOP/byte,
# and a larger figure only drives γ towards overflow.
HOI_MAX = 1e5


def device_names() -> tuple[str, ...]:
    """Every name :func:`resolve_device` accepts (case-insensitive)."""
    return ("auto", "measured", *PROFILES)


class UnknownDeviceError(ValueError):
    pass


def profile_for_gpu_name(gpu_name: str) -> DeviceProfile | None:
    low = gpu_name.lower()
    for hints, name in _NAME_HINTS:
        if all(h in low for h in hints):
            return PROFILES[name]
    return None


def detect_local_gpu() -> DeviceProfile | None:
    """Profile of the local CUDA/ROCm GPU, or None when there is none or it is unknown."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return profile_for_gpu_name(torch.cuda.get_device_name(0))


def measure_profile(device: str | None = None, size: int = 4096, repeats: int = 5) -> DeviceProfile:
    """Time a large matmul and a large copy on ``device`` (default: cuda if present, else
    cpu) and derive the measured HOI. Best of ``repeats`` runs. bf16 on a GPU; fp32 on a
    CPU, where bf16 is often emulated (minutes per matmul) and vLLM's CPU build serves fp32."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dev.type == "cpu":
        size = min(size, 2048)
    a = torch.randn(size, size, device=dev, dtype=dtype)
    b = torch.randn(size, size, device=dev, dtype=dtype)
    n_bytes = (256 << 20) if dev.type == "cuda" else (64 << 20)
    src = torch.empty(n_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)

    def best(fn) -> float:
        fn()  # warm up
        times = []
        for _ in range(repeats):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return min(times)

    t_mm = best(lambda: torch.mm(a, b))
    t_cp = best(lambda: dst.copy_(src))
    flops = 2.0 * size**3 / t_mm
    bandwidth = 2.0 * n_bytes / t_cp  # read + write
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return DeviceProfile(
        name=f"measured:{name}",
        peak_flops=flops,
        mem_bandwidth=bandwidth,
        source=f"measured {time.strftime('%Y-%m-%d')}: {str(dtype).removeprefix('torch.')} {size}^3 matmul, {n_bytes >> 20} MiB copy",
        measured=True,
        **measured_achieved(dev.type),
    )


def measured_achieved(device_type: str) -> dict[str, object]:
    """Fractions and overhead of a measured profile: its rates are already achieved ones."""
    cpu = device_type == "cpu"
    why = (
        "12 ms per step: this project's CPU build, the latency bench's per-step constant 25.1 ms "
        "less the small model's 13.2 ms weight read (2-core VM, 2026-11-30)"
        if cpu
        else "1 ms per step: stated default, no public measured figure"
    )
    return {
        "flops_fraction": 1.0,
        "bandwidth_fraction": 1.0,
        "step_overhead_s": MEASURED_CPU_STEP_OVERHEAD_S if cpu else DEFAULT_STEP_OVERHEAD_S,
        "achieved_source": f"measured rates are achieved rates (fractions 1); overhead {why}",
    }


def resolve_device(name: str | None = "auto", hoi: float | None = None) -> DeviceProfile:
    """Profile by name (``auto`` detects the local GPU, ``measured`` times this host),
    optionally with its HOI overridden."""
    key = (name or "auto").strip().lower()
    if key == "auto":
        profile = detect_local_gpu() or PROFILES[DEFAULT_DEVICE]
    elif key == "measured":
        profile = measure_profile()
    elif key in PROFILES:
        profile = PROFILES[key]
    else:
        raise UnknownDeviceError(f"unknown device {name!r}; known: {', '.join(device_names())}")
    if hoi is not None:
        if not 0 < hoi <= HOI_MAX:  # NaN fails both comparisons
            raise UnknownDeviceError(
                f"HOI must be a positive number of at most {HOI_MAX:g} FLOP/byte, got {hoi!r}"
            )
        profile = DeviceProfile(
            name=f"{profile.name}@hoi={hoi:g}",
            peak_flops=hoi * profile.mem_bandwidth,
            mem_bandwidth=profile.mem_bandwidth,
            source=f"HOI overridden to {hoi:g} (bandwidth from {profile.name})",
            measured=profile.measured,
            flops_fraction=profile.flops_fraction,
            bandwidth_fraction=profile.bandwidth_fraction,
            step_overhead_s=profile.step_overhead_s,
            achieved_source=profile.achieved_source,
        )
    return profile
