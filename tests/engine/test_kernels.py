"""The step-accumulator kernels (docs/cost-model.md §4): the numpy reference against hand arithmetic and a
position-by-position brute force, and every other backend against the reference on fresh
random batches (the seed is in each failure message; set PTE_TEST_SEED to replay one).

Triton runs compiled on CUDA and under the Triton interpreter on CPU tensors (see
triton_backend's docstring for how the interpreter is chosen); one test also runs it in a
subprocess with TRITON_INTERPRET=1 set before triton is imported, the documented way."""

from __future__ import annotations

import importlib.util
import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pte_instrument.cost.model import context_sum
from pte_instrument.engine.kernels import reference as ref

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TORCH:
    import torch

    HAS_CUDA = torch.cuda.is_available()
else:
    HAS_CUDA = False

needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
needs_triton = pytest.mark.skipif(not (HAS_TORCH and HAS_TRITON), reason="triton not installed")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")

WINDOW_SETS: list[tuple[int | None, ...]] = [(None,), (None, 128), (4096, None, 7), (1,)]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def seed() -> int:
    """A fresh seed per test (printed in failures), or PTE_TEST_SEED to replay one."""
    return int(os.environ.get("PTE_TEST_SEED") or secrets.randbits(63))


def random_packed(rng: np.random.Generator, size: int, slots: int) -> np.ndarray:
    """A (7, size) batch mixing every regime: chunked prefill, decode (with speculative
    tokens), preemption recompute (H > c), prompt completion, n = 0, and repeated slots.
    Half the batches use tiny values so the boundaries (c = P, c + n = P, H = P, p = W)
    are hit often; the others use large ones to exercise int64/float64 exactness."""
    tiny = rng.random() < 0.5
    hi = 24 if tiny else 1_000_000
    P = rng.integers(1, hi, size)
    c = rng.integers(0, hi, size)
    n = rng.integers(0, 24 if tiny else 20_000, size)
    n[rng.random(size) < 0.1] = 0
    H = c.copy()
    grow = rng.random(size)
    H[grow < 0.3] += rng.integers(0, hi, int((grow < 0.3).sum()))  # preempted: H > c
    H[grow > 0.9] = 0  # host passes no high-water mark
    spec = np.minimum(rng.integers(0, 5, size), n)
    rejected = rng.integers(0, 5, size)
    # Few distinct slots in a large batch forces repeats.
    slot = rng.integers(0, slots, size)
    return np.ascontiguousarray(np.stack([slot, c, n, P, H, spec, rejected]).astype(np.int64))


def brute_force(packed: np.ndarray, windows: tuple[int | None, ...]) -> np.ndarray:
    """The meaning, one position at a time (docs/cost-model.md §4, literally)."""
    G = len(windows)
    out = np.zeros((ref.N_FIXED + G, packed.shape[1]), dtype=np.int64)
    for j, (_slot, c, n, P, H, spec, rejected) in enumerate(packed.T.tolist()):
        E = max(P, H)
        for p in range(c, c + n):
            if p < E:
                out[ref.PREFILL, j] += 1
                out[ref.RECOMPUTE, j] += p < H
            else:
                out[ref.DECODE_TOKENS, j] += 1
                for g, W in enumerate(windows):
                    out[ref.CTX0 + g, j] += p + 1 if W is None else min(p + 1, W)
        if H < P and c < P <= c + n:  # the first sample, from position P-1
            out[ref.DECODE_TOKENS, j] += 1
            for g, W in enumerate(windows):
                out[ref.CTX0 + g, j] += P if W is None else min(P, W)
        out[ref.SPEC_TOKENS, j] = spec
        out[ref.REJECTED_TOKENS, j] = rejected
    return out


def reference_step(packed: np.ndarray, windows: np.ndarray, capacity: int) -> tuple:
    state = np.zeros((capacity, ref.N_FIXED + len(windows)))
    sums = ref.accumulate(state, packed, windows)
    return state, sums


# --- the reference -----------------------------------------------------------------------


