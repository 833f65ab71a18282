"""Each step's measured time split exactly over its requests (docs/cost-model.md §5b).

A step's duration is shared by the step-time model: each request pays its own prefill and
KV-read terms, and the step's weight read and fixed overhead are split evenly over the
step's requests. The shares are rescaled to the measured duration, so the GPU seconds of all
requests add up to the engine's busy time exactly. A request also collects the durations of
every step it was scheduled in (its latency spent in the engine) and what its own work would
have cost alone (``predicted``). The coefficients come from theory, a saved fit, or the
online fit of the steps seen so far.

Numpy only, vectorized over the rows of a journal pass: the engine hook runs it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pte_instrument.cost.step_time import OnlineStepFit, StepTimeModel

# Per-slot columns.
PREFILL_S, KV_S, WEIGHTS_S, OVERHEAD_S, LATENCY_S, PREDICTED_S = range(6)
N_COLUMNS = 6
REFIT_STEPS = 256  # steps between two online refits (amortized over the journal passes)


@dataclass
class _Pending:
    """The latest step, processed before its duration was known."""

    slots: np.ndarray
    parts: np.ndarray  # (4, rows): modelled prefill, KV, weights, overhead seconds per row
    alone: np.ndarray  # modelled seconds of each row's work, had it run alone
    features: tuple[float, float, float]  # the step's prefill tokens, context, memory-bound


class TimeAttribution:
    def __init__(self, model: StepTimeModel, online: OnlineStepFit | None, capacity: int) -> None:
        self.model = model  # the coefficients in use (theory, a saved fit, or the online fit)
        self.online = online
        self.per_slot = np.zeros((N_COLUMNS, capacity))
        self.busy_s = 0.0  # Σ measured step durations
        self.unattributed_s = 0.0  # time of rows whose request finished before the step did
        self._pending: _Pending | None = None
        self._since_refit = 0

    def grow(self, capacity: int) -> None:
        extra = capacity - self.per_slot.shape[1]
        if extra > 0:
            self.per_slot = np.concatenate([self.per_slot, np.zeros((N_COLUMNS, extra))], axis=1)

    def steps(
        self,
        slots: np.ndarray,
        sizes: list[int],
        offsets: list[int] | None,
        prefill: np.ndarray,
        ctx: np.ndarray,
        alone_memory_bound: np.ndarray,
        memory_bound: np.ndarray,
        durations: list[float | None],
    ) -> None:
        """The rows of one or more steps (``sizes`` rows each, in step order): per row its
        prefill tokens, γ-weighted context read and whether it alone would be memory-bound;
        per step whether it is memory-bound and its measured duration (None: only the latest
        step can still be running)."""
        m = self.model
        n = np.repeat(np.asarray(sizes, dtype=np.float64), sizes)
        mb_row = np.repeat(memory_bound.astype(np.float64), sizes)
        parts = np.empty((4, len(slots)))
        np.multiply(prefill, m.a, out=parts[0])
        np.multiply(ctx, m.b, out=parts[1])
        np.divide(mb_row * m.w, n, out=parts[2])
        np.divide(m.o, n, out=parts[3])
        alone = parts[0] + parts[1] + alone_memory_bound * m.w + m.o
        if offsets is None:
            step_prefill, step_ctx = np.array([prefill.sum()]), np.array([ctx.sum()])
        else:
            step_prefill, step_ctx = np.add.reduceat(prefill, offsets), np.add.reduceat(ctx, offsets)
        last = len(sizes) - 1
        if durations[last] is None:  # its time is attributed when it ends
            start = len(slots) - sizes[last]
            self._pending = _Pending(
                slots[start:].copy(), parts[:, start:].copy(), alone[start:].copy(),
                (float(step_prefill[last]), float(step_ctx[last]), float(memory_bound[last])),
            )  # fmt: skip
            slots, parts, alone, sizes = slots[:start], parts[:, :start], alone[:start], sizes[:last]
            step_prefill, step_ctx, memory_bound = step_prefill[:last], step_ctx[:last], memory_bound[:last]
        if sizes:
            dts = np.asarray(durations[: len(sizes)], dtype=np.float64)
            self._charge(slots, sizes, parts, alone, dts)
            self._observe(step_prefill, step_ctx, memory_bound.astype(np.float64), dts)

    def step_done(self, duration: float) -> None:
        """The pending step ended after ``duration`` seconds."""
        p, self._pending = self._pending, None
        if p is None:
            return
        self._charge(p.slots, [len(p.slots)], p.parts, p.alone, np.array([duration]))
        self._observe(*(np.array([v]) for v in p.features), np.array([duration]))

    def release(self, slots: np.ndarray) -> None:
        """Slots freed (their totals read): a pending step's share of them can no longer be
        charged to anyone; it is counted as unattributed busy time when the step ends."""
        p = self._pending
        if p is not None and len(slots):
            gone = np.isin(p.slots, slots)
            if gone.any():  # their rows stay in the step's total, charged to nobody
                p.slots = np.where(gone, -1, p.slots)

    def read(self, slot: int) -> np.ndarray:
        """A finished request's columns; the slot's are zeroed for its next request."""
        out = self.per_slot[:, slot].copy()
        self.per_slot[:, slot] = 0.0
        return out

    def _charge(
        self, slots: np.ndarray, sizes: list[int], parts: np.ndarray, alone: np.ndarray, dts: np.ndarray
    ) -> None:
        step = np.repeat(np.arange(len(sizes)), sizes)
        modelled = parts.sum(axis=0)
        total = np.bincount(step, weights=modelled, minlength=len(sizes))
        even = total <= 0  # a model that predicts nothing: share the step evenly
        scale = np.where(even, 0.0, dts / np.where(even, 1.0, total))[step]
        charged = parts * scale
        if even.any():  # all of an unpredicted step's time goes to its overhead column
            charged[3] = np.where(even[step], dts[step] / np.repeat(np.asarray(sizes, float), sizes), charged[3])
        self.busy_s += float(dts.sum())
        known = slots >= 0
        if not known.all():
            self.unattributed_s += float(charged[:, ~known].sum())
            slots, charged, alone, step = slots[known], charged[:, known], alone[known], step[known]
        for col in range(4):
            np.add.at(self.per_slot[col], slots, charged[col])
        np.add.at(self.per_slot[LATENCY_S], slots, dts[step])
        np.add.at(self.per_slot[PREDICTED_S], slots, alone)

    def _observe(self, prefill: np.ndarray, ctx: np.ndarray, memory_bound: np.ndarray, dts: np.ndarray) -> None:
        if self.online is None:
            return
        self.online.add(prefill, ctx, memory_bound, dts)
        self._since_refit += len(dts)
        if self._since_refit >= REFIT_STEPS:
            self._since_refit = 0
            self.online.refit()
            self.model = self.online.model
