"""γ measured on a GPU with only torch and transformers (no vLLM, no network).

Builds a real-architecture model from a config — Llama-3.1-8B shapes (transformers'
LlamaConfig, random bf16 weights; ``--layers`` keeps fewer layers to fit a time budget) —
and times, with CUDA events:

- prefill steps: a batch of B prompts of L tokens, one forward (logits of the last position
  only, as a server computes them);
- decode steps: B sequences decoding one token on a context of C tokens, from a
  preallocated ``StaticCache`` (DynamicCache would re-copy the whole cache every step with
  ``torch.cat``, tripling the memory traffic a paged KV cache has).

Then fits, exactly as the vLLM bench does (pte_instrument/validation/calibrate.py),
``t ≈ a·prefill + b·ctx + c (+ d·decode)`` and reports γ_measured = b/a beside γ_theory
for the detected (or named) device profile, and the per-step constant c/a beside the
weight read predicted by the roofline attribution (docs/cost-model.md §5). It also fits the
four-term step-time model ``t ≈ a·prefill + b·ctx + w·memory_bound + o``
(``pte_instrument.cost.step_time``, docs/cost-model.md §5b; memory-bound as the engine classes
a step) with bootstrap intervals, beside theory for the profile and for the measured rates.

HF's eager forward launches ~30 kernels per layer from Python; for small steps the CPU
may not keep up with the GPU. Each timed step is therefore queued behind a short GPU sleep
(``torch.cuda._sleep``), so the events time the kernels back to back; the CPU-side enqueue
time is recorded too, and points where it exceeds the GPU time are flagged ``launch_bound``.

    python -m bench.gpu_latency                       # on a GPU: Llama-3.1-8B shapes
    python -m bench.gpu_latency --layers 8            # fewer layers, same per-layer shapes
    python -m bench.gpu_latency --device cpu --tiny   # smoke test of the code path

Run from the repository root (or with it on ``PYTHONPATH``; ``pte bench gpu-latency`` does that).

Writes gpu-latency-<host>-<date>.json and .md to --out (default $OUT, else bench/results).
"""

from __future__ import annotations

import inspect
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

LLAMA_31_8B: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
TINY: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 16384,
    "tie_word_embeddings": False,
}

# (batch, length) grids. Prefill: enough tokens per step to be compute-bound on an H100/H200.
# Decode: batch and context varied apart, so the per-step constant, the per-token term and
# the KV term separate; B·C capped by --max-kv-gib.
GPU_PREFILL = [
    (1, 512),
    (1, 1024),
    (1, 2048),
    (1, 4096),
    (2, 1024),
    (2, 2048),
    (2, 4096),
    (4, 512),
    (4, 1024),
    (4, 2048),
    (4, 4096),
    (8, 512),
    (8, 1024),
    (8, 2048),
]
GPU_DECODE = [(b, c) for b in (1, 4, 16, 64) for c in (1024, 4096, 16384, 32768)] + [(128, 1024), (128, 2048)]
CPU_PREFILL = [(1, 64), (1, 128), (1, 256), (2, 128), (2, 256), (4, 256)]
CPU_DECODE = [(b, c) for b in (1, 4, 16) for c in (256, 1024, 4096)]