def test_hand_computed_prefill_decode_and_first_sample() -> None:
    w = ref.window_array((None, 4))
    rows = [
        # slot, c, n, P, H, spec, rej
        (0, 0, 5, 5, 0, 0, 0),
        # whole prompt of 5: prefill 5; completes it → first sample over P = 5 entries:
        # ctx = (5, min(5, 4) = 4), decode_tokens = 1.
        (1, 5, 1, 5, 5, 0, 2),
        # decode at position 5: attends over 6 entries: ctx = (6, min(6, 4) = 4); rejected 2.
        (2, 3, 4, 5, 0, 1, 0),
        # chunk [3, 7) of a 5-token prompt: prefill {3, 4} = 2; first sample (c=3 < 5 ≤ 7):
        # ctx += 5 and 4; decode positions 5, 6 read 6 and 7 (capped: 4, 4):
        # ctx = (5 + 6 + 7, 4 + 4 + 4) = (18, 12), decode_tokens = 1 + 2 = 3, spec 1.
        (3, 0, 9, 5, 8, 0, 0),
        # recompute after preemption at H = 8: positions 0..7 are prefill (E = max(5, 8) = 8),
        # all recompute; position 8 decodes over 9 entries: ctx = (9, 4); no first sample
        # (H ≥ P: it was sampled before the preemption).
        (4, 2, 3, 10, 4, 0, 0),
        # mid-prompt chunk [2, 5) of a 10-token prompt with H = 4: prefill 3, recompute
        # {2, 3} = 2; no decode, no first sample (P = 10 > c + n = 5).
        (5, 7, 0, 5, 7, 0, 1),
        # n = 0: nothing computed, only the late rejected count: rejected 1.
    ]
    packed = np.array(rows, dtype=np.int64).T.copy()
    got = ref.step_contributions(packed, w).T
    want = np.array(
        [
            # prefill, recompute, decode, spec, rejected, ctx0, ctx1
            [5, 0, 1, 0, 0, 5, 4],
            [0, 0, 1, 0, 2, 6, 4],
            [2, 0, 3, 1, 0, 18, 12],
            [8, 8, 1, 0, 0, 9, 4],
            [3, 2, 0, 0, 0, 0, 0],
            [0, 0, 0, 0, 1, 0, 0],
        ],
        dtype=np.float64,
    )
    np.testing.assert_array_equal(got, want)


def test_hand_computed_repeated_slot_and_step_sums() -> None:
    # Slot 2 twice in one step: (c=0, n=3, P=3) → prefill 3, first sample ctx 3, decode 1;
    # (c=3, n=2, P=3, H=3) → decode positions 3, 4 read 4 + 5 = 9, decode 2.
    # Slot 2 = prefill 3, decode 3, ctx 12; slot 0: (c=10, n=1, P=4, H=10) → ctx 11.
    packed = np.array(
        [[2, 2, 0], [0, 3, 10], [3, 2, 1], [3, 3, 4], [0, 3, 10], [0, 0, 0], [0, 0, 0]], dtype=np.int64
    )
    state, sums = reference_step(packed, ref.window_array((None,)), 4)
    np.testing.assert_array_equal(state[2], [3, 0, 3, 0, 0, 12])
    np.testing.assert_array_equal(state[0], [0, 0, 1, 0, 0, 11])
    np.testing.assert_array_equal(state[[1, 3]], 0)
    np.testing.assert_array_equal(sums, state.sum(axis=0))


@pytest.mark.parametrize("windows", WINDOW_SETS)
def test_reference_matches_brute_force(seed: int, windows: tuple[int | None, ...]) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(20):
        packed = random_packed(rng, int(rng.integers(0, 40)), 8)
        # Brute force walks every position: keep the sizes small.
        packed[ref.C] %= 60
        packed[ref.N] %= 40
        packed[ref.P] = packed[ref.P] % 60 + 1
        packed[ref.H] %= 80
        got = ref.step_contributions(packed, ref.window_array(windows))
        np.testing.assert_array_equal(got, brute_force(packed, windows), err_msg=f"seed={seed}")


