"""Exact step-level accounting in the engine process (docs/cost-model.md §4–5), vLLM-free: the
scheduler adapter hands it plain numbers; it keeps per-request totals in the batched
accumulator and reports each finished request once, through a transport.

The hook does almost nothing per step: the adapter keeps a reference to each step's
scheduler output and two clock readings, and reads the output's lists (a ``RawStep``) only
when the step is priced, as rows (``CompletedSteps``) — every ``PRICE_EVERY_STEPS`` steps
(or rows), or soon after a request finished (docs/cost-model.md §5c), in the hook's pricing
process or on the engine thread. ``price``
then processes all of them in one vectorized pass: one accumulator update over the rows of
every step, the roofline attribution, the split of each step's measured time and the
step-log lines. At these sizes a numpy call costs about the same whatever its size, and far
more than a list append; the pass needs a few dozen of them, paid once per batch of steps
instead of once per step.

Only completed steps are priced, so every step's duration is known when it is split, and a
request's totals are read only after every step that scheduled it has completed (the
adapter holds a finished request back while a step in flight still has it). Rejected drafts
are known with the step's outputs, so they are priced with the step that ran them.

The only state one batch leaves for the next is per slot: the high-water mark H (a row's
tokens below H are recompute), the prompt length and the prefix-cache hits. Within a batch H
is the running max of the slot's valid ends (a row's end less its rejected drafts), so the
pass derives each row's H from the state and the slot's earlier rows.
"""

from __future__ import annotations

import contextlib
import errno
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

import msgspec
import numpy as np

from pte_instrument.cost.model import CostModel
from pte_instrument.cost.step_time import OnlineStepFit, StepTimeModel, finite_or_none, theory
from pte_instrument.engine.accumulator import StepAccumulator
from pte_instrument.engine.kernels import reference as ref
from pte_instrument.engine.timing import TimeAttribution
from pte_instrument.faults import log
from pte_instrument.wire import EngineCalibration, RequestTotals, StepLogHeader, StepLogLine, encode_step_log

# Per-slot host state, one int64 array row each (slot-indexed, so a batch is vectorized).
HIGH_WATER, PROMPT, CACHED = range(3)
N_STATE = 3
_KEY_BITS = 32  # slot·2³² + end sorts rows by slot, then end (ends < 2³² tokens)
SENT_KEPT = 4096  # ids of requests already sent, remembered so a late row is not a new request


# A step whose outputs are back, as the scheduler output had it: plain values and references
# to its lists, so that the engine thread does no per-row work. (requests scheduled for the
# first time, as (id, tokens computed before the step, prompt length) — None if none; ids of
# the others (running and resumed); their tokens computed before the step; tokens scheduled
# per id; the clock when scheduled; when its outputs were back; the hook's time for it; per id:
# draft tokens scheduled, drafts rejected, positions to take back — None if none.)
RawStep = tuple[
    list[tuple[str, int, int]] | None,
    list[str],
    list[int],
    dict[str, int],
    float,
    float,
    float,
    dict[str, int] | None,
    dict[str, int] | None,
    dict[str, int] | None,
]


