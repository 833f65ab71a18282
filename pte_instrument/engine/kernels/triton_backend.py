"""The step accumulator as one Triton kernel (CUDA; on CPU tensors it runs under the
Triton interpreter, for tests).

One program per block of ``BLOCK`` rows: it loads the packed batch (field-major, so each
field's loads are coalesced), computes every column in int64 registers with the closed
forms of ``reference.py``, and ``tl.atomic_add``s them into the rows of the state (atomics
make repeated slots in one batch add up). It also adds its block's column sums into the
step's history row and the running totals, and program 0 zeroes the *next* history row,
so one launch is the whole device side of ``update()``: no memset, no reduction kernel,
no host synchronisation.

Interpreter or compiler: ``triton.jit`` decides when it decorates a function, from
``TRITON_INTERPRET`` (``triton.knobs.runtime.interpret``, read at decoration time). This
module therefore decorates lazily and picks by the tensors' device instead: CPU tensors
always go to the interpreter (``InterpretedFunction``), CUDA tensors to ``triton.jit``
(which itself honours ``TRITON_INTERPRET=1``). Importing this module needs triton, never
a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from pte_instrument.engine.kernels.reference import (
    CTX0,
    DECODE_TOKENS,
    N_FIELDS,
    PREFILL,
    RECOMPUTE,
    REJECTED_TOKENS,
    n_columns,
)
from pte_instrument.engine.kernels.reference import SPEC_TOKENS as SPEC_COL

__all__ = ["accumulate_triton", "compile_for_target"]

# tl.sum is itself a @triton.jit function, decorated when triton is imported, so a kernel
# interpreted on demand (TRITON_INTERPRET unset at import) cannot call it. tl.reduce is a
# builtin that the interpreter patches, and it recognises this combine function by
# identity (it sums with numpy); compiled, it is exactly what tl.sum lowers to.
_SUM = tl.standard._sum_combine

BLOCK_CUDA = 256  # rows per program on a GPU: 8 warps-worth of int64 lanes, good occupancy
BLOCK_INTERPRET = 1024  # the interpreter pays per program, not per lane: fewer, larger blocks


# The kernel hard-codes the column order of reference.py (Triton kernels cannot read
# non-constexpr module globals); this guard keeps the two in step.
assert (PREFILL, RECOMPUTE, DECODE_TOKENS, SPEC_COL, REJECTED_TOKENS, CTX0) == (0, 1, 2, 3, 4, 5)
assert N_FIELDS == 7


def _step_kernel(
    packed_ptr,  # (7, B) int64, field-major
    B,  # rows in the batch
    state_ptr,  # (capacity, NCOL) float64
    hist_ptr,  # (history, NCOL) float64
    totals_ptr,  # (NCOL,) float64
    win_ptr,  # (G,) int64, UNLIMITED for full attention
    hist_row,  # this step's history row
    next_row,  # the next step's history row, zeroed here
    NCOL: tl.constexpr,
    NCOL_P2: tl.constexpr,  # NCOL rounded up to a power of two (tl.arange needs one)
    G: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < B
    # Masked lanes load zeros; tl.where below zeroes their values anyway.
    slot = tl.load(packed_ptr + offs, mask=mask, other=0)
    c = tl.load(packed_ptr + B + offs, mask=mask, other=0)
    n = tl.load(packed_ptr + 2 * B + offs, mask=mask, other=0)
    P = tl.load(packed_ptr + 3 * B + offs, mask=mask, other=0)
    H = tl.load(packed_ptr + 4 * B + offs, mask=mask, other=0)
    spec = tl.load(packed_ptr + 5 * B + offs, mask=mask, other=0)
    rejected = tl.load(packed_ptr + 6 * B + offs, mask=mask, other=0)

    end = c + n
    E = tl.maximum(P, H)
    a = tl.maximum(c, E)  # first decode position
    nd = tl.maximum(end - a, 0)
    first = ((H < P) & (c < P) & (end >= P)).to(tl.int64)
    L = a + 1  # decode position a attends over a+1 entries

    row = state_ptr + slot * NCOL
    hist = hist_ptr + hist_row * NCOL

    # Column 0: prefill = |[c, end) ∩ [0, E)|.
    v = tl.where(mask, tl.maximum(tl.minimum(end, E) - c, 0), 0).to(tl.float64)
    tl.atomic_add(row + 0, v, mask=mask, sem="relaxed")
    s = tl.reduce(v, 0, _SUM)
    tl.atomic_add(hist + 0, s, sem="relaxed")
    tl.atomic_add(totals_ptr + 0, s, sem="relaxed")
    # Column 1: recompute = |[c, end) ∩ [0, H)|.
    v = tl.where(mask, tl.maximum(tl.minimum(end, H) - c, 0), 0).to(tl.float64)
    tl.atomic_add(row + 1, v, mask=mask, sem="relaxed")
    s = tl.reduce(v, 0, _SUM)
    tl.atomic_add(hist + 1, s, sem="relaxed")
    tl.atomic_add(totals_ptr + 1, s, sem="relaxed")
    # Column 2: decode tokens, the first sample included.
    v = tl.where(mask, nd + first, 0).to(tl.float64)
    tl.atomic_add(row + 2, v, mask=mask, sem="relaxed")
    s = tl.reduce(v, 0, _SUM)
    tl.atomic_add(hist + 2, s, sem="relaxed")
    tl.atomic_add(totals_ptr + 2, s, sem="relaxed")
    # Column 3: speculative tokens.
    v = tl.where(mask, spec, 0).to(tl.float64)
    tl.atomic_add(row + 3, v, mask=mask, sem="relaxed")
    s = tl.reduce(v, 0, _SUM)
    tl.atomic_add(hist + 3, s, sem="relaxed")
    tl.atomic_add(totals_ptr + 3, s, sem="relaxed")
    # Column 4: rejected draft tokens (of the previous step).
    v = tl.where(mask, rejected, 0).to(tl.float64)
    tl.atomic_add(row + 4, v, mask=mask, sem="relaxed")
    s = tl.reduce(v, 0, _SUM)
    tl.atomic_add(hist + 4, s, sem="relaxed")
    tl.atomic_add(totals_ptr + 4, s, sem="relaxed")
    # Columns 5..5+G-1: context read per KV group.
    for g in tl.static_range(G):
        W = tl.load(win_ptr + g)
        # Σ_{j<nd} min(L+j, W): m uncapped terms, then nd-m terms of a full window;
        # plus the first sample, which attends over P entries.
        m = tl.minimum(tl.maximum(W - L + 1, 0), nd)
        ctx = m * L + (m * (m - 1)) // 2 + (nd - m) * W + first * tl.minimum(P, W)
        v = tl.where(mask, ctx, 0).to(tl.float64)
        tl.atomic_add(row + 5 + g, v, mask=mask, sem="relaxed")
        s = tl.reduce(v, 0, _SUM)
        tl.atomic_add(hist + 5 + g, s, sem="relaxed")
        tl.atomic_add(totals_ptr + 5 + g, s, sem="relaxed")

    if pid == 0:  # zero the next step's history row (stream order makes it safe)
        cols = tl.arange(0, NCOL_P2)
        zeros = tl.full([NCOL_P2], 0.0, tl.float64)  # tl.zeros is @jit (see _SUM)
        tl.store(hist_ptr + next_row * NCOL + cols, zeros, mask=cols < NCOL)


_KERNELS: dict[bool, Any] = {}


def _kernel(interpret: bool) -> Any:
    """The kernel, decorated on first use: interpreted (CPU tensors) or compiled (CUDA)."""
    k = _KERNELS.get(interpret)
    if k is None:
        opts: dict[str, Any] = {"do_not_specialize": ["B", "hist_row", "next_row"]}
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            k = InterpretedFunction(_step_kernel, **opts)
        else:
            k = triton.jit(_step_kernel, **opts)
        _KERNELS[interpret] = k
    return k


def accumulate_triton(
    state: torch.Tensor,
    hist: torch.Tensor,
    totals: torch.Tensor,
    hist_row: int,
    next_row: int,
    packed: torch.Tensor,
    windows: torch.Tensor,
) -> None:
    """Add one step into ``state``, its column sums into ``hist[hist_row]`` and ``totals``,
    and zero ``hist[next_row]``: one kernel launch, even for an empty batch (which only
    zeroes the next row), so ``update()`` costs the same launch count at every size."""
    B = packed.shape[1]
    ncol = state.shape[1]
    interpret = state.device.type == "cpu"
    block = BLOCK_INTERPRET if interpret else BLOCK_CUDA
    grid = (max(1, triton.cdiv(B, block)),)
    _kernel(interpret)[grid](
        packed,
        B,
        state,
        hist,
        totals,
        windows,
        hist_row,
        next_row,
        NCOL=ncol,
        NCOL_P2=triton.next_power_of_2(ncol),
        G=windows.shape[0],
        BLOCK=block,
    )


def compile_for_target(n_groups: int = 1, arch: int = 90, block: int = BLOCK_CUDA) -> Any:
    """Compile the kernel ahead of time for an NVIDIA target (default sm_90, H100/H200)
    without a GPU — Triton ships ptxas. Proves the CUDA path compiles; returns the
    compiled kernel (``.asm`` holds ttir/ttgir/llir/ptx/cubin)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ncol = n_columns(n_groups)
    signature = {
        "packed_ptr": "*i64",
        "B": "i32",
        "state_ptr": "*fp64",
        "hist_ptr": "*fp64",
        "totals_ptr": "*fp64",
        "win_ptr": "*i64",
        "hist_row": "i32",
        "next_row": "i32",
        "NCOL": "constexpr",
        "NCOL_P2": "constexpr",
        "G": "constexpr",
        "BLOCK": "constexpr",
    }
    constexprs = {"NCOL": ncol, "NCOL_P2": triton.next_power_of_2(ncol), "G": n_groups, "BLOCK": block}
    src = ASTSource(fn=triton.jit(_step_kernel), signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32))