def test_context_sum_int_matches_core_cost(seed: int) -> None:
    rng = np.random.default_rng(seed)
    L = rng.integers(1, 100_000, 2000)
    D = rng.integers(0, 5000, 2000)
    for W in (None, 1, 64, 50_000):
        got = ref.context_sum_int(L, D, ref.UNLIMITED if W is None else W)
        np.testing.assert_array_equal(got, context_sum(L, D, W), err_msg=f"seed={seed} W={W}")


def test_empty_batch_and_validation() -> None:
    w = ref.window_array((None, 16))
    state, sums = reference_step(np.zeros((7, 0), dtype=np.int64), w, 3)
    assert not state.any() and not sums.any() and sums.shape == (7,)
    with pytest.raises(ValueError):
        ref.window_array(())
    with pytest.raises(ValueError):
        ref.window_array((0,))


def test_served_pte() -> None:
    rows = np.array([[10, 2, 3, 0, 0, 100, 40], [0, 0, 0, 0, 0, 0, 0]], dtype=np.float64)
    np.testing.assert_allclose(ref.served_pte(rows, [0.01, 0.5]), [10 + 1 + 20, 0])
    with pytest.raises(ValueError):
        ref.served_pte(rows, [0.01])


# --- torch and Triton against the reference ----------------------------------------------

SIZES = [0, 1, 2, 7, 64, 513, 4096, 8192]


