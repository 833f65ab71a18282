#!/usr/bin/env bash
# Device check for a GPU host (H100/H200): the batched step accumulator's CUDA tests,
# benchmark and sync proof, then γ measured on the GPU. No vLLM, no network; torch, triton
# and transformers installed. Run from anywhere (it changes to the repository root); every
# bench runs as a module, `python -m bench.<name>`, with the root on PYTHONPATH.
#
#   OUT=/some/dir bash bench/device_check.sh        # default OUT=./device-out
#
# Steps, each under its own timeout so one hang cannot stall the rest:
#   1. environment (nvidia-smi, versions)                        → $OUT/env.txt
#   2. pytest tests/engine/test_kernels.py tests/engine/test_accumulator.py
#                                                                 → $OUT/pytest.txt, junit.xml
#      (the CUDA tests run here: kernels vs the numpy reference, no-sync update())
#   2b. the CUDA-vs-reference comparison again, without pytest     → $OUT/cuda_vs_reference.txt
#   3. the accumulator benchmark (CUDA events, no interpreter)    → $OUT/accumulator-*.json
#   4. sync proof: 1000 update() calls per GPU backend under
#      torch.cuda.set_sync_debug_mode("error"), then a torch.profiler trace counting
#      cudaStreamSynchronize / cudaDeviceSynchronize / … per update → $OUT/sync_proof.json
#   4b. the accumulator while a model runs on the GPU, as under async scheduling: host µs per
#      update(), the model stream's time per step with and without it, no sync, exact
#      (bench.accumulator_stream_bench)                          → $OUT/accumulator-stream-*.json
#   5. γ measured vs theory, Llama-3.1-8B shapes (bench.gpu_latency), and the four-term
#      step-time model t ≈ a·prefill + b·ctx + w·memory_bound + o fitted on the same timings
#      (pte_instrument.cost.step_time.fit, theory as the prior; docs/cost-model.md §5b)
#                                                                 → $OUT/gpu-latency-*.json, .md
# $OUT/summary.txt lists each step's exit status; the script exits non-zero if any failed.
# Copy $OUT/accumulator-<host>-<date>.json into bench/results/ to keep the GPU figures.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-./device-out}"
mkdir -p "$OUT"
PY="$(command -v python || command -v python3)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"  # silence 3.9's warning
unset TRITON_INTERPRET  # compiled kernels on the GPU; CPU tensors still use the interpreter
: > "$OUT/summary.txt"
status=0

