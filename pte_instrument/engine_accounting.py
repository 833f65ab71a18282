"""Exact step-level accounting in the engine process (SPEC-PTE §4–5), vLLM-free: the
scheduler adapter hands it plain numbers; it keeps per-request totals in the batched
accumulator and reports each finished request once, through a transport.

Per step the host does O(batch) Python work to build one packed int array; everything
else is one accumulator call (numpy, or an asynchronous GPU kernel) and, when the step
log or roofline attribution is on, a few vectorized numpy calls.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .accumulator import StepAccumulator
from .core.cost import CostModel
from .kernels import reference as ref

# Per-slot host state, one int64 array row each (slot-indexed, so a step is vectorized).
HIGH_WATER, REJECTED, SCHED_END, SPEC, CACHED, PROMPT = range(6)
N_STATE = 6


@dataclass
class EngineAccounting:
    cost_model: CostModel
    send: Callable[[list[dict[str, Any]]], None]
    engine: int = 0
    backend: str = "numpy"
    step_log: str | None = None
    clock: Callable[[], float] = time.perf_counter
    external_id: Callable[[str], str] = lambda rid: rid  # the id the API server knows
    weight_bytes: float = 2.0  # bytes per weight as served (bf16: 2); read once per step
    acc: StepAccumulator = field(init=False)
    slot_of: dict[str, int] = field(default_factory=dict, init=False)  # live requests
    finished: list[tuple[str, str, int, dict[str, int]]] = field(default_factory=list, init=False)
    steps: int = field(default=0, init=False)
    hook_s: float = field(default=0.0, init=False)  # the hook's own time in on_schedule, all steps
    fault_counts: Mapping[str, int] = field(default_factory=dict, init=False)  # the hook's own faults

    def __post_init__(self) -> None:
        # validate=False: the batches are built here, and the check costs ~10 µs a step
        self.acc = StepAccumulator.from_cost_model(self.cost_model, backend=self.backend, validate=False)
        self.gammas = np.array([g.gamma for g in self.cost_model.groups])
        shape = self.cost_model.shape
        # Weight read per step in prefill-token units (SPEC §5): W_bytes·HOI/(2·N_active).
        self.weights_pte = (
            shape.n_total * self.weight_bytes * self.cost_model.device.hoi / (2 * shape.n_active)
        )
        # high-water mark: most tokens ever validly computed (survives preemption);
        # rejected drafts not yet sent; c+n and drafts of the latest step; prefix-cache hits
        # (computed tokens at first schedule); prompt length.
        self.state = np.zeros((N_STATE, self.acc.capacity), dtype=np.int64)
        self.roofline = np.zeros(self.acc.capacity)
        self._workspace = ref.Workspace()  # reused buffers: fresh large arrays cost page faults
        self._log = None
        self._pending_step: dict[str, Any] | None = None
        if self.step_log:
            path = Path(f"{self.step_log}.engine{self.engine}" if self.engine else self.step_log)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._log = path.open("a", buffering=1 << 16)
            header = {"header": True, "engine": self.engine, "gammas": self.gammas.tolist(),
                      "windows": [g.window for g in self.cost_model.groups], "n_active": shape.n_active,
                      "n_total": shape.n_total, "hoi": self.cost_model.device.hoi,
                      "device": self.cost_model.device.name, "weights_pte": self.weights_pte}  # fmt: skip
            self._log.write(json.dumps(header) + "\n")

    @property
    def live(self) -> int:
        return len(self.slot_of)

    def _slots(self, rids: list[str], first_c: np.ndarray, prompts: np.ndarray) -> np.ndarray:
        slot_of = self.slot_of
        new = [j for j, rid in enumerate(rids) if rid not in slot_of]
        if new:
            for j in new:
                slot_of[rids[j]] = self.acc.allocate()
            if self.acc.capacity > self.state.shape[1]:  # the accumulator grew
                grow = self.acc.capacity - self.state.shape[1]
                self.state = np.concatenate([self.state, np.zeros((N_STATE, grow), dtype=np.int64)], axis=1)
                self.roofline = np.concatenate([self.roofline, np.zeros(grow)])
            fresh = np.fromiter((slot_of[rids[j]] for j in new), np.int64, len(new))
            self.state[:, fresh] = 0
            self.state[CACHED, fresh] = first_c[new]
            self.state[PROMPT, fresh] = prompts[new]
        return np.fromiter((slot_of[r] for r in rids), np.int64, len(rids))

    # --- per step -----------------------------------------------------------------------

    def on_schedule(self, rids: list[str], columns: list[list[int]]) -> None:
        """One scheduled step. ``columns``: per request, in the order of ``rids``: tokens
        computed before the step, tokens scheduled, prompt length, speculative drafts."""
        t_start = self.clock()
        self._close_step(t_start)
        b = len(rids)
        if not b:
            return
        c, n, prompt, spec = np.array(columns, dtype=np.int64).reshape(4, b)
        slots = self._slots(rids, c, prompt)
        st = self.state
        end = c + n
        packed = np.stack([slots, c, n, prompt, st[HIGH_WATER, slots], spec, st[REJECTED, slots]])
        st[REJECTED, slots] = 0
        st[SCHED_END, slots] = end
        st[SPEC, slots] = spec
        st[HIGH_WATER, slots] = np.maximum(st[HIGH_WATER, slots], end)
        self.acc.update(packed)
        self.steps += 1
        self._attribute(packed, t_start)
        self.hook_s += self.clock() - t_start

    def _attribute(self, packed: np.ndarray, t_start: float) -> None:
        """Roofline attribution (SPEC §5) of this step, and its step-log line."""
        contrib = self.acc.last_contributions(packed.shape[1])  # numpy: already computed
        if contrib is None:  # a GPU backend computed them on the device: redo them here
            values, _, _ = self._workspace.buffers(self.acc.n_columns, packed.shape[1])
            contrib = ref.step_contributions(packed, self.acc.windows, out=values)
        tokens = packed[ref.N]
        kv_pte = (contrib[ref.CTX0 :] * self.gammas[:, None]).sum(axis=0)  # no BLAS call: it may spin threads
        total_tokens = float(tokens.sum())
        memory = self.weights_pte + float(kv_pte.sum())
        if total_tokens >= memory:  # compute-bound: each request pays for its tokens
            share = tokens.astype(np.float64)
        else:  # memory-bound: weights split evenly, each request's own KV reads
            share = self.weights_pte / max(len(tokens), 1) + kv_pte
        self.roofline[packed[ref.SLOT]] += share  # a request appears once per vLLM step
        if self._log is not None:
            sums = contrib.sum(axis=1)
            self._pending_step = {
                "engine": self.engine, "step": self.steps - 1, "t": time.time(), "n_reqs": int(packed.shape[1]),
                "tokens": int(total_tokens), "prefill": int(sums[ref.PREFILL]), "recompute": int(sums[ref.RECOMPUTE]),
                "decode_tokens": int(sums[ref.DECODE_TOKENS]), "spec_tokens": int(sums[ref.SPEC_TOKENS]),
                "ctx": sums[ref.CTX0 :].tolist(), "pte": float(sums[ref.PREFILL] + float(self.gammas @ sums[ref.CTX0 :])),
                "roofline_pte": max(total_tokens, memory), "weights_pte": self.weights_pte,
            }  # fmt: skip
            now = self.clock()
            self._pending_step["hook_s"] = now - t_start  # the plugin's own time this step
            self._pending_step["_t0"] = now

    def on_step_done(self) -> None:
        """The model ran: the step's wall time is schedule end → outputs back."""
        self._close_step(self.clock())

    def _close_step(self, now: float) -> None:
        step = self._pending_step
        if step is None or self._log is None:
            return
        self._pending_step = None
        step["dt_s"] = now - step.pop("_t0")
        self._log.write(json.dumps(step) + "\n")

    def accepted(self, rid: str, num_computed: int) -> None:
        """After the step's outputs: drafts beyond ``num_computed`` were rejected."""
        slot = self.slot_of.get(rid)
        if slot is not None:
            self._settle_drafts(slot, num_computed)

    def _settle_drafts(self, slot: int, num_computed: int) -> None:
        """vLLM rolls ``num_computed_tokens`` back over rejected drafts; those positions were
        computed (wasted work) but hold no valid KV, so the high-water mark drops to match."""
        st = self.state
        if st[SPEC, slot]:
            st[REJECTED, slot] += max(0, int(st[SCHED_END, slot]) - num_computed)
            st[HIGH_WATER, slot] = num_computed
            st[SPEC, slot] = 0

    # --- finish -------------------------------------------------------------------------

    def on_finished(self, rid: str, reason: str, num_computed: int, counts: dict[str, int]) -> None:
        """``counts``: prompt_tokens, output_tokens, num_preemptions as the engine saw them,
        so the API server can still account a request its stat logger never reports."""
        slot = self.slot_of.pop(rid, -1)  # -1: never scheduled (aborted while waiting)
        if slot >= 0:
            self._settle_drafts(slot, num_computed)
        self.finished.append((rid, reason, slot, counts))

    def flush(self) -> None:
        """Read the finished requests' rows in one transfer, send them, free the slots."""
        if not self.finished:
            return
        done, self.finished = self.finished, []
        slots = np.array([slot for _, _, slot, _ in done if slot >= 0], dtype=np.int64)
        rows = self.acc.read(slots) if len(slots) else np.zeros((0, self.acc.n_columns))
        cols = self.acc.columns
        faults = dict(self.fault_counts)
        messages, k = [], 0
        for rid, reason, slot, counts in done:
            msg: dict[str, Any] = {"request_id": rid, "external_id": self.external_id(rid), "engine": self.engine,
                                   "finish_reason": reason, **counts, "engine_live": self.live,
                                   "engine_faults": faults, "engine_steps": self.steps,
                                   "engine_hook_s": self.hook_s}  # fmt: skip
            if slot >= 0:
                row = rows[k]
                k += 1
                msg.update({c: float(v) for c, v in zip(cols, row, strict=True)})
                msg["rejected_tokens"] += float(
                    self.state[REJECTED, slot]
                )  # drafts rejected in the final step
                msg["cached_tokens"] = int(self.state[CACHED, slot])
                msg["pte_served"] = float(row[ref.PREFILL] + self.gammas @ row[ref.CTX0 :])
                msg["pte_recompute"] = float(row[ref.RECOMPUTE])
                msg["pte_roofline"] = float(self.roofline[slot])
                self.roofline[slot] = 0.0
            else:
                msg.update(dict.fromkeys(cols, 0.0))
                msg.update(cached_tokens=0, pte_served=0.0, pte_recompute=0.0, pte_roofline=0.0)
            messages.append(msg)
        if len(slots):
            self.acc.release(slots)
        self.send(messages)
        if self._log is not None:
            self._log.flush()  # step lines reach the file at least as often as requests finish

    def conservation(self) -> tuple[np.ndarray, np.ndarray]:
        return self.acc.conservation()

    def close(self) -> None:
        self._close_step(self.clock())
        if self._log is not None:
            self._log.close()
            self._log = None
