"""An engine on another node: data parallelism with engine 1 started ``--headless`` as a
command of its own (its own environment, working and temporary directory, nothing inherited
from the API server, as on a second node). With ``PTE_ENGINE_TRANSPORT=tcp`` on both nodes,
its hook reaches the API server over TCP at the address both derive from vLLM's
data-parallel settings: its requests carry exact engine totals, none left unjoined, no fault."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pte_instrument.devtools.serving import CPU_DEFAULT_ARGS, VllmServer, free_port
from tests.conftest import EAGER, scrape
from tests.e2e.test_scale_out import complete
from tests.e2e.test_vllm_plugin import words
from tests.exposition import metric_sum
from tests.helpers import jsonl, wait

HOOK = ["--scheduler-cls", "pte_instrument.vllm_adapter.scheduler.PteScheduler"]


@pytest.fixture(scope="module")
def two_nodes(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("head")
    other = tmp_path_factory.mktemp("other-node")
    rpc = free_port()
    dp = [
        "--data-parallel-size",
        "2",
        "--data-parallel-size-local",
        "1",
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(rpc),
    ]
    node_env = {k: v for k, v in os.environ.items() if not k.startswith(("PTE_", "VLLM_", "PROMETHEUS_"))}
    # and a malformed setting, which no API server on that node is there to name
    node_env.update(
        TMPDIR=str(other),
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # the model in the engine process, as the head's
        PTE_ENGINE_TRANSPORT="tcp",
        PTE_MAX_SESSIONS="many",
    )
    command = [
        sys.executable,
        "-m",
        "pte_instrument.vllm_adapter.serve",
        str(tiny_model),
        "--served-model-name",
        "tiny",
        "--headless",
        EAGER,
        "--data-parallel-start-rank",
        "1",
        *dp,
        *HOOK,
        *CPU_DEFAULT_ARGS,  # as the head's: the same dtype, so both price alike
    ]
    headless = subprocess.Popen(
        command,
        cwd=other,
        env=node_env,
        stdout=(other / "engine.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log = work / "requests.jsonl"
    head = VllmServer(
        tiny_model,
        log_path=work / "vllm.log",
        env={"PTE_REQUEST_LOG": str(log), "PTE_ENGINE_TRANSPORT": "tcp", "VLLM_PLUGINS": "pte"},
        extra_args=["--enable-prefix-caching", EAGER, "--api-server-count", "1", *dp, *HOOK],
    )
    try:
        head.start()
        yield head, log, other / "engine.log"
    finally:
        head.stop()
        os.killpg(os.getpgid(headless.pid), 9)
        headless.wait()


def test_a_headless_engine_on_another_node_reports_its_totals(two_nodes):
    head, log, _ = two_nodes
    rng = random.Random(5)
    prompts = [words(rng, rng.randint(20, 200)) for _ in range(24)]
    with ThreadPoolExecutor(8) as pool:  # concurrent: the balancer uses both engines
        responses = list(pool.map(lambda p: complete(head.url, p, 8), prompts))
    assert wait(lambda: len(jsonl(log)) == len(responses), timeout_s=30)
    records = jsonl(log)
    with httpx.Client(base_url=head.url, timeout=10) as client:
        summary = client.get("/pte/summary").json()
        m = scrape(client)
    assert {r["engine"] for r in records} == {0, 1}
    # which requests, and what the join said of them (its faults name why it gave up)
    lost = [
        (r["request_id"], r["engine"], r["finished_at"]) for r in records if r["engine_pte_served"] is None
    ]
    assert not lost, (lost, summary["faults"], summary["engine_hook"], head.log_path.read_text()[-4000:])
    for r in records:
        assert r["engine_pte_served"] == pytest.approx(r["pte_served"], rel=1e-9)
    hook = summary["engine_hook"]
    assert hook["engines"] == [0, 1] and hook["results_unjoined"] == 0 and hook["requests_waiting"] == 0
    assert metric_sum(m, "pte_engine_served_pte_total", engine="1") == pytest.approx(
        metric_sum(m, "pte_served_pte_total", engine="1"), rel=1e-9
    )
    assert metric_sum(m, "pte_engine_served_pte_total", engine="1") > 0
    faults = {dict(k[1])["stage"]: v for k, v in m.items() if k[0] == "pte_plugin_faults_total"}
    assert not any(faults.values()), faults


def test_a_headless_node_names_its_malformed_settings_once(two_nodes):
    *_, node_log = two_nodes
    text = node_log.read_text(errors="replace")
    said = [line for line in text.splitlines() if "pte-instrument configuration: PTE_MAX_SESSIONS" in line]
    assert len(said) == 1 and "'many'" in said[0], said
