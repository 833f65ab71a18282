"""The plugin inside a real vLLM server: Prometheus totals and the request log equal an
independent computation from the OpenAI responses (usage, cached tokens)."""

from __future__ import annotations

import json
import random

import pytest

from tests.exposition import metric_sum


def independent_gamma(config: dict) -> float:
    """γ of the tiny Llama written out by hand, not through the package's core."""
    d, layers = config["hidden_size"], config["num_hidden_layers"]
    hq, hkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    ffn, vocab = config["intermediate_size"], config["vocab_size"]
    element = {"float32": 4, "bfloat16": 2, "float16": 2}[config.get("torch_dtype") or config["dtype"]]
    kv_bytes = layers * 2 * hkv * hd * element
    n_active = layers * (d * hq * hd + 2 * d * hkv * hd + hq * hd * d + 3 * d * ffn) + d * vocab
    hoi = 989.4e12 / 3.35e12  # H100 SXM datasheet
    return kv_bytes * hoi / (2 * n_active)


def words(rng: random.Random, n: int) -> str:
    vocab = [
        "agent",
        "tool",
        "call",
        "result",
        "search",
        "python",
        "value",
        "error",
        "table",
        "row",
        "column",
        "cache",
        "token",
    ]
    return " ".join(rng.choice(vocab) for _ in range(n))


def test_prometheus_and_request_log_match_responses(server, tiny_model):
    gamma = independent_gamma(json.loads((tiny_model / "config.json").read_text()))
    rng = random.Random()
    shared = words(rng, 400)  # > one 128-token KV block: later requests hit the prefix cache
    before = server.metrics()
    responses = [
        server.chat(shared + " first question", max_tokens=12),
        server.chat(shared + " second question " + words(rng, 30), max_tokens=7),
        server.chat(words(rng, 50), max_tokens=5),  # no shared prefix
        server.chat(words(rng, 300), max_tokens=1),
        server.chat(shared + " third " + words(rng, 200), max_tokens=20),
    ]
    usages = [r["usage"] for r in responses]
    cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usages]
    assert cached[0] == 0 and cached[1] > 0 and cached[4] > 0, cached  # prefix caching engaged
    assert cached[2] == 0

    ids = {r["id"] for r in responses}
    records = server.log_records(ids)
    assert set(records) == ids
    assert all(len(v) == 1 for v in records.values()), "exactly one log entry per request"

    exp_totals = dict(served_prefill=0.0, served_decode=0.0, reference=0.0, prompt=0, cached=0, output=0)
    for r, u, c in zip(responses, usages, cached, strict=True):
        rec = records[r["id"]][0]
        L, D = u["prompt_tokens"], u["completion_tokens"]
        assert (rec["prompt_tokens"], rec["cached_tokens"], rec["output_tokens"]) == (L, c, D)
        assert rec["computed_prefill_tokens"] == L - c
        assert rec["finish_reason"] == "length" and rec["model"] == server.model
        served_decode = gamma * (L * D + D * (D - 1) / 2)
        assert rec["gamma"] == pytest.approx(gamma, rel=1e-9)
        assert rec["pte_prefill"] == L - c
        assert rec["pte_decode"] == pytest.approx(served_decode, rel=1e-9)
        assert rec["pte_served"] == pytest.approx(L - c + served_decode, rel=1e-9)
        assert rec["pte_reference"] == pytest.approx(L + gamma * L * D, rel=1e-9)
        assert rec["pte_ideal"] == pytest.approx(L + served_decode, rel=1e-9)  # one-turn trajectory
        assert rec["inference_s"] > 0 and rec["prefill_s"] >= 0
        exp_totals["served_prefill"] += L - c
        exp_totals["served_decode"] += served_decode
        exp_totals["reference"] += L + gamma * L * D
        exp_totals["prompt"] += L
        exp_totals["cached"] += c
        exp_totals["output"] += D

    after = server.metrics()

    def delta(name, **labels):
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    assert delta("pte_requests_total", model_name=server.model) == len(responses)
    assert delta("pte_prompt_tokens_total") == exp_totals["prompt"]
    assert delta("pte_cached_tokens_total") == exp_totals["cached"]
    assert delta("pte_output_tokens_total") == exp_totals["output"]
    assert delta("pte_served_pte_total", phase="prefill") == exp_totals["served_prefill"]
    assert delta("pte_served_pte_total", phase="decode") == pytest.approx(
        exp_totals["served_decode"], rel=1e-9
    )
    assert delta("pte_reference_pte_total") == pytest.approx(exp_totals["reference"], rel=1e-9)
    assert delta("pte_request_served_pte_count") == len(responses)
    assert delta("pte_request_served_pte_sum") == pytest.approx(
        exp_totals["served_prefill"] + exp_totals["served_decode"], rel=1e-9
    )
    assert metric_sum(after, "pte_gamma", model_name=server.model) == pytest.approx(gamma, rel=1e-9)


def test_streaming_request_is_priced(server):
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "stream please " * 20}],
        "max_tokens": 9,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage, rid = None, None
    with server.client.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                rid = chunk["id"]
                usage = chunk.get("usage") or usage
    rec = server.log_records({rid})[rid][0]
    assert (rec["prompt_tokens"], rec["output_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
