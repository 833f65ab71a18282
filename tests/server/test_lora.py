"""LoRA adapters: a request is accounted under the adapter the server served it with (its
``model`` field, kept only when the server serves an adapter of that name), priced with the
base model's cost model, and the adapter names are bounded."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pte_instrument.server.exporters.otel import span_attributes
from pte_instrument.server.lora import OTHER_ADAPTER, LoraNames
from pte_instrument.server.middleware import MAX_MODEL_NAME_LEN, TaggingMiddleware
from pte_instrument.server.pricer import RequestPricer
from pte_instrument.server.records import FinishedRequest
from pte_instrument.server.request_tags import PendingTags
from pte_instrument.server.runtime import Runtime
from pte_instrument.settings import Settings
from tests import exposition
from tests.server.test_sessions import Clock
from tests.server.test_tenants import COST


def test_only_a_served_adapter_keeps_its_name_and_only_up_to_the_capacity():
    names = LoraNames(capacity=2)
    assert names.account("ad-1") is None  # the server's adapters are not known yet
    names.served = {"ad-1": 1, "ad-2": 2, "ad-3": 3}
    assert [names.account(m) for m in (None, "base", "ad-1", "ad-2", "ad-3", "ad-1", "ad-3")] == [
        None,
        None,
        "ad-1",
        "ad-2",
        OTHER_ADAPTER,
        "ad-1",
        OTHER_ADAPTER,
    ]
    assert len(names) == 2 and names.overflowed == 2
    with pytest.raises(ValueError):
        LoraNames(0)


def test_adapters_the_server_loads_later_are_seen_live():
    served: dict[str, int] = {}
    names = LoraNames(capacity=4)
    names.served = served
    assert names.account("late") is None
    served["late"] = 1  # vLLM loaded it (/v1/load_lora_adapter, a resolver)
    assert names.account("late") == "late"


async def post_all(runtime: Runtime, bodies: list[bytes]) -> list[bytes]:
    """One POST per body through the middleware; what the app behind it received of each."""
    received: list[bytes] = []

    async def downstream(scope, receive, send):
        received.append((await receive()).get("body", b""))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    for i, body in enumerate(bodies):

        async def receive(body=body):
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            pass

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"x-request-id", f"r{i}".encode())],
        }
        await TaggingMiddleware(downstream, runtime)(scope, receive, send)
    return received


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def runtime(registry):
    rt = Runtime(Settings(session_store=None, max_lora_names=8), registry=registry)
    rt.pending = PendingTags(clock=Clock())
    rt.lora_names.enabled = True
    rt.lora_names.served = {f"adapter-{k}": k for k in range(100)}  # the server's adapters, by name
    yield rt
    rt.sessions.close()


def test_ten_thousand_model_names_leave_the_served_adapters_up_to_the_cap(runtime, registry):
    n = 10_000
    models = [
        f"adapter-{i % 100}" if i % 3 == 0 else ("base" if i % 3 == 1 else f"no-such-{i}") for i in range(n)
    ]
    bodies = [b'{"prompt": "hi", "model": "%s", "max_tokens": 2}' % m.encode() for m in models]
    assert asyncio.run(post_all(runtime, bodies)) == bodies  # every body reaches the server whole
    pricer = RequestPricer(COST, runtime.exporters_for("base", 0, COST), runtime.faults, runtime.sessions)
    by_name: dict[str | None, int] = {}
    for i, model in enumerate(models):
        tag = runtime.pending.claim(f"cmpl-r{i}-0", f"r{i}-0", f"r{i}")
        assert tag is not None and tag.model == model
        if model.startswith("no-such"):  # vLLM answers 404: it never finishes
            continue
        finished = FinishedRequest(f"cmpl-r{i}-0", "base", 64, 0, 4, "length")
        record = pricer.on_finished(runtime.tagged(finished, tag))
        assert record.model == "base" and record.gamma == COST.gamma  # priced as the base model
        by_name[record.lora_name] = by_name.get(record.lora_name, 0) + 1
        if i % 1000 == 999:  # the store's writer keeps pace (its queue bound is not under test here)
            assert runtime.sessions.flush()
    # i % 3 == 0: adapter-(i % 100); the first 8 distinct ones (0, 3, …, 21 in arrival order) keep their name
    first = {f"adapter-{k}" for k in range(0, 24, 3)}
    assert set(by_name) == {None, OTHER_ADAPTER, *first}
    assert by_name[None] == 3333  # i % 3 == 1
    assert sum(by_name[a] for a in first) + by_name[OTHER_ADAPTER] == 3334  # i % 3 == 0
    assert by_name["adapter-0"] == len(range(0, n, 300))  # i ≡ 0 (mod 3) and (mod 100)

    samples = exposition.samples(generate_latest(registry).decode())
    lora_values = {dict(k[1])["lora_name"] for k in samples if "lora_name" in dict(k[1])}
    assert lora_values == {"", OTHER_ADAPTER, *first}  # empty: the base model
    assert {dict(k[1])["model_name"] for k in samples if "lora_name" in dict(k[1])} == {"base"}
    assert len(runtime.metrics.requests._metrics) == len(lora_values)

    assert runtime.sessions.flush()
    summary = runtime.summary()
    assert summary["models"]["base"]["requests"] == 6667  # the base model's totals include its adapters'
    assert set(summary["lora_adapters"]) == {OTHER_ADAPTER, *first}
    assert summary["lora_adapters"]["adapter-0"]["requests"] == by_name["adapter-0"]
    assert {a["model"] for a in summary["lora_adapters"].values()} == {"base"}


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[1, 2]",
        b'{"model": 7}',
        b'{"prompt": "x"}',
        b'{"model": "%s"}' % (b"a" * (MAX_MODEL_NAME_LEN + 1)),
        b'{"model": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    ],
)
def test_a_model_field_that_names_no_adapter_is_the_base_model(runtime, body):
    runtime.lora_names.served = {"a" * (MAX_MODEL_NAME_LEN + 1): 1}
    assert asyncio.run(post_all(runtime, [body])) == [body]
    tag = runtime.pending.claim("r0")
    assert tag is None  # nothing else to tag: no session, benchmark or tenant
    assert runtime.tagged(FinishedRequest("cmpl-r0-0", "base", 8, 0, 1, "stop"), tag).lora_name is None
    assert runtime.faults.counts.get("middleware", 0) == 0


def test_without_lora_the_body_is_not_read_for_the_model(runtime):
    runtime.lora_names.enabled = False
    asyncio.run(post_all(runtime, [b'{"model": "adapter-1"}']))
    assert runtime.pending.claim("r0") is None  # nothing else to tag either: no tag at all


def test_the_span_and_the_request_log_name_the_adapter(runtime):
    pricer = RequestPricer(COST, [], runtime.faults)
    adapter = pricer.on_finished(FinishedRequest("a", "base", 10, 0, 2, "stop", lora_name="adapter-1"))
    base = pricer.on_finished(FinishedRequest("b", "base", 10, 0, 2, "stop"))
    attrs = span_attributes(adapter)
    assert attrs["pte.lora_name"] == "adapter-1" and attrs["gen_ai.request.model"] == "base"
    assert adapter.to_dict()["lora_name"] == "adapter-1" and base.to_dict()["lora_name"] is None
    assert "pte.lora_name" not in span_attributes(base)
    assert adapter.pte_served == base.pte_served  # same tokens, same cost model: same price
