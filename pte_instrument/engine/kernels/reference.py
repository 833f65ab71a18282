"""The batched step accumulator, in numpy: the reference that defines what every backend
computes (docs/cost-model.md §4). The torch and Triton backends are tested against it.

One scheduler step is a batch of B rows, packed as one ``(7, B)`` int64 array whose rows
are the fields below (one contiguous array, so a GPU backend needs one host→device copy):

    slot      row of the per-request state (may repeat within a batch: contributions add)
    c         tokens computed for the request before this step (num_computed_tokens)
    n         tokens scheduled for it in this step (≥ 0)
    P         its prompt length
    H         its high-water mark: the most tokens it ever had validly computed before
              this step (≥ c after a preemption reset c; host-tracked)
    spec      how many of the n scheduled tokens are speculative drafts
    rejected  draft tokens rejected in its previous step (known one step late)

Positions scheduled are p ∈ [c, c+n). With E = max(P, H):

    prefill    |[c, c+n) ∩ [0, E)|        positions below the prompt or the high-water mark
    recompute  |[c, c+n) ∩ [0, H)|        the part of prefill that had been computed before
    decode     n_d = |[max(c, E), c+n)|   each decode position p samples a token attending
               over p+1 KV entries, so group g reads Σ_p min(p+1, W_g) context tokens
    first      the step that completes the prompt for the first time (H < P, c < P ≤ c+n)
               samples output token 0 from position P-1, attending over P entries

So n decode positions starting at c read Σ_{p=c}^{c+n-1} (p+1) = n·c + n(n+1)/2 context
tokens (uncapped), and the first sample adds P. A request of prompt L that decodes D tokens
therefore reads exactly the request-level term of docs/cost-model.md §2,
Σ_{j<D} (L+j) = pte_instrument.cost.model.context_sum(L, D): output 0 reads the L prompt
entries (the first sample), output j ≥ 1 is sampled at position L+j-1 and reads L+j.

State columns per slot: prefill, recompute, decode_tokens, spec_tokens, rejected_tokens,
ctx[0..G-1] (one per KV group). Every contribution is an integer and the state is float64,
so sums are exact up to 2**53 and the backends agree bit for bit whatever the order of
their additions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Rows of the packed step batch.
FIELDS: tuple[str, ...] = ("slot", "c", "n", "P", "H", "spec", "rejected")
SLOT, C, N, P, H, SPEC, REJECTED = range(7)
N_FIELDS = len(FIELDS)

# Columns of the per-slot state and of the per-step totals.
PREFILL, RECOMPUTE, DECODE_TOKENS, SPEC_TOKENS, REJECTED_TOKENS, CTX0 = range(6)
FIXED_COLUMNS: tuple[str, ...] = (
    "prefill",
    "recompute",
    "decode_tokens",
    "spec_tokens",
    "rejected_tokens",
)
N_FIXED = len(FIXED_COLUMNS)

# An unlimited window (full attention). Large enough never to cap a context, small enough
# that W - L + 1 and (D - m)·W (with D - m = 0) cannot overflow int64.
UNLIMITED = 2**62


def n_columns(n_groups: int) -> int:
    return N_FIXED + n_groups


def column_names(n_groups: int) -> tuple[str, ...]:
    return FIXED_COLUMNS + tuple(f"ctx{g}" for g in range(n_groups))


def window_array(windows: Sequence[int | None]) -> np.ndarray:
    """KV-group windows as int64, None (full attention) → UNLIMITED."""
    if len(windows) == 0:
        raise ValueError("at least one KV group is needed")
    out = np.array([UNLIMITED if w is None else int(w) for w in windows], dtype=np.int64)
    if (out <= 0).any():
        raise ValueError(f"windows must be positive or None, got {list(windows)}")
    return out


def context_sum_int(L: np.ndarray, D: np.ndarray, W: int) -> np.ndarray:
    """Σ_{j<D} min(L+j, W) in closed form, exactly, in int64 (L ≥ 1, D ≥ 0): the value of
    pte_instrument.cost.model.context_sum(L, D, W). The first m = clip(W-L+1, 0, D) terms
    are uncapped (L+j ≤ W) and sum to m·L + m(m-1)/2; the other D-m read the whole window:
    (D-m)·W."""
    if W >= UNLIMITED:
        return D * L + D * (D - 1) // 2
    m = np.clip(W - L + 1, 0, D)
    return m * L + m * (m - 1) // 2 + (D - m) * W


def step_contributions(packed: np.ndarray, windows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """What each row of one step adds to its slot: a ``(n_columns, B)`` float64 array
    (column-major, so each column is written contiguously; every value is an integer).

    Written for few numpy calls (at scheduler batch sizes the fixed cost of each call
    outweighs its arithmetic), so some closed forms are rearranged; the comment on each
    line says what it equals."""
    _slot, c, n, P, H, spec, rejected = packed
    if out is None:
        out = np.empty((N_FIXED + len(windows), packed.shape[1]), dtype=np.float64)
    end = c + n  # positions [c, end) are scheduled
    E = np.maximum(P, H)  # below E: prefill; from E on: decode
    # prefill = |[c, end) ∩ [0, E)| = max(0, min(end, E) - c), as c ≥ 0; same for H.
    np.maximum(np.minimum(end, E) - c, 0, out=out[PREFILL])
    np.maximum(np.minimum(end, H) - c, 0, out=out[RECOMPUTE])
    a = np.maximum(c, E)  # first decode position
    nd = np.maximum(end - a, 0)  # decode positions [a, a+nd)
    # The first sample: the prompt completes here for the first time (H < P, c < P ≤ end).
    first = (np.maximum(H, c) < P) & (end >= P)
    np.add(nd, first, out=out[DECODE_TOKENS])
    out[SPEC_TOKENS] = spec
    out[REJECTED_TOKENS] = rejected
    for g, W in enumerate(windows.tolist()):
        # Decode position p reads min(p+1, W) entries: Σ_{p=a}^{a+nd-1} min(p+1, W)
        # = context_sum(a+1, nd, W). Positions p < W are uncapped: m = |[a, min(end, W))|
        # of them, reading (a+1) + … + (a+m) = m(2a+m+1)/2; the other nd-m read W each.
        if W >= UNLIMITED:
            # m = nd, and when nd > 0, 2a+nd+1 = a+end+1 (when nd = 0 the product is 0).
            ctx = nd * (a + end + 1) // 2
            ctx += first * P  # the first sample attends over P entries
        else:
            m = np.maximum(np.minimum(end, W) - a, 0)
            ctx = m * (2 * a + m + 1) // 2 + (nd - m) * W
            ctx += first * np.minimum(P, W)
        out[CTX0 + g] = ctx
    return out


class Workspace:
    """Scratch arrays reused across steps. glibc serves allocations over ~128 KiB with a
    fresh mmap, and at large batches faulting its pages in costs more than the arithmetic
    on the (n_columns, B) buffers."""

    def __init__(self) -> None:
        self._values = np.empty(0, dtype=np.float64)
        self._index = np.empty(0, dtype=np.int64)
        self._offsets: dict[int, np.ndarray] = {}

    def buffers(self, ncol: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(values, flat index) as C-contiguous (ncol, size) views, and column offsets."""
        k = ncol * size
        if len(self._values) < k:
            self._values = np.empty(2 * k, dtype=np.float64)
            self._index = np.empty(2 * k, dtype=np.int64)
        offsets = self._offsets.get(ncol)
        if offsets is None:
            offsets = self._offsets[ncol] = np.arange(ncol, dtype=np.int64)[:, None]
        return self._values[:k].reshape(ncol, size), self._index[:k].reshape(ncol, size), offsets