@dataclass
class Point:
    kind: str  # "prefill" or "decode"
    batch: int
    length: int  # prompt length (prefill) or context length (decode)
    prefill: int  # prefill tokens computed
    ctx: int  # context tokens read by decode attention (what the cache holds and SDPA reads)
    decode_tokens: int
    times_ms: list[float] = field(default_factory=list)  # GPU (events) or wall (CPU) per rep
    enqueue_ms: list[float] = field(default_factory=list)  # CPU time to issue the step

    @property
    def median_ms(self) -> float:
        t = sorted(self.times_ms)
        return t[len(t) // 2] if t else math.nan

    @property
    def launch_bound(self) -> bool:
        e = sorted(self.enqueue_ms)
        return bool(e) and e[len(e) // 2] > self.median_ms

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "median_ms": self.median_ms, "launch_bound": self.launch_bound}


def build_model(shape: dict[str, Any], layers: int | None, dtype: Any, device: Any, seed: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(shape)
    if layers:
        cfg["num_hidden_layers"] = layers
    config = LlamaConfig(**cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are born in the target dtype: no fp32 copy of 8B
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    return model.to(dtype).eval()


class Timer:
    """Per-rep step times: CUDA events behind a GPU sleep on CUDA, perf_counter on CPU."""

    def __init__(self, device: Any, sleep_ms: float) -> None:
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"
        self.sleep_cycles = 0
        if self.cuda and sleep_ms > 0 and hasattr(torch.cuda, "_sleep"):
            # clock_rate (kHz) is absent from some torch builds; 1.7 GHz is H100/H200-like.
            khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 1_700_000
            self.sleep_cycles = int(sleep_ms * khz)

    def run(self, fn: Any, reps: int, warmup: int) -> tuple[list[float], list[float]]:
        torch = self.torch
        for _ in range(warmup):
            fn()
        if not self.cuda:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return times, times
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        enqueue = []
        for i in range(reps):
            if self.sleep_cycles:
                torch.cuda._sleep(self.sleep_cycles)
            t0 = time.perf_counter()
            starts[i].record()
            fn()
            ends[i].record()
            enqueue.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)], enqueue


def time_prefill(
    model: Any, timer: Timer, batch: int, length: int, vocab: int, reps: int, warmup: int
) -> Point:
    torch = timer.torch
    dev = next(model.parameters()).device
    ids = torch.randint(0, vocab, (batch, length), device=dev)
    # Logits of the last position only, as a server computes them (the argument was
    # called num_logits_to_keep before transformers 4.50; absent before 4.45).
    params = inspect.signature(model.forward).parameters
    keep = next(({k: 1} for k in ("logits_to_keep", "num_logits_to_keep") if k in params), {})

    def step() -> None:
        model(input_ids=ids, use_cache=False, **keep)

    times, enq = timer.run(step, reps, warmup)
    return Point("prefill", batch, length, batch * length, 0, 0, times, enq)


def _static_cache(config: Any, max_len: int, batch: int, device: Any, dtype: Any) -> Any:
    """A StaticCache across transformers versions: recent ones size it lazily from the first
    update (config and length only); older ones want batch size, device and dtype up front."""
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kwargs: dict[str, Any] = {"config": config, "max_cache_len": max_len}
    for name, value in (
        ("max_batch_size", batch),
        ("batch_size", batch),
        ("device", device),
        ("dtype", dtype),
    ):
        if name in params:
            kwargs[name] = value
            if name == "max_batch_size":
                params = {k: v for k, v in params.items() if k != "batch_size"}
    return StaticCache(**kwargs)


def time_decode(model: Any, timer: Timer, batch: int, ctx: int, vocab: int, reps: int, warmup: int) -> Point:
    """One decode token for ``batch`` sequences at context ``ctx``: the cache is allocated
    (zeros; timing does not depend on the values) and each step writes position ctx+i."""
    torch = timer.torch
    p = next(model.parameters())
    max_len = ctx + reps + warmup + 1
    cache = _static_cache(model.config, max_len, batch, p.device, p.dtype)
    ids = torch.randint(0, vocab, (batch, 1), device=p.device)
    pos = [ctx]

    def step() -> None:
        i = pos[0]
        model(
            input_ids=ids,
            past_key_values=cache,
            use_cache=True,
            position_ids=torch.full((batch, 1), i, device=p.device),
            cache_position=torch.tensor([i], device=p.device),
        )
        pos[0] = i + 1

    times, enq = timer.run(step, reps, warmup)
    # SDPA over a static cache reads its whole length (the rest is masked out).
    return Point("decode", batch, ctx, 0, batch * max_len, batch, times, enq)


def _fit(points: list[Point], gamma_theory: float, weights_pte: float, n_boot: int, with_decode: bool) -> Any:
    import numpy as np

    from pte_instrument.validation.calibrate import calibrate

    feats = {
        "prefill": np.array([p.prefill for p in points], dtype=float),
        "ctx": np.array([p.ctx for p in points], dtype=float),
        "const": np.ones(len(points)),
    }
    if with_decode:
        feats["decode_tokens"] = np.array([p.decode_tokens for p in points], dtype=float)
    t = np.array([p.median_ms / 1e3 for p in points])
    return calibrate(
        "gpu-steps", feats, t, gamma_theory=gamma_theory, const_pte_theory=weights_pte, n_boot=n_boot
    )


def four_term_features(points: list[Point], weights_pte: float, gamma: float) -> dict[str, Any]:
    """The four-term model's features per point (docs/cost-model.md §5b): prefill tokens,
    context read, and memory-bound as the engine classes a step (T < weights_pte + γ·ctx)."""
    import numpy as np

    from pte_instrument.cost.step_time import memory_bound

    prefill = np.array([p.prefill for p in points], dtype=float)
    ctx = np.array([p.ctx for p in points], dtype=float)
    tokens = np.array([p.prefill + p.decode_tokens for p in points], dtype=float)
    return {
        "prefill": prefill,
        "ctx": ctx,
        "memory_bound": memory_bound(tokens, gamma * ctx, weights_pte),
        "dt": np.array([p.median_ms / 1e3 for p in points]),
    }


def four_term_fit(
    points: list[Point],
    theories: dict[str, Any],
    weights_pte: float,
    gamma: float,
    n_boot: int,
    seed: int = 0,
) -> dict[str, Any]:
    """t ≈ a·prefill + b·ctx + w·memory_bound + o fitted on the points with
    ``pte_instrument.cost.step_time.fit`` (the first theory as the prior), with bootstrap
    intervals, beside each theory (name → StepTimeModel) scored on the same points."""
    from pte_instrument.cost.step_time import TERMS, bootstrap_intervals, fit, score

    f = four_term_features(points, weights_pte, gamma)
    cols = (f["prefill"], f["ctx"], f["memory_bound"], f["dt"])
    prior = next(iter(theories.values()), None)
    result = fit(*cols, prior)
    ci = bootstrap_intervals(*cols, prior, n_boot=min(n_boot, 200), seed=seed) if n_boot > 0 else {}
    kinds = [p.kind for p in points]
    out: dict[str, Any] = {
        "fit": result.to_dict(),
        "intervals": {k: list(v) for k, v in ci.items()},
        "memory_bound_points": int(f["memory_bound"].sum()),
        "theory": {},
    }
    out["by_kind"] = {k: _score_kind(result.model, f, kinds, k, score) for k in ("prefill", "decode")}
    for name, th in theories.items():
        r2, mape, mdape = score(th, *cols)
        out["theory"][name] = {
            "model": th.to_dict(),
            "r2": r2,
            "mape": mape,
            "median_ape": mdape,
            "fit_over_theory": {
                t: (getattr(result.model, t) / getattr(th, t) if getattr(th, t) > 0 else None) for t in TERMS
            },
        }
    return out


def _score_kind(model: Any, f: dict[str, Any], kinds: list[str], kind: str, score: Any) -> dict[str, Any]:
    import numpy as np

    m = np.array([k == kind for k in kinds])
    if m.sum() < 2:
        return {"n": int(m.sum())}
    r2, mape, mdape = score(model, f["prefill"][m], f["ctx"][m], f["memory_bound"][m], f["dt"][m])
    return {"n": int(m.sum()), "r2": r2, "mape": mape, "median_ape": mdape}


def _split_fit(points: list[Point]) -> dict[str, Any]:
    """a from prefill points alone (t = a·tokens + c_p), b and c from decode points alone
    (t = c + b·ctx + d·B): no constant shared between compute- and memory-bound steps."""
    import numpy as np

    from pte_instrument.validation.calibrate import fit_linear

    pre = [p for p in points if p.kind == "prefill"]
    dec = [p for p in points if p.kind == "decode"]
    out: dict[str, Any] = {}
    if len(pre) >= 3:
        f = fit_linear(
            {"prefill": np.array([p.prefill for p in pre], float), "const": np.ones(len(pre))},
            np.array([p.median_ms / 1e3 for p in pre]),
            n_boot=0,
        )
        out["prefill"] = {"a_s_per_token": float(f.coef[0]), "c_s": float(f.coef[1]), "r2": f.r2}
    if len(dec) >= 4:
        f = fit_linear(
            {
                "ctx": np.array([p.ctx for p in dec], float),
                "decode_tokens": np.array([p.batch for p in dec], float),
                "const": np.ones(len(dec)),
            },
            np.array([p.median_ms / 1e3 for p in dec]),
            n_boot=0,
        )
        out["decode"] = {
            "b_s_per_ctx_token": float(f.coef[0]),
            "d_s_per_token": float(f.coef[1]),
            "c_s": float(f.coef[2]),
            "r2": f.r2,
        }
    if "prefill" in out and "decode" in out and out["prefill"]["a_s_per_token"] > 0:
        a = out["prefill"]["a_s_per_token"]
        out["gamma_measured"] = out["decode"]["b_s_per_ctx_token"] / a
        out["const_pte"] = out["decode"]["c_s"] / a
        out["decode_token_pte"] = out["decode"]["d_s_per_token"] / a
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.provenance import bench_parser

    ap = bench_parser("bench.gpu_latency", __doc__)
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny config and grid (the CPU smoke test)")
    ap.add_argument(
        "--layers", type=int, default=None, help="keep only this many layers (Llama-3.1-8B has 32)"
    )
    ap.add_argument("--profile", default=None, help="device profile for γ_theory (default: detected GPU)")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default on GPU) or float32 (default on CPU)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per point")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--sleep-ms", type=float, default=20.0, help="GPU sleep queued before each timed step")
    ap.add_argument(
        "--max-kv-gib", type=float, default=48.0, help="skip decode points whose cache exceeds this"
    )
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop adding grid points after this long")
    ap.add_argument("--bootstrap", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else bench/results)")
    args = ap.parse_args(argv)

    import torch

    from bench.provenance import load_avg_1m, provenance, results_path, write_results
    from pte_instrument.cost.architecture import parse_shape
    from pte_instrument.cost.devices import PROFILES, detect_local_gpu, measure_profile, resolve_device
    from pte_instrument.cost.model import CostModel
    from pte_instrument.cost.step_time import theory
    from pte_instrument.validation.calibrate import explain_shares, measure_host_profile
    from pte_instrument.validation.step_model import host_device

    t_begin = time.time()
    prov = provenance()  # after importing torch: it records the GPU
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    shape = TINY if args.tiny else LLAMA_31_8B
    reps = args.reps or (3 if args.tiny or not on_gpu else 10)
    gpu_name = torch.cuda.get_device_name(device) if on_gpu else platform.processor() or "cpu"
    notes: list[str] = []

    # --- device profiles: the datasheet one for γ_theory, and a measured one ---
    if on_gpu:
        measured = measure_profile("cuda")  # bf16 matmul ÷ copy on this GPU
    else:
        # In the dtype and thread count that run the model (core's measure_profile times bf16,
        # which most CPUs emulate ~100× slower than they run fp32).
        measured = host_device(
            measure_host_profile(str(dtype).removeprefix("torch."), threads=torch.get_num_threads()), "cpu"
        )
    if args.profile:
        profile = resolve_device(args.profile)
    else:
        profile = detect_local_gpu() if on_gpu else measured
        if profile is None:
            profile = PROFILES["h100-sxm"]
            notes.append(f"no known profile for {gpu_name!r}: γ_theory uses h100-sxm; pass --profile")

    print(
        f"[gpu-latency] building {'tiny' if args.tiny else 'Llama-3.1-8B'}-shaped model "
        f"({args.layers or shape['num_hidden_layers']} layers, {dtype}) on {device} …",
        flush=True,
    )
    t0 = time.time()
    model = build_model(shape, args.layers, dtype, device, args.seed)
    build_s = time.time() - t0
    cfg = model.config.to_dict()
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    model_shape = parse_shape(cfg)
    cost = CostModel(model_shape, profile)
    dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    weights_pte = model_shape.n_total * dtype_bytes * profile.hoi / (2 * model_shape.n_active)
    kv_bytes = model_shape.kv_bytes_per_token

    # --- the grid ---
    timer = Timer(device, args.sleep_ms)
    pre_grid = CPU_PREFILL if (args.tiny or not on_gpu) else GPU_PREFILL
    dec_grid = CPU_DECODE if (args.tiny or not on_gpu) else GPU_DECODE
    points: list[Point] = []
    skipped: list[str] = []
    with torch.inference_mode():
        for kind, grid in (("prefill", pre_grid), ("decode", dec_grid)):
            for b, n in grid:
                if time.time() - t_begin > args.budget_s:
                    skipped.append(f"{kind} B={b} L={n}: time budget")
                    continue
                if kind == "decode" and b * n * kv_bytes > args.max_kv_gib * 2**30:
                    skipped.append(f"decode B={b} C={n}: cache over {args.max_kv_gib} GiB")
                    continue
                try:
                    fn = time_prefill if kind == "prefill" else time_decode
                    p = fn(model, timer, b, n, shape["vocab_size"], reps, args.warmup)
                except RuntimeError as e:  # torch's OutOfMemoryError is one; anything else is a bug
                    if "out of memory" not in str(e).lower():
                        raise
                    skipped.append(f"{kind} B={b} L={n}: out of memory")
                    if on_gpu:
                        torch.cuda.empty_cache()
                    continue
                points.append(p)
                print(
                    f"  {kind:7s} B={b:<4d} {'L' if kind == 'prefill' else 'C'}={n:<6d} "
                    f"{p.median_ms:9.3f} ms{'  (launch-bound)' if p.launch_bound else ''}",
                    flush=True,
                )
                if on_gpu:
                    torch.cuda.empty_cache()
    if skipped:
        notes.append(f"{len(skipped)} grid points skipped: " + "; ".join(skipped))
    lb = [p for p in points if p.launch_bound]
    if lb:
        notes.append(
            f"{len(lb)} points launch-bound (CPU enqueue slower than the GPU): their times "
            "include idle GPU time; the fits keep them"
        )

    fit = _fit(points, cost.gamma, weights_pte, args.bootstrap, False) if len(points) >= 4 else None
    fit_d = _fit(points, cost.gamma, weights_pte, args.bootstrap, True) if len(points) >= 5 else None
    split = _split_fit(points)
    theories = {f"theory ({profile.name})": theory(cost, dtype_bytes)}
    if measured is not None and measured.name != profile.name:
        theories[f"theory ({measured.name})"] = theory(CostModel(model_shape, measured), dtype_bytes)
    four = (
        four_term_fit(points, theories, weights_pte, cost.gamma, args.bootstrap, args.seed)
        if len(points) >= 4
        else None
    )
    result: dict[str, Any] = {
        "benchmark": "gpu-latency",
        **prov,
        "machine": {**prov["machine"], "device": str(device), "device_name": gpu_name},
        "config": {
            "model": "tiny" if args.tiny else "Llama-3.1-8B shapes, random weights",
            "layers": model.config.num_hidden_layers,
            "dtype": str(dtype),
            "reps": reps,
            "warmup": args.warmup,
            "sleep_ms": args.sleep_ms if on_gpu else 0,
            "seed": args.seed,
            "shape": {k: v for k, v in shape.items()},
        },
        "build_s": round(build_s, 1),
        "profile": {"name": profile.name, "hoi": profile.hoi, "source": profile.source},
        "measured_profile": None
        if measured is None
        else {
            "name": measured.name,
            "hoi": measured.hoi,
            "peak_flops": measured.peak_flops,
            "mem_bandwidth": measured.mem_bandwidth,
            "source": measured.source,
            "gamma_implied": cost.gamma * measured.hoi / profile.hoi,
        },
        "theory": {
            "gamma": cost.gamma,
            "kv_bytes_per_token": kv_bytes,
            "n_active": model_shape.n_active,
            "n_total": model_shape.n_total,
            "weights_pte": weights_pte,
        },
        "fit": fit.to_dict() if fit else None,
        "fit_with_decode_term": fit_d.to_dict() if fit_d else None,
        "split_fit": split,
        "four_term": four,
        "points": [p.to_dict() for p in points],
        "notes": notes,
        "wall_s": round(time.time() - t_begin, 1),
        "load_avg_1m_end": load_avg_1m(),
    }
    from pte_instrument.validation.report import strict_json

    kind = "gpu-latency-tiny" if args.tiny else "gpu-latency"
    out = Path(args.out or os.environ.get("OUT") or REPO / "bench" / "results")
    jpath = write_results(strict_json(result), kind, results_path(kind, out))
    mpath = jpath.with_suffix(".md")
    mpath.write_text(_markdown(result, fit, fit_d, explain_shares))
    print(mpath.read_text())
    print(f"[gpu-latency] wrote {jpath} and {mpath} in {result['wall_s']:.0f}s", flush=True)
    return 0


