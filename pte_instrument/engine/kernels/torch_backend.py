"""The step accumulator in torch (CPU or CUDA): the same arithmetic as ``reference.py``,
on tensors, scattered with ``index_add_``.

On CUDA it is a chain of ~30 small elementwise kernels, all enqueued on the current
stream: nothing here reads a device value back on the host (no ``.item()``, ``.cpu()``,
``.tolist()``, ``nonzero()`` or data-dependent shapes), so ``update()`` never waits for
the GPU. Launch overhead dominates at every batch size a scheduler produces; the Triton
backend does the same work in one launch.

Precision: the state is float64. Every contribution is an integer, so float64 keeps the
sums exact up to 2**53 and makes the result independent of the (non-deterministic) order
of CUDA atomics in ``index_add_``. float32 would be exact only to 2**24 ≈ 1.7e7 context
tokens per slot — one 100k-token request decoding 200 tokens already exceeds it — and
would not be measurably faster, since the work is launch-bound, not bandwidth-bound.
"""

from __future__ import annotations

import torch

from pte_instrument.engine.kernels.reference import (
    CTX0,
    DECODE_TOKENS,
    N_FIXED,
    PREFILL,
    RECOMPUTE,
    REJECTED_TOKENS,
)
from pte_instrument.engine.kernels.reference import SPEC_TOKENS as SPEC_COL

__all__ = ["accumulate_torch", "step_contributions_torch"]


def step_contributions_torch(packed: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """``(B, n_columns)`` float64 contributions of one step (packed: (7, B) int64;
    windows: (G,) int64 on the same device, UNLIMITED for full attention)."""
    _slot, c, n, P, H, spec, rejected = packed.unbind(0)
    end = c + n
    E = torch.maximum(P, H)
    prefill = (torch.minimum(end, E) - c).clamp_(min=0)
    recompute = (torch.minimum(end, H) - c).clamp_(min=0)
    a = torch.maximum(c, E)
    nd = (end - a).clamp_(min=0)
    first = ((torch.maximum(H, c) < P) & (end >= P)).to(torch.int64)
    W = windows[:, None]  # (G, 1) against (B,) rows → (G, B)
    # Decode position p reads min(p+1, W): the m positions p < W read a+1 … a+m, the other
    # nd-m read W each (the form of reference.step_contributions); plus the first sample.
    m = (torch.minimum(end, W) - a).clamp_(min=0)
    ctx = m * (2 * a + m + 1) // 2 + (nd - m) * W + first * torch.minimum(P, W)
    out = torch.empty(
        (packed.shape[1], N_FIXED + windows.shape[0]), dtype=torch.float64, device=packed.device
    )
    out[:, PREFILL] = prefill
    out[:, RECOMPUTE] = recompute
    out[:, DECODE_TOKENS] = nd + first
    out[:, SPEC_COL] = spec
    out[:, REJECTED_TOKENS] = rejected
    out[:, CTX0:] = ctx.T
    return out


def accumulate_torch(
    state: torch.Tensor,
    hist: torch.Tensor,
    totals: torch.Tensor,
    hist_row: int,
    next_row: int,
    packed: torch.Tensor,
    windows: torch.Tensor,
) -> None:
    """Add one step into ``state`` (capacity, n_columns) float64; write the step's column
    sums into ``hist[hist_row]`` and add them to ``totals``. ``next_row`` is unused here
    (the Triton kernel zeroes it ahead of time; this backend overwrites its row)."""
    if packed.shape[1] == 0:  # host-known shape: no device read
        hist[hist_row].zero_()
        return
    contrib = step_contributions_torch(packed, windows)
    state.index_add_(0, packed[0], contrib)
    sums = contrib.sum(0)
    hist[hist_row].copy_(sums)
    totals.add_(sums)
