"""Tenants and LoRA adapters on a real server (the CPU build serves LoRA): hundreds of
distinct tenants through vLLM's HTTP stack leave at most |allow-list| + 1 ``tenant`` values,
each tenant's requests, PTE, GPU seconds and cost counted under it; a request to an adapter
is accounted under the adapter's name, priced with the base model's γ, and the adapter names
are bounded (``PTE_MAX_LORA_NAMES=1``: the second adapter is ``other``)."""

from __future__ import annotations

import hashlib
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from pte_instrument.devtools.tinymodel import build_lora_adapter
from tests.e2e.conftest import serving
from tests.exposition import metric_sum, samples
from tests.helpers import jsonl, wait

KEY_C = "sk-team-c"
HASH_C = hashlib.sha256(KEY_C.encode()).hexdigest()[:12]  # what `pte tenant-hash` prints
TENANTS = ("team-a", "team-b", HASH_C)
PRICE = 2.0  # USD per GPU-hour


@pytest.fixture(scope="module")
def lora_server(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("tenants-lora")
    first = build_lora_adapter(work / "tiny-lora", tiny_model, rank=8, seed=1)
    second = build_lora_adapter(work / "tiny-lora-2", tiny_model, rank=8, seed=2)
    env = {
        "PTE_REQUEST_LOG": str(work / "requests.jsonl"),
        "VLLM_PLUGINS": "pte",
        "PTE_DEVICE": "h100-sxm",
        "PTE_TENANT_HEADER": "X-Tenant-Id",
        "PTE_TENANT_FROM_API_KEY": "1",
        "PTE_TENANTS": ",".join(TENANTS),
        "PTE_GPU_HOURLY_PRICE": str(PRICE),
        "PTE_MAX_LORA_NAMES": "1",
    }
    args = [
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-loras",
        "2",
        "--lora-modules",
        f"tiny-lora={first}",
        f"tiny-lora-2={second}",
        "--scheduler-cls",
        "pte_instrument.vllm_adapter.scheduler.PteScheduler",
    ]
    with serving(tiny_model, work, env, args) as (vllm, client):
        yield vllm, work, client


def complete(client, model: str, headers: dict[str, str], prompt: str = "agent tool call result") -> str:
    r = client.post(
        "/v1/completions",
        headers=headers,
        json={"model": model, "prompt": prompt, "max_tokens": 2, "ignore_eos": True},
    )
    r.raise_for_status()
    return r.json()["id"]


def logged(work, ids: set[str]) -> dict[str, dict]:
    """Request-log entries of ``ids`` (the completions API appends the prompt's index)."""

    def entries() -> dict[str, dict]:
        by_id = {e["request_id"].rpartition("-")[0]: e for e in jsonl(work / "requests.jsonl")}
        return {rid: e for rid, e in by_id.items() if rid in ids}

    assert wait(lambda: len(entries()) == len(ids), timeout_s=60)
    return entries()


def test_hundreds_of_tenants_leave_the_allow_list_plus_other(lora_server):
    vllm, work, client = lora_server
    rng = random.Random()
    n = 400
    sent: list[tuple[dict[str, str], str]] = []  # headers, the tenant they should be accounted to
    for i in range(n):
        kind = i % 4
        if kind == 0:  # a distinct tenant header; every 20th allow-listed
            name = TENANTS[i // 20 % 2] if i % 20 == 0 else f"tenant-{i}-{rng.randrange(10**9)}"
            sent.append(({"X-Tenant-Id": name}, name if i % 20 == 0 else "other"))
        elif kind == 1:  # a distinct API key; every 20th is team C's
            key = KEY_C if i % 20 == 1 else f"sk-{i}-{rng.randrange(10**9)}"
            sent.append(({"Authorization": f"Bearer {key}"}, HASH_C if key == KEY_C else "other"))
        elif kind == 2:  # a header that is no tenant name at all
            sent.append(({"X-Tenant-Id": "x" * rng.randint(65, 2000)}, "other"))
        else:  # nothing
            sent.append(({}, "other"))
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda s: complete(client, vllm.served_name, s[0]), sent))
    expected = {t: sum(want == t for _, want in sent) for t in (*TENANTS, "other")}
    # i % 20 == 0 alternates team-a and team-b (20 requests), i % 20 == 1 is team C's key (20)
    assert expected["team-a"] == expected["team-b"] == 10 and expected[HASH_C] == 20
    records = logged(work, set(ids))
    assert {rid: records[rid]["tenant"] for rid in ids} == {
        rid: want for rid, (_, want) in zip(ids, sent, strict=True)
    }

    m = samples(client.get("/metrics").text)
    tenant_values = {dict(labels).get("tenant") for (_, labels) in m if "tenant" in dict(labels)}
    assert tenant_values <= {*TENANTS, "other"} and len(tenant_values) == len(TENANTS) + 1
    for tenant, count in expected.items():
        assert metric_sum(m, "pte_requests_total", tenant=tenant, lora_name="") == count, tenant
        mine = [r for r in records.values() if r["tenant"] == tenant]
        assert metric_sum(m, "pte_served_pte_total", tenant=tenant) == pytest.approx(
            sum(r["pte_served"] for r in mine), rel=1e-9
        )
        assert metric_sum(m, "pte_gpu_seconds_total", tenant=tenant) == pytest.approx(
            sum(r["gpu_seconds"] for r in mine), rel=1e-9
        )
        assert metric_sum(m, "pte_cost_usd_total", tenant=tenant) == pytest.approx(
            sum(r["cost_usd"] for r in mine), rel=1e-9
        )
        assert sum(r["cost_usd"] for r in mine) > 0
    summary = client.get("/pte/summary").json()
    assert {t: v["requests"] for t, v in summary["tenants"].items()} == expected
    assert summary["tenants"]["team-a"]["cost_usd"] == pytest.approx(
        sum(r["cost_usd"] for r in records.values() if r["tenant"] == "team-a"), rel=1e-9
    )
    assert not any(KEY_C in line for line in (work / "requests.jsonl").read_text().splitlines())


