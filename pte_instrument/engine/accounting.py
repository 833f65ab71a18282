"""Exact step-level accounting in the engine process (docs/cost-model.md §4–5), vLLM-free: the
scheduler adapter hands it plain numbers; it keeps per-request totals in the batched
accumulator and reports each finished request once, through a transport.

A step journal keeps the hook cheap: per step the host only looks up slots and appends the
step's columns to Python lists (O(batch) Python, no numpy call). The journal is processed
in one vectorized pass — one accumulator update over the rows of all its steps, the
roofline attribution and the step-log lines of each of them — when it holds
``JOURNAL_STEPS`` steps, when something reads totals (``flush`` with finished requests,
``conservation``, ``close``), and at once for a step with speculative drafts (and while
drafts are unsettled), so ``accepted()`` works on per-step state. At these sizes a numpy
call costs about the same whatever its size, and far more than a list append; the pass
needs a few dozen of them, paid once per journal instead of once per step (the measured
cost per step: ``python -m bench.hook_bench``, bench/results/hook-*.json).

The only state one step leaves for the next is per slot: the high-water mark H (a row's
tokens below H are recompute), the rejected drafts not yet charged, and the latest step's
end and drafts. Within a journal H is the running max of the slot's ends (H changes
otherwise only when drafts are settled, and then the journal is empty), so the pass derives
each row's H from the state and the slot's earlier rows.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np

from pte_instrument.cost.model import CostModel
from pte_instrument.cost.step_time import OnlineStepFit, StepTimeModel, theory
from pte_instrument.engine.accumulator import StepAccumulator
from pte_instrument.engine.kernels import reference as ref
from pte_instrument.engine.timing import TimeAttribution
from pte_instrument.wire import EngineCalibration, RequestTotals, StepLogHeader, StepLogLine, encode_step_log

# Per-slot host state, one int64 array row each (slot-indexed, so a step is vectorized).
HIGH_WATER, REJECTED, SCHED_END, SPEC, CACHED = range(5)
N_STATE = 5
JOURNAL_STEPS = 32  # steps journaled before one vectorized pass (the hook must stay ≤ 1% of engine time)
_KEY_BITS = 32  # slot·2³² + end sorts rows by slot, then end (ends < 2³² tokens)


class _Journal:
    """Steps captured but not yet processed: the rows of all of them, concatenated in step
    order, as plain lists (a list append is far cheaper than a numpy call).
    ``spec``: drafts of the latest step, if it has any (a step with drafts is processed at
    once, so it is the latest). ``meta``, with the step log on: per step [step, unix time,
    hook s, end of hook, dt s] (dt None until the model's outputs are back)."""

    __slots__ = ("c", "meta", "n", "prompt", "sizes", "slots", "spec")

    def __init__(self) -> None:
        self.slots: list[int] = []
        self.c: list[int] = []
        self.n: list[int] = []
        self.prompt: list[int] = []
        self.spec: list[int] | None = None
        self.sizes: list[int] = []  # rows per step
        self.meta: list[list[Any]] = []


@dataclass
class _Running:
    """The latest step, processed before its outputs were back: its wall time, its share of
    the measured time and its step-log line wait until the step ends."""

    t0: float  # its wall time starts: the end of its hook call
    line: StepLogLine | None  # with the step log on: written once dt_s is known


@dataclass
class EngineAccounting:
    cost_model: CostModel
    send: Callable[[list[RequestTotals]], None]
    engine: int = 0
    backend: str = "numpy"
    step_log: str | None = None
    clock: Callable[[], float] = time.perf_counter
    # the id the API server knows, and a parallel-sampling child's index
    external_id: Callable[[str], tuple[str, int | None]] = lambda rid: (rid, None)
    weight_bytes: float = 2.0  # bytes per weight as served (bf16: 2); read once per step
    journal_steps: int = JOURNAL_STEPS  # 1: process every step at once
    # the step-time model that splits each step's measured time (None: theory), and whether
    # to keep fitting it to the steps seen (docs/cost-model.md §5b)
    step_model: StepTimeModel | None = None
    step_model_source: str = "theory"  # or "file": a saved fit
    calibrate_online: bool = True
    acc: StepAccumulator = field(init=False)
    slot_of: dict[str, int] = field(default_factory=dict, init=False)  # live requests
    finished: list[tuple[str, str, int, Mapping[str, float], float]] = field(default_factory=list, init=False)
    steps: int = field(default=0, init=False)
    # the hook's own time, all steps: on_schedule, and journal passes wherever they run
    hook_s: float = field(default=0.0, init=False)
    step_log_error: OSError | None = field(default=None, init=False)  # why the step log is off

    def __post_init__(self) -> None:
        # validate=False: the batches are built here, and the check would cost more than the step
        self.acc = StepAccumulator.from_cost_model(self.cost_model, backend=self.backend, validate=False)
        self.gammas = np.array([g.gamma for g in self.cost_model.groups])
        shape = self.cost_model.shape
        # Weight read per step in prefill-token units (docs/cost-model.md §5): W_bytes·HOI/(2·N_active).
        self.weights_pte = (
            shape.n_total * self.weight_bytes * self.cost_model.device.hoi / (2 * shape.n_active)
        )
        # high-water mark: most tokens ever validly computed (survives preemption);
        # rejected drafts not yet sent; c+n and drafts of the latest step; prefix-cache hits
        # (computed tokens at first schedule). Up to date for every step processed; the
        # journal holds the rest.
        self.state = np.zeros((N_STATE, self.acc.capacity), dtype=np.int64)
        self.roofline = np.zeros(self.acc.capacity)
        self.rejected_pte = np.zeros(self.acc.capacity)  # PTE of each slot's rejected drafts
        self._workspace = ref.Workspace()  # reused buffers: fresh large arrays cost page faults
        self._journal = _Journal()
        self._drafts: set[int] = set()  # slots whose drafts accepted() has not settled yet
        self._rejected = False  # whether some slot has rejected drafts not yet charged
        self._log = None
        self._running: _Running | None = None  # the latest step, processed while it runs
        prior = self.step_model or theory(self.cost_model, self.weight_bytes)
        self.timing = TimeAttribution(
            prior, OnlineStepFit(prior) if self.calibrate_online else None, self.acc.capacity
        )
        self._gamma_total = float(self.gammas.sum()) or 1.0
        if self.step_log:
            self._open_step_log(self.step_log)

    def _open_step_log(self, base: str) -> None:
        """The step log with its header; one that cannot be opened stays off (``step_log_error``):
        the accounting does not need it."""
        path = Path(f"{base}.engine{self.engine}" if self.engine else base)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._log = path.open("a", buffering=1 << 16)
        except FileExistsError:  # a file where the directory should be: say so
            self.step_log_error = NotADirectoryError(errno.ENOTDIR, "Not a directory", str(path.parent))
            return
        except OSError as e:
            self.step_log_error = e
            return
        shape = self.cost_model.shape
        header = StepLogHeader(
            engine=self.engine, gammas=self.gammas.tolist(), windows=[g.window for g in self.cost_model.groups],
            n_active=shape.n_active, n_total=shape.n_total, hoi=self.cost_model.device.hoi,
            device=self.cost_model.device.name, weights_pte=self.weights_pte,
        )  # fmt: skip
        self._log.write(encode_step_log(header))

    @property
    def live(self) -> int:
        return len(self.slot_of)

    def _allocate(self, rids: list[str], first_c: list[int]) -> list[int]:
        """Slots of a step with new requests among it: a fresh slot each, its state zeroed
        (a freed slot is reused only after the journal was processed, at flush)."""
        slot_of, st, out = self.slot_of, self.state, []
        for j, rid in enumerate(rids):
            s = slot_of.get(rid)
            if s is None:
                s = slot_of[rid] = self.acc.allocate()
                if self.acc.capacity > st.shape[1]:  # the accumulator grew
                    grow = self.acc.capacity - st.shape[1]
                    st = self.state = np.concatenate([st, np.zeros((N_STATE, grow), dtype=np.int64)], axis=1)
                    self.roofline = np.concatenate([self.roofline, np.zeros(grow)])
                    self.rejected_pte = np.concatenate([self.rejected_pte, np.zeros(grow)])
                    self.timing.grow(self.acc.capacity)
                st[:, s] = 0
                st[CACHED, s] = first_c[j]
                self._drafts.discard(s)
            out.append(s)
        return out

    # --- per step -----------------------------------------------------------------------

    def on_schedule(self, rids: list[str], columns: list[list[int]]) -> None:
        """One scheduled step. ``columns``: per request, in the order of ``rids``: tokens
        computed before the step, tokens scheduled, prompt length, speculative drafts
        (sequences of ints; a request appears once per step)."""
        t_start = self.clock()
        log = self._log
        self._close_step(t_start)
        if not rids:
            return
        if len(self._journal.sizes) >= self.journal_steps:
            # its time counts in this step's hook_s: the step that triggers it; the latest
            # journaled step ended above, so its line is complete
            self._write(self._process())
        c, n, prompt, spec = columns
        slot_of = self.slot_of
        try:
            slots = [slot_of[rid] for rid in rids]
        except KeyError:
            slots = self._allocate(rids, c)
        j = self._journal
        j.slots += slots
        j.c += c
        j.n += n
        j.prompt += prompt
        j.sizes.append(len(slots))
        self.steps += 1
        j.meta.append([self.steps - 1, time.time() if log is not None else 0.0, 0.0, 0.0, None])
        if any(spec):
            j.spec = list(spec)
        # at once for drafts, or unsettled ones: accepted() settles them against this step's state
        processed = j.spec is not None or bool(self._drafts)
        line = self._process() if processed else None
        t_end = self.clock()
        self.hook_s += t_end - t_start
        # the step's own time; its wall time starts now
        if not processed:
            j.meta[-1][2:4] = t_end - t_start, t_end
        else:
            if line is not None:
                line.hook_s = t_end - t_start
            self._running = _Running(t_end, line)

    def on_step_done(self) -> None:
        """The model ran: the step's wall time is schedule end → outputs back."""
        self._close_step(self.clock())

    def _close_step(self, now: float) -> None:
        """The latest step's wall time ends (its outputs are back, or the next step is being
        scheduled); a second call for the same step changes nothing."""
        running = self._running
        if running is not None:  # processed already: its time is attributed now
            self._running = None
            dt = now - running.t0
            self.timing.step_done(dt)
            if running.line is not None:
                running.line.dt_s = dt
                self._write(running.line)
        meta = self._journal.meta
        if meta and meta[-1][4] is None:
            meta[-1][4] = now - meta[-1][3]

    def accepted(self, rid: str, num_computed: int) -> None:
        """After the step's outputs: drafts beyond ``num_computed`` were rejected."""
        slot = self.slot_of.get(rid)
        if slot is not None:
            self._settle_drafts(slot, num_computed)

    def _settle_drafts(self, slot: int, num_computed: int) -> None:
        """vLLM rolls ``num_computed_tokens`` back over rejected drafts; those positions were
        computed (wasted work) but hold no valid KV, so the high-water mark drops to match.
        A slot has drafts only after a step processed at once, so the journal is empty."""
        st = self.state
        if st[SPEC, slot]:
            end = int(st[SCHED_END, slot])
            rejected = end - num_computed
            if rejected > 0:
                st[REJECTED, slot] += rejected
                self._rejected = True
                # each rejected position p read min(p + 1, W) KV entries per group: wasted
                self.rejected_pte[slot] += sum(
                    g * int(ref.context_sum_int(np.int64(num_computed + 1), np.int64(rejected), int(w)))
                    for g, w in zip(self.gammas.tolist(), self.acc.windows.tolist(), strict=True)
                )
            st[HIGH_WATER, slot] = num_computed
            st[SPEC, slot] = 0
        self._drafts.discard(slot)

    # --- the journal pass ---------------------------------------------------------------

    def _process(self) -> StepLogLine | None:
        """Every journaled step into the accumulator (one update), the roofline and the
        step log. Written for few numpy calls, whose fixed cost dominates at these sizes.
        Returns the latest step's step-log line, not written yet (see ``_log_steps``)."""
        j = self._journal
        if not j.sizes:
            return None
        self._journal = _Journal()  # a fault below loses these steps, never repeats them
        sizes, R, st = j.sizes, len(j.slots), self.state
        packed = np.zeros((ref.N_FIELDS, R), dtype=np.int64)
        packed[ref.SLOT] = j.slots
        packed[ref.C] = j.c
        packed[ref.N] = j.n
        packed[ref.P] = j.prompt
        last = slice(R - sizes[-1], R)  # the latest step's rows: the only ones with drafts
        if j.spec is not None:
            packed[ref.SPEC, last] = j.spec
        slot = packed[ref.SLOT]
        end = packed[ref.C] + packed[ref.N]
        if len(sizes) == 1:  # one step: each slot once
            h = st[HIGH_WATER, slot]
            packed[ref.H] = h
            st[HIGH_WATER, slot] = np.maximum(h, end)
            if self._rejected:
                packed[ref.REJECTED] = st[REJECTED, slot]
                st[REJECTED, slot] = 0
        else:
            # Rows grouped by slot, in step order within a group (stable sort). A row's H is
            # max(the slot's H before the journal, the ends of its earlier rows). key = slot·2³²
            # + end: its running max over the sorted rows, minus the row's slot·2³², is the
            # slot's running max end (≥ 0) or, from an earlier slot's rows, negative.
            order = np.argsort(slot, kind="stable")
            ss = slot[order]
            base = ss << _KEY_BITS
            run = np.maximum.accumulate(base + end[order])
            h = np.empty(R, dtype=np.int64)
            h[0] = -1
            h[1:] = run[:-1]
            h -= base
            np.maximum(h, st[HIGH_WATER, ss], out=h)  # the state's H ≥ 0 beats the negatives
            packed[ref.H, order] = h
            np.maximum.at(st[HIGH_WATER], slot, end)
            if self._rejected:  # undelivered rejected drafts go to the slot's first row
                first = np.empty(R, dtype=bool)
                first[0] = True
                np.not_equal(ss[1:], ss[:-1], out=first[1:])
                uniq = ss[first]
                packed[ref.REJECTED, order[first]] = st[REJECTED, uniq]
                st[REJECTED, uniq] = 0
        if self._rejected:
            self._rejected = bool(st[REJECTED].any())
        if j.spec is not None or self._drafts:  # drafts (or unsettled ones): as of the latest step
            st[SCHED_END, slot[last]] = end[last]
            st[SPEC, slot[last]] = packed[ref.SPEC, last]
            self._drafts = set(np.flatnonzero(st[SPEC]).tolist())
        self.acc.update(packed)  # repeated slots add up (np.add.at / index_add_ / atomics)
        return self._attribute(packed, sizes, j.meta)

    def _attribute(self, packed: np.ndarray, sizes: list[int], meta: list[list[Any]]) -> StepLogLine | None:
        """Roofline attribution (docs/cost-model.md §5), step by step: a compute-bound step charges each
        request its tokens; a memory-bound one splits the weights evenly over its requests
        and charges each its own KV reads. Then the step-log lines (the latest returned)."""
        R, m = packed.shape[1], len(sizes)
        contrib = self.acc.last_contributions(R)  # numpy: already computed
        if contrib is None:  # a GPU backend computed them on the device: redo them here
            values, _, _ = self._workspace.buffers(self.acc.n_columns, R)
            contrib = ref.step_contributions(packed, self.acc.windows, out=values)
        tokens = packed[ref.N]
        if len(self.gammas) == 1:
            kv_pte = contrib[ref.CTX0] * self.gammas[0]
        else:  # no BLAS call: it may spin threads
            kv_pte = (contrib[ref.CTX0 :] * self.gammas[:, None]).sum(axis=0)
        offsets = None  # each step's first row, when there are several steps
        if m == 1:
            step_tokens = np.array([tokens.sum()], dtype=np.float64)
            memory = self.weights_pte + np.array([kv_pte.sum()])
            memory_bound = step_tokens < memory
            # memory-bound: the weights split evenly, each its own KV reads; else its tokens
            share = self.weights_pte / R + kv_pte if memory_bound[0] else tokens.astype(np.float64)
            self.roofline[packed[ref.SLOT]] += share  # a request appears once per vLLM step
        else:
            offsets = np.array([0, *accumulate(sizes[:-1])])  # an array once, not a list per reduceat
            step_tokens = np.add.reduceat(tokens, offsets).astype(np.float64)
            memory = np.add.reduceat(kv_pte, offsets)
            memory += self.weights_pte
            memory_bound = step_tokens < memory
            weights = np.repeat(self.weights_pte / np.array(sizes, dtype=np.float64), sizes)
            share = np.where(np.repeat(memory_bound, sizes), weights + kv_pte, tokens)
            np.add.at(self.roofline, packed[ref.SLOT], share)  # a slot repeats across steps
        durations = [row[4] for row in meta]
        predicted = self.timing.steps(
            packed[ref.SLOT], sizes, offsets, contrib[ref.PREFILL], kv_pte / self._gamma_total,
            tokens < self.weights_pte + kv_pte, memory_bound, durations,
        )  # fmt: skip
        if self._log is None:
            return None
        return self._log_steps(contrib, offsets, sizes, meta, step_tokens, memory, predicted)

    def _log_steps(
        self,
        contrib: np.ndarray,
        offsets: np.ndarray | None,
        sizes: list[int],
        meta: list[list[Any]],
        step_tokens: np.ndarray,
        memory: np.ndarray,
        predicted: np.ndarray,
    ) -> StepLogLine:
        """One JSON line per step, the same as when every step was priced on its own.
        ``hook_s`` is the time of the step's own hook call, which includes any journal pass
        that call ran (amortized work is charged to the step that triggers it; a pass that a
        read of totals runs is charged to the latest step). The latest step's line is
        returned unwritten: its hook_s may still grow, or its outputs may not be back yet."""
        # per step column sums: (n_columns, steps)
        sums = contrib.sum(axis=1)[:, None] if offsets is None else np.add.reduceat(contrib, offsets, axis=1)
        pte = (sums[ref.PREFILL] + (sums[ref.CTX0 :] * self.gammas[:, None]).sum(axis=0)).tolist()
        cols = sums.tolist()
        ctx = sums[ref.CTX0 :].T.tolist()
        prefill, recompute, decode = cols[ref.PREFILL], cols[ref.RECOMPUTE], cols[ref.DECODE_TOKENS]
        spec_tokens, tokens = cols[ref.SPEC_TOKENS], step_tokens.tolist()
        roofline = np.maximum(step_tokens, memory).tolist()
        write = self._log.write  # type: ignore[union-attr]
        model_s = predicted.tolist()  # only with the step log: plain floats for its lines
        for i, (step, t, hook, _, dt) in enumerate(meta):
            line = StepLogLine(
                engine=self.engine, step=step, t=t, n_reqs=sizes[i], tokens=int(tokens[i]), prefill=int(prefill[i]),
                recompute=int(recompute[i]), decode_tokens=int(decode[i]), spec_tokens=int(spec_tokens[i]),
                ctx=ctx[i], pte=pte[i], roofline_pte=roofline[i], weights_pte=self.weights_pte, hook_s=hook, dt_s=dt,
                model_s=model_s[i],
            )  # fmt: skip
            if i + 1 < len(meta):  # closed: only the latest step can still be running
                write(encode_step_log(line))
        return line

    def _write(self, line: StepLogLine | None) -> None:
        """A step-log line whose wall time is known."""
        if line is not None and self._log is not None:
            self._log.write(encode_step_log(line))

    def _process_now(self) -> None:
        """A journal pass outside on_schedule, before totals are read: its time counts in
        hook_s (and in the step log, in the latest step's hook_s)."""
        meta = self._journal.meta
        if not meta:
            return
        latest = meta[-1]  # [step, unix time, hook s, end of hook, dt s]
        t_start = self.clock()
        line = self._process()
        spent = self.clock() - t_start
        self.hook_s += spent
        if line is not None:
            line.hook_s += spent
        if latest[4] is None:  # its outputs are not back: its time and its line wait for them
            self._running = _Running(latest[3], line)
        else:
            self._write(line)

    # --- finish -------------------------------------------------------------------------

    def on_finished(self, rid: str, reason: str, num_computed: int, counts: Mapping[str, float]) -> None:
        """``counts``: prompt_tokens, output_tokens, num_preemptions as the engine saw them
        (so the API server can still account a request its stat logger never reports),
        api_server (the API server the totals must reach) and arrival_time."""
        slot = self.slot_of.pop(rid, -1)  # -1: never scheduled (aborted while waiting)
        if slot >= 0:
            self._settle_drafts(slot, num_computed)
        self.finished.append((rid, reason, slot, counts, time.time()))

    def flush(self) -> None:
        """Process the journal, read the finished requests' rows in one transfer, send them,
        free the slots."""
        if not self.finished:
            return
        self._process_now()
        done, self.finished = self.finished, []
        slots = np.array([slot for _, _, slot, _, _ in done if slot >= 0], dtype=np.int64)
        rows = self.acc.read(slots)
        served = ref.served_pte(rows, self.gammas)
        self.timing.release(slots)
        messages, k = [], 0
        for rid, reason, slot, counts, finished_at in done:
            external, child = self.external_id(rid)
            common = {"request_id": rid, "external_id": external, "child_index": child, "engine": self.engine,
                      "finish_reason": reason, **counts, "finished_at": finished_at, "engine_live": self.live,
                      "engine_steps": self.steps, "engine_hook_s": self.hook_s,
                      "engine_busy_s": self.timing.busy_s, "engine_unattributed_s": self.timing.unattributed_s}  # fmt: skip
            if slot < 0:  # never scheduled: no work
                messages.append(RequestTotals(**common, ctx=(0.0,) * self.acc.n_groups))
                continue
            row = rows[k].tolist()
            messages.append(RequestTotals(
                **common,
                scheduled=True,
                cached_tokens=int(self.state[CACHED, slot]),
                prefill=row[ref.PREFILL],
                recompute=row[ref.RECOMPUTE],
                decode_tokens=row[ref.DECODE_TOKENS],
                spec_tokens=row[ref.SPEC_TOKENS],
                rejected_tokens=row[ref.REJECTED_TOKENS] + float(self.state[REJECTED, slot]),  # + the final step's
                ctx=tuple(row[ref.CTX0 :]),
                pte_served=float(served[k]),
                pte_recompute=row[ref.RECOMPUTE],
                pte_roofline=float(self.roofline[slot]),
                pte_rejected=float(self.rejected_pte[slot]),
                **self._seconds(slot),
            ))  # fmt: skip
            self.roofline[slot] = 0.0
            self.rejected_pte[slot] = 0.0
            k += 1
        self.acc.release(slots)
        self.send(messages)
        if self._log is not None:
            self._log.flush()  # step lines reach the file at least as often as requests finish

    def calibration(self) -> EngineCalibration:
        """The step-time model in use, for the API servers' metrics."""
        m, online = self.timing.model, self.timing.online
        fitted = online is not None and online.last_fit is not None
        return EngineCalibration(
            self.engine, m.a, m.b, m.w, m.o, "online" if fitted else self.step_model_source,
            gamma_theory=self.cost_model.gamma, r2=online.r2 if fitted else None,
            mape=online.mape if fitted else None, steps=online.steps_seen if online is not None else 0,
            speed=online.speed.ratio if online is not None else 1.0,
        )  # fmt: skip

    def _seconds(self, slot: int) -> dict[str, float]:
        prefill, kv, weights, overhead, latency, predicted = self.timing.read(slot).tolist()
        return {"gpu_prefill_s": prefill, "gpu_kv_s": kv, "gpu_weights_s": weights, "gpu_overhead_s": overhead,
                "engine_latency_s": latency, "predicted_s": predicted}  # fmt: skip

    def conservation(self) -> tuple[np.ndarray, np.ndarray]:
        """(Σ per-request rows, Σ per-update totals) of the accumulator, journal included;
        an update is one journal pass (many steps), so per-update, not per-step."""
        self._process_now()
        return self.acc.conservation()

    def close(self) -> None:
        self._close_step(self.clock())
        self._process_now()
        if self._log is not None:
            self._log.close()
            self._log = None
