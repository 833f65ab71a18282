"""vLLM's real schedulers driven without a model, the way vLLM's own scheduler tests drive
them: synthetic requests and synthetic model-runner outputs, in the engine core's order for
each kind — synchronous (schedule step N, then its outputs) or asynchronous (schedule step
N+1 while step N runs, then the outputs of N, as vLLM's batch queue of two does). For the
exactness tests of the scheduler hook and the scheduler-overhead benchmark; nothing here
runs in a server.

The model is deterministic per request: its k-th output token is ``EOS`` where the
request's ``stop_at`` says so, else an ordinary token; of the draft tokens a step scheduled
it accepts a number that depends only on the request and k. So the same request stream
gives each request the same outputs under either kind of scheduling.
"""

from __future__ import annotations

import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

EOS = 2
BLOCK_SIZE = 16


def build_scheduler(
    cls: type,
    model: str | Path,
    *,
    async_scheduling: bool,
    num_blocks: int = 4096,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 4096,
    num_spec_tokens: int = 0,
    prefix_caching: bool = True,
) -> Any:
    """A scheduler of class ``cls`` (vLLM's, or one of the hook's) over a KV pool of
    ``num_blocks`` blocks. ``async_scheduling`` is set after the config is built, as the
    CPU platform turns it off; ``model``: a local model directory (its config only)."""
    model_config = ModelConfig(
        model=str(model), max_model_len=max_model_len, dtype="float32", skip_tokenizer_init=True
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE, cache_dtype="auto", enable_prefix_caching=prefix_caching
    )
    cache_config.num_gpu_blocks = num_blocks
    speculative = None
    if num_spec_tokens:
        speculative = SpeculativeConfig(
            method="ngram", num_speculative_tokens=num_spec_tokens, prompt_lookup_max=4, prompt_lookup_min=2
        )
    cfg = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        speculative_config=speculative,
    )
    cfg.scheduler_config.async_scheduling = async_scheduling
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    return cls(
        vllm_config=cfg,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BLOCK_SIZE,
        log_stats=False,
    )


@dataclass(frozen=True)
class Arrival:
    """A request of the stream: added before driver step ``step``; the model samples EOS as
    its output ``stop_at`` (None: it runs to ``max_tokens``); the client aborts it before
    driver step ``abort_at``."""

    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    step: int = 0
    stop_at: int | None = None
    abort_at: int | None = None


@dataclass
class Row:
    """One request in one scheduled step, as the scheduler output said."""

    rid: str
    c: int  # num_computed_tokens before the step, as reported
    n: int
    drafts: int


@dataclass
class StepRecord:
    rows: list[Row]
    scheduled: int  # when schedule() returned it, on the driver's count of calls
    delivered: int = -1  # when update_from_output() took its outputs (-1: never), same count
    # per request live when its outputs came back: the drafts the model rejected, and what
    # vLLM took back of its computed tokens for them (none for an output a preemption made stale)
    rejected: dict[str, int] = field(default_factory=dict)
    rolled_back: dict[str, int] = field(default_factory=dict)
    scheduled_at: float = 0.0  # the driver's clock
    done_at: float = 0.0


class StepClock:
    """A clock that moves only when the driver says: the model of step N runs ``run_s(N)``
    seconds from when it is scheduled, or from when step N-1's run ends if that is later
    (one device, steps in order)."""

    def __init__(self, run_s: Callable[[int], float]) -> None:
        self.now = 0.0
        self.run_s = run_s
        self._device_free = 0.0

    def __call__(self) -> float:
        return self.now

    def finish_time(self, scheduled_at: float, step: int) -> float:
        start = max(scheduled_at, self._device_free)
        self._device_free = start + self.run_s(step)
        return self._device_free


