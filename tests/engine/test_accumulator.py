"""StepAccumulator (docs/cost-model.md §4): request-level meaning (the exact decode integral
of pte_instrument.cost.model, chunked prefill, preemption, cache hits), slots, conservation,
backends in agreement over simulated multi-request workloads, and no host sync in update().

Seeds are fresh per test and printed in failures; PTE_TEST_SEED replays one."""

from __future__ import annotations

import importlib.util
import os
import secrets
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from pte_instrument.cost.architecture import KVGroup, ModelShape
from pte_instrument.cost.devices import DeviceProfile
from pte_instrument.cost.model import CostModel, TurnTokens, context_sum, price_turn
from pte_instrument.engine.accumulator import StepAccumulator, StepBatch, resolve_backend, served_pte
from pte_instrument.engine.kernels import reference as ref
from tests.helpers import no_host_sync

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_TRITON = HAS_TORCH and importlib.util.find_spec("triton") is not None
HAS_CUDA = False
if HAS_TORCH:
    import torch

    HAS_CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[2]

# (backend, device) pairs this host can run; Triton on CPU is the interpreter (slow).
BACKENDS = [pytest.param(("numpy", "cpu"), id="numpy")]
if HAS_TORCH:
    BACKENDS.append(pytest.param(("torch", "cpu"), id="torch-cpu"))
if HAS_TRITON:
    BACKENDS.append(pytest.param(("triton", "cpu"), id="triton-interp"))
if HAS_CUDA:
    BACKENDS.append(pytest.param(("torch", "cuda"), id="torch-cuda"))
    if HAS_TRITON:
        BACKENDS.append(pytest.param(("triton", "cuda"), id="triton-cuda"))


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("PTE_TEST_SEED") or secrets.randbits(63))


def cost_model(windows: tuple[int | None, ...]) -> CostModel:
    """A made-up model whose KV groups have the given windows (γ ≈ 1e-3 … 4e-3)."""
    groups = tuple(
        KVGroup(layers=4, bytes_per_token=4096.0 * (g + 1), window=w) for g, w in enumerate(windows)
    )
    shape = ModelShape(
        model_type="test",
        n_layers=4 * len(windows),
        hidden_size=512,
        n_heads=8,
        n_kv_heads=2,
        head_dim=64,
        attention="gqa",
        kv_dtype_bytes=2,
        kv_groups=groups,
        n_active=1e9,
        n_total=1e9,
    )
    return CostModel(shape, DeviceProfile("test", 1e15, 2e12, "made up"))


def gammas(model: CostModel) -> list[float]:
    return [g.gamma for g in model.groups]


# --- a request as the vLLM scheduler drives it --------------------------------------------


@dataclass
class Request:
    """Host-side bookkeeping of one request: c = num_computed_tokens, hw = the most tokens
    ever validly computed (what the host passes as H), outputs sampled so far."""

    slot: int
    prompt: int
    max_outputs: int
    c: int = 0
    hw: int = 0
    outputs: int = 0
    rejected_pending: int = 0
    log: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.outputs >= self.max_outputs

    def schedule(self, budget: int, spec: int = 0) -> tuple[int, ...]:
        """The row for a step giving this request up to ``budget`` tokens (+ drafts)."""
        known = self.prompt + self.outputs  # tokens whose ids exist
        n = min(budget, known - self.c)
        k = spec if self.c + n == known and self.c >= self.prompt else 0
        row = (self.slot, self.c, n + k, self.prompt, self.hw, k, self.rejected_pending)
        self.rejected_pending = 0
        return row

    def finish_step(self, row: tuple[int, ...], rejected: int = 0) -> None:
        _slot, c, n, *_rest, k, _rej = row
        known = self.prompt + self.outputs
        end = c + n - k  # the verified part
        if end == known:  # reached the end of known tokens: sample (plus accepted drafts)
            self.outputs = min(self.max_outputs, self.outputs + 1 + k - rejected)
        self.c = c + n - rejected
        self.hw = max(self.hw, self.c)
        self.rejected_pending = rejected
        self.log.append(row)

    def preempt(self, cached: int = 0) -> None:
        """Free the KV cache; resume from ``cached`` prefix-cache hits."""
        self.c = cached