class CompletedSteps(msgspec.Struct, gc=False):
    """Scheduler steps whose outputs are back, not yet priced, in the order they completed:
    the rows of all of them concatenated, as plain lists (a list extend is far cheaper than a
    numpy call). Per row: request id, tokens computed before the step (where its positions
    start), tokens scheduled (drafts included). Per step: rows, the clock when it was
    scheduled and when its outputs were back, and the hook's own time for it. Sparse, as
    (row, count): draft tokens scheduled and drafts rejected. ``prompts``: the prompt length
    of requests scheduled for the first time here."""

    rids: list[str] = msgspec.field(default_factory=list)
    c: list[int] = msgspec.field(default_factory=list)
    n: list[int] = msgspec.field(default_factory=list)
    sizes: list[int] = msgspec.field(default_factory=list)
    scheduled_at: list[float] = msgspec.field(default_factory=list)
    done_at: list[float] = msgspec.field(default_factory=list)
    hook_s: list[float] = msgspec.field(default_factory=list)
    drafts: list[tuple[int, int]] = msgspec.field(default_factory=list)
    rejected: list[tuple[int, int]] = msgspec.field(default_factory=list)
    prompts: dict[str, int] = msgspec.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.sizes)

    @classmethod
    def of(cls, steps: Iterable[RawStep], prompts: Mapping[str, int] | None = None) -> CompletedSteps:
        """Raw steps as rows; ``prompts``: prompt lengths of requests whose first step was lost."""
        batch = cls()
        if prompts:
            batch.prompts.update(prompts)
        for step in steps:
            batch.add_raw(step)
        return batch

    def add_raw(self, step: RawStep) -> None:
        new, rids, c, counts, scheduled_at, done_at, hook_s, drafts, rejected, back = step
        if new:  # new requests come first in a step's rows
            for rid, _, prompt in new:
                self.prompts[rid] = prompt
            rids = [d[0] for d in new] + rids
            c = [d[1] for d in new] + c
        if back:
            c = [k - back.get(rid, 0) for rid, k in zip(rids, c, strict=True)]
        self.add(
            rids, c, list(map(counts.__getitem__, rids)), scheduled_at, done_at, hook_s, drafts, rejected
        )

    def add(
        self,
        rids: list[str],
        c: list[int],
        n: list[int],
        scheduled_at: float,
        done_at: float,
        hook_s: float = 0.0,
        drafts: Mapping[str, int] | None = None,
        rejected: Mapping[str, int] | None = None,
    ) -> None:
        """One step (``rids`` once each). ``drafts``/``rejected``: per request id, for the
        requests that had draft tokens."""
        base = len(self.rids)
        self.rids += rids
        self.c += c
        self.n += n
        self.sizes.append(len(rids))
        self.scheduled_at.append(scheduled_at)
        self.done_at.append(done_at)
        self.hook_s.append(hook_s)
        if drafts or rejected:
            row = {rid: base + j for j, rid in enumerate(rids)}
            self.drafts += [(row[r], k) for r, k in (drafts or {}).items() if k and r in row]
            self.rejected += [(row[r], k) for r, k in (rejected or {}).items() if k > 0 and r in row]


class Finished(msgspec.Struct, array_like=True, gc=False):
    """A request the engine finished, its totals not sent yet. ``counts``: prompt_tokens,
    output_tokens, num_preemptions as the engine saw them (so the API server can still
    account a request its stat logger never reports), api_server (the API server the totals
    must reach) and arrival_time."""

    rid: str
    external_id: str  # the id the API server knows
    child_index: int | None  # a parallel-sampling child's index
    reason: str
    counts: dict[str, int | float]
    finished_at: float  # unix time

    @classmethod
    def of(
        cls,
        rid: str,
        reason: str,
        counts: Mapping[str, float],
        external_id: Callable[[str], tuple[str, int | None]],
    ) -> Finished:
        return cls(rid, *external_id(rid), reason, dict(counts), time.time())


def split_held(
    finished: list[Finished], hold: Callable[[str], bool] | None
) -> tuple[list[Finished], list[Finished]]:
    """(to send now, held back): ``hold`` keeps a request whose steps are still running."""
    if hold is None or not finished:
        return finished, []
    done, waiting = [], []
    for f in finished:
        (waiting if hold(f.rid) else done).append(f)
    return done, waiting


class StepLogFailed(RuntimeError):
    """The step log could not be written (a full disk): it is off; the accounting goes on."""


