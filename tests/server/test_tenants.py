"""Tenants: where a request's tenant comes from (a header, the API key's hash), the
allow-list that bounds it, and 10,000 distinct tenants through the middleware and the
accounting path leaving at most |allow-list| + 1 label values and bounded stores."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pte_instrument.cost.architecture import load_config, parse_shape
from pte_instrument.cost.devices import PROFILES
from pte_instrument.cost.model import CostModel
from pte_instrument.server.exporters.otel import span_attributes
from pte_instrument.server.middleware import TaggingMiddleware
from pte_instrument.server.pricer import RequestPricer
from pte_instrument.server.records import FinishedRequest
from pte_instrument.server.request_tags import PendingTags
from pte_instrument.server.runtime import Runtime
from pte_instrument.server.tenants import TenantPolicy, bearer_token, tenant_hash
from pte_instrument.settings import MAX_TENANT_LEN, MAX_TENANTS, Settings
from tests import exposition
from tests.cost.test_architecture import FIX
from tests.server.test_sessions import Clock

COST = CostModel(parse_shape(load_config(FIX / "dense_mha.json")), PROFILES["h200"])
KEY_C = "sk-team-c"
HASH_C = hashlib.sha256(KEY_C.encode()).hexdigest()[:12]
ALLOWED = frozenset({"team-a", "team-b", HASH_C})


def policy(header: str | None = "x-tenant-id", from_api_key: bool = True) -> TenantPolicy:
    return TenantPolicy(header.encode() if header else None, from_api_key, ALLOWED)


# --- where the tenant comes from ------------------------------------------------------------


def test_the_hash_is_the_first_twelve_hex_digits_of_sha256():
    # SHA-256("abc") = ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad (FIPS 180-2)
    assert tenant_hash("abc") == "ba7816bf8f01" == tenant_hash(b"abc")


@pytest.mark.parametrize(
    ("header", "key"),
    [
        (b"Bearer k1", b"k1"),
        (b"bearer k1", b"k1"),
        (b"BEARER a b", b"a b"),
        (b"Basic k1", None),
        (b"Bearer", None),
        (b"Bearer ", None),
        (b"k1", None),
    ],
)
def test_bearer_token(header, key):
    assert bearer_token(header) == key


@pytest.mark.parametrize(
    ("headers", "tenant"),
    [
        ([(b"x-tenant-id", b"team-a")], "team-a"),
        ([(b"x-tenant-id", b"team-z")], "other"),  # not on the allow-list
        ([(b"x-tenant-id", b"")], "other"),
        ([(b"x-tenant-id", b"team-a ")], "other"),  # exactly as listed, nothing trimmed
        ([(b"x-tenant-id", b"TEAM-A")], "other"),
        ([(b"x-tenant-id", "t\u00e9am".encode())], "other"),
        ([(b"x-tenant-id", b"team-a" * 1000)], "other"),
        ([(b"x-tenant-id", b"team-b"), (b"x-tenant-id", b"team-a")], "team-b"),  # the first
        ([(b"authorization", f"Bearer {KEY_C}".encode())], HASH_C),
        ([(b"authorization", b"Bearer sk-unknown")], "other"),
        ([(b"authorization", f"Basic {KEY_C}".encode())], "other"),
        ([(b"authorization", HASH_C.encode())], "other"),  # a hash sent as the key is hashed again
        # the header wins over the key when both are there
        ([(b"authorization", f"Bearer {KEY_C}".encode()), (b"x-tenant-id", b"team-b")], "team-b"),
        ([(b"authorization", f"Bearer {KEY_C}".encode()), (b"x-tenant-id", b"nope")], "other"),
        ([], "other"),  # nothing to go by
        ([(b"x-session-id", b"team-a")], "other"),
    ],
)
def test_resolve(headers, tenant):
    assert policy().resolve(headers) == tenant


def test_each_source_alone():
    key_only, header_only = policy(header=None), policy(from_api_key=False)
    with_key = [(b"authorization", f"Bearer {KEY_C}".encode())]
    assert key_only.resolve([*with_key, (b"x-tenant-id", b"team-a")]) == HASH_C  # the header is not read
    assert header_only.resolve(with_key) == "other"  # the key is not read
    assert header_only.resolve([(b"x-tenant-id", b"team-a")]) == "team-a"


def test_off_when_no_source_is_configured():
    off = TenantPolicy(None, False, ALLOWED)
    assert not off.enabled and off.untagged is None
    assert off.resolve([(b"x-tenant-id", b"team-a"), (b"authorization", f"Bearer {KEY_C}".encode())]) is None
    assert policy().untagged == "other"


def test_policy_from_settings():
    s = Settings.from_env(
        {"PTE_TENANT_HEADER": "X-Team", "PTE_TENANT_FROM_API_KEY": "1", "PTE_TENANTS": "a,b"}
    )
    p = TenantPolicy.from_settings(s)
    assert (p.header, p.from_api_key, p.allowed) == (b"x-team", True, frozenset({"a", "b"}))
    assert s.errors == ()


# --- settings -------------------------------------------------------------------------------


def test_tenant_settings_default_to_off():
    s = Settings.from_env({})
    assert (s.tenant_header, s.tenant_from_api_key, s.tenants, s.max_lora_names) == (
        None,
        False,
        frozenset(),
        64,
    )


def test_unusable_allow_list_entries_are_named_and_left_out():
    long = "x" * (MAX_TENANT_LEN + 1)
    s = Settings.from_env(
        {
            "PTE_TENANT_HEADER": "X-Tenant-Id",
            "PTE_TENANTS": f" team-a , ,team-b,team-a,other,{long},t\u00e9am,a b",
        }
    )
    assert s.tenants == frozenset({"team-a", "team-b"})
    assert len(s.errors) == 4, s.errors
    assert all(e.startswith("PTE_TENANTS: ") and "left out" in e for e in s.errors)
    assert any("'other'" in e and "catch-all" in e for e in s.errors)
    assert any("longer than 64" in e for e in s.errors)
    assert sum("not visible ASCII" in e for e in s.errors) == 2


def test_unusable_benchmark_labels_are_named_and_left_out():
    """A benchmark label comes in a header read as Latin-1 bytes: one that is not visible ASCII
    can never be sent, and ``other`` and ``none`` are the plugin's own values; each such is
    said and left out, as a tenant is."""
    long = "b" * 65
    s = Settings.from_env(
        {"PTE_BENCHMARK_LABELS": f"gsm8k, mmlu-pro-\u4e2d\u6587,aime 2024,none,other,{long},gsm8k"}
    )
    assert s.benchmark_labels == frozenset({"gsm8k"})
    assert len(s.errors) == 5, s.errors
    assert all(e.startswith("PTE_BENCHMARK_LABELS: ") and "left out" in e for e in s.errors)
    assert (
        sum("not visible ASCII" in e for e in s.errors) == 2 and sum("catch-all" in e for e in s.errors) == 2
    )


def test_the_allow_list_is_capped():
    s = Settings.from_env(
        {"PTE_TENANT_FROM_API_KEY": "1", "PTE_TENANTS": ",".join(f"t{i}" for i in range(MAX_TENANTS + 5))}
    )
    assert len(s.tenants) == MAX_TENANTS and "t0" in s.tenants and f"t{MAX_TENANTS}" not in s.tenants
    assert len(s.errors) == 1 and f"more than {MAX_TENANTS}" in s.errors[0]


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"PTE_TENANTS": "a"}, "neither PTE_TENANT_HEADER nor PTE_TENANT_FROM_API_KEY"),
        ({"PTE_TENANT_HEADER": "X-Tenant-Id"}, "every request is accounted to tenant 'other'"),
        (
            {"PTE_TENANT_FROM_API_KEY": "1", "PTE_TENANTS": " , "},
            "every request is accounted to tenant 'other'",
        ),
        (
            {"PTE_TENANT_HEADER": "X Tenant", "PTE_TENANTS": "a"},
            "PTE_TENANT_HEADER='X Tenant' is not a valid",
        ),
        ({"PTE_TENANT_FROM_API_KEY": "maybe"}, "PTE_TENANT_FROM_API_KEY='maybe' is not a boolean"),
    ],
)
def test_a_configuration_that_cannot_work_as_meant_says_so(env, fragment):
    s = Settings.from_env(env)
    assert any(fragment in e for e in s.errors), s.errors


def test_an_invalid_tenant_header_turns_that_source_off():
    s = Settings.from_env({"PTE_TENANT_HEADER": "X Tenant", "PTE_TENANTS": "a"})
    assert s.tenant_header is None and not TenantPolicy.from_settings(s).enabled


# --- 10,000 tenants through the middleware and the accounting path ------------------------------


async def generation_app(scope, receive, send):
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def post_all(app, requests: list[list[tuple[bytes, bytes]]]) -> None:
    for headers in requests:

        async def receive():
            return {"type": "http.request", "body": b'{"model": "m"}', "more_body": False}

        async def send(message):
            pass

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "headers": headers,
            "query_string": b"",
            "root_path": "",
        }
        await app(scope, receive, send)


def tenant_label_values(text: str) -> set[str]:
    return {
        dict(labels).get("tenant") for (name, labels) in exposition.samples(text) if "tenant" in dict(labels)
    }


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def runtime(tmp_path, registry):
    settings = Settings(
        tenant_header="X-Tenant-Id",
        tenant_from_api_key=True,
        tenants=ALLOWED,
        request_log=str(tmp_path / "requests.jsonl"),
        session_store=None,
    )
    rt = Runtime(settings, registry=registry)
    yield rt
    rt.sessions.close()


def test_ten_thousand_distinct_tenants_leave_the_allow_list_plus_other(runtime, registry, tmp_path):
    n = 10_000
    requests: list[list[tuple[bytes, bytes]]] = []
    for i in range(n):
        rid = f"r{i}".encode()
        if i % 4 == 0:  # a distinct tenant header, a few allow-listed
            value = (b"team-a" if i % 200 == 0 else b"team-b") if i % 100 == 0 else f"tenant-{i}".encode()
            requests.append([(b"x-request-id", rid), (b"x-tenant-id", value)])
        elif i % 4 == 1:  # a distinct API key, one of them allow-listed by its hash
            key = KEY_C if i % 100 == 1 else f"sk-{i}"
            requests.append([(b"x-request-id", rid), (b"authorization", f"Bearer {key}".encode())])
        elif i % 4 == 2:  # a hostile header: long, binary
            requests.append([(b"x-request-id", rid), (b"x-tenant-id", bytes([i % 256]) * (i % 300 + 1))])
        else:  # nothing at all
            requests.append([(b"x-request-id", rid)])
    runtime.pending = PendingTags(clock=Clock())  # still within the grace when the engine reports
    asyncio.run(post_all(TaggingMiddleware(generation_app, runtime), requests))
    pricer = RequestPricer(COST, runtime.exporters_for("m", 0, COST), runtime.faults, runtime.sessions)
    expected = {"team-a": 0, "team-b": 0, HASH_C: 0, "other": 0}
    for i in range(n):
        tag = runtime.pending.claim(f"chatcmpl-r{i}", f"r{i}")
        assert tag is not None, i  # with tenants on, every generation request is tagged
        request = runtime.tagged(FinishedRequest(f"chatcmpl-r{i}", "m", 100, 0, 5, "stop"), tag)
        expected[request.tenant] += 1
        assert pricer.on_finished(request) is not None
        if i % 1000 == 999:  # the store's writer keeps pace (its queue bound is not under test here)
            assert runtime.sessions.flush()
    assert expected["team-a"] == expected["team-b"] == 50 and expected[HASH_C] == 100  # i % 100 == 0, 1
    assert sum(expected.values()) == n

    text = generate_latest(registry).decode()
    assert tenant_label_values(text) == set(expected)  # |allow-list| + 1
    requests_by_tenant = {
        dict(k[1])["tenant"]: v for k, v in exposition.samples(text).items() if k[0] == "pte_requests_total"
    }
    assert requests_by_tenant == expected
    # the stores stay bounded: the families' label children, the exporter's caches
    assert len(runtime.metrics.served._metrics) == 2 * len(expected)  # phase × tenant
    assert len(runtime.metrics.requests._metrics) == len(expected)  # one finish reason
    assert len(runtime.prometheus[("m", 0)]._usage) == len(expected)

    assert runtime.sessions.flush()
    summary = runtime.summary()
    assert {t: v["requests"] for t, v in summary["tenants"].items()} == expected
    assert summary["tenants"]["team-a"]["pte_served"] == pytest.approx(
        50 * summary["models"]["m"]["pte_served"] / n  # every request alike
    )
    lines = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == n and {line["tenant"] for line in lines} == set(expected)
    assert not any(KEY_C in line for line in (tmp_path / "requests.jsonl").read_text().splitlines())


def test_with_tenants_off_there_is_no_tenant_and_no_tag(registry):
    rt = Runtime(Settings(session_store=None), registry=registry)
    try:
        asyncio.run(
            post_all(
                TaggingMiddleware(generation_app, rt),
                [[(b"x-request-id", b"r1"), (b"x-tenant-id", b"team-a")]],
            )
        )
        assert rt.pending.claim("r1") is None  # nothing to remember: no session, benchmark or tenant
        request = rt.tagged(FinishedRequest("chatcmpl-r1", "m", 100, 0, 5, "stop"), None)
        assert request.tenant is None
        RequestPricer(COST, rt.exporters_for("m", 0, COST), rt.faults, rt.sessions).on_finished(request)
        text = generate_latest(registry).decode()
        assert tenant_label_values(text) == {""}  # empty: Prometheus stores it as no label
        assert rt.summary()["tenants"] == {}
    finally:
        rt.sessions.close()


def test_a_request_the_middleware_never_saw_is_the_catch_all(runtime):
    request = runtime.tagged(FinishedRequest("chatcmpl-x", "m", 100, 0, 5, "stop"), None)
    assert request.tenant == "other" and request.session_id is None


def test_the_span_carries_the_tenant_only_when_tenants_are_on(runtime):
    pricer = RequestPricer(COST, [], runtime.faults)
    on = pricer.on_finished(FinishedRequest("a", "m", 10, 0, 2, "stop", tenant="team-a"))
    off = pricer.on_finished(FinishedRequest("b", "m", 10, 0, 2, "stop"))
    assert span_attributes(on)["pte.tenant"] == "team-a" and on.to_dict()["tenant"] == "team-a"
    assert "pte.tenant" not in span_attributes(off) and off.to_dict()["tenant"] is None