def run_single(
    acc: StepAccumulator,
    L: int,
    D: int,
    *,
    chunk: int | None = None,
    cached: int = 0,
    preempt_after: tuple[int, ...] = (),
    rng: np.random.Generator | None = None,
) -> Request:
    """Drive one request to completion, one step per update; preempt after the listed step
    numbers (resuming from no cache)."""
    req = Request(acc.allocate(), L, D, c=cached)
    step = 0
    while not req.done:
        budget = chunk if chunk else 10**9
        if rng is not None and chunk:
            budget = int(rng.integers(1, chunk + 1))
        row = req.schedule(budget)
        acc.update(StepBatch.from_rows([row]))
        req.finish_step(row)
        if step in preempt_after and not req.done:
            req.preempt()
        step += 1
    return req


WINDOWS = [(None,), (None, 64), (16, None)]


# --- request-level meaning -----------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("windows", WINDOWS, ids=str)
def test_decode_integral_equals_core_cost(backend, windows, seed: int) -> None:
    """Prompt L, no cache, no chunking, D outputs: Σ_g γ_g·ctx[g] = Σ_g γ_g·context_sum(L, D,
    W_g), and served = price_turn(...).served — the request-level exact formula."""
    rng = np.random.default_rng(seed)
    model = cost_model(windows)
    acc = StepAccumulator.from_cost_model(model, backend=backend[0], device=backend[1])
    steps = 12 if backend[0] == "triton" and backend[1] == "cpu" else 60
    L, D = int(rng.integers(1, 200)), int(rng.integers(1, steps))
    req = run_single(acc, L, D)
    assert acc.step == D  # one update per step: one prefill step, then D-1 single-token decode steps
    row = acc.read([req.slot])[0]
    msg = f"seed={seed} L={L} D={D}"
    assert row[ref.PREFILL] == L and row[ref.RECOMPUTE] == 0, msg
    assert row[ref.DECODE_TOKENS] == D, msg
    for g, w in enumerate(windows):
        assert row[ref.CTX0 + g] == context_sum(L, D, w), msg
    want = model.decode_exact(L, D)
    assert np.isclose(row[ref.CTX0 :] @ gammas(model), want, rtol=1e-12), msg
    served = acc.served([req.slot], gammas(model))[0]
    assert np.isclose(served, price_turn(model, TurnTokens(L, D)).served, rtol=1e-12), msg


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_sums_to_uncached_prompt(backend, seed: int) -> None:
    rng = np.random.default_rng(seed)
    windows = (None, 64)
    acc = StepAccumulator(windows, backend=backend[0], device=backend[1])
    L, D = int(rng.integers(50, 400)), int(rng.integers(1, 8))
    chunked = run_single(acc, L, D, chunk=int(rng.integers(1, 64)), rng=rng)
    whole = run_single(acc, L, D)
    a, b = acc.read([chunked.slot, whole.slot])
    msg = f"seed={seed} L={L} D={D} steps={len(chunked.log)}"
    assert a[ref.PREFILL] == L, msg
    np.testing.assert_array_equal(a, b, err_msg=msg)  # chunking changes no column


@pytest.mark.parametrize("backend", BACKENDS)
def test_preemption_served_is_plain_served_plus_recompute(backend, seed: int) -> None:
    rng = np.random.default_rng(seed)
    windows = (None, 32)
    model = cost_model(windows)
    acc = StepAccumulator.from_cost_model(model, backend=backend[0], device=backend[1])
    L, D = int(rng.integers(20, 200)), int(rng.integers(2, 12))
    chunk = int(rng.integers(8, 64))
    plain = run_single(acc, L, D, chunk=chunk)
    # Preempt after 1–2 random steps (during prefill or decode), never the last one: up to
    # there the preempted run is never ahead of the plain one, so it is not done yet.
    last = len(plain.log) - 1
    after = tuple(sorted(rng.choice(last, size=min(last, int(rng.integers(1, 3))), replace=False).tolist()))
    preempted = run_single(acc, L, D, chunk=chunk, preempt_after=after)
    p, q = acc.read([plain.slot, preempted.slot])
    msg = f"seed={seed} L={L} D={D} chunk={chunk} preempt_after={after}"
    recomputed = q[ref.RECOMPUTE]
    # Recompute = every token the preempted run computed beyond the plain run's.
    extra = sum(r[2] for r in preempted.log) - sum(r[2] for r in plain.log)
    assert recomputed == extra and recomputed > 0, msg
    assert q[ref.PREFILL] == p[ref.PREFILL] + recomputed, msg
    cols = [ref.DECODE_TOKENS, *range(ref.CTX0, ref.CTX0 + len(windows))]
    np.testing.assert_array_equal(q[cols], p[cols], err_msg=msg)  # decode work unchanged
    sp, sq = served_pte(np.stack([p, q]), gammas(model))
    assert sq == pytest.approx(sp + recomputed, rel=1e-12), msg
    want = price_turn(model, TurnTokens(L, D, recomputed_tokens=int(recomputed))).served
    assert sq == pytest.approx(want, rel=1e-12), msg


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_hits_cost_nothing(backend, seed: int) -> None:
    rng = np.random.default_rng(seed)
    windows = (None,)
    model = cost_model(windows)
    acc = StepAccumulator.from_cost_model(model, backend=backend[0], device=backend[1])
    L, D = int(rng.integers(2, 300)), int(rng.integers(1, 6))
    cached = int(rng.integers(1, L))  # vLLM always computes at least the last prompt token
    req = run_single(acc, L, D, cached=cached)
    row = acc.read([req.slot])[0]
    msg = f"seed={seed} L={L} D={D} cached={cached}"
    # the first output is still sampled after a cached prefix: D outputs, D decode tokens
    assert row[ref.DECODE_TOKENS] == D, msg
    assert row[ref.PREFILL] == L - cached and row[ref.RECOMPUTE] == 0, msg
    assert row[ref.CTX0] == context_sum(L, D), msg  # decode reads the cached context too
    want = price_turn(model, TurnTokens(L, D, cached_tokens=cached)).served
    assert served_pte(row, gammas(model)) == pytest.approx(want, rel=1e-12), msg


