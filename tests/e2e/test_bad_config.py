"""One server started with a device name that does not exist, an HOI no hardware has, and a
model whose config names its KV heads as only its own (remote) code knows: the plugin stays
active, prices with the default profile, and says each of the three in one log line."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import httpx
import pytest

from tests.conftest import scrape, start_server
from tests.helpers import jsonl, wait

# A remote-code config class: the standard attribute is an alias of a field of its own, so
# vLLM reads 1 KV head while the config's dict has no num_key_value_heads at all.
REMOTE_CONFIG = """
from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"
    attribute_map = {**LlamaConfig.attribute_map, "num_key_value_heads": "kv_head_count"}
"""
ASSUMED = "num_key_value_heads missing: assumed = num_attention_heads (MHA)"


def remote_code_copy(tiny_model: Path, dest: Path) -> Path:
    shutil.copytree(tiny_model, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg["kv_head_count"] = cfg.pop("num_key_value_heads")
    cfg["model_type"] = "tiny_remote"
    cfg["auto_map"] = {"AutoConfig": "configuration_tiny_remote.TinyRemoteConfig"}
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    (dest / "configuration_tiny_remote.py").write_text(REMOTE_CONFIG)
    return dest


@pytest.fixture(scope="module")
def bad_config(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("bad_config")
    model = remote_code_copy(tiny_model, work / "tiny-remote")
    log = work / "requests.jsonl"
    env = {
        "PTE_DEVICE": "nonexistent",
        "PTE_HOI": "1e308",
        "PTE_REQUEST_LOG": str(log),
        "VLLM_PLUGINS": "pte",
    }
    vllm = start_server(model, work, env, ["--trust-remote-code"])
    try:
        yield vllm, log
    finally:
        vllm.stop()


def test_bad_settings_fall_back_and_the_assumed_kv_heads_are_said(bad_config):
    vllm, request_log = bad_config
    client = httpx.Client(base_url=vllm.url, timeout=120)
    body = {
        "model": vllm.served_name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "ignore_eos": True,
    }
    ids = {client.post("/v1/chat/completions", json=body).json()["id"] for _ in range(2)}
    if not wait(lambda: {r["request_id"] for r in jsonl(request_log)} >= ids, timeout_s=60):
        plugin_lines = [ln for ln in vllm.log_path.read_text(errors="replace").splitlines() if "pte" in ln]
        raise AssertionError(
            f"the plugin priced {len(jsonl(request_log))} of {sorted(ids)} in 60 s; /pte/summary: "
            f"{client.get('/pte/summary').text}; its log lines: {plugin_lines[-20:]}"
        )
    records = jsonl(request_log)

    # the default profile (auto: no GPU here → h100-sxm), its own HOI, a finite γ
    summary = client.get("/pte/summary")
    assert summary.status_code == 200
    (cm,) = summary.json()["cost_models"]
    assert cm["device"] == "h100-sxm" and cm["hoi"] == pytest.approx(989.4 / 3.35)
    assert math.isfinite(cm["gamma"]) and cm["gamma"] > 0
    assert cm["assumed"] == [ASSUMED] and cm["attention"] == "mha"
    for r in records:
        assert r["device"] == "h100-sxm" and r["gamma"] == pytest.approx(cm["gamma"])
    gauges = {
        dict(labels)["device"]: v for (name, labels), v in scrape(client).items() if name == "pte_gamma"
    }
    assert gauges == {"h100-sxm": pytest.approx(cm["gamma"])}

    text = vllm.log_path.read_text(errors="replace")
    device_lines = [
        ln for ln in text.splitlines() if "pte-instrument configuration: PTE_DEVICE='nonexistent'" in ln
    ]
    hoi_lines = [ln for ln in text.splitlines() if "pte-instrument configuration: PTE_HOI='1e308'" in ln]
    assumed_lines = [ln for ln in text.splitlines() if ASSUMED in ln]
    for lines in (device_lines, hoi_lines, assumed_lines):
        assert len(lines) == 1, lines
        print(lines[0])
    assert "inactive" not in text