def accumulate(
    state: np.ndarray,
    packed: np.ndarray,
    windows: np.ndarray,
    workspace: Workspace | None = None,
) -> np.ndarray:
    """Add one step into ``state`` (shape (capacity, n_columns), float64, C-contiguous);
    return the step's column sums (float64). Repeated slots add up (np.add.at on the
    flattened state: unbuffered, and faster than the 2-D fancy-index form)."""
    ncol = state.shape[1]
    if not state.flags.c_contiguous:
        raise ValueError("state must be C-contiguous (it is updated through a flat view)")
    if packed.shape[1] == 0:
        return np.zeros(ncol, dtype=np.float64)
    values, flat_index, offsets = (workspace or Workspace()).buffers(ncol, packed.shape[1])
    step_contributions(packed, windows, out=values)
    # element (k, j) of the contributions goes to state[slot_j, k]
    np.add(packed[SLOT] * ncol, offsets, out=flat_index)
    np.add.at(state.reshape(-1), flat_index.reshape(-1), values.reshape(-1))
    return values.sum(axis=1)


def served_pte(rows: np.ndarray, gammas: Sequence[float]) -> np.ndarray:
    """PTE served of state rows: prefill + Σ_g γ_g·ctx[g] (recompute is part of prefill)."""
    rows = np.asarray(rows, dtype=np.float64)
    g = np.asarray(gammas, dtype=np.float64)
    if rows.shape[-1] != N_FIXED + len(g):
        raise ValueError(f"rows have {rows.shape[-1]} columns, expected {N_FIXED + len(g)}")
    return rows[..., PREFILL] + rows[..., CTX0:] @ g