def _g(v: float | None, spec: str = ".4g") -> str:
    return "–" if v is None or not math.isfinite(v) else format(v, spec)


def four_term_markdown(four: dict[str, Any] | None) -> list[str]:
    """The four-term fit beside each theory: coefficients, intervals, MAPE and R²."""
    if not four:
        return []
    fit, ci = four["fit"], four.get("intervals") or {}
    m = fit["model"]
    L = [
        "Four-term step-time model t ≈ a·prefill + b·ctx + w·memory_bound + o (docs/cost-model.md §5b), "
        f"{four['memory_bound_points']} of {fit['n']} points memory-bound:",
        "",
        "| model | a (s/token) | b (s/ctx token) | w (s) | o (s) | MAPE | R² |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(t: str, v: float) -> str:
        lo, hi = ci.get(t, (None, None))
        return f"{_g(v)} [{_g(lo, '.3g')}, {_g(hi, '.3g')}]" if lo is not None else _g(v)

    L.append(
        f"| fit | {cell('a', m['a'])} | {cell('b', m['b'])} | {cell('w', m['w'])} | {cell('o', m['o'])} | "
        f"{_g(fit['mape'], '.1%')} | {_g(fit['r2'], '.3f')} |"
    )
    for name, th in four["theory"].items():
        tm = th["model"]
        L.append(
            f"| {name} | {_g(tm['a'])} | {_g(tm['b'])} | {_g(tm['w'])} | {_g(tm['o'])} | "
            f"{_g(th['mape'], '.1%')} | {_g(th['r2'], '.3f')} |"
        )
    kinds = ", ".join(f"{k} MAPE {_g(v.get('mape'), '.1%')} (n {v['n']})" for k, v in four["by_kind"].items())
    L += ["", f"- fit by point kind: {kinds}"]
    if fit["from_prior"]:
        L.append(f"- taken from the prior (not identifiable on these points): {', '.join(fit['from_prior'])}")
    L.append("")
    return L


def _markdown(r: dict[str, Any], fit: Any, fit_d: Any, explain: Any) -> str:
    th, m = r["theory"], r["machine"]
    L = [
        f"# GPU latency (no vLLM) — {r['config']['model']}, {r['config']['layers']} layers, {m['device_name']}",
        "",
        f"{r['date']}, `{m['hostname']}`, torch {m['torch']}, transformers {m['transformers']}, "
        f"commit `{r['git_commit']}`; model build {r['build_s']} s, total {r['wall_s']} s.",
        "",
        "| quantity | theory | measured |",
        "|---|---|---|",
    ]
    mp = r.get("measured_profile")
    hoi_measured = f"{mp['hoi']:.1f} ({mp['name']}: matmul ÷ copy)" if mp else "–"
    L.append(f"| HOI (FLOP/byte) | {r['profile']['hoi']:.1f} ({r['profile']['name']}) | {hoi_measured} |")
    for name, f in (("joint fit", fit), ("joint fit + decode term", fit_d)):
        if f is not None:
            lo, hi = f.gamma_ci
            L.append(
                f"| γ, {name} (R² {f.r2:.3f}) | {th['gamma']:.5g} | {f.gamma_measured:.5g} [{lo:.4g}, {hi:.4g}] |"
            )
            L.append(
                f"| per-step constant c/a (prefill tokens), {name} | {th['weights_pte']:.1f} (weight read) | {f.const_pte:.1f} |"
            )
    s = r.get("split_fit") or {}
    if "gamma_measured" in s:
        L.append(
            f"| γ, split fit (a from prefill, b from decode) | {th['gamma']:.5g} | {s['gamma_measured']:.5g} |"
        )
        L.append(f"| per-step constant, split fit | {th['weights_pte']:.1f} | {s['const_pte']:.1f} |")
        L.append(f"| per decode token (prefill tokens), split fit | 0 (PTE) | {s['decode_token_pte']:.3f} |")
    if mp:
        L.append(f"| γ at the measured HOI | {mp['gamma_implied']:.5g} | |")
    L += [""]
    if fit is not None:
        L += [f"- {explain(fit)}", ""]
    L += four_term_markdown(r.get("four_term"))
    L += ["| kind | B | L or C | median ms | launch-bound |", "|---|---|---|---|---|"]
    for p in r["points"]:
        L.append(
            f"| {p['kind']} | {p['batch']} | {p['length']} | {p['median_ms']:.3f} | {'yes' if p['launch_bound'] else ''} |"
        )
    L += ["", *(f"> {n}" for n in r["notes"]), ""]
    return "\n".join(L)


if __name__ == "__main__":
    sys.exit(main())
