"""Shared fixtures. Tests that concern vLLM start a real engine (the CPU build) on the tiny
locally generated model and talk to it over HTTP; start-up takes about a minute, so one
server is shared by every test that does not need its own configuration."""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.exposition import samples
from tests.helpers import jsonl

if TYPE_CHECKING:
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord
    from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / "models" / "tiny"

# Every process the suite starts (vLLM servers above all) loads tests/vllm_site/sitecustomize.py:
# vLLM's idle polling shortened, so that a server that just answered does not starve the others.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT / "tests" / "vllm_site"), os.environ.get("PYTHONPATH", "")) if p
)

# vLLM's CPU build runs the model in a worker process of its own (its multiprocessing executor)
# unless VLLM_ENABLE_V1_MULTIPROCESSING is 0; then the engine process runs it, as a server on
# one GPU does, and a start-up imports vLLM in two processes instead of three (the slowest part
# of a start-up). tests/e2e/test_engine_hook_e2e.py keeps the CPU build's default.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


# The test files that use a session-wide server fixture: under pytest-xdist each fixture's
# files run in one worker together, so that its server starts once (a file that uses one and
# is not named under it is an error).
SERVER_GROUPS = {
    "server": {
        "tests/e2e/test_otel_e2e.py",
        "tests/e2e/test_routes_hostile.py",
        "tests/e2e/test_sessions_e2e.py",
        "tests/e2e/test_vllm_plugin.py",
    },
    "timed_server": {
        "tests/e2e/test_gpu_seconds_e2e.py",
        "tests/e2e/test_harness_e2e.py",
    },
}


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The serial run (``-m alone``) skips the test files that mark no test ``alone``, unread:
    some import vLLM, which takes seconds."""
    if config.getoption("markexpr") == "alone" and collection_path.suffix == ".py":
        name = collection_path.name
        if name.startswith("test_") and "mark.alone" not in collection_path.read_text(errors="replace"):
            return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        for fixture, files in SERVER_GROUPS.items():
            if fixture in item.fixturenames and path not in files:
                raise pytest.UsageError(f"{path} uses the {fixture!r} fixture: name it in SERVER_GROUPS")
    # Files are handed to the workers in this order: those that start vLLM servers (most of
    # the suite's time, a few tests each) first, so that the many short files fill the end and
    # both workers finish together.
    items.sort(key=lambda item: not item.nodeid.startswith("tests/e2e/"))


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under ``--dist loadfile``, the files of each SERVER_GROUPS entry go to one worker
    together, in collection order (``pytest_collection_modifyitems``)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False  # in collection order, not by number of tests

    group_of = {path: fixture for fixture, files in SERVER_GROUPS.items() for path in files}

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return group_of.get(path, path)

    return Scheduling(config, log)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from pte_instrument.devtools.tinymodel import build_model

    return build_model(TINY_MODEL, "tiny", seed=0)


# Test servers run the model eagerly: compiling it is vLLM's concern, not the plugin's, and
# takes 15–40 s of each start-up on this machine.
EAGER = "--enforce-eager"


def start_server(tiny_model: Path, workdir: Path, env: dict[str, str], extra_args: list[str] | None = None):
    from pte_instrument.devtools.serving import VllmServer

    return VllmServer(
        tiny_model,
        log_path=workdir / "vllm.log",
        env=env,
        extra_args=["--enable-prefix-caching", EAGER, *(extra_args or [])],
    ).start()


API_KEY = "test-key"


class OtlpReceiver:
    """An in-process OTLP/HTTP receiver of traces (``/v1/traces``), logs (``/v1/logs``) and
    metrics (``/v1/metrics``): decodes the protobuf export requests."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        spans, logs = self.spans, self.logs = [], []
        # Metric points by series, the latest only: the server exports every 300 ms for the
        # whole test session, and cumulative temporality puts every observation in the latest.
        points: dict[str, dict[str, Any]] = {}
        self.points = points

        def take_spans(body: bytes) -> None:
            request = ExportTraceServiceRequest.FromString(body)
            spans.extend(_span(sp) for _, sp in _items(request.resource_spans, "scope_spans", "spans"))

        def take_logs(body: bytes) -> None:
            request = ExportLogsServiceRequest.FromString(body)
            logs.extend(
                _log_record(lr, resource)
                for resource, lr in _items(request.resource_logs, "scope_logs", "log_records")
            )

        def take_metrics(body: bytes) -> None:
            request = ExportMetricsServiceRequest.FromString(body)
            for resource, m in _items(request.resource_metrics, "scope_metrics", "metrics"):
                for point in _metric_points(m, resource):
                    series = json.dumps(
                        [point["name"], point["resource"], point["attributes"]], sort_keys=True
                    )
                    points[series] = point

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path.endswith("/v1/logs"):
                    take_logs(body)
                elif self.path.endswith("/v1/metrics"):
                    take_metrics(body)
                else:
                    take_spans(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.endpoint, self.logs_endpoint = f"{base}/v1/traces", f"{base}/v1/logs"
        self.metrics_endpoint = f"{base}/v1/metrics"

    def span_for(self, response_id: str, timeout_s: float = 10.0) -> dict | None:
        return self._find(
            self.spans, lambda a: a.get("gen_ai.response.id") == response_id and "pte.served" in a, timeout_s
        )

    def log_for(self, request_id: str, timeout_s: float = 10.0) -> dict | None:
        return self._find(self.logs, lambda a: a.get("request_id") == request_id, timeout_s)

    def latest_point(self, name: str, **attributes) -> dict | None:
        """The most recent data point of metric ``name`` whose attributes include ``attributes``
        (cumulative temporality: it holds every observation so far)."""
        found = [
            p
            for p in self.points.copy().values()
            if p["name"] == name and all(p["attributes"].get(k) == v for k, v in attributes.items())
        ]
        return max(found, key=lambda p: p["time"], default=None)

    @staticmethod
    def _find(items: list[dict], match, timeout_s: float) -> dict | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for item in list(items):
                if match(item["attributes"]):
                    return item
            time.sleep(0.1)
        return None


def _any_value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_any_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def _attributes(key_values: Iterable[KeyValue]) -> dict[str, Any]:
    return {a.key: _any_value(a.value) for a in key_values}


def _items(resources: Iterable[Any], scopes: str, items: str) -> Iterator[tuple[dict[str, Any], Any]]:
    """(its resource's attributes, item) for each item of an OTLP export request: every signal
    nests its spans, log records or metrics by resource, then by instrumentation scope."""
    for r in resources:
        resource = _attributes(r.resource.attributes)
        for scope in getattr(r, scopes):
            for item in getattr(scope, items):
                yield resource, item


def _span(sp: Span) -> dict[str, Any]:
    """A received span as the tests read it: times in ns since the epoch, ids in hex."""
    return dict(
        name=sp.name,
        start=sp.start_time_unix_nano,
        end=sp.end_time_unix_nano,
        attributes=_attributes(sp.attributes),
        trace_id=sp.trace_id.hex(),
        span_id=sp.span_id.hex(),
        parent_span_id=sp.parent_span_id.hex(),
        kind=sp.kind,
        status=sp.status.code,
        status_message=sp.status.message,
    )


def _log_record(lr: LogRecord, resource: dict[str, Any]) -> dict[str, Any]:
    """A received log record, with the attributes of the resource that sent it."""
    return dict(
        event_name=lr.event_name,
        time=lr.time_unix_nano,
        severity=lr.severity_text,
        body=_any_value(lr.body),
        attributes=_attributes(lr.attributes),
        resource=resource,
    )


def _metric_points(m: Metric, resource: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """One entry per data point: histograms with count, sum and buckets, sums with value."""
    kind = m.WhichOneof("data")
    for dp in getattr(m, kind).data_points:
        point = {
            "name": m.name,
            "unit": m.unit,
            "kind": kind,
            "time": dp.time_unix_nano,
            "attributes": _attributes(dp.attributes),
            "resource": resource,
        }
        if kind == "histogram":
            point.update(
                count=dp.count,
                sum=dp.sum,
                bounds=list(dp.explicit_bounds),
                bucket_counts=list(dp.bucket_counts),
            )
        else:
            point["value"] = getattr(dp, dp.WhichOneof("value"))
        yield point


def generation(model: str, max_tokens: int, **fields: Any) -> dict[str, Any]:
    """A request body for exactly ``max_tokens`` tokens, greedy: the same answer each time."""
    return {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, **fields}


class Server:
    def __init__(self, vllm, request_log: Path, otlp: OtlpReceiver | None = None) -> None:
        self.vllm = vllm
        self.url = vllm.url
        self.model = vllm.served_name
        self.request_log = request_log
        self.otlp = otlp
        self.client = httpx.Client(
            base_url=self.url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}
        )

    def chat(self, content: str, max_tokens: int = 8, headers: dict[str, str] | None = None, **extra) -> dict:
        messages = [{"role": "user", "content": content}]
        return self.generate("/v1/chat/completions", max_tokens, headers, messages=messages, **extra)

    def completion(
        self, prompt: str, max_tokens: int = 8, headers: dict[str, str] | None = None, **extra
    ) -> dict:
        return self.generate("/v1/completions", max_tokens, headers, prompt=prompt, **extra)

    def generate(self, route: str, max_tokens: int, headers: dict[str, str] | None, **fields) -> dict:
        r = self.client.post(route, json=generation(self.model, max_tokens, **fields), headers=headers or {})
        r.raise_for_status()
        return r.json()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        return scrape(self.client)

    def log_records(self, ids: set[str], timeout_s: float = 15.0) -> dict[str, dict]:
        """Request-log entries for ``ids``; the stat logger records a request just after
        its response is sent, so wait briefly for all of them."""
        deadline = time.monotonic() + timeout_s
        while True:
            found: dict[str, dict] = {}
            for rec in jsonl(self.request_log):
                rid = rec["request_id"]
                if rid not in ids:  # /v1/completions: vLLM appends the prompt index
                    rid = rid.rpartition("-")[0]
                if rid in ids:
                    found.setdefault(rid, []).append(rec)
            if len(found) == len(ids) or time.monotonic() > deadline:
                return found
            time.sleep(0.2)


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory) -> Iterator[Server]:
    """Every feature on: request log, sessions and routes (VLLM_PLUGINS names pte, and
    vLLM's filesystem LoRA resolver as the README's form that keeps other plugins), OTLP
    export to an in-process receiver, an API key, and vLLM's dev routes (prefix-cache reset)."""
    work = tmp_path_factory.mktemp("server")
    log = work / "requests.jsonl"
    otlp = OtlpReceiver()
    env = {
        "PTE_REQUEST_LOG": str(log),
        "PTE_DEVICE": "h100-sxm",
        "VLLM_PLUGINS": "pte,lora_filesystem_resolver",
        "VLLM_SERVER_DEV_MODE": "1",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp.endpoint,
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",  # the receiver speaks OTLP/HTTP only
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": otlp.logs_endpoint,
        "OTEL_EXPORTER_OTLP_LOGS_PROTOCOL": "http/protobuf",
        "OTEL_BLRP_SCHEDULE_DELAY": "100",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": otlp.metrics_endpoint,
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
        "OTEL_METRIC_EXPORT_INTERVAL": "300",  # ms: the test waits for each export
    }
    vllm = start_server(tiny_model, work, env, ["--api-key", API_KEY])
    try:
        yield Server(vllm, log, otlp)
    finally:
        vllm.stop()
        otlp.httpd.shutdown()


def scrape(client: httpx.Client) -> dict[tuple[str, tuple], float]:
    """Every pte_* sample of the server's /metrics: (name, sorted labels) → value."""
    return samples(client.get("/metrics").text)
