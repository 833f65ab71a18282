"""A server with small session caps and deliberately broken configuration: bad input and
faults never stop serving, and memory stays bounded."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.conftest import scrape, start_server
from tests.helpers import wait

MAX_SESSIONS = 50


@pytest.fixture(scope="module")
def constrained(tiny_model, tmp_path_factory):
    """The request log's parent is a file, so every write fails; PTE_HOI is malformed."""
    work = tmp_path_factory.mktemp("constrained")
    blocker = work / "not-a-dir"
    blocker.write_text("")
    vllm = start_server(
        tiny_model,
        work,
        {
            "PTE_REQUEST_LOG": str(blocker / "requests.jsonl"),
            "PTE_HOI": "banana",
            "PTE_DEVICE": "h200",
            "VLLM_PLUGINS": "pte",
            "PTE_MAX_SESSIONS": str(MAX_SESSIONS),
            "PTE_MAX_TURNS": "4",
            "PTE_FEEDBACK_WINDOW": "2",
        },
    )
    try:
        yield vllm
    finally:
        vllm.stop()


def sample(client: httpx.Client, name: str, **labels: str) -> float | None:
    """The first matching sample's value, None if there is none."""
    for (n, labs), value in scrape(client).items():
        if n == name and all(dict(labs).get(k) == v for k, v in labels.items()):
            return value
    return None


def chat(client: httpx.Client, model: str, session: bytes | str | None = None, text: str = "hello") -> int:
    headers = {} if session is None else {"X-Session-Id": session}
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "ignore_eos": True,
    }
    return client.post("/v1/chat/completions", json=body, headers=headers).status_code


def wait_for(
    client: httpx.Client, name: str, value: float, timeout_s: float = 15.0, **labels: str
) -> float | None:
    deadline = time.monotonic() + timeout_s
    while (got := sample(client, name, **labels)) != value and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def test_exporter_and_config_faults_do_not_stop_serving(constrained):
    client = httpx.Client(base_url=constrained.url, timeout=60)
    before = sample(client, "pte_requests_total") or 0
    for i in range(4):
        assert chat(client, constrained.served_name, text=f"hello {i}") == 200
    assert wait_for(client, "pte_requests_total", before + 4) == before + 4  # Prometheus still counts
    assert sample(client, "pte_plugin_faults_total", stage="request_log") == before + 4
    assert client.get("/health").status_code == 200
    log = constrained.log_tail(2000)
    assert "PTE_HOI='banana' must be a positive number" in log
    assert "fault in stage 'request_log'" in log
    # the malformed HOI fell back to the chosen device's datasheet value
    assert sample(client, "pte_hardware_operational_intensity_flops_per_byte") == pytest.approx(989.4 / 4.8)


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        ("x" * 10_000, "too_long"),
        (b"caf\xc3\xa9-\xff", "invalid_chars"),
        ("", "empty"),
        ("two words", "invalid_chars"),
    ],
)
def test_malformed_session_ids_are_served_untracked(constrained, header, reason):
    client = httpx.Client(base_url=constrained.url, timeout=60)
    before = sample(client, "pte_session_ids_rejected_total", reason=reason) or 0
    assert chat(client, constrained.served_name, session=header) == 200
    assert sample(client, "pte_session_ids_rejected_total", reason=reason) == before + 1


def test_many_distinct_sessions_stay_capped_with_bounded_memory(constrained):
    client = httpx.Client(base_url=constrained.url, timeout=60)
    model = constrained.served_name
    proc = psutil.Process(constrained.proc.pid)  # the API server: the plugin's process

    def burst(prefix: str, n: int) -> list[int]:
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(lambda i: chat(client, model, session=f"{prefix}-{i}"), range(n)))

    opened_before = client.get("/pte/summary").json()["sessions"]["opened"]
    assert set(burst("warm", 300)) == {200}
    rss_before = proc.memory_info().rss
    assert set(burst("many", 1500)) == {200}
    rss_after = proc.memory_info().rss

    def opened() -> int:
        return client.get("/pte/summary").json()["sessions"]["opened"] - opened_before

    # a request is priced just after its answer: the burst's last ones may still be on their way
    assert wait(lambda: opened() >= 1800, timeout_s=30), opened()
    summary = client.get("/pte/summary").json()["sessions"]
    assert summary["live"] == MAX_SESSIONS
    assert summary["evicted"] == summary["opened"] - MAX_SESSIONS  # dropped sessions are counted
    assert sample(client, "pte_sessions_live") == MAX_SESSIONS
    closed = sample(client, "pte_sessions_closed_total", reason="evicted")
    assert closed == summary["evicted"]
    growth_mb = (rss_after - rss_before) / 2**20
    print(f"API server RSS growth over 1500 distinct session ids: {growth_mb:.1f} MiB")
    assert growth_mb < 64


def test_feedback_window_is_configurable(constrained):
    client = httpx.Client(base_url=constrained.url, timeout=60)
    ids = []
    for _ in range(3):
        before = sample(client, "pte_requests_total") or 0
        body = {
            "model": constrained.served_name,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
        }
        ids.append(client.post("/v1/chat/completions", json=body).json()["id"])
        assert wait_for(client, "pte_requests_total", before + 1) == before + 1
    # PTE_FEEDBACK_WINDOW=2: the oldest of the three fell out of the window
    assert client.post("/pte/feedback", json={"request_id": ids[0], "correct": True}).status_code == 404
    assert client.post("/pte/feedback", json={"request_id": ids[2], "correct": True}).status_code == 200
