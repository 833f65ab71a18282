"""Speculative decoding in a real vLLM engine (n-gram drafts, which the CPU build runs): the
step hook's drafts and rejections per request against vLLM's own counters, and each
request's engine PTE against the request-level price plus the work the drafts added."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.conftest import start_server
from tests.e2e.test_engine_hook_e2e import records_for
from tests.e2e.test_vllm_plugin import independent_gamma
from tests.exposition import metric_sum, samples

DRAFTS = 3  # num_speculative_tokens
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def speculating(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("speculating")
    env = {"PTE_REQUEST_LOG": str(work / "requests.jsonl"), "PTE_DEVICE": "h100-sxm"}
    spec = {
        "method": "ngram",
        "num_speculative_tokens": DRAFTS,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
    args = [
        "--scheduler-cls",
        "pte_instrument.vllm_adapter.scheduler.PteScheduler",
        "--speculative-config",
        json.dumps(spec),
    ]
    vllm = start_server(tiny_model, work, env, args)
    try:
        yield vllm, work, httpx.Client(base_url=vllm.url, timeout=120)
    finally:
        vllm.stop()


def spec_counters(client: httpx.Client) -> tuple[float, float, float, float]:
    """vLLM's draft and accepted tokens, and the plugin's drafts and rejected drafts."""
    m = samples(client.get("/metrics").text, prefix="")
    return (
        metric_sum(m, "vllm:spec_decode_num_draft_tokens_total"),
        metric_sum(m, "vllm:spec_decode_num_accepted_tokens_total"),
        metric_sum(m, "pte_spec_draft_tokens_total"),
        metric_sum(m, "pte_spec_rejected_tokens_total"),
    )


def test_drafts_and_rejections_per_request_add_up_to_vllms_counters_and_price_what_ran(
    speculating, tiny_model
):
    vllm, work, client = speculating
    gamma = independent_gamma(json.loads((tiny_model / "config.json").read_text()))
    before = spec_counters(client)
    answers = [
        client.post(
            "/v1/completions",
            json={
                "model": vllm.served_name,
                "prompt": "a b c d " * repeats,  # repeats give the n-gram proposer drafts to offer
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
                "temperature": 0.0,
            },
        ).json()
        for repeats in range(1, 9)
    ]
    records = records_for(work, {a["id"] for a in answers})
    assert len(records) == len(answers) and all(len(r) == 1 for r in records.values())
    rows = [(a["usage"], records[a["id"]][0]) for a in answers]
    logged = sum(rec["engine_spec_tokens"] for _, rec in rows)
    # vLLM's counters of the last steps reach /metrics at a later log interval than the log's
    deadline = time.monotonic() + 15
    while (after := spec_counters(client))[0] - before[0] < logged and time.monotonic() < deadline:
        time.sleep(0.2)
    vllm_drafts, vllm_accepted, pte_drafts, pte_rejected = (a - b for a, b in zip(after, before, strict=True))
    assert vllm_drafts > 0 and vllm_drafts > vllm_accepted > 0  # drafts both taken and turned down
    assert logged == vllm_drafts == pte_drafts
    assert (
        sum(rec["engine_rejected_tokens"] for _, rec in rows) == vllm_drafts - vllm_accepted == pte_rejected
    )
    for usage, rec in rows:
        L, D = usage["prompt_tokens"], usage["completion_tokens"]
        assert (rec["prompt_tokens"], rec["output_tokens"], D) == (L, D, MAX_TOKENS)
        assert rec["engine_prefill_tokens"] == L - rec["cached_tokens"]
        # Positions the engine computed past the request's last token: drafts it accepted in
        # the last step and then cut at max_tokens (at most one step's drafts).
        past_end = rec["engine_decode_tokens"] - D - rec["engine_rejected_tokens"]
        assert 0 <= past_end <= DRAFTS
        # What ran is what is charged: the request-level price, the rejected drafts' reads,
        # and the reads of the positions past the end (output D + m reads L + D + m entries).
        extra = gamma * sum(L + D + m for m in range(int(past_end)))
        assert rec["engine_pte_served"] == pytest.approx(
            rec["pte_served"] + rec["pte_wasted_rejected_drafts"] + extra, rel=1e-9
        )
        assert rec["pte_wasted_past_end"] == pytest.approx(extra, abs=1e-9)