@dataclass
class EngineAccounting:
    cost_model: CostModel
    send: Callable[[list[RequestTotals]], None]
    engine: int = 0
    backend: str = "numpy"
    step_log: str | None = None
    # the id the API server knows, and a parallel-sampling child's index
    external_id: Callable[[str], tuple[str, int | None]] = lambda rid: (rid, None)
    # the prompt length of a request first seen without one (its first step was not seen)
    prompt_of: Callable[[str], int] = lambda rid: 0
    weight_bytes: float = 2.0  # bytes per weight as served (bf16: 2); read once per step
    # the step-time model that splits each step's measured time (None: theory), and whether
    # to keep fitting it to the steps seen (docs/cost-model.md §5b)
    step_model: StepTimeModel | None = None
    step_model_source: str = "theory"  # or "file": a saved fit
    calibrate_online: bool = True
    acc: StepAccumulator = field(init=False)
    slot_of: dict[str, int] = field(default_factory=dict, init=False)  # live requests
    finished: list[Finished] = field(default_factory=list, init=False)  # not sent yet
    steps: int = field(default=0, init=False)
    # everything the hook adds to the scheduler, all steps: the adapter measures it
    hook_s: float = field(default=0.0, init=False)
    # Σ GPU seconds of the totals sent so far: busy time charged to finished requests, whichever
    # API server prices them
    attributed_s: float = field(default=0.0, init=False)
    step_log_error: OSError | None = field(default=None, init=False)  # why the step log is off
    _step_log_failed: StepLogFailed | None = field(default=None, init=False)  # not said yet

    def __post_init__(self) -> None:
        # validate=False: the batches are built here, and the check would cost more than the step
        self.acc = StepAccumulator.from_cost_model(self.cost_model, backend=self.backend, validate=False)
        self.gammas = np.array([g.gamma for g in self.cost_model.groups])
        shape = self.cost_model.shape
        # Weight read per step in prefill-token units (docs/cost-model.md §5): W_bytes·HOI/(2·N_active).
        self.weights_pte = (
            shape.n_total * self.weight_bytes * self.cost_model.device.hoi / (2 * shape.n_active)
        )
        # high-water mark: most tokens ever validly computed (survives preemption); prompt
        # length; prefix-cache hits (computed tokens at first schedule)
        self.state = np.zeros((N_STATE, self.acc.capacity), dtype=np.int64)
        self.roofline = np.zeros(self.acc.capacity)
        self.rejected_pte = np.zeros(self.acc.capacity)  # PTE of each slot's rejected drafts
        self._workspace = ref.Workspace()  # reused buffers: fresh large arrays cost page faults
        self._sent: deque[str] = deque(maxlen=SENT_KEPT)
        self._sent_set: set[str] = set()
        self._scratch: list[int] = []  # slots of late rows in the latest pass
        self._last_done: float | None = None  # when the latest priced step's outputs were back
        self._log = None
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
            engine=self.engine,
            gammas=self.gammas.tolist(),
            windows=[g.window for g in self.cost_model.groups],
            n_active=shape.n_active,
            n_total=shape.n_total,
            hoi=self.cost_model.device.hoi,
            device=self.cost_model.device.name,
            weights_pte=self.weights_pte,
        )
        self._log.write(encode_step_log(header))

    @property
    def live(self) -> int:
        return len(self.slot_of)

    def _slots(self, rids: list[str], c: list[int], prompts: Mapping[str, int]) -> np.ndarray:
        """Each row's slot; a request seen for the first time gets a fresh one, its state set
        (prompt, prefix-cache hits = computed tokens at its first row). A late row of a
        request whose totals were sent already gets a scratch slot, released after the pass
        with its time counted as unattributed."""
        slot_of = self.slot_of
        try:
            return np.fromiter(map(slot_of.__getitem__, rids), dtype=np.int64, count=len(rids))
        except KeyError:
            pass
        first: dict[str, int] = {}  # each new request's first row
        for j, rid in enumerate(rids):
            if rid not in slot_of and rid not in first:
                first[rid] = j
        scratch: dict[str, int] = {}
        for rid, j in first.items():
            s = self.acc.allocate()
            if rid in self._sent_set:
                scratch[rid] = s
            else:
                slot_of[rid] = s
            self._grow()
            st = self.state
            st[:, s] = 0
            st[PROMPT, s] = prompts[rid] if rid in prompts else self.prompt_of(rid)
            st[CACHED, s] = c[j]
        self._scratch = list(scratch.values())
        get = slot_of.get if not scratch else (lambda rid: slot_of.get(rid, scratch.get(rid)))
        return np.fromiter(map(get, rids), dtype=np.int64, count=len(rids))

    def _release_scratch(self) -> None:
        """Scratch slots of the latest pass: their time is nobody's, their rows retired."""
        slots = self._scratch
        if slots:
            self._scratch = []
            for s in slots:
                self.timing.unattributed_s += float(self.timing.read(s)[:4].sum())
                self.roofline[s] = self.rejected_pte[s] = 0.0
            self.acc.release(slots)

    def _grow(self) -> None:
        grow = self.acc.capacity - self.state.shape[1]
        if grow > 0:  # the accumulator grew
            self.state = np.concatenate([self.state, np.zeros((N_STATE, grow), dtype=np.int64)], axis=1)
            self.roofline = np.concatenate([self.roofline, np.zeros(grow)])
            self.rejected_pte = np.concatenate([self.rejected_pte, np.zeros(grow)])
            self.timing.grow(self.acc.capacity)

    # --- the pass over completed steps --------------------------------------------------

    def price(self, batch: CompletedSteps) -> None:
        """Every step of ``batch`` into the accumulator (one update), the roofline, the split
        of each step's measured time and the step log. Written for few numpy calls, whose
        fixed cost dominates at these sizes."""
        sizes = batch.sizes
        if not sizes:
            return
        first_step = self.steps
        self.steps += len(sizes)
        slot = self._slots(batch.rids, batch.c, batch.prompts)
        R = len(slot)
        packed = np.zeros((ref.N_FIELDS, R), dtype=np.int64)
        packed[ref.SLOT] = slot
        packed[ref.C] = batch.c
        packed[ref.N] = batch.n
        if batch.drafts:
            rows, counts = zip(*batch.drafts, strict=True)
            packed[ref.SPEC, list(rows)] = counts
        rejected = None
        if batch.rejected:
            rows, counts = zip(*batch.rejected, strict=True)
            rejected = (np.array(rows, dtype=np.int64), np.array(counts, dtype=np.int64))
            packed[ref.REJECTED, rejected[0]] = rejected[1]
        st = self.state
        s = packed[ref.SLOT]
        packed[ref.P] = st[PROMPT, s]
        end = packed[ref.C] + packed[ref.N]
        valid_end = end - packed[ref.REJECTED] if rejected is not None else end
        if len(sizes) == 1:  # one step: each slot once
            h = st[HIGH_WATER, s]
            packed[ref.H] = h
            st[HIGH_WATER, s] = np.maximum(h, valid_end)
        else:
            # Rows grouped by slot, in step order within a group (stable sort). A row's H is
            # max(the slot's H before the batch, the valid ends of its earlier rows). key =
            # slot·2³² + end: its running max over the sorted rows, minus the row's slot·2³²,
            # is the slot's running max end (≥ 0) or, from an earlier slot's rows, negative.
            order = np.argsort(s, kind="stable")
            ss = s[order]
            base = ss << _KEY_BITS
            run = np.maximum.accumulate(base + valid_end[order])
            h = np.empty(R, dtype=np.int64)
            h[0] = -1
            h[1:] = run[:-1]
            h -= base
            np.maximum(h, st[HIGH_WATER, ss], out=h)  # the state's H ≥ 0 beats the negatives
            packed[ref.H, order] = h
            np.maximum.at(st[HIGH_WATER], s, valid_end)
        self.acc.update(packed)  # repeated slots add up (np.add.at / index_add_ / atomics)
        if rejected is not None:
            self._price_rejected(s, valid_end, *rejected)
        self._attribute(packed, batch, first_step)
        self._release_scratch()

    def price_raw(self, steps: list[RawStep], prompts: Mapping[str, int] | None = None) -> None:
        self.price(CompletedSteps.of(steps, prompts))

    def _price_rejected(
        self, slot: np.ndarray, valid_end: np.ndarray, rows: np.ndarray, k: np.ndarray
    ) -> None:
        """Each rejected draft position p ∈ [valid end, end) read min(p + 1, W) KV entries per
        group: wasted work, priced on its own (it is in the served PTE already)."""
        first = valid_end[rows] + 1
        wasted = sum(
            g * ref.context_sum_int(first, k, int(w))
            for g, w in zip(self.gammas.tolist(), self.acc.windows.tolist(), strict=True)
        )
        np.add.at(self.rejected_pte, slot[rows], wasted)

    def _durations(self, batch: CompletedSteps) -> np.ndarray:
        """Each step's measured time: from when it was scheduled, or when the step before it
        completed if that was later (steps overlap under async scheduling), to when its
        outputs were back. The intervals do not overlap, and together they cover every moment
        at which some step was running: their sum is the engine's busy time."""
        ends = np.empty(len(batch.done_at) + 1)  # the latest completion so far, before each step and after
        ends[0] = -np.inf if self._last_done is None else self._last_done
        ends[1:] = batch.done_at
        np.maximum.accumulate(ends, out=ends)
        self._last_done = float(ends[-1])
        started = np.maximum(np.asarray(batch.scheduled_at, dtype=np.float64), ends[:-1])
        return np.maximum(ends[1:] - started, 0.0)

    def _attribute(self, packed: np.ndarray, batch: CompletedSteps, first_step: int) -> None:
        """Roofline attribution (docs/cost-model.md §5), step by step: a compute-bound step
        charges each request its tokens; a memory-bound one splits the weights evenly over
        its requests and charges each its own KV reads. Then each step's measured time is
        split, and the step-log lines written."""
        sizes = batch.sizes
        R = packed.shape[1]
        contrib = self.acc.last_contributions(R)  # numpy: already computed
        if contrib is None:  # a GPU backend computed them on the device: redo them here
            values, _, _ = self._workspace.buffers(self.acc.n_columns, R)
            contrib = ref.step_contributions(packed, self.acc.windows, out=values)
        slot, tokens = packed[ref.SLOT], packed[ref.N]
        if len(self.gammas) == 1:
            kv_pte = contrib[ref.CTX0] * self.gammas[0]
        else:  # no BLAS call: it may spin threads
            kv_pte = (contrib[ref.CTX0 :] * self.gammas[:, None]).sum(axis=0)
        m = len(sizes)
        offsets = None  # each step's first row, when there are several steps
        if m == 1:
            step_tokens = np.array([tokens.sum()], dtype=np.float64)
            memory = self.weights_pte + np.array([kv_pte.sum()])
            memory_bound = step_tokens < memory
            # memory-bound: the weights split evenly, each its own KV reads; else its tokens
            share = self.weights_pte / len(slot) + kv_pte if memory_bound[0] else tokens.astype(np.float64)
        else:
            offsets = np.array([0, *accumulate(sizes[:-1])])  # an array once, not a list per reduceat
            step_tokens = np.add.reduceat(tokens, offsets).astype(np.float64)
            memory = np.add.reduceat(kv_pte, offsets)
            memory += self.weights_pte
            memory_bound = step_tokens < memory
            weights = np.repeat(self.weights_pte / np.array(sizes, dtype=np.float64), sizes)
            share = np.where(np.repeat(memory_bound, sizes), weights + kv_pte, tokens)
        np.add.at(self.roofline, slot, share)  # a slot repeats across steps
        durations = self._durations(batch)
        predicted = self.timing.steps(
            slot,
            sizes,
            offsets,
            contrib[ref.PREFILL],
            kv_pte / self._gamma_total,
            tokens < self.weights_pte + kv_pte,
            memory_bound,
            durations,
        )
        if self._log is not None:
            try:
                self._log_steps(
                    contrib, offsets, batch, first_step, step_tokens, memory, predicted, durations
                )
            except OSError as e:
                self._step_log_off(e)

    def _log_steps(
        self,
        contrib: np.ndarray,
        offsets: np.ndarray | None,
        batch: CompletedSteps,
        first_step: int,
        step_tokens: np.ndarray,
        memory: np.ndarray,
        predicted: np.ndarray,
        durations: np.ndarray,
    ) -> None:
        """One JSON line per step, the same as when every step was priced on its own.
        ``hook_s`` is the hook's time for the step; a pass is charged to the step whose
        completion ran it."""
        # per step column sums: (n_columns, steps)
        sums = contrib.sum(axis=1)[:, None] if offsets is None else np.add.reduceat(contrib, offsets, axis=1)
        pte = (sums[ref.PREFILL] + (sums[ref.CTX0 :] * self.gammas[:, None]).sum(axis=0)).tolist()
        cols = sums.tolist()
        ctx = sums[ref.CTX0 :].T.tolist()
        prefill, recompute, decode = cols[ref.PREFILL], cols[ref.RECOMPUTE], cols[ref.DECODE_TOKENS]
        spec_tokens, tokens = cols[ref.SPEC_TOKENS], step_tokens.tolist()
        roofline = np.maximum(step_tokens, memory).tolist()
        write = self._log.write  # type: ignore[union-attr]
        model_s, dt_s = predicted.tolist(), durations.tolist()  # plain floats for the lines
        unix = time.time() - time.perf_counter()  # the adapter's clock is perf_counter
        for i, size in enumerate(batch.sizes):
            line = StepLogLine(
                engine=self.engine,
                step=first_step + i,
                t=unix + batch.scheduled_at[i],
                n_reqs=size,
                tokens=int(tokens[i]),
                prefill=int(prefill[i]),
                recompute=int(recompute[i]),
                decode_tokens=int(decode[i]),
                spec_tokens=int(spec_tokens[i]),
                ctx=ctx[i],
                pte=pte[i],
                roofline_pte=roofline[i],
                weights_pte=self.weights_pte,
                hook_s=batch.hook_s[i],
                dt_s=dt_s[i],
                model_s=model_s[i],
            )
            write(encode_step_log(line))

    # --- finish -------------------------------------------------------------------------

    def on_finished(self, rid: str, reason: str, counts: Mapping[str, float]) -> None:
        """Its totals are sent at the next ``flush`` that does not hold it back."""
        self.finished.append(Finished.of(rid, reason, counts, self.external_id))

    def flush(self, hold: Callable[[str], bool] | None = None) -> None:
        """Send the finished requests' totals (one read of their rows), free their slots;
        those for which ``hold`` is true (a step still running has them) wait. Price the
        steps they ran first. Then raises ``StepLogFailed`` if the step log could not be
        written since the last call (it is off: said once)."""
        self._send_finished(hold)
        if (failed := self._step_log_failed) is not None:
            self._step_log_failed = None
            raise failed

    def _send_finished(self, hold: Callable[[str], bool] | None) -> None:
        done, self.finished = split_held(self.finished, hold)
        if not done:
            return
        slot_of, sent = self.slot_of, self._sent
        picked = []
        for f in done:
            picked.append((f, slot_of.pop(f.rid, -1)))  # -1: never scheduled
            if len(sent) == sent.maxlen:
                self._sent_set.discard(sent[0])
            sent.append(f.rid)
            self._sent_set.add(f.rid)
        slots = np.array([slot for _, slot in picked if slot >= 0], dtype=np.int64)
        rows = self.acc.read(slots)
        served = ref.served_pte(rows, self.gammas)
        seconds = self.timing.take(slots).T.tolist()  # per request: its six columns
        cached = self.state[CACHED, slots].tolist()
        messages, k = [], 0
        for f, slot in picked:
            if slot >= 0:
                self.attributed_s += sum(seconds[k][:4])  # prefill, KV read, weights, overhead
            common = {
                "request_id": f.rid,
                "external_id": f.external_id,
                "child_index": f.child_index,
                "engine": self.engine,
                "finish_reason": f.reason,
                **f.counts,
                "finished_at": f.finished_at,
                "engine_live": self.live,
                "engine_steps": self.steps,
                "engine_hook_s": self.hook_s,
                "engine_busy_s": self.timing.busy_s,
                "engine_attributed_s": self.attributed_s,
            }
            if slot < 0:  # never scheduled: no work
                messages.append(RequestTotals(**common, ctx=(0.0,) * self.acc.n_groups))
                continue
            row = rows[k].tolist()
            prefill_s, kv_s, weights_s, overhead_s, latency_s, predicted_s = seconds[k]
            messages.append(
                RequestTotals(
                    **common,
                    scheduled=True,
                    cached_tokens=cached[k],
                    prefill=row[ref.PREFILL],
                    recompute=row[ref.RECOMPUTE],
                    decode_tokens=row[ref.DECODE_TOKENS],
                    spec_tokens=row[ref.SPEC_TOKENS],
                    rejected_tokens=row[ref.REJECTED_TOKENS],
                    ctx=tuple(row[ref.CTX0 :]),
                    pte_served=float(served[k]),
                    pte_recompute=row[ref.RECOMPUTE],
                    pte_roofline=float(self.roofline[slot]),
                    pte_rejected=float(self.rejected_pte[slot]),
                    gpu_prefill_s=prefill_s,
                    gpu_kv_s=kv_s,
                    gpu_weights_s=weights_s,
                    gpu_overhead_s=overhead_s,
                    engine_latency_s=latency_s,
                    predicted_s=predicted_s,
                )
            )
            k += 1
        self.roofline[slots] = 0.0
        self.rejected_pte[slots] = 0.0
        self.acc.release(slots)
        if self._log is not None:  # a request's step lines are in the file when its totals leave
            try:
                self._log.flush()
            except OSError as e:
                self._step_log_off(e)
        self.send(messages)

    def _step_log_off(self, e: OSError) -> None:
        """A step log that cannot be written (a full disk) goes off, and is said at the end of
        the next ``flush``: once, and at no cost to the accounting."""
        step_log, self._log = self._log, None
        with contextlib.suppress(OSError):  # what it still buffers is lost with it
            step_log.close()  # type: ignore[union-attr]
        self._step_log_failed = StepLogFailed(
            f"the step log {self.step_log!r} could not be written ({e}); the step log is off"
        )

    def calibration(self) -> EngineCalibration:
        """The step-time model in use, for the API servers' metrics."""
        m, online = self.timing.model, self.timing.online
        fitted = online is not None and online.last_fit is not None
        return EngineCalibration(
            self.engine,
            m.a,
            m.b,
            m.w,
            m.o,
            "online" if fitted else self.step_model_source,
            gamma_theory=self.cost_model.gamma,
            # undefined where the steps' times have no variance (JSON has no NaN)
            r2=finite_or_none(online.r2) if fitted else None,
            mape=finite_or_none(online.mape) if fitted else None,
            steps=online.steps_seen if online is not None else 0,
            speed=online.speed.ratio if online is not None else 1.0,
        )

    def conservation(self) -> tuple[np.ndarray, np.ndarray]:
        """(Σ per-request rows, Σ per-update totals) of the accumulator; an update is one
        pass (many steps), so per-update, not per-step."""
        return self.acc.conservation()

    def close(self) -> None:
        """Closes the step log: lines it could not write are said, never raised (the engine is
        shutting down)."""
        step_log, self._log = self._log, None
        if step_log is not None:
            try:
                step_log.close()
            except OSError as e:
                log.error("pte-instrument: the step log's last lines could not be written (%s)", e)
