"""How the plugin coexists with vLLM's other plugins. ``VLLM_PLUGINS`` is an allow-list for
every plugin group: naming only ``pte`` turns off vLLM's own LoRA resolvers (and any other
installed plugin), so the README shows the form that keeps them. Checked against real
servers: ``VLLM_PLUGINS=pte,lora_filesystem_resolver`` loads both, with routes and sessions;
``--middleware …SessionMiddleware`` tracks sessions with ``VLLM_PLUGINS`` unset (no routes)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from tests.conftest import EAGER
from tests.helpers import wait

KEEP_LORA = "pte,lora_filesystem_resolver"
MIDDLEWARE = "pte_instrument.vllm_adapter.endpoints.SessionMiddleware"

# What vLLM's loader lets through for each VLLM_PLUGINS value, in one process (importing vLLM is slow).
LOADER_PROBE = """
import json, os, sys
from vllm.plugins import load_endpoint_plugins, load_plugins_by_group
out = {}
for value in json.loads(sys.argv[1]):
    os.environ.pop("VLLM_PLUGINS", None)
    if value is not None:
        os.environ["VLLM_PLUGINS"] = value
    out[str(value)] = {
        "general": sorted(load_plugins_by_group("vllm.general_plugins")),
        "stat_logger": sorted(load_plugins_by_group("vllm.stat_logger_plugins")),
        "endpoint": sorted(p.name for p in load_endpoint_plugins()),
    }
