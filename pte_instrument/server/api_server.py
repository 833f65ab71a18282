"""The plugin in one vLLM API-server process, as the vLLM adapter sees it: a few verbs, and
nothing of the collaborators behind them.

The adapter converts vLLM's types and calls ``configure`` (once per served model, from
vLLM's config), ``finished`` (the requests an output batch finished), ``fault`` (what it
could not convert), ``announce``, and for its HTTP side ``router``, ``middleware`` and
``set_api_keys``. A finished request walks one way: ``finished`` tags it and queues it in
the model's ``RequestJoin``; the pricer thread (``tick``) takes it once the engine's
totals joined it, and once the turns of its session before it are in the store
(``turn_order``), and its ``RequestPricer`` prices it, files it under its session and fans it
out to the exporters, each isolated. No exporter runs on vLLM's output loop."""

from __future__ import annotations

import atexit
import math
import threading
import time
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fastapi import APIRouter
from starlette.types import ASGIApp

from pte_instrument.cost.model import CostModel, cost_model_for
from pte_instrument.faults import log
from pte_instrument.server.engine_join import TICK_S, RequestJoin
from pte_instrument.server.middleware import TaggingMiddleware
from pte_instrument.server.pricer import RequestPricer
from pte_instrument.server.records import FinishedRequest
from pte_instrument.server.routes import build_router
from pte_instrument.server.runtime import Runtime, get_runtime, once
from pte_instrument.server.turn_order import TURN_ORDER_WAIT_S
from pte_instrument.settings import Settings

EXPIRY_EVERY_S = 1.0  # idle sessions are closed this often, whether or not a turn arrives


@dataclass(frozen=True)
class ServedModel:
    """What the plugin needs to know of a served model, read from vLLM's config."""

    name: str
    engines: tuple[int, ...]  # this API server's engines (data-parallel ranks)
    architecture: dict[str, Any]  # the Hugging Face text config, with the dtype served
    kv_cache_dtype: str | None
    kv_block_size: int  # prefix caching is per block
    gpus_per_engine: int  # tensor × pipeline parallel
    lora: bool  # the server serves LoRA adapters
    api_server: int  # this process's index among the API servers
    transport: str | None  # the engine hooks' transport base (None: no hook can reach here)


@dataclass
class _Pricing:
    """One served model's join and its engines' pricers."""

    cost_model: CostModel
    join: RequestJoin
    pricers: dict[int, RequestPricer]
    # session turns waiting for the turns before them (``turn_order``), with their deadlines
    held: list[tuple[FinishedRequest, float]] = field(default_factory=list)


