"""The ``pte`` console script: tables, stable JSON, and one-line errors (never a traceback)."""

import hashlib
import json
import subprocess
import sys

import pytest

from tests.cost.test_architecture import FIX


def pte(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pte_instrument.cli.main", *args], capture_output=True, text=True
    )


def test_gamma_json_worked_example():
    r = pte(
        "gamma", str(FIX / "llama31_8b.json"), "--device", "h100-pcie-sparse", "--n-active", "8e9", "--json"
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["gamma"] == pytest.approx(0.006197248, rel=1e-9)
    assert info["kv_bytes_per_token"] == 131072 and info["hoi"] == pytest.approx(756.5)
    assert list(info) == sorted(info)  # stable key order


def test_gamma_table_and_hoi_override():
    r = pte("gamma", str(FIX / "dense_mha.json"), "--hoi", "100")
    assert r.returncode == 0, r.stderr
    # 4096 · 100 / (2 · 2,877,440) = 409600 / 5754880 = 0.0711744
    assert "0.0711744" in r.stdout and "KV bytes / context token" in r.stdout


def test_gamma_unknown_model_type_reads_what_it_can():
    r = pte("gamma", str(FIX / "unknown_complete.json"), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model_type"] == "brand_new_arch"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((str(FIX / "unknown_partial.json"),), "num_attention_heads"),
        (("/no/such/model",), "cannot read model config"),
        ((str(FIX / "dense_mha.json"), "--device", "tpu"), "unknown device"),
    ],
)
def test_gamma_bad_input_is_one_line(args, needle):
    r = pte("gamma", *args)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_devices_json():
    r = pte("devices", "--json")
    assert r.returncode == 0
    names = {d["name"]: d for d in json.loads(r.stdout)}
    assert names["h100-pcie-sparse"]["hoi"] == pytest.approx(756.5)
    assert all(d["source"] for d in names.values())


def test_measuring_a_device_torch_does_not_know_is_one_line():
    r = pte("devices", "--measure", "--measure-device", "bogus")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "cannot measure on 'bogus'" in r.stderr


def test_tenant_hash_of_an_api_key():
    # SHA-256("abc") = ba7816bf8f01cfea… (FIPS 180-2): the first 12 hex digits
    r = pte("tenant-hash", "abc", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"tenant": "ba7816bf8f01"}
    assert "ba7816bf8f01" in pte("tenant-hash", "abc").stdout  # the table
    piped = subprocess.run(
        [sys.executable, "-m", "pte_instrument.cli.main", "tenant-hash", "-", "--json"],
        input="abc\n",
        capture_output=True,
        text=True,
    )
    assert json.loads(piped.stdout) == {"tenant": "ba7816bf8f01"}  # the key from stdin, newline not hashed


def test_tenant_hash_of_a_key_that_is_not_utf8_hashes_its_bytes_as_the_server_does():
    """The server hashes the bearer token's bytes; such a key, given or piped, was a traceback."""
    key = b"ab\xff\xfecd"
    tenant = hashlib.sha256(key).hexdigest()[:12]
    cmd = [sys.executable, "-m", "pte_instrument.cli.main", "tenant-hash"]
    piped = subprocess.run([*cmd, "-", "--json"], input=key + b"\r\n", capture_output=True)
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout) == {"tenant": tenant}
    given = subprocess.run([*cmd, key, "--json"], capture_output=True)  # argv bytes, as a shell passes them
    assert given.returncode == 0, given.stderr
    assert json.loads(given.stdout) == {"tenant": tenant}


def test_tenant_hash_without_a_key_is_one_line():
    r = pte("tenant-hash", "")
    assert r.returncode == 2 and "no API key" in r.stderr and len(r.stderr.strip().splitlines()) == 1
