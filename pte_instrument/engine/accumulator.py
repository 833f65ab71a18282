"""The batched step accumulator (docs/cost-model.md §4): per-request PTE state updated with one batch of
rows per call — one scheduler step, or several concatenated (the engine hook prices
completed steps in one call) — on whichever backend fits the host.

    acc = StepAccumulator(windows=(None,))          # one full-attention KV group
    s = acc.allocate()                               # a state row for a new request
    acc.update(StepBatch.from_arrays(slot=[s], c=[0], n=[L], P=[L]))   # a prefill step
    rows = acc.read([s])                             # one batched read-back
    acc.release([s])                                 # zero the row; the slot is reused

The meaning of an update is defined by ``pte_instrument.engine.kernels.reference`` (numpy); the
``torch`` and ``triton`` backends compute the same numbers and are tested against it.

Backends: ``"numpy"`` (CPU; the default off-GPU, fastest there), ``"torch"`` (CPU or CUDA),
``"triton"`` (CUDA; on CPU it runs under the Triton interpreter, for tests only) and
``"auto"`` (triton on CUDA when importable, else torch on CUDA, else numpy). torch and
triton are imported only when chosen: numpy alone is enough to import and use this module.

GPU discipline: ``update()`` and ``release()`` never synchronise with the device. The batch
is packed on the host into one pinned (7, B) int64 buffer and copied with one
``non_blocking`` transfer; the kernel(s) are enqueued behind it; the per-update totals stay
on the device. Nothing reads a device value back (no ``.item()``, ``.cpu()``, ``nonzero()``,
no data-dependent shapes). Only ``read()``, ``step_totals()``, ``totals()`` and
``conservation()`` copy device→host, each as one batched transfer, and so wait for the
work enqueued before them. Pinned staging buffers come from torch's caching host
allocator, which does not reuse a buffer before the copy that read it has completed
(it records an event on it), so the host may refill the next one at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from pte_instrument.engine.kernels import reference as ref
from pte_instrument.engine.kernels.reference import served_pte

__all__ = ["BackendName", "StepAccumulator", "StepBatch", "StepTotals", "served_pte"]

BackendName = Literal["numpy", "torch", "triton", "auto"]
_ArrayLike = Sequence[int] | np.ndarray


def _row(field: str) -> property:
    """A ``StepBatch`` property for one of ``reference.FIELDS``: a view of its row of ``packed``."""
    i = ref.FIELDS.index(field)

    def get(batch: StepBatch) -> np.ndarray:
        return batch.packed[i]

    return property(get, doc=f"The ``{field}`` row of ``packed`` (a view).")


@dataclass(frozen=True, eq=False)  # eq on arrays is ambiguous
class StepBatch:
    """One scheduler step, packed: ``packed`` is a C-contiguous (7, B) int64 array whose rows
    are ``reference.FIELDS``:

        slot      the request's state row (a slot may repeat: its rows add up)
        c         num_computed_tokens before the step
        n         tokens scheduled in the step, drafts included
        P         prompt length
        H         the most tokens ever validly computed before the step: the running max of
                  num_computed_tokens *after* rejected drafts are rolled back (else the
                  positions re-used after a rejection would count as recompute)
        spec      speculative draft tokens among the n (the last ``spec`` positions)
        rejected  drafts rejected in the request's previous step (reported one step late)

    The named properties are views; an adapter may fill ``StepBatch.zeros(B)`` in place."""

    packed: np.ndarray

    def __post_init__(self) -> None:
        p = self.packed
        if p.dtype != np.int64 or p.ndim != 2 or p.shape[0] != ref.N_FIELDS:
            raise ValueError(f"packed must be ({ref.N_FIELDS}, B) int64, got {p.dtype} {p.shape}")
        if not p.flags.c_contiguous:
            raise ValueError("packed must be C-contiguous")

    @classmethod
    def zeros(cls, size: int) -> StepBatch:
        return cls(np.zeros((ref.N_FIELDS, size), dtype=np.int64))

    @classmethod
    def from_arrays(
        cls,
        slot: _ArrayLike,
        c: _ArrayLike,
        n: _ArrayLike,
        P: _ArrayLike,
        H: _ArrayLike | None = None,
        spec: _ArrayLike | None = None,
        rejected: _ArrayLike | None = None,
    ) -> StepBatch:
        """Pack per-field arrays; H, spec and rejected default to 0."""
        size = len(slot)
        packed = np.zeros((ref.N_FIELDS, size), dtype=np.int64)
        for i, arr in enumerate((slot, c, n, P, H, spec, rejected)):
            if arr is not None:
                packed[i] = arr  # raises on a length mismatch
        return cls(packed)

    @classmethod
    def from_rows(cls, rows: Iterable[Sequence[int]]) -> StepBatch:
        """From (slot, c, n, P[, H[, spec[, rejected]]]) tuples; missing fields are 0."""
        rows = list(rows)
        packed = np.zeros((ref.N_FIELDS, len(rows)), dtype=np.int64)
        for j, r in enumerate(rows):
            packed[: len(r), j] = r
        return cls(packed)

    def __len__(self) -> int:
        return self.packed.shape[1]

    slot = _row("slot")
    c = _row("c")
    n = _row("n")
    P = _row("P")
    H = _row("H")
    spec = _row("spec")
    rejected = _row("rejected")


@dataclass(frozen=True, eq=False)
class StepTotals:
    """Per-update column sums: ``rows[i]`` is what update ``steps[i]`` added over its batch
    (an update is one scheduler step, or several that a caller batched into one)."""

    steps: np.ndarray  # (k,) int64 update indices, ascending
    rows: np.ndarray  # (k, n_columns) float64
    columns: tuple[str, ...]


class _Store(Protocol):
    """Where the state lives: numpy arrays, or torch tensors on some device."""

    def update(self, packed: np.ndarray, hist_row: int, next_row: int) -> None: ...
    def read(self, slots: np.ndarray) -> np.ndarray: ...
    def release(self, slots: np.ndarray) -> None: ...
    def grow(self, capacity: int) -> None: ...
    def read_hist(self) -> np.ndarray: ...
    def read_vectors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


class _NumpyStore:
    def __init__(self, capacity: int, ncol: int, history: int, windows: np.ndarray) -> None:
        self.state = np.zeros((capacity, ncol), dtype=np.float64)
        self.hist = np.zeros((history, ncol), dtype=np.float64)
        self.totals = np.zeros(ncol, dtype=np.float64)
        self.retired = np.zeros(ncol, dtype=np.float64)  # sums of rows zeroed by release()
        self.windows = windows
        self.workspace = ref.Workspace()

    def update(self, packed: np.ndarray, hist_row: int, next_row: int) -> None:
        sums = ref.accumulate(self.state, packed, self.windows, self.workspace)
        self.hist[hist_row] = sums
        self.totals += sums

    def read(self, slots: np.ndarray) -> np.ndarray:
        return self.state[slots]  # fancy indexing copies

    def release(self, slots: np.ndarray) -> None:
        self.retired += self.state[slots].sum(axis=0)
        self.state[slots] = 0.0

    def grow(self, capacity: int) -> None:
        new = np.zeros((capacity, self.state.shape[1]), dtype=np.float64)
        new[: self.state.shape[0]] = self.state
        self.state = new

    def read_hist(self) -> np.ndarray:
        return self.hist.copy()

    def read_vectors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.totals.copy(), self.retired.copy(), self.state.sum(axis=0)


class _TorchStore:
    """State as float64 tensors on ``device``; ``kernel`` is accumulate_torch or
    accumulate_triton (same signature)."""

    def __init__(
        self, capacity: int, ncol: int, history: int, windows: np.ndarray, device: str, kernel: Any
    ) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        f64 = {"dtype": torch.float64, "device": self.device}
        self.state = torch.zeros((capacity, ncol), **f64)
        self.hist = torch.zeros((history, ncol), **f64)
        self.totals = torch.zeros(ncol, **f64)
        self.retired = torch.zeros(ncol, **f64)
        self.windows = torch.as_tensor(windows, dtype=torch.int64).to(self.device)
        self.kernel = kernel

    def _upload(self, arr: np.ndarray) -> Any:
        """Host int64 array → device tensor without a host sync (pinned + non_blocking)."""
        torch = self.torch
        if not self.cuda:
            return torch.from_numpy(arr)  # zero-copy; CPU work is synchronous anyway
        staging = torch.empty(arr.shape, dtype=torch.int64, pin_memory=True)
        staging.numpy()[...] = arr  # the one host-side pack copy
        return staging.to(self.device, non_blocking=True)

    def update(self, packed: np.ndarray, hist_row: int, next_row: int) -> None:
        self.kernel(
            self.state, self.hist, self.totals, hist_row, next_row, self._upload(packed), self.windows
        )

    def read(self, slots: np.ndarray) -> np.ndarray:
        idx = self._upload(slots)
        return self.state.index_select(0, idx).cpu().numpy()  # one D2H copy (syncs)

    def release(self, slots: np.ndarray) -> None:
        idx = self._upload(slots)
        self.retired.add_(self.state.index_select(0, idx).sum(0))
        self.state.index_fill_(0, idx, 0.0)

    def grow(self, capacity: int) -> None:
        new = self.torch.zeros((capacity, self.state.shape[1]), dtype=self.state.dtype, device=self.device)
        new[: self.state.shape[0]].copy_(self.state)
        self.state = new

    def read_hist(self) -> np.ndarray:
        return self.hist.cpu().numpy()

    def read_vectors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        torch = self.torch
        v = torch.stack([self.totals, self.retired, self.state.sum(0)]).cpu().numpy()
        return v[0], v[1], v[2]


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: BackendName, device: str | None) -> tuple[str, str]:
    """(backend, device) actually used for a requested pair."""
    on_cuda = device is not None and device.startswith("cuda")
    if backend == "auto":
        if on_cuda or (device is None and _cuda_available()):
            return ("triton" if _triton_available() else "torch"), device or "cuda"
        return "numpy", "cpu"
    if backend == "numpy":
        if on_cuda:
            raise ValueError("the numpy backend runs on the CPU only")
        return "numpy", "cpu"
    if backend in ("torch", "triton"):
        return backend, device or ("cuda" if _cuda_available() else "cpu")
    raise ValueError(f"unknown backend {backend!r}: numpy, torch, triton or auto")


class StepAccumulator:
    """Per-request PTE state, one row per slot, updated one batch of rows at a time: a
    scheduler step, or several steps' rows concatenated in step order (a slot may repeat;
    the caller derives each row's H from the slot's earlier rows, as EngineAccounting does).

    Columns (``columns``): prefill, recompute, decode_tokens, spec_tokens, rejected_tokens,
    ctx0..ctx{G-1} (context tokens read at decode, per KV group; see kernels/reference.py).

    windows:   one entry per KV group: its sliding window, or None for full attention.
    capacity:  initial number of slots; doubled when allocate() finds none free (a host
               decision between steps: the device copy is enqueued, not waited for).
    history:   rows in the ring of per-update totals; the last ``history - 1`` are kept.
    validate:  check each batch on the host (slots allocated, no negative field): a small
               host-side cost that turns what would be an out-of-bounds GPU write into a
               ValueError.
    """

    def __init__(
        self,
        windows: Sequence[int | None] = (None,),
        capacity: int = 256,
        backend: BackendName = "auto",
        device: str | None = None,
        history: int = 1024,
        validate: bool = True,
    ) -> None:
        if capacity < 1 or history < 2:
            raise ValueError("capacity must be ≥ 1 and history ≥ 2")
        self.windows = ref.window_array(windows)
        self.n_groups = len(self.windows)
        self.n_columns = ref.n_columns(self.n_groups)
        self.columns = ref.column_names(self.n_groups)
        self.history = history
        self.validate = validate
        self.backend, self.device = resolve_backend(backend, device)
        self._store: _Store
        if self.backend == "numpy":
            self._store = _NumpyStore(capacity, self.n_columns, history, self.windows)
        elif self.backend == "torch":
            from pte_instrument.engine.kernels.torch_backend import accumulate_torch

            self._store = _TorchStore(
                capacity, self.n_columns, history, self.windows, self.device, accumulate_torch
            )
        else:
            from pte_instrument.engine.kernels.triton_backend import accumulate_triton

            self._store = _TorchStore(
                capacity, self.n_columns, history, self.windows, self.device, accumulate_triton
            )
        self._allocated = np.zeros(capacity, dtype=bool)
        self._free = list(range(capacity - 1, -1, -1))  # a stack: low slots first
        self.step = 0  # number of update() calls so far

    @classmethod
    def from_cost_model(cls, model: Any, **kwargs: Any) -> StepAccumulator:
        """Windows from a ``pte_instrument.cost.model.CostModel`` (anything with ``.groups`` of
        ``.window``)."""
        return cls(windows=tuple(g.window for g in model.groups), **kwargs)

    # --- slots ---------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return len(self._allocated)

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    def allocate(self) -> int:
        """A zeroed slot for a new request."""
        if not self._free:
            self._grow(2 * self.capacity)
        s = self._free.pop()
        self._allocated[s] = True
        return s

    def allocate_many(self, k: int) -> np.ndarray:
        if len(self._free) < k:
            self._grow(max(2 * self.capacity, self.in_use + k))
        out = np.array([self._free.pop() for _ in range(k)], dtype=np.int64)
        self._allocated[out] = True
        return out

    def release(self, slots: _ArrayLike) -> None:
        """Zero the rows (their sums move to the retired total, for conservation) and free
        the slots for reuse. Read them first. No host sync on a GPU backend."""
        s = self._slots(slots)
        if len(s) > 1 and len(set(s.tolist())) != len(s):  # a set: np.unique sorts, and costs more
            raise ValueError("release() got a slot twice")
        if len(s) == 0:
            return
        self._store.release(s)
        self._allocated[s] = False
        self._free.extend(s[::-1].tolist())

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        self._store.grow(capacity)
        self._allocated = np.concatenate([self._allocated, np.zeros(capacity - old, dtype=bool)])
        self._free = list(range(capacity - 1, old - 1, -1)) + self._free

    def _slots(self, slots: _ArrayLike) -> np.ndarray:
        s = np.ascontiguousarray(slots, dtype=np.int64).reshape(-1)
        if len(s) and (s.min() < 0 or s.max() >= self.capacity or not self._allocated[s].all()):
            raise ValueError(f"not allocated slot(s) among {s[:16].tolist()}")
        return s

    # --- steps ---------------------------------------------------------------------------

    def update(self, batch: StepBatch | np.ndarray) -> int:
        """Add one batch (a scheduler step, or several); return its update index. Never
        waits for a GPU."""
        packed = batch.packed if isinstance(batch, StepBatch) else batch
        if self.validate:
            if isinstance(batch, np.ndarray):
                StepBatch(packed)  # shape/dtype/contiguity checks
            if packed.shape[1]:
                if packed.min() < 0:
                    bad = ref.FIELDS[int(packed.min(axis=1).argmin())]
                    raise ValueError(f"negative value in field {bad!r}")
                slot = packed[ref.SLOT]
                if slot.max() >= self.capacity or not self._allocated[slot].all():
                    raise ValueError("update() got a slot that is not allocated")
        row = self.step % self.history
        self._store.update(packed, row, (self.step + 1) % self.history)
        self.step += 1
        return self.step - 1

    def last_contributions(self, size: int) -> np.ndarray | None:
        """The per-row contributions of the latest ``update`` (a ``(n_columns, size)`` view
        of a reused buffer) when the numpy backend computed them on the host, else None."""
        if isinstance(self._store, _NumpyStore):
            return self._store.workspace.buffers(self.n_columns, size)[0]
        return None

    # --- read-back (each one batched device→host transfer) -------------------------------

    def read(self, slots: _ArrayLike) -> np.ndarray:
        """(len(slots), n_columns) float64 rows of the given slots."""
        s = self._slots(slots)
        if len(s) == 0:
            return np.zeros((0, self.n_columns), dtype=np.float64)
        return np.asarray(self._store.read(s), dtype=np.float64)

    def step_totals(self, since: int = 0) -> StepTotals:
        """Per-update column sums of updates ≥ ``since`` still held in the ring (at most
        the last ``history - 1``). Poll with ``since`` = the last update seen + 1."""
        first = max(since, self.step - (self.history - 1), 0)
        steps = np.arange(first, self.step, dtype=np.int64)
        hist = self._store.read_hist()
        return StepTotals(steps, hist[steps % self.history], self.columns)

    def totals(self) -> np.ndarray:
        """Column sums over every update so far (never truncated)."""
        return self._store.read_vectors()[0]

    def conservation(self) -> tuple[np.ndarray, np.ndarray]:
        """(per-request side, per-update side): Σ live rows + Σ released rows, and Σ over
        all updates of the per-update totals. Equal, column by column, exactly."""
        totals, retired, live = self._store.read_vectors()
        return live + retired, totals

    def served(self, slots: _ArrayLike, gammas: Sequence[float]) -> np.ndarray:
        """PTE served of the given slots: prefill + Σ_g γ_g·ctx[g]."""
        return served_pte(self.read(slots), gammas)
