"""A config field the cost model had to assume is named: on the shape, in
CostModel.describe() (so in /pte/summary), and in `pte gamma`'s table, JSON and stderr."""

import json
import os
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from pte_instrument.cost.architecture import load_config, parse_shape
from pte_instrument.cost.devices import resolve_device
from pte_instrument.cost.model import CostModel
from pte_instrument.server.runtime import Runtime
from pte_instrument.settings import Settings
from tests.cost.test_architecture import FIX

MHA_ASSUMED = "num_key_value_heads missing: assumed = num_attention_heads (MHA)"


def remote_code_config() -> dict:
    """dense_mha.json with its 4 KV heads (of 4) under a name no known family uses, as
    remote-code models do; here the heads are really GQA: 1 KV head."""
    cfg = load_config(FIX / "dense_mha.json")
    del cfg["num_key_value_heads"]
    cfg["kv_head_count"] = 1
    return cfg


def test_missing_kv_heads_is_named_as_assumed():
    s = parse_shape(remote_code_config())
    assert s.attention == "mha" and s.n_kv_heads == s.n_heads
    assert s.assumed == (MHA_ASSUMED,)
    assert CostModel(s, resolve_device("h100-sxm")).describe()["assumed"] == [MHA_ASSUMED]


@pytest.mark.parametrize(
    "name", ["dense_mha", "gqa_head_dim", "llama31_8b", "mla_deepseek", "moe_mixtral", "sliding_gemma2"]
)
def test_complete_configs_assume_nothing(name):
    assert parse_shape(load_config(FIX / f"{name}.json")).assumed == ()


def test_multi_query_flag_and_mla_are_not_assumptions():
    assert not any(
        "num_key_value_heads" in a for a in parse_shape(load_config(FIX / "mqa_fp32.json")).assumed
    )
    cfg = load_config(FIX / "mla_deepseek.json")
    del cfg["num_key_value_heads"]
    assert parse_shape(cfg).assumed == ()


def test_missing_dtype_is_named_unless_the_kv_dtype_is_given():
    cfg = load_config(FIX / "dense_mha.json")
    del cfg["torch_dtype"]
    assert parse_shape(cfg).assumed == ("torch_dtype missing: assumed bfloat16 (2 bytes per KV element)",)
    assert parse_shape(cfg, kv_cache_dtype="fp8").assumed == ()


def test_summary_shows_the_assumed_fields():
    runtime = Runtime(Settings(), CollectorRegistry())
    runtime.exporters_for(
        "remote", 0, CostModel(parse_shape(remote_code_config()), resolve_device("h100-sxm"))
    )
    (entry,) = runtime.summary()["cost_models"]
    assert entry["model"] == "remote" and entry["assumed"] == [MHA_ASSUMED]


def pte(*args: str) -> subprocess.CompletedProcess:
    # wide enough that the table does not wrap the assumption across lines
    env = {**os.environ, "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "pte_instrument.cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def test_pte_gamma_shows_the_assumed_fields(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(remote_code_config()))
    table = pte("gamma", str(path))
    assert table.returncode == 0, table.stderr
    assert "assumed" in table.stdout and "num_key_value_heads missing" in table.stdout
    assert table.stderr.strip() == f"pte gamma: warning: {MHA_ASSUMED}"
    as_json = pte("gamma", str(path), "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["assumed"] == [MHA_ASSUMED]
    assert as_json.stderr.strip() == f"pte gamma: warning: {MHA_ASSUMED}"
    complete = pte("gamma", str(FIX / "dense_mha.json"), "--json")
    assert json.loads(complete.stdout)["assumed"] == [] and complete.stderr == ""
