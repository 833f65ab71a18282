"""Exporters that fail on a real server. One that fails 100 times in a row is suspended with
one log line and ``pte_exporter_enabled{stage}`` (the series the
``PteInstrumentExporterSuspended`` alert reads) drops from 1 to 0; it is retried with
back-off and resumes by itself once its fault is gone. Every priced record an exporter does
not deliver is counted in ``pte_exporter_records_lost_total{stage}``, so written + lost =
priced across a fault and its recovery; OTLP batches a collector never takes are faults of
their stage. Serving goes on throughout."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import httpx

from pte_instrument.server.pricer import MAX_CONSECUTIVE_FAULTS
from tests.conftest import scrape
from tests.e2e.conftest import serving
from tests.helpers import jsonl, wait

SUSPENDED_LINE = "failed 100 times in a row"


def by_stage(client: httpx.Client, family: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (name, labels), v in scrape(client).items():
        if name == family:
            stage = dict(labels)["stage"]
            out[stage] = out.get(stage, 0.0) + v
    return out


def priced(client: httpx.Client) -> float:
    return sum(v for (name, _), v in scrape(client).items() if name == "pte_requests_total")


def completions(client: httpx.Client, model: str, n: int, tag: str) -> int:
    """Send ``n`` requests, 8 at a time; returns ``n`` once each is answered (its pricing
    follows on the pricer thread)."""

    def complete(i: int) -> int:
        body = {"model": model, "prompt": f"{tag} {i}", "max_tokens": 1}
        return client.post("/v1/completions", json=body).status_code

    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(complete, range(n))) == {200}
    return n


def test_an_exporter_failing_100_times_in_a_row_is_suspended_and_every_record_it_misses_counted(
    tiny_model, tmp_path
):
    log = tmp_path / "requests.jsonl"
    env = {"PTE_FAILPOINTS": "prometheus:1", "PTE_REQUEST_LOG": str(log)}  # every Prometheus export fails
    with serving(tiny_model, tmp_path, env, []) as (vllm, client):
        assert by_stage(client, "pte_exporter_enabled") == {
            "prometheus": 1,
            "efficiency": 1,
            "request_log": 1,
        }
        n = MAX_CONSECUTIVE_FAULTS + 10
        completions(client, vllm.served_name, n, "suspend")
        assert wait(lambda: len(jsonl(log)) == n, timeout_s=60), len(jsonl(log))  # the request log kept going
        assert by_stage(client, "pte_exporter_enabled") == {
            "prometheus": 0,
            "efficiency": 1,
            "request_log": 1,
        }
        faults = by_stage(client, "pte_plugin_faults_total")["prometheus"]
        assert MAX_CONSECUTIVE_FAULTS <= faults < n  # the suspended exporter is only retried now and then
        lost = by_stage(client, "pte_exporter_records_lost_total")
        assert lost == {"prometheus": n, "efficiency": 0, "request_log": 0}  # every record, none else
        text = vllm.log_path.read_text(errors="replace")
        assert sum(SUSPENDED_LINE in line and "'prometheus'" in line for line in text.splitlines()) == 1
        assert client.get("/health").status_code == 200


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_transient_fault_and_its_recovery_leave_written_plus_lost_equal_to_priced(tiny_model, tmp_path):
    blocker = tmp_path / "logs"
    blocker.write_text("a file where the request log's directory should be")
    log = blocker / "requests.jsonl"
    env = {
        "VLLM_PLUGINS": "pte",  # the /pte/* routes
        "PTE_REQUEST_LOG": str(log),
        # a collector that is not there: every OTLP batch fails, quickly
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_BLRP_SCHEDULE_DELAY": "200",
        "OTEL_METRIC_EXPORT_INTERVAL": "1000",
    }
    with serving(tiny_model, tmp_path, env, []) as (vllm, client):
        sent = completions(client, vllm.served_name, MAX_CONSECUTIVE_FAULTS + 5, "blocked")
        assert wait(lambda: priced(client) == sent, timeout_s=60), (priced(client), sent)
        assert by_stage(client, "pte_exporter_enabled")["request_log"] == 0
        blocker.unlink()  # the fault goes away: the log resumes at a retry, with no restart

        def resumed() -> bool:
            nonlocal sent
            sent += completions(client, vllm.served_name, 2, "recovered")
            return by_stage(client, "pte_exporter_enabled")["request_log"] == 1

        assert wait(resumed, timeout_s=120, interval_s=0.5)
        sent += completions(client, vllm.served_name, 10, "after")
        assert wait(lambda: priced(client) == sent, timeout_s=60), (priced(client), sent)  # all of them
        total = sent

        def accounted() -> bool:
            summary = client.get("/pte/summary").json()["request_log"]
            lost = by_stage(client, "pte_exporter_records_lost_total")
            return summary["written"] + summary["lost"] == total and lost["request_log"] == summary["lost"]

        assert wait(accounted, timeout_s=30), (client.get("/pte/summary").json()["request_log"], total)
        summary = client.get("/pte/summary").json()["request_log"]
        assert summary["written"] == len(jsonl(log)) >= 11 and summary["lost"] >= MAX_CONSECUTIVE_FAULTS
        # OTLP: every span and log record was in a batch the collector never took, and counted
        assert wait(
            lambda: by_stage(client, "pte_exporter_records_lost_total")["otel"] == total, timeout_s=60
        )
        assert wait(
            lambda: by_stage(client, "pte_exporter_records_lost_total")["otel_logs"] == total, timeout_s=60
        )
        faults = by_stage(client, "pte_plugin_faults_total")
        assert faults["otel"] > 0 and faults["otel_logs"] > 0
        assert wait(lambda: by_stage(client, "pte_plugin_faults_total")["otel_metrics"] > 0, timeout_s=30)
        text = vllm.log_path.read_text(errors="replace")
        assert sum("'request_log' resumed" in line for line in text.splitlines()) == 1
        assert client.get("/health").status_code == 200
        print(f"\nrequest log: {summary}; priced {total:.0f}; faults {faults}")