step() {  # step NAME TIMEOUT_S CMD... — run, log, record the exit status
    local name="$1" limit="$2"
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name rc=$rc ${limit}s-limit took=$((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
    [ "$rc" -eq 0 ] || status=1
}

# 1. environment
{
    date -Is
    hostname
    nvidia-smi || true
    "$PY" - <<'EOF'
import platform, numpy, torch
print("python", platform.python_version(), "numpy", numpy.__version__, "torch", torch.__version__,
      "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
try:
    import triton; print("triton", triton.__version__)
except ImportError as e:
    print("triton missing:", e)
try:
    import pytest; print("pytest", pytest.__version__)
except ImportError as e:
    print("pytest missing:", e)
EOF
} > "$OUT/env.txt" 2>&1

# 2. tests (--noconftest: these two files need no fixture from elsewhere, and a conftest
#    written for the vLLM suite must not stop them on a host without vLLM)
step pytest 240 "$PY" -m pytest -q -p no:cacheprovider --noconftest -rs \
    --junitxml="$OUT/junit.xml" tests/engine/test_kernels.py tests/engine/test_accumulator.py

# 2b. the same comparison without pytest (in case the host lacks it): CUDA backends vs the
#     numpy reference on random batches with repeated slots, sizes 0 … 8192
step cuda_vs_reference 120 "$PY" - <<'EOF'
import secrets
import numpy as np
import torch
from pte_instrument.engine.accumulator import StepAccumulator, StepBatch
seed = secrets.randbits(63)
rng = np.random.default_rng(seed)
for backend in ("triton", "torch"):
    for windows in [(None,), (None, 128), (4096, None, 7)]:
        for size in (0, 1, 7, 64, 513, 4096, 8192):
            accs = [StepAccumulator(windows, capacity=64, backend=b, device=d)
                    for b, d in (("numpy", "cpu"), (backend, "cuda"))]
            for acc in accs:
                acc.allocate_many(64)
            for _ in range(3):
                c = rng.integers(0, 1_000_000, size)
                b = StepBatch.from_arrays(slot=rng.integers(0, 64, size), c=c,
                                          n=rng.integers(0, 20_000, size),
                                          P=rng.integers(1, 1_000_000, size),
                                          H=c + rng.integers(0, 2, size) * rng.integers(0, 9999, size),
                                          spec=rng.integers(0, 3, size),
                                          rejected=rng.integers(0, 3, size))
                for acc in accs:
                    acc.update(b)
            want, got = (a.read(np.arange(64)) for a in accs)
            msg = f"seed={seed} backend={backend} windows={windows} size={size}"
            np.testing.assert_array_equal(got, want, err_msg=msg)
            np.testing.assert_array_equal(accs[1].step_totals().rows,
                                          accs[0].step_totals().rows, err_msg=msg)
            np.testing.assert_array_equal(*accs[1].conservation(), err_msg=msg)
    print(backend, "matches the numpy reference exactly", f"seed={seed}")
EOF

# 3. benchmark
step bench 150 "$PY" -m bench.accumulator_bench --seconds 0.3 --no-interp \
    --out "$OUT/accumulator-$(hostname)-$(date +%F).json"

# 4. sync proof
step sync_proof 120 "$PY" - "$OUT" <<'EOF'
"""1000 update() calls per GPU backend with sync debug mode "error" (any synchronising
torch call raises), then a profiler trace of 200 more, counting the CUDA API calls."""
import gzip, json, os, shutil, sys
from collections import Counter

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from pte_instrument.engine.accumulator import StepAccumulator, StepBatch
from tests.helpers import no_host_sync

out = sys.argv[1]
rng = np.random.default_rng(0)
result = {"gpu": torch.cuda.get_device_name(0), "backends": {}}
for backend in ("triton", "torch"):
    acc = StepAccumulator((None, 4096), capacity=8192, backend=backend, device="cuda")
    slots = acc.allocate_many(8192)
    batches = []
    for size in (0, 1, 64, 512, 4096, 8192):
        c = rng.integers(0, 30_000, size)
        batches.append(StepBatch.from_arrays(slot=rng.choice(slots, size, replace=False), c=c,
                                             n=rng.integers(1, 64, size),
                                             P=rng.integers(1, 30_000, size), H=c))
    for b in batches * 2:  # warm-up: compile, fill the pinned pool
        acc.update(b)
    with no_host_sync():
        for i in range(1000):
            acc.update(batches[i % len(batches)])
        acc.release(slots[:16])
        acc.allocate_many(16)  # the same 16 slots come back (LIFO), zeroed
    torch.cuda.synchronize()
    n_prof = 200
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(n_prof):
            acc.update(batches[i % len(batches)])
        torch.cuda.synchronize()  # the one deliberate sync, outside update()
    counts = Counter()
    for e in prof.events():
        if any(k in e.name for k in ("Synchronize", "Memcpy", "Launch", "cudaHostAlloc",
                                     "cudaEventQuery", "cudaStreamWaitEvent")):
            counts[e.name] += 1
    syncs = {k: v for k, v in counts.items() if "Synchronize" in k}
    requests, per_step = acc.conservation()
    result["backends"][backend] = {
        "sync_debug_error_mode_updates": 1000,
        "profiled_updates": n_prof,
        "cuda_api_counts": dict(counts),
        "synchronize_calls": syncs,
        "synchronize_calls_in_updates": sum(syncs.values()) - syncs.get("cudaDeviceSynchronize", 0),
        "launches_per_update": sum(v for k, v in counts.items() if "Launch" in k) / n_prof,
        "conservation_ok": bool(np.array_equal(requests, per_step)),
    }
    trace = f"{out}/trace-{backend}.json"
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(trace)
    with open(f"{out}/profile-{backend}.txt", "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
print(json.dumps(result, indent=2))
with open(f"{out}/sync_proof.json", "w") as f:
    json.dump(result, f, indent=2)
bad = [b for b, r in result["backends"].items()
       if r["synchronize_calls_in_updates"] or not r["conservation_ok"]]
sys.exit(1 if bad else 0)
EOF

# 4b. the accumulator beside a running model
step accumulator_stream 180 "$PY" -m bench.accumulator_stream_bench \
    --out "$OUT/accumulator-stream-$(hostname)-$(date +%F).json"

# 5. γ measured vs theory on the GPU, and the four-term step-time model on the same timings
step gpu_latency 300 "$PY" -m bench.gpu_latency --out "$OUT"
"$PY" - "$OUT" <<'EOF' >> "$OUT/summary.txt" 2>&1 || true
"""One line per model of the four-term fit (the fit, then each theory): a, b, w, o, MAPE."""
import glob, json, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/gpu-latency-*.json")):
    four = json.load(open(path)).get("four_term") or {}
    rows = [("fit", four["fit"]["model"], four["fit"]["mape"])] if four.get("fit") else []
    rows += [(k, v["model"], v["mape"]) for k, v in (four.get("theory") or {}).items()]
    for name, m, mape in rows:
        print(f"four-term {name}: a={m['a']:.3g} b={m['b']:.3g} w={m['w']:.3g} o={m['o']:.3g} MAPE={mape}")
EOF

cat "$OUT/summary.txt"
exit "$status"