print(json.dumps(out))
"""


def loader_view(values: Sequence[str | None]) -> dict[str, dict[str, list[str]]]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    done = subprocess.run(
        [sys.executable, "-c", LOADER_PROBE, json.dumps(list(values))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_vllm_plugins_is_an_allow_list_for_every_group():
    view = loader_view([None, "pte", KEEP_LORA, "pte, lora_filesystem_resolver"])
    unset = view["None"]
    assert {"pte", "lora_filesystem_resolver", "lora_hf_hub_resolver"} <= set(unset["general"])
    assert unset["endpoint"] == []  # endpoint plugins only when named
    assert view["pte"] == {
        "general": ["pte"],
        "stat_logger": ["pte"],
        "endpoint": ["pte"],
    }  # LoRA resolvers off
    assert view[KEEP_LORA]["general"] == ["lora_filesystem_resolver", "pte"]
    assert view[KEEP_LORA]["endpoint"] == ["pte"]
    # vLLM splits on "," without stripping: a space drops the name after it
    assert view["pte, lora_filesystem_resolver"]["general"] == ["pte"]


PLUGIN_GROUP = re.compile(r"^\((?P<process>[^)]*)\) .*Available plugins for group (?P<group>\S+):")
PLUGIN_LOADED = re.compile(r"^\((?P<process>[^)]*)\) .*Loading plugin (?P<name>\S+)")


def loaded_plugins(log: str) -> dict[str, set[str]]:
    """Plugin group → the names vLLM logged loading ("Loading plugin <name>", after the
    group's "Available plugins for group <group>:" line in the same process)."""
    current: dict[str, str] = {}  # process → the group it is loading
    out: dict[str, set[str]] = {}
    for line in log.splitlines():
        if m := PLUGIN_GROUP.match(line):
            current[m["process"]] = m["group"]
        elif (m := PLUGIN_LOADED.match(line)) and m["process"] in current:
            out.setdefault(current[m["process"]], set()).add(m["name"])
    return out


def launch(
    tiny_model: Path,
    work: Path,
    env: dict[str, str],
    extra_args: Sequence[str] = (),
    unset: Sequence[str] = (),
):
    from pte_instrument.devtools.serving import VllmServer

    server = VllmServer(
        tiny_model,
        log_path=work / "vllm.log",
        env=env,
        extra_args=["--enable-prefix-caching", EAGER, *extra_args],
    )
    for name in unset:  # the server's environment starts from this process's
        server.env.pop(name, None)
    return server.start()


def run_session(client: httpx.Client, model: str, sid: str, turns: int) -> list[str]:
    """``turns`` chat turns of one session, each prompt extending the last; the response ids."""
    history = "You are an agent. " + " ".join(random.choice(["alpha", "beta", "gamma"]) for _ in range(250))
    ids = []
    for t in range(turns):
        history += f" Turn {t}: call the tool."
        r = client.post(
            "/v1/chat/completions",
            headers={"X-Session-Id": sid},
            json={
                "model": model,
                "messages": [{"role": "user", "content": history}],
                "max_tokens": 4,
                "ignore_eos": True,
                "temperature": 0.0,
            },
        )
        r.raise_for_status()
        ids.append(r.json()["id"])
    return ids


def logged(request_log: Path, ids: list[str]) -> dict[str, dict]:
    """Request-log entries of ``ids`` once all are written (the stat logger records just after
    the response is sent)."""
    found: dict[str, dict] = {}

    def complete() -> bool:
        if request_log.exists():
            for line in request_log.read_text().splitlines():
                rec = json.loads(line)
                if rec["request_id"] in ids:
                    found[rec["request_id"]] = rec
        return len(found) == len(ids)

    assert wait(complete, timeout_s=15), found
    return found


@pytest.fixture(scope="module")
def keep_lora_server(tiny_model, tmp_path_factory) -> Iterator:
    """VLLM_PLUGINS naming pte and vLLM's filesystem LoRA resolver; DEBUG logging, at which
    vLLM logs the general plugins a process it starts with ``spawn`` loads (the CPU build's
    way: the suite's other servers fork their engine process, which loads none of its own)."""
    work = tmp_path_factory.mktemp("keep-lora")
    env = {
        "VLLM_PLUGINS": KEEP_LORA,
        "VLLM_LOGGING_LEVEL": "DEBUG",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "VLLM_LORA_RESOLVER_CACHE_DIR": str(work),  # gives the resolver a directory to register on
        "PTE_REQUEST_LOG": str(work / "requests.jsonl"),
    }
    server = launch(tiny_model, work, env)
    try:
        yield server
    finally:
        server.stop()


def test_both_named_plugins_load_with_routes_and_sessions(keep_lora_server):
    server = keep_lora_server
    log = server.log_path.read_text(errors="replace")
    loaded = loaded_plugins(log)
    assert loaded["vllm.general_plugins"] == {"pte", "lora_filesystem_resolver"}  # hf_hub: not named, off
    assert loaded["vllm.stat_logger_plugins"] == loaded["vllm.endpoint_plugins"] == {"pte"}
    assert "Loaded endpoint plugin pte" in log

    sid = f"keep-lora-{random.getrandbits(32):x}"
    with httpx.Client(base_url=server.url, timeout=120) as client:
        ids = run_session(client, server.served_name, sid, turns=2)
        summary = client.get("/pte/summary")
        assert summary.status_code == 200, summary.text
        # the session exists from its first turn on; its second is priced just after its answer
        assert wait(lambda: client.get(f"/pte/sessions/{sid}").json().get("turns") == 2)
    records = logged(Path(server.env["PTE_REQUEST_LOG"]), ids)
    assert [(records[i]["session_id"], records[i]["turn"]) for i in ids] == [(sid, 1), (sid, 2)]


def test_middleware_flag_tracks_sessions_without_vllm_plugins(tiny_model, tmp_path):
    """``--middleware`` adds the session middleware (vLLM calls ``SessionMiddleware(app)``)
    with VLLM_PLUGINS unset, so no other plugin is turned off; the /pte/* routes need the
    endpoint plugin and are absent."""
    log = tmp_path / "requests.jsonl"
    server = launch(
        tiny_model,
        tmp_path,
        {"PTE_REQUEST_LOG": str(log)},
        ["--middleware", MIDDLEWARE],
        unset=["VLLM_PLUGINS"],
    )
    try:
        assert "but VLLM_PLUGINS is not set" in server.log_path.read_text(errors="replace")
        sid = f"middleware-{random.getrandbits(32):x}"
        with httpx.Client(base_url=server.url, timeout=120) as client:
            ids = run_session(client, server.served_name, sid, turns=2)
            untagged = client.post(
                "/v1/chat/completions",
                json={
                    "model": server.served_name,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                },
            )
            untagged.raise_for_status()
            assert client.get("/pte/summary").status_code == 404
        records = logged(log, [*ids, untagged.json()["id"]])
        assert [(records[i]["session_id"], records[i]["turn"]) for i in ids] == [(sid, 1), (sid, 2)]
        assert records[untagged.json()["id"]]["session_id"] is None
        # the second turn reused the first's KV: the session ledger priced it as a turn
        second = records[ids[1]]
        assert second["pte_ideal"] < second["pte_reference"]
    finally:
        server.stop()
