"""A real Prometheus scrapes a real vLLM server with the plugin: every required dashboard
query returns data, ``promtool check metrics`` finds nothing to say about the
plugin's exposition, and with the shipped rule file loaded every recording rule produces
data and no alert is pending or firing.

Needs Debian's ``prometheus`` package (``scripts/install_test_deps.sh``)."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from deploy.generate import RULE_FILE
from grafana.panels import QUERIES, RATE, VARIABLES
from prometheus.rules import ALERTS, GROUPS, RECORDING, Recording
from pte_instrument.devtools.serving import free_port
from pte_instrument.devtools.workload import WorkloadConfig, run_workload
from tests import exposition
from tests.conftest import scrape, start_server
from tests.exposition import metric_sum
from tests.test_prometheus_rules import level_labels

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
pytestmark = [
    pytest.mark.skipif(
        not (Path(PROMETHEUS).exists() and Path(PROMTOOL).exists()),
        reason="no prometheus/promtool binary: run scripts/install_test_deps.sh (apt-get install prometheus)",
    ),
]
IDLE_TTL_S = 2.0  # sessions close soon after the workload, so session histograms get observed
SCRAPE_S = 1

# promtool findings we know about and accept for now, each with its reason (none today):
# {"<exact promtool output line>": "<why it is accepted>"}.
KNOWN_PROMTOOL_FINDINGS: dict[str, str] = {}


def wait_until(what: str, check: Callable[[], bool], timeout_s: float = 60.0, every_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(every_s)


class Prometheus:
    """Debian's Prometheus, scraping one target every second, with its TSDB in tmp."""

    def __init__(self, workdir: Path, target: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {SCRAPE_S}s\n"
            f"  scrape_timeout: {SCRAPE_S}s\n"
            f"  evaluation_interval: {SCRAPE_S}s\n"
            f"rule_files:\n  - '{RULE_FILE}'\n"
            "scrape_configs:\n"
            "  - job_name: vllm\n"
            "    metrics_path: /metrics\n"
            "    static_configs:\n"
            f"      - targets: ['{target}']\n"
        )
        self.log_path = workdir / "prometheus.log"
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.started = time.time()
        self.client = httpx.Client(base_url=self.url, timeout=10)
        wait_until("Prometheus ready", self._ready, timeout_s=60)
        wait_until("the vLLM target to be scraped and up", self._target_up, timeout_s=60)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
        try:
            return self.client.get("/-/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def _target_up(self) -> bool:
        targets = self.client.get("/api/v1/targets").json()["data"]["activeTargets"]
        return bool(targets) and all(t["health"] == "up" for t in targets)

    def query(self, expr: str) -> dict:
        r = self.client.get("/api/v1/query", params={"query": expr})
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr!r}: {body}"
        return body["data"]

    def value(self, expr: str) -> float:
        result = self.query(expr)["result"]
        return float(result[0]["value"][1]) if result else float("nan")

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict]:
        r = self.client.get(
            "/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": step_s}
        )
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr!r}: {body}"
        return body["data"]["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        r = self.client.get(f"/api/v1/label/{label}/values", params={"match[]": match})
        assert r.status_code == 200, r.text
        return sorted(r.json()["data"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@dataclass
class Stack:
    vllm: object
    prom: Prometheus
    client: httpx.Client
    model: str


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("prometheus-e2e")
    env = {
        "VLLM_PLUGINS": "pte",  # sessions and routes
        "PTE_REQUEST_LOG": str(work / "requests.jsonl"),
        "PTE_DEVICE": "h100-sxm",
        "PTE_SESSION_IDLE_TTL_S": str(IDLE_TTL_S),
    }
    # with the step hook: the dashboard's engine panels (seconds, γ measured) get data too
    vllm = start_server(
        tiny_model, work, env, ["--scheduler-cls", "pte_instrument.vllm_adapter.scheduler.PteScheduler"]
    )
    prom = None
    try:
        prom = Prometheus(work, f"127.0.0.1:{vllm.port}")
        with httpx.Client(base_url=vllm.url, timeout=120) as client:
            yield Stack(vllm, prom, client, vllm.served_name)
    finally:
        if prom is not None:
            prom.stop()
        vllm.stop()


def plugin_sum(client: httpx.Client, name: str) -> float:
    """Sum of a pte_* sample over its label sets, read from /metrics directly."""
    return metric_sum(scrape(client), name)


def chat(stack: Stack, headers: dict[str, str] | None = None) -> None:
    body = {
        "model": stack.model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 2,
        "ignore_eos": True,
    }
    stack.client.post("/v1/chat/completions", json=body, headers=headers or {}).raise_for_status()


def close_idle_sessions(stack: Stack, closed_before: float, sessions: int) -> None:
    """Sessions close on the stat logger's next record() after the TTL: wait, then send a
    session-less request so one happens."""
    time.sleep(IDLE_TTL_S + 1.2)
    chat(stack)
    wait_until(
        f"{sessions} more sessions closed",
        lambda: plugin_sum(stack.client, "pte_sessions_closed_total") >= closed_before + sessions,
        timeout_s=30,
    )


@pytest.fixture(scope="module")
def scraped(stack: Stack) -> Stack:
    """Traffic that makes every dashboard series move. A warm-up first creates the series
    (a counter's first sample is its baseline for rate()); the workload then increments
    them, and Prometheus scrapes before and after."""
    url, model, prom = stack.vllm.url, stack.model, stack.prom
    # Warm-up: a two-turn session (tool pause), one unusable session id (rejected).
    run_workload(url, model, WorkloadConfig(sessions=1, turns=2, max_tokens=4, seed=1))
    chat(stack, {"X-Session-Id": "x" * 200})
    close_idle_sessions(stack, closed_before=0, sessions=1)
    n_before = plugin_sum(stack.client, "pte_requests_total")
    wait_until("Prometheus to scrape the warm-up", lambda: prom.value("sum(pte_requests_total)") >= n_before)
    wait_until("Prometheus to scrape the warm-up", lambda: prom.value("sum(pte_sessions_closed_total)") >= 1)

    closed_before = plugin_sum(stack.client, "pte_sessions_closed_total")
    results = run_workload(url, model, WorkloadConfig(sessions=2, turns=3, session_header="X-Session-Id"))
    assert len(results) == 6 and all(r.output_tokens > 0 for r in results)
    for r, correct in zip(results[:2], (True, False), strict=True):  # labels for the E0 panel
        reply = stack.client.post("/pte/feedback", json={"request_id": r.request_id, "correct": correct})
        assert reply.status_code == 200, reply.text
    close_idle_sessions(stack, closed_before, sessions=2)
    n_after = plugin_sum(stack.client, "pte_requests_total")
    closed = plugin_sum(stack.client, "pte_sessions_closed_total")
    assert n_after >= n_before + 6
    wait_until("Prometheus to scrape the workload", lambda: prom.value("sum(pte_requests_total)") >= n_after)
    wait_until(
        "Prometheus to scrape the workload", lambda: prom.value("sum(pte_sessions_closed_total)") >= closed
    )
    time.sleep(2 * SCRAPE_S)  # one more scrape of everything, so rate() windows end after it
    return stack


def substitute(expr: str, variables: dict[str, str], window_s: int) -> str:
    """What Grafana sends: template variables replaced, the rate interval a window that
    covers everything this test did."""
    for name, value in variables.items():
        expr = expr.replace(f"${name}", value)
    return expr.replace(RATE, f"{window_s}s")


def dashboard_variables(stack: Stack) -> dict[str, str]:
    """The variables as Grafana fills them for this server (every value of each)."""
    instances = stack.prom.label_values("instance", "pte_requests_total")
    return {
        "job": "vllm",
        "instance": grafana_regex(instances),
        "model_name": grafana_regex([stack.model]),
        "engine": "0",
    }


def grafana_regex(values: list[str]) -> str:
    """Grafana's rendering of a multi-value variable inside =~: each value regex-escaped,
    the backslashes doubled for PromQL's double-quoted string."""
    escaped = [re.escape(v).replace("\\", "\\\\") for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def test_template_variables_list_the_server(scraped: Stack):
    values: dict[str, str] = {}
    for v in VARIABLES:
        match = substitute(v.query.removeprefix("label_values(").rsplit(",", 1)[0], values, 60)
        found = scraped.prom.label_values(v.label_name, match)
        assert found, f"variable {v.name}: no values for {match}"
        values[v.name] = grafana_regex(found)
    assert values["job"] == "vllm"
    assert scraped.prom.label_values("model_name", "pte_requests_total") == [scraped.model]
    assert scraped.prom.label_values("engine", "pte_requests_total") == ["0"]


@pytest.mark.parametrize(
    ("title", "expr", "optional"), QUERIES, ids=[f"{t}: {e[:40]}" for t, e, _ in QUERIES]
)
def test_dashboard_query_returns_data(scraped: Stack, title: str, expr: str, optional: bool):
    window_s = int(time.time() - scraped.prom.started) + 10
    data = scraped.prom.query(
        substitute(expr, dashboard_variables(scraped), window_s)
    )  # parses and evaluates
    result = data["result"]
    if optional:
        return  # valid PromQL over a metric that does not exist yet: empty is expected
    assert result, f"{title}: no data for {expr!r}"
    values = [float(r["value"][1]) for r in result]
    assert any(math.isfinite(v) for v in values), f"{title}: only NaN/Inf for {expr!r}: {result}"


def test_pte_series_join_vllm_series_on_model_name_and_engine(scraped: Stack):
    """vLLM's label names and values: a pte_* series divides by a vllm:* series with
    ``on (model_name, engine)`` and the result is the ratio of the two read apart."""
    pte = "sum by (model_name, engine) (pte_output_tokens_total)"
    vllm = "sum by (model_name, engine) (vllm:generation_tokens_total)"
    joined = scraped.prom.query(f"{pte} / on (model_name, engine) {vllm}")["result"]
    assert [r["metric"] for r in joined] == [{"model_name": scraped.model, "engine": "0"}]
    # Both count the same generated tokens of the same finished requests.
    assert float(joined[0]["value"][1]) == pytest.approx(scraped.prom.value(pte) / scraped.prom.value(vllm))
    assert scraped.prom.value(pte) > 0
    kv = scraped.prom.query(
        "pte_requests_total * on (model_name, engine) group_left () vllm:kv_cache_usage_perc"
    )["result"]
    assert kv and all(r["metric"]["model_name"] == scraped.model for r in kv)


def test_promtool_finds_nothing_in_the_plugin_exposition(scraped: Stack):
    text = exposition.only(scraped.client.get("/metrics").text)
    assert "pte_session_served_pte_bucket" in text and "pte_requests_total" in text
    proc = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    findings = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    unexpected = [f for f in findings if f not in KNOWN_PROMTOOL_FINDINGS]
    assert not unexpected, "promtool check metrics:\n" + "\n".join(unexpected)
    if not findings:
        assert proc.returncode == 0
    elif KNOWN_PROMTOOL_FINDINGS:
        pytest.xfail("known promtool findings: " + "; ".join(KNOWN_PROMTOOL_FINDINGS[f] for f in findings))


# --- the shipped rule file (prometheus/pte-rules.yml), loaded by this Prometheus ---

# Alerts that may be pending or firing on this healthy server, each with its reason (none today):
# {"<alertname>": "<why>"}.
KNOWN_ALERTS: dict[str, str] = {}
# Recorded series that must be above 0 here: traffic went through the step hook. (The taxes,
# wasted work and the engine gap may rightly be 0 on this server.)
POSITIVE_HERE = {
    "model_name:pte_requests:rate5m",
    "model_name:pte_served_pte:rate5m",
    "model_name_phase:pte_served_pte:rate5m",
    "model_name_engine:pte_served_pte:rate5m",
    "model_name:pte_reference_pte:rate5m",
    "model_name:pte_ideal_pte:rate5m",
    "model_name:pte_engine_served_pte:rate5m",
    "model_name:pte_gpu_seconds:rate5m",
    "model_name_phase:pte_gpu_seconds:rate5m",
}


def test_the_rule_file_loads_and_every_rule_evaluates(scraped: Stack):
    groups = scraped.prom.client.get("/api/v1/rules").json()["data"]["groups"]  # sorted by name
    loaded = {g["name"]: [r["name"] for r in g["rules"]] for g in groups}
    assert loaded == {
        g.name: [r.record if isinstance(r, Recording) else r.alert for r in g.rules] for g in GROUPS
    }
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == len(RECORDING) + len(ALERTS)
    for r in rules:
        assert r["health"] == "ok", f"{r['name']}: {r.get('lastError')}"
        assert not r["lastEvaluation"].startswith("0001-"), f"{r['name']} was never evaluated"


@pytest.mark.parametrize("rule", RECORDING, ids=lambda r: r.record)
def test_every_recording_rule_produces_data(scraped: Stack, rule: Recording):
    series = scraped.prom.query_range(rule.record, scraped.prom.started, time.time(), SCRAPE_S)
    if rule.empty_on_test_server is not None:  # no money without a price: no series at all, not $0
        assert not series, f"{rule.record} is no longer {rule.empty_on_test_server}: {series[:1]}"
        return
    assert series, f"{rule.record}: no data"
    model = scraped.model
    for s in series:
        labels = {k: v for k, v in s["metric"].items() if k != "__name__"}
        assert labels.keys() == level_labels(rule.record), f"{rule.record}: labels {sorted(labels)}"
        assert labels["model_name"] == model
    values = [float(v) for s in series for _, v in s["values"]]
    finite = [v for v in values if math.isfinite(v)]
    assert finite, f"{rule.record}: only NaN/Inf"
    if rule.record in POSITIVE_HERE:
        assert max(finite) > 0, f"{rule.record}: never above 0"


def test_no_alert_is_pending_or_firing_on_a_healthy_server(scraped: Stack):
    window_s = int(time.time() - scraped.prom.started) + 10
    seen = scraped.prom.query(f"max_over_time(ALERTS[{window_s}s])")["result"]
    unexpected = [s["metric"] for s in seen if s["metric"]["alertname"] not in KNOWN_ALERTS]
    assert not unexpected, f"alerts on a healthy server: {unexpected}"


def test_every_exporter_is_on_and_says_so(scraped: Stack):
    """The series PteInstrumentExporterSuspended reads: 1 for each exporter this server has."""
    result = scraped.prom.query("pte_exporter_enabled")["result"]
    assert {r["metric"]["stage"]: float(r["value"][1]) for r in result} == {
        "prometheus": 1.0,
        "efficiency": 1.0,
        "request_log": 1.0,
    }
    assert {r["metric"]["model_name"] for r in result} == {scraped.model}