class ApiServer:
    """``threaded``: price on the pricer thread (False: only when ``tick`` is called)."""

    def __init__(self, runtime: Runtime, threaded: bool = True) -> None:
        self.runtime = runtime
        self.threaded = threaded
        self._models: dict[str, _Pricing] = {}
        self._next_expiry = 0.0
        self._lock = threading.Lock()  # one tick at a time: requests ready together are priced in order
        self._thread: threading.Thread | None = None
        self._priced_through = 0.0  # unix: every request seen finished before it is priced

    @property
    def settings(self) -> Settings:
        return self.runtime.settings

    @property
    def active(self) -> bool:
        return bool(self._models)

    def configure(self, served: ServedModel, request_keys: Callable[[str], tuple[str, ...]]) -> None:
        """Price ``served``'s requests from now on. ``request_keys(request_id)``: the
        spellings under which the middleware and the engine may know a request's id. An
        unknown architecture or device leaves the model unpriced, with one error line."""
        rt = self.runtime
        if not rt.settings.enabled:
            log.info("pte-instrument disabled (PTE_ENABLED=0)")
            return
        try:
            s = rt.settings
            cost_model = cost_model_for(
                served.architecture, served.kv_cache_dtype, s.device, s.hoi, s.n_active
            )
            price = s.gpu_hourly_price  # USD per GPU-hour; an engine runs on TP × PP GPUs
            usd_per_engine_second = None if price is None else price * served.gpus_per_engine / 3600
            if cost_model.shape.assumed:  # priced, but on a guess: one line naming it
                log.warning(
                    "pte-instrument cost model for %r: %s", served.name, "; ".join(cost_model.shape.assumed)
                )
            rt.sessions.block_size = served.kv_block_size
            rt.sessions.start()  # the other API servers wait for its watermark (``turn_order``)
            rt.lora_names.enabled = served.lora  # adapters are priced as their base model
            pricers = {
                engine: RequestPricer(
                    cost_model,
                    rt.exporters_for(served.name, engine, cost_model),
                    rt.faults,
                    rt.sessions,
                    replica=s.instance,
                    usd_per_gpu_second=usd_per_engine_second,
                    new_trace_id=rt.new_trace_id,
                    on_state=partial(rt.exporter_state, served.name, engine),
                    on_lost=partial(rt.exporter_lost, served.name, engine),
                )
                for engine in served.engines
            }
        except Exception as e:  # unknown architecture, bad device name…: keep serving unpriced
            rt.faults.record("setup", e)
            log.error("pte-instrument could not build its cost model and is inactive: %s", e)
            return
        join = RequestJoin(rt.inbox, served.name, request_keys, self._tagger(request_keys), rt.faults)
        rt.listen(served.api_server, served.transport)
        rt.joins.append(join)
        with self._lock:
            self._models[served.name] = _Pricing(cost_model, join, pricers)
        self._start_pricer()

    def _tagger(
        self, request_keys: Callable[[str], tuple[str, ...]]
    ) -> Callable[[FinishedRequest], FinishedRequest]:
        def tagged(request: FinishedRequest) -> FinishedRequest:
            return self.runtime.tagged(request, self.runtime.pending.claim(*request_keys(request.request_id)))

        return tagged

    def finished(self, requests: Iterable[FinishedRequest]) -> None:
        """Requests vLLM reported finished (one output batch): tagged now, while their tags
        are kept, and priced on the pricer thread."""
        now = time.monotonic()
        for request in requests:
            pricing = self._models.get(request.model)
            if pricing is None:
                self.fault("adapter", KeyError(f"a request of unconfigured model {request.model!r}"))
                continue
            try:
                tagged = pricing.join.tag(request)
                if pricing.join.finished(tagged, now):
                    self.runtime.sessions.told_finished(tagged.request_id, tagged.session_id)
            except Exception as e:
                self.fault("adapter", e)
        self.runtime.inbox.arrived.set()  # wake the pricer

    def fault(self, stage: str, error: Exception) -> None:
        self.runtime.faults.record(stage, error)

    def tick(self, now: float | None = None, final: bool = False) -> None:
        """Price every request that is ready (its engine totals arrived, or waiting for
        them timed out), and close the sessions idle past their TTL. ``final`` (the process
        exits): the turns held for the turns before them are priced too."""
        now = time.monotonic() if now is None else now
        with self._lock:
            started = time.time()
            priced = 0
            for pricing in list(self._models.values()):
                priced += self._price_in_turn_order(pricing, pricing.join.ready(now), now, final)
            self._priced_through = self._unpriced_since(started)
            expiring = now >= self._next_expiry
            if expiring:
                self._next_expiry = now + EXPIRY_EVERY_S
                try:
                    self.runtime.sessions.expire()
                except Exception as e:
                    self.fault("sessions", e)
            if priced or expiring:  # the ledger changed only then
                try:
                    self.runtime.ledger_metrics.sync()
                except Exception as e:
                    self.fault("sessions", e)

    def _price_in_turn_order(
        self, pricing: _Pricing, ready: list[FinishedRequest], now: float, final: bool
    ) -> int:
        """Price the ready requests and the held turns whose sessions' earlier turns are in the
        store (every other writer's watermark, and this process's unpriced turns of the
        session, past their arrival), in arrival order; hold the other turns, at most
        ``TURN_ORDER_WAIT_S`` (``final``: not at all). Returns how many were priced."""
        waiting = pricing.held + [(r, now + TURN_ORDER_WAIT_S) for r in ready]
        waiting.sort(key=lambda w: w[0].arrived_at)
        pricing.held = []
        sessions = self.runtime.sessions
        others = math.inf
        if any(r.session_id is not None for r, _ in waiting):
            others = sessions.others_caught_up_to()
        self._prefetch_sessions([r for r, _ in waiting if r.arrived_at <= others])
        priced = 0
        for request, deadline in waiting:
            sid = request.session_id
            if sid is not None and request.arrived_at > min(others, sessions.unpriced_since(sid)):
                if now < deadline and not final:
                    pricing.held.append((request, deadline))
                    continue
                self.fault("sessions", self._out_of_order(request))
            self._price(pricing, request)
            priced += 1
        return priced

    def _unpriced_since(self, started: float) -> float:
        """After a tick that started at ``started`` (unix): the earliest a request still
        unpriced could have been seen finished (one waiting for its engine's totals, a turn
        held for the turns before it: before it was seen, it arrived)."""
        since = started
        for pricing in self._models.values():
            oldest = pricing.join.oldest_seen_at()
            if oldest is not None:
                since = min(since, oldest)
            since = min([since, *(request.arrived_at for request, _ in pricing.held)])
        return since

    def priced_through(self) -> float:
        """Unix time before which every request this process saw finish is priced (infinite
        where nothing prices here: no model configured, or no pricer thread)."""
        return self._priced_through if self._models and self._thread is not None else math.inf

    @staticmethod
    def _out_of_order(request: FinishedRequest) -> Exception:
        return TimeoutError(
            f"turn {request.request_id} of session {request.session_id!r} priced before the turns "
            f"before it reached the session store (another API server's writes lagged {TURN_ORDER_WAIT_S:g} s, "
            "or this process exits): its turn number, pause and reusable prefix are as the store held them"
        )

    def _prefetch_sessions(self, ready: list[FinishedRequest]) -> None:
        """The sessions of a pass's requests read from the store at once (one round trip to a
        shared store, not one per request)."""
        sessions = [r.session_id for r in ready if r.session_id is not None]
        if sessions:
            try:
                self.runtime.sessions.prefetch(sessions)
            except Exception as e:
                self.fault("sessions", e)

    def _price(self, pricing: _Pricing, request: FinishedRequest) -> None:
        pricer = pricing.pricers.get(request.engine)
        if pricer is None:  # an engine index vLLM did not announce
            self.fault("adapter", KeyError(f"unknown engine {request.engine}"))
            self.runtime.sessions.gave_up(request)
            return
        pricer.on_finished(request)
        totals = request.engine_totals
        if totals is not None:
            try:
                self.runtime.prometheus[(request.model, request.engine)].publish_engine_time(
                    totals.engine_busy_s, totals.engine_attributed_s
                )
            except Exception as e:
                self.fault("prometheus", e)

    def _start_pricer(self) -> None:
        if self.threaded and self._thread is None:
            self._thread = threading.Thread(target=self._price_forever, name="pte-pricer", daemon=True)
            self._thread.start()

    def _price_forever(self) -> None:
        arrived = self.runtime.inbox.arrived  # engine totals or finished requests came
        while True:
            arrived.wait(TICK_S)
            arrived.clear()
            try:
                self.tick()
            except Exception as e:  # never let the pricer die
                self.fault("engine_join", e)

    def announce(self, model: str) -> None:
        """One line saying what prices ``model``'s requests (once vLLM's engines are up)."""
        pricing = self._models.get(model)
        if pricing is None:
            return
        c = pricing.cost_model
        log.info(
            "pte-instrument active for %s (engines %s, API server %d, engine totals on %s): gamma=%.6g, "
            "device=%s (HOI %.1f), N_active=%.4g, KV bytes/token=%g",
            model,
            ",".join(map(str, pricing.pricers)),
            self.runtime.api_server,
            self.runtime.receiver_address or "nothing (no engine hook can reach this process)",
            c.gamma,
            c.device.name,
            c.device.hoi,
            c.shape.n_active,
            c.shape.kv_bytes_per_token,
        )

    def set_api_keys(self, keys: list[str]) -> None:
        """The API keys vLLM's server checks: the plugin's routes and tags check them too."""
        self.runtime.api_keys = keys

    def router(self) -> APIRouter:
        """The ``/pte/*`` routes."""
        return build_router(self.runtime, self.priced_through)

    def middleware(
        self,
        app: ASGIApp,
        keys_of: Callable[[Any], list[str]] | None = None,
        adapters_of: Callable[[Any], Container[str] | None] | None = None,
    ) -> TaggingMiddleware:
        """The middleware that tags generation requests, around ``app``. ``keys_of(asgi_app)``:
        the server's API keys, when no one set them; ``adapters_of(asgi_app)``: the LoRA
        adapters it serves, by name."""
        return TaggingMiddleware(app, self.runtime, keys_of, adapters_of)


@once
def api_server() -> ApiServer:
    """This process's plugin (vLLM loads the stat logger and the routes separately)."""
    server = ApiServer(get_runtime())
    atexit.register(server.tick, final=True)  # price what is ready before the session store closes
    return server