class Driver:
    """One scheduler, its synthetic model, in the engine core's order for its kind. With a
    ``clock`` the scheduler's hook (if any) reads it, and it advances: 1 ms of host time
    between calls, the model's run time from ``StepClock``."""

    def __init__(self, scheduler: Any, *, async_scheduling: bool, clock: StepClock | None = None) -> None:
        self.s = scheduler
        self.async_scheduling = async_scheduling
        self.num_spec = scheduler.num_spec_tokens
        self.clock = clock
        if clock is not None and hasattr(scheduler, "_pte_state"):
            scheduler._pte_state.clock = clock
        algo = scheduler.vllm_config.cache_config.prefix_caching_hash_algo
        hash_fn = get_hash_fn_by_name(algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self.arrivals: dict[str, Arrival] = {}
        self.generated: dict[str, int] = {}  # outputs delivered per request
        # request id → the scheduled-at count of the step whose outputs finished it (an
        # abort: the count when it came)
        self.finished_in: dict[str, int] = {}
        self.steps: list[StepRecord] = []
        # scheduled steps whose outputs are not taken yet, with the drafts the model rejects
        self.queue: deque[tuple[Any, ModelRunnerOutput, StepRecord, dict[str, int]]] = deque()
        self.schedule_s: list[float] = []  # per step: schedule() + update_from_output(), host seconds
        self._pending_s = 0.0
        self._calls = 0  # schedule() and update_from_output() calls so far

    # --- requests -----------------------------------------------------------------------

    def add(self, a: Arrival) -> None:
        params = SamplingParams(max_tokens=a.max_tokens)
        params.update_from_generation_config({}, EOS)
        req = Request(a.rid, list(a.prompt), params, None, block_hasher=self._hasher)
        self.arrivals[a.rid] = a
        self.generated[a.rid] = 0
        self.s.add_request(req)

    def abort(self, rid: str) -> None:
        self.finished_in.setdefault(rid, self._calls)  # every row scheduled before this ran
        self.s.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    # --- the model ----------------------------------------------------------------------

    def token(self, rid: str, k: int) -> int:
        a = self.arrivals[rid]
        return EOS if a.stop_at is not None and k == a.stop_at else 10 + (k % 50)

    def accepted(self, rid: str, k: int, drafts: int) -> int:
        return zlib.crc32(f"{rid}/{k}".encode()) % (drafts + 1) if drafts else 0

    def _outputs(self, out: Any) -> tuple[ModelRunnerOutput, StepRecord, dict[str, int]]:
        requests = self.s.requests
        spec = out.scheduled_spec_decode_tokens
        new = [Row(d.req_id, d.num_computed_tokens, 0, 0) for d in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        rows = new + [
            Row(r, c, 0, 0) for r, c in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        ]
        for row in rows:
            row.n = out.num_scheduled_tokens[row.rid]
            row.drafts = len(spec.get(row.rid, ()))
        ids = list(out.num_scheduled_tokens)
        sampled, rejected = [], {}
        for rid in ids:  # a prefill chunk samples nothing; a finished row's tokens are dropped by vLLM
            req = requests.get(rid)
            if req is None or req.is_prefill_chunk:
                sampled.append([])
                continue
            k, d = self.generated[rid], len(spec.get(rid, ()))
            accepted = self.accepted(rid, k, d)
            sampled.append([self.token(rid, k + i) for i in range(accepted + 1)])
            self.generated[rid] = k + len(sampled[-1])
            if d > accepted:
                rejected[rid] = d - accepted
        record = StepRecord(rows, self._calls)
        self._calls += 1
        return (
            ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
            ),
            record,
            rejected,
        )

    # --- the engine's order -------------------------------------------------------------

    def _tick(self, seconds: float = 1e-3) -> None:
        if self.clock is not None:
            self.clock.now += seconds

    def _schedule(self) -> None:
        self._tick()
        t = time.perf_counter()
        out = self.s.schedule()
        self._pending_s += time.perf_counter() - t
        mro, record, rejected = self._outputs(out)
        if self.clock is not None:
            record.scheduled_at = self.clock.now
            record.done_at = self.clock.finish_time(self.clock.now, record.scheduled)
        self.queue.append((out, mro, record, rejected))
        self.steps.append(record)

    def _update(self) -> None:
        out, mro, record, rejected = self.queue.popleft()
        if self.clock is not None:
            self.clock.now = max(self.clock.now + 1e-3, record.done_at)
        requests = self.s.requests
        before = {
            r.rid: (requests[r.rid], requests[r.rid].num_computed_tokens)
            for r in record.rows
            if r.drafts and r.rid in requests and not requests[r.rid].is_finished()
        }
        t = time.perf_counter()
        self.s.update_from_output(out, mro)
        self._pending_s += time.perf_counter() - t
        record.delivered = self._calls
        self._calls += 1
        for row in record.rows:
            req = requests.get(row.rid)
            if row.rid not in self.finished_in and (req is None or req.is_finished()):
                self.finished_in[row.rid] = record.scheduled
        record.rejected = {rid: k for rid, k in rejected.items() if rid in before}
        for rid, (req, c) in before.items():
            if c - req.num_computed_tokens > 0:  # vLLM rolls back what it rejected
                record.rolled_back[rid] = c - req.num_computed_tokens
        if self.num_spec and not self.async_scheduling:  # the proposer drafts for every sampled request
            ids = [
                rid
                for rid, toks in zip(mro.req_ids, mro.sampled_token_ids, strict=True)
                if toks and rid in self.s.requests
            ]
            self.s.update_draft_token_ids(DraftTokenIds(ids, [[7] * self.num_spec for _ in ids]))
        self.schedule_s.append(self._pending_s)
        self._pending_s = 0.0

    def step(self) -> bool:
        """One call of the engine core's step: schedule, and (at once when synchronous; when
        the queue of two is full or nothing more can be scheduled, when asynchronous) process
        the oldest step's outputs. False when nothing is left to do."""
        if self.s.has_requests():
            self._schedule()
            if self.async_scheduling and len(self.queue) < 2 and self.s.has_requests():
                return True
        elif not self.queue:
            return False
        self._update()
        return True

    def run(self, stream: list[Arrival], max_steps: int = 100_000) -> None:
        """The whole stream: arrivals and aborts at their driver steps, until nothing is left."""
        by_step: dict[int, list[Arrival]] = {}
        aborts: dict[int, list[str]] = {}
        for a in stream:
            by_step.setdefault(a.step, []).append(a)
            if a.abort_at is not None:
                aborts.setdefault(a.abort_at, []).append(a.rid)
        last = max([*by_step, *aborts, 0])
        for k in range(max_steps):
            for a in by_step.get(k, ()):
                self.add(a)
            for rid in aborts.get(k, ()):
                self.abort(rid)
            if not self.step() and k > last:
                break
        else:
            raise RuntimeError(f"the stream did not finish in {max_steps} steps")