def _torch_step(
    kernel, packed: np.ndarray, windows: np.ndarray, capacity: int, device: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ncol = ref.N_FIXED + len(windows)
    f64 = {"dtype": torch.float64, "device": device}
    state = torch.zeros((capacity, ncol), **f64)
    hist = torch.full((4, ncol), 7.0, **f64)  # garbage in the next row: must be zeroed
    hist[1] = 0
    totals = torch.ones(ncol, **f64)  # running totals add to what is there
    kernel(
        state, hist, totals, 1, 2, torch.from_numpy(packed).to(device), torch.from_numpy(windows).to(device)
    )
    return state.cpu().numpy(), hist.cpu().numpy(), totals.cpu().numpy()


def _check_against_reference(kernel, device: str, seed: int, sizes: list[int], zeroes_next_row: bool) -> None:
    rng = np.random.default_rng(seed)
    for windows in WINDOW_SETS:
        w = ref.window_array(windows)
        for size in sizes:
            capacity = int(rng.integers(1, 2 * size + 2))  # small capacity: many repeats
            packed = random_packed(rng, size, capacity)
            want_state, want_sums = reference_step(packed, w, capacity)
            state, hist, totals = _torch_step(kernel, packed, w, capacity, device)
            msg = f"seed={seed} size={size} windows={windows} device={device}"
            # Every value is an integer below 2**53: float64 results are exact; the
            # float32-level tolerance only guards against a future float32 state.
            np.testing.assert_allclose(state, want_state, rtol=1e-6, err_msg=msg)
            np.testing.assert_allclose(hist[1], want_sums, rtol=1e-6, err_msg=msg)
            np.testing.assert_allclose(totals, want_sums + 1, rtol=1e-6, err_msg=msg)
            if zeroes_next_row:
                np.testing.assert_array_equal(hist[2], 0, err_msg=msg)
            np.testing.assert_array_equal(hist[[0, 3]], 7.0, err_msg=msg)


@needs_torch
def test_torch_contributions_match_reference_per_row(seed: int) -> None:
    from pte_instrument.engine.kernels.torch_backend import step_contributions_torch

    rng = np.random.default_rng(seed)
    for windows in WINDOW_SETS:
        w = ref.window_array(windows)
        for size in SIZES:
            packed = random_packed(rng, size, 16)
            got = step_contributions_torch(torch.from_numpy(packed), torch.from_numpy(w))
            np.testing.assert_array_equal(
                got.numpy().T, ref.step_contributions(packed, w), err_msg=f"seed={seed} size={size}"
            )


@needs_torch
def test_torch_cpu_matches_reference(seed: int) -> None:
    from pte_instrument.engine.kernels.torch_backend import accumulate_torch

    _check_against_reference(accumulate_torch, "cpu", seed, SIZES, zeroes_next_row=False)


@needs_triton
def test_triton_interpreter_matches_reference(seed: int) -> None:
    from pte_instrument.engine.kernels.triton_backend import accumulate_triton

    # Interpreted Triton pays per 1024-row program: small sizes, one medium case.
    _check_against_reference(accumulate_triton, "cpu", seed, [0, 1, 5, 300], zeroes_next_row=True)


@needs_triton
def test_triton_interpreter_medium_batch(seed: int) -> None:
    from pte_instrument.engine.kernels.triton_backend import accumulate_triton

    rng = np.random.default_rng(seed)
    w = ref.window_array((None, 4096))
    packed = random_packed(rng, 8192, 97)
    want_state, want_sums = reference_step(packed, w, 97)
    state, hist, totals = _torch_step(accumulate_triton, packed, w, 97, "cpu")
    np.testing.assert_allclose(state, want_state, rtol=1e-6, err_msg=f"seed={seed}")
    np.testing.assert_allclose(hist[1], want_sums, rtol=1e-6, err_msg=f"seed={seed}")
    np.testing.assert_allclose(totals, want_sums + 1, rtol=1e-6, err_msg=f"seed={seed}")


@needs_triton
def test_triton_with_env_interpret_in_subprocess(seed: int) -> None:
    """TRITON_INTERPRET=1 set before triton is imported (triton reads it when @jit
    decorates): the kernel and the stdlib reductions all come out interpreted."""
    code = textwrap.dedent(f"""
        import numpy as np, torch
        from pte_instrument.engine.kernels import reference as ref
        from pte_instrument.engine.kernels import triton_backend as tb
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
        assert isinstance(tl.standard._sum_combine, InterpretedFunction)
        rng = np.random.default_rng({seed})
        w = ref.window_array((None, 33))
        slot = rng.integers(0, 5, 40)
        c = rng.integers(0, 50, 40); P = rng.integers(1, 50, 40)
        packed = np.stack([slot, c, rng.integers(0, 30, 40), P, c, 0 * c, 0 * c])
        packed = np.ascontiguousarray(packed.astype(np.int64))
        want = np.zeros((5, 7)); ref.accumulate(want, packed, w)
        state = torch.zeros((5, 7), dtype=torch.float64)
        hist = torch.zeros((2, 7), dtype=torch.float64); tot = torch.zeros(7, dtype=torch.float64)
        tb._kernel(False)  # the triton.jit path: interpreted because of the env var
        assert isinstance(tb._kernel(False), InterpretedFunction)
        tb._KERNELS[True] = tb._kernel(False)
        tb.accumulate_triton(state, hist, tot, 0, 1, torch.from_numpy(packed), torch.from_numpy(w))
        np.testing.assert_array_equal(state.numpy(), want)
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "ok" in r.stdout, f"seed={seed}\n{r.stdout}\n{r.stderr}"


@needs_triton
def test_triton_kernel_compiles_for_sm90() -> None:
    """The CUDA path compiles (Triton ships ptxas): ttir → ptx → cubin for an H100/H200,
    with float64 atomics and no GPU present."""
    from pte_instrument.engine.kernels.triton_backend import compile_for_target

    k = compile_for_target(n_groups=2, arch=90)
    assert k.asm["cubin"], "no cubin"
    assert "red.global.gpu.relaxed.add.f64" in k.asm["ptx"] or "atom.global" in k.asm["ptx"]


@needs_cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_matches_reference(seed: int, backend: str) -> None:
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton not installed")
    if backend == "torch":
        from pte_instrument.engine.kernels.torch_backend import accumulate_torch as kernel
    else:
        from pte_instrument.engine.kernels.triton_backend import accumulate_triton as kernel
    _check_against_reference(kernel, "cuda", seed, SIZES, zeroes_next_row=backend == "triton")
