"""An exporter that keeps failing on a real server: after 100 faults in a row it is switched
off with one log line, ``pte_exporter_enabled{stage}`` (the series the
``PteInstrumentExporterSwitchedOff`` alert reads) drops from 1 to 0 on ``/metrics``, and
the other exporters and serving go on."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from pte_instrument.server.accountant import MAX_CONSECUTIVE_FAULTS
from tests.conftest import scrape
from tests.e2e.conftest import serving
from tests.helpers import jsonl, wait

SWITCHED_OFF_LINE = "exporter 'prometheus' failed"


def exporters_enabled(client: httpx.Client) -> dict[str, float]:
    return {dict(labels)["stage"]: v for (name, labels), v in scrape(client).items()
            if name == "pte_exporter_enabled"}  # fmt: skip


def faults(client: httpx.Client, stage: str) -> float:
    return sum(v for (name, labels), v in scrape(client).items()
               if name == "pte_plugin_faults_total" and dict(labels)["stage"] == stage)  # fmt: skip


def test_an_exporter_failing_100_times_in_a_row_is_switched_off_and_reported(tiny_model, tmp_path):
    log = tmp_path / "requests.jsonl"
    env = {"PTE_FAILPOINTS": "prometheus:1", "PTE_REQUEST_LOG": str(log)}  # every Prometheus export fails
    with serving(tiny_model, tmp_path, env, []) as (vllm, client):
        assert exporters_enabled(client) == {"prometheus": 1, "efficiency": 1, "request_log": 1}
        n = MAX_CONSECUTIVE_FAULTS + 10
        body = {"model": vllm.served_name, "prompt": "switch off", "max_tokens": 1}

        def complete(i: int) -> int:
            return client.post("/v1/completions", json={**body, "prompt": f"switch off {i}"}).status_code

        with ThreadPoolExecutor(8) as pool:
            assert set(pool.map(complete, range(n))) == {200}
        assert wait(lambda: len(jsonl(log)) == n, timeout_s=60), len(jsonl(log))  # the request log kept going
        assert exporters_enabled(client) == {"prometheus": 0, "efficiency": 1, "request_log": 1}
        assert faults(client, "prometheus") == MAX_CONSECUTIVE_FAULTS  # not called after the switch-off
        text = vllm.log_path.read_text(errors="replace")
        assert sum(SWITCHED_OFF_LINE in line and "switched off" in line for line in text.splitlines()) == 1
        assert client.get("/health").status_code == 200