def test_an_adapters_requests_are_accounted_under_its_name_at_the_base_models_gamma(lora_server):
    _, work, client = lora_server
    before = client.get("/pte/summary").json()["lora_adapters"]
    base = [complete(client, "tiny", {"X-Tenant-Id": "team-a"}, f"base turn {i}") for i in range(3)]
    adapter = [
        complete(client, "tiny-lora", {"X-Tenant-Id": "team-b"}, f"adapter turn {i}") for i in range(3)
    ]
    second = [complete(client, "tiny-lora-2", {}, f"second adapter turn {i}") for i in range(2)]
    missing = client.post(
        "/v1/completions", json={"model": "no-such-adapter", "prompt": "x", "max_tokens": 1}
    )
    assert missing.status_code == 404
    records = logged(work, {*base, *adapter, *second})
    assert {records[r]["lora_name"] for r in base} == {None}
    assert {records[r]["lora_name"] for r in adapter} == {"tiny-lora"}
    assert {records[r]["lora_name"] for r in second} == {"other"}  # past PTE_MAX_LORA_NAMES=1
    assert {records[r]["model"] for r in records} == {"tiny"}  # the served model, as vLLM's own model_name
    assert {records[r]["tenant"] for r in adapter} == {"team-b"}
    gammas = {records[r]["gamma"] for r in records}
    assert len(gammas) == 1  # one cost model: the base model's
    (gamma,) = gammas
    for r in records.values():  # exact decode at that γ: γ·(L·D + D(D−1)/2)
        L, D = r["prompt_tokens"], r["output_tokens"]
        assert r["pte_decode"] == pytest.approx(gamma * (L * D + D * (D - 1) / 2), rel=1e-9)

    m = samples(client.get("/metrics").text)
    lora_values = {dict(labels)["lora_name"] for (_, labels) in m if "lora_name" in dict(labels)}
    assert lora_values == {"", "tiny-lora", "other"}
    assert {dict(labels)["model_name"] for (_, labels) in m if "lora_name" in dict(labels)} == {"tiny"}
    assert metric_sum(m, "pte_requests_total", lora_name="tiny-lora") == 3
    assert metric_sum(m, "pte_served_pte_total", lora_name="tiny-lora") == pytest.approx(
        sum(records[r]["pte_served"] for r in adapter), rel=1e-9
    )
    assert metric_sum(m, "pte_cost_usd_total", lora_name="tiny-lora") == pytest.approx(
        sum(records[r]["cost_usd"] for r in adapter), rel=1e-9
    )
    assert {dict(labels)["model_name"] for (name, labels) in m if name == "pte_gamma"} == {"tiny"}

    after = client.get("/pte/summary").json()
    adapters = after["lora_adapters"]
    assert set(adapters) == {"tiny-lora", "other"} and {a["model"] for a in adapters.values()} == {"tiny"}
    assert adapters["tiny-lora"]["requests"] - before.get("tiny-lora", {}).get("requests", 0) == 3
    assert adapters["other"]["requests"] - before.get("other", {}).get("requests", 0) == 2
    assert set(after["models"]) == {"tiny"}  # the base model's totals include its adapters'