# --- a multi-request workload: backends agree, conservation holds ------------------------


def simulate(
    seed: int, n_requests: int, max_prompt: int, max_out: int, max_batch: int
) -> list[tuple[np.ndarray, list[int]]]:
    """Steps of a toy continuous-batching scheduler: chunked prefill, decode with
    speculative drafts (random rejections reported next step), preemptions resuming from
    partial prefix-cache hits, arrivals and finishes. Returns (packed batch, slots to
    release after the step) per step; slots are ints assigned in arrival order."""
    rng = np.random.default_rng(seed)
    waiting = [
        Request(i, int(rng.integers(1, max_prompt)), int(rng.integers(1, max_out))) for i in range(n_requests)
    ]
    running: list[Request] = []
    steps: list[tuple[np.ndarray, list[int]]] = []
    while waiting or running:
        while waiting and len(running) < max_batch and rng.random() < 0.7:
            running.append(waiting.pop(0))
        budget = int(rng.integers(1, 4 * max_prompt))
        rows, reqs, spec = [], [], int(rng.integers(0, 4))
        for r in running:
            if budget <= 0:
                break
            row = r.schedule(budget, spec)
            budget -= row[2]
            rows.append(row)
            reqs.append(r)
        # A second row for one request in the same step (exercises repeated slots: the
        # contract allows it even if vLLM never does it).
        if rows and rng.random() < 0.2:
            rows.append((rows[0][0], 0, 0, rows[0][3], rows[0][4], 0, 1))
            reqs.append(None)
        finished = []
        for r, row in zip(reqs, rows, strict=True):
            if r is None:
                continue
            k = row[5]
            r.finish_step(row, rejected=int(rng.integers(0, k + 1)) if k else 0)
            if r.done:
                finished.append(r)
            elif rng.random() < 0.03:
                r.preempt(cached=int(rng.integers(0, r.c + 1)) // 2)
        for r in finished:
            running.remove(r)
        packed = StepBatch.from_rows(rows).packed
        steps.append((packed, [r.slot for r in finished]))
    return steps


def per_row_oracle(steps, windows=(None, 48)) -> tuple[dict[int, np.ndarray], list[np.ndarray]]:
    """Each request's totals and each step's column sums straight from the reference
    contributions of its rows: no slots, no scatter, no ring."""
    w = ref.window_array(windows)
    requests: dict[int, np.ndarray] = {}
    per_step = []
    for packed, _ in steps:
        contrib = ref.step_contributions(packed, w)
        per_step.append(contrib.sum(axis=1))
        for j, rid in enumerate(packed[ref.SLOT].tolist()):
            requests[rid] = requests.get(rid, 0) + contrib[:, j]
    return requests, per_step


def run_workload(
    backend: tuple[str, str],
    steps,
    history: int = 64,
) -> tuple[StepAccumulator, dict[int, np.ndarray]]:
    acc = StepAccumulator((None, 48), capacity=4, backend=backend[0], device=backend[1], history=history)
    slot_of: dict[int, int] = {}
    finished: dict[int, np.ndarray] = {}
    for packed, done in steps:
        packed = packed.copy()
        for j, rid in enumerate(packed[ref.SLOT].tolist()):
            if rid not in slot_of:
                slot_of[rid] = acc.allocate()  # grows past capacity 4 on the way
            packed[ref.SLOT, j] = slot_of[rid]
        acc.update(packed)
        if done:
            slots = [slot_of.pop(rid) for rid in done]
            for rid, row in zip(done, acc.read(slots), strict=True):
                finished[rid] = row
            acc.release(slots)
    return acc, finished


@pytest.mark.parametrize("backend", BACKENDS)
def test_workload_backends_agree_and_conserve(backend, seed: int) -> None:
    small = backend == ("triton", "cpu")
    steps = simulate(seed, n_requests=6 if small else 40, max_prompt=60, max_out=12, max_batch=8)
    acc, finished = run_workload(backend, steps)
    want, want_steps = per_row_oracle(steps)  # independent of every backend, numpy included
    msg = f"seed={seed} steps={len(steps)}"
    assert finished.keys() == want.keys(), msg
    for rid in want:
        np.testing.assert_allclose(finished[rid], want[rid], rtol=1e-6, err_msg=msg)
    st = acc.step_totals()  # the ring: the last history − 1 = 63 steps
    np.testing.assert_array_equal(st.steps, np.arange(max(0, len(steps) - 63), len(steps)), err_msg=msg)
    np.testing.assert_allclose(st.rows, [want_steps[s] for s in st.steps], rtol=1e-6, err_msg=msg)
    # Conservation: Σ per-request totals == Σ per-step totals, exactly.
    requests, per_step = acc.conservation()
    np.testing.assert_array_equal(requests, per_step, err_msg=msg)
    np.testing.assert_array_equal(sum(finished.values()), per_step, err_msg=msg)
    assert acc.in_use == 0, msg


def test_step_totals_ring_and_conservation(seed: int) -> None:
    steps = simulate(seed, n_requests=30, max_prompt=40, max_out=10, max_batch=6)
    acc, _ = run_workload(("numpy", "cpu"), steps, history=8)
    st = acc.step_totals()
    msg = f"seed={seed}"
    assert acc.step == len(steps), msg
    assert list(st.steps) == list(range(max(0, len(steps) - 7), len(steps))), msg
    for s, row in zip(st.steps, st.rows, strict=True):
        ref_state = np.zeros((1 + int(steps[s][0][ref.SLOT].max(initial=0)), 7))
        np.testing.assert_array_equal(
            row, ref.accumulate(ref_state, steps[s][0], ref.window_array((None, 48)))
        )
    assert list(acc.step_totals(since=len(steps) - 2).steps) == [len(steps) - 2, len(steps) - 1]
    assert len(acc.step_totals(since=len(steps)).steps) == 0
    # totals() covers every step, not just the ring.
    _, want_steps = per_row_oracle(steps)
    np.testing.assert_array_equal(acc.totals(), np.sum(want_steps, axis=0), err_msg=msg)
    requests, per_step = acc.conservation()
    np.testing.assert_array_equal(per_step, acc.totals(), err_msg=msg)
    np.testing.assert_array_equal(requests, per_step, err_msg=msg)


# --- slots ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_release_zeroes_and_reuses_slots(backend) -> None:
    acc = StepAccumulator((None,), capacity=2, backend=backend[0], device=backend[1])
    a, b = acc.allocate(), acc.allocate()
    acc.update(StepBatch.from_rows([(a, 0, 10, 10), (b, 0, 3, 3)]))
    before = acc.read([a, b])
    acc.release([a])
    c = acc.allocate()
    assert c == a  # the freed slot comes back first
    np.testing.assert_array_equal(acc.read([c])[0], 0)
    np.testing.assert_array_equal(acc.read([b]), before[1:])
    d = acc.allocate()  # full: capacity doubles, b keeps its row
    assert acc.capacity == 4 and d not in (a, b)
    np.testing.assert_array_equal(acc.read([b, d]), np.vstack([before[1], np.zeros(6)]))
    requests, per_step = acc.conservation()
    np.testing.assert_array_equal(requests, per_step)
    with pytest.raises(ValueError):
        acc.release([c, c])
    acc.release([c])
    with pytest.raises(ValueError):
        acc.read([c])  # released
    with pytest.raises(ValueError):
        acc.update(StepBatch.from_rows([(c, 0, 1, 1)]))  # not allocated
    with pytest.raises(ValueError):
        acc.update(StepBatch.from_rows([(b, -1, 1, 1)]))
    acc.update(StepBatch.zeros(0))  # an empty step is a step
    assert acc.step == 2 and not acc.step_totals(since=1).rows.any()


def test_step_batch_layout() -> None:
    b = StepBatch.from_arrays(slot=[3, 1], c=[0, 7], n=[5, 1], P=[5, 7], H=[0, 7])
    assert b.packed.shape == (7, 2) and b.packed.dtype == np.int64 and len(b) == 2
    assert b.slot.tolist() == [3, 1] and b.spec.tolist() == [0, 0]
    assert StepBatch.from_rows([(3, 0, 5, 5), (1, 7, 1, 7, 7)]).packed.tolist() == b.packed.tolist()
    z = StepBatch.zeros(3)
    z.n[:] = 4  # properties are views: an adapter fills the batch in place
    assert z.packed[ref.N].tolist() == [4, 4, 4]
    with pytest.raises(ValueError):
        StepBatch(np.zeros((6, 2), dtype=np.int64))
    with pytest.raises(ValueError):
        StepBatch(np.zeros((7, 2), dtype=np.int32))


def test_backend_resolution() -> None:
    assert resolve_backend("numpy", None) == ("numpy", "cpu")
    assert resolve_backend("auto", "cpu") == ("numpy", "cpu")
    if not HAS_CUDA:
        assert resolve_backend("auto", None) == ("numpy", "cpu")
        assert resolve_backend("torch", None) == ("torch", "cpu")
    else:
        assert resolve_backend("auto", None)[1] == "cuda"
    with pytest.raises(ValueError):
        resolve_backend("numpy", "cuda")
    with pytest.raises(ValueError):
        resolve_backend("cupy", None)  # type: ignore[arg-type]


def test_numpy_backend_needs_neither_torch_nor_triton() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"
        "from pte_instrument.engine.accumulator import StepAccumulator, StepBatch\n"
        "acc = StepAccumulator((None,), backend='auto')\n"
        "s = acc.allocate(); acc.update(StepBatch.from_rows([(s, 0, 4, 4)]))\n"
        "assert acc.backend == 'numpy' and acc.read([s])[0].tolist() == [4, 0, 1, 0, 0, 4]\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


# --- no host synchronisation in update() ------------------------------------------------


def random_batches(
    rng: np.random.Generator, slots: np.ndarray, sizes: tuple[int, ...], tokens: int, scheduled: int
) -> list[StepBatch]:
    """One random batch per size over ``slots``: c and P below ``tokens``, n below
    ``scheduled``, H = c."""
    batches = []
    for size in sizes:
        slot, c = rng.choice(slots, size), rng.integers(0, tokens, size)
        n, P = rng.integers(0, scheduled, size), rng.integers(1, tokens, size)
        batches.append(StepBatch.from_arrays(slot, c, n, P, H=c))
    return batches


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_cpu_update_reads_nothing_back(monkeypatch, seed: int) -> None:
    """Any device→host read in update() would be a sync on CUDA: on CPU, make every
    such call raise and run updates of all shapes (CPU and CUDA share the code path, except
    the pinned upload)."""
    rng = np.random.default_rng(seed)
    acc = StepAccumulator((None, 16), capacity=64, backend="torch", device="cpu")
    slots = acc.allocate_many(64)
    batches = random_batches(rng, slots, (0, 1, 17, 300), tokens=100, scheduled=50)

    def forbidden(*_a, **_k):
        raise AssertionError("host read-back in update()")

    for name in (
        "item",
        "cpu",
        "tolist",
        "numpy",
        "nonzero",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
    ):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    monkeypatch.setattr(torch, "nonzero", forbidden)
    for b in batches:
        acc.update(b)
    acc.release(slots[:5])  # release() is sync-free too
    monkeypatch.undo()
    requests, per_step = acc.conservation()
    np.testing.assert_array_equal(requests, per_step, err_msg=f"seed={seed}")


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_update_never_synchronises(backend: str, seed: int) -> None:
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton not installed")
    rng = np.random.default_rng(seed)
    acc = StepAccumulator((None, 4096), capacity=512, backend=backend, device="cuda")
    slots = acc.allocate_many(512)
    batches = random_batches(rng, slots, (0, 1, 64, 512, 8192), tokens=10_000, scheduled=500)
    for b in batches:  # warm-up: Triton compiles, the pinned pool fills
        acc.update(b)
    with no_host_sync():
        for i in range(200):
            acc.update(batches[i % len(batches)])
        acc.release(slots[:8])
    requests, per_step = acc.conservation()
    np.testing.assert_array_equal(requests, per_step, err_msg=f"seed={seed}")
