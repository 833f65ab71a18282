"""Each step's measured time split exactly over its requests (docs/cost-model.md §5b).

A step's duration is shared by the step-time model: each request pays its own prefill and
KV-read terms, and the step's weight read and fixed overhead are split evenly over the
step's requests. The shares are rescaled to the measured duration, so the GPU seconds of all
requests add up to the engine's busy time exactly. A request also collects the durations of
every step it was scheduled in (its latency spent in the engine) and what its own work would
have cost alone (``predicted``), at the host's speed of the moment when the online fit runs
(measured / modelled time of the steps before). The coefficients come from theory, a saved
fit, or the online fit of the steps seen so far.

Numpy only, vectorized over the rows of a pricing pass: the engine hook runs it."""

from __future__ import annotations

import time

import numpy as np

from pte_instrument.cost.step_time import OnlineStepFit, StepTimeModel

# Per-slot columns.
PREFILL_S, KV_S, WEIGHTS_S, OVERHEAD_S, LATENCY_S, PREDICTED_S = range(6)
N_COLUMNS = 6
REFIT_STEPS = 256  # steps between two online refits, at least
# and seconds, at least, after the first: a refit costs milliseconds, which at small batches
# would be more than the scheduler's own time if it ran every 256 steps
REFIT_INTERVAL_S = 10.0
_Floats = np.ndarray | float  # per step, or one step's


class TimeAttribution:
    def __init__(self, model: StepTimeModel, online: OnlineStepFit | None, capacity: int) -> None:
        self.model = model  # the coefficients in use (theory, a saved fit, or the online fit)
        self.online = online
        self.per_slot = np.zeros((N_COLUMNS, capacity))
        self.busy_s = 0.0  # Σ measured step durations
        self.unattributed_s = 0.0  # time of rows whose request's totals were sent before them
        self._since_refit = 0
        self._refit_at = -np.inf  # the first refit waits for steps only

    def grow(self, capacity: int) -> None:
        extra = capacity - self.per_slot.shape[1]
        if extra > 0:
            self.per_slot = np.concatenate([self.per_slot, np.zeros((N_COLUMNS, extra))], axis=1)

    def steps(
        self,
        slots: np.ndarray,
        sizes: list[int],
        offsets: np.ndarray | list[int] | None,
        prefill: np.ndarray,
        ctx: np.ndarray,
        alone_memory_bound: np.ndarray,
        memory_bound: np.ndarray,
        durations: np.ndarray | list[float],
    ) -> np.ndarray:
        """The rows of one or more steps (``sizes`` rows each, in step order, the first row
        of each at ``offsets``, None for one step): per row its prefill tokens, γ-weighted
        context read and whether it alone would be memory-bound; per step whether it is
        memory-bound and its measured duration. Returns each step's predicted duration: the
        model at the host's speed of the steps before it."""
        m = self.model
        rows = np.asarray(sizes)  # once: np.repeat converts a list on every call
        parts = np.empty((4, len(slots)))
        np.multiply(prefill, m.a, out=parts[0])
        np.multiply(ctx, m.b, out=parts[1])
        # a step's weight read (if memory-bound) and overhead, split evenly over its rows
        if len(sizes) == 1:  # scalars: no per-row copies
            parts[2] = memory_bound[0] * m.w / sizes[0]
            parts[3] = m.o / sizes[0]
        else:
            parts[2] = np.repeat(memory_bound * m.w / rows, rows)
            parts[3] = np.repeat(m.o / rows, rows)
        own = parts[0] + parts[1]  # shared by both sums below
        modelled = own + parts[2]
        modelled += parts[3]  # parts.sum(axis=0), the same additions in the same order
        alone = own + alone_memory_bound * m.w
        alone += m.o
        features = None  # per step, for the online fit only: (prefill tokens, context)
        if self.online is not None:
            if offsets is None:
                features = np.array([prefill.sum()]), np.array([ctx.sum()])
            else:
                features = np.add.reduceat(prefill, offsets), np.add.reduceat(ctx, offsets)
        # bincount adds each step's rows in order (a pairwise sum would round differently)
        total = np.bincount(np.repeat(np.arange(len(rows)), rows), weights=modelled, minlength=len(rows))
        dts = np.asarray(durations, dtype=np.float64)
        speeds = self._advance_speed(total, dts)
        predicted = total * speeds  # each step's price: its model at the host's speed before it
        self._charge(slots, rows, parts, total, alone, dts, speeds)
        if features is not None:
            self._observe(*features, memory_bound, dts)
        return predicted

    def read(self, slot: int) -> np.ndarray:
        """A finished request's columns; the slot's are zeroed for its next request."""
        out = self.per_slot[:, slot].copy()
        self.per_slot[:, slot] = 0.0
        return out

    def take(self, slots: np.ndarray) -> np.ndarray:
        """Finished requests' columns, (N_COLUMNS, len(slots)); their slots are zeroed."""
        out = self.per_slot[:, slots]  # fancy indexing copies
        self.per_slot[:, slots] = 0.0
        return out

    def _charge(
        self,
        slots: np.ndarray,
        rows: np.ndarray,
        parts: np.ndarray,
        total: np.ndarray,
        alone: np.ndarray,
        dts: np.ndarray,
        speeds: np.ndarray,
    ) -> None:
        """Steps of ``rows`` rows each that took ``dts``, modelled at ``total`` seconds and
        priced at the host's ``speeds``; per row its modelled ``parts`` (prefill, KV, weights,
        overhead seconds) and ``alone``, its work's modelled seconds had it run alone."""
        even = total <= 0  # a model that predicts nothing: share the step evenly
        scale = np.where(even, 0.0, dts / np.where(even, 1.0, total))
        one = len(rows) == 1  # one step: its values broadcast as scalars
        charged = parts * (scale[0] if one else np.repeat(scale, rows))
        if even.any():  # all of an unpredicted step's time goes to its overhead column
            charged[3] = np.where(np.repeat(even, rows), np.repeat(dts / rows, rows), charged[3])
        self.busy_s += float(dts.sum())
        latency = np.full(len(slots), dts[0]) if one else np.repeat(dts, rows)
        alone = alone * (speeds[0] if one else np.repeat(speeds, rows))
        for col in range(4):
            np.add.at(self.per_slot[col], slots, charged[col])
        np.add.at(self.per_slot[LATENCY_S], slots, latency)
        np.add.at(self.per_slot[PREDICTED_S], slots, alone)

    def _advance_speed(self, total: np.ndarray, dts: np.ndarray) -> np.ndarray:
        """The host's speed before each of these steps; it then moves past them."""
        if self.online is None or not len(dts):
            return np.ones(len(dts))
        return self.online.speed.advance(total, dts)

    def _observe(self, prefill: _Floats, ctx: _Floats, memory_bound: _Floats, dts: np.ndarray) -> None:
        """Steps into the online fit (per step; ``add`` takes floats for one step too)."""
        if self.online is None:
            return
        self.online.add(prefill, ctx, memory_bound, dts)
        self._since_refit += len(dts)
        if self._since_refit >= REFIT_STEPS and time.monotonic() - self._refit_at >= REFIT_INTERVAL_S:
            self._since_refit = 0
            self._refit_at = time.monotonic()
            self.online.refit()
            self.model = self.online.model
