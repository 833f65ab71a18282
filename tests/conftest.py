"""Shared fixtures. Tests that concern vLLM start a real engine (the CPU build) on the tiny
locally generated model and talk to it over HTTP; start-up takes about a minute, so one
server is shared by every test that does not need its own configuration."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / "models" / "tiny"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from pte_instrument.tinymodel import build_model

    return build_model(TINY_MODEL, "tiny", seed=0)


def start_server(tiny_model: Path, workdir: Path, env: dict[str, str], extra_args: list[str] | None = None):
    from pte_instrument.serving import VllmServer

    return VllmServer(
        tiny_model,
        log_path=workdir / "vllm.log",
        env=env,
        extra_args=["--enable-prefix-caching", *(extra_args or [])],
    ).start()


class Server:
    def __init__(self, vllm, request_log: Path) -> None:
        self.vllm = vllm
        self.url = vllm.url
        self.model = vllm.served_name
        self.request_log = request_log
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def chat(self, content: str, max_tokens: int = 8, **extra) -> dict:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            **extra,
        }
        r = self.client.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return r.json()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = self.client.get("/metrics").text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name.startswith("pte_"):
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def log_records(self, ids: set[str], timeout_s: float = 15.0) -> dict[str, dict]:
        """Request-log entries for ``ids``; the stat logger records a request just after
        its response is sent, so wait briefly for all of them."""
        deadline = time.monotonic() + timeout_s
        while True:
            found: dict[str, dict] = {}
            if self.request_log.exists():
                for line in self.request_log.read_text().splitlines():
                    rec = json.loads(line)
                    if rec["request_id"] in ids:
                        found.setdefault(rec["request_id"], []).append(rec)
            if len(found) == len(ids) or time.monotonic() > deadline:
                return found
            time.sleep(0.2)


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("server")
    log = work / "requests.jsonl"
    vllm = start_server(tiny_model, work, {"PTE_REQUEST_LOG": str(log), "PTE_DEVICE": "h100-sxm"})
    try:
        yield Server(vllm, log)
    finally:
        vllm.stop()


def metric_sum(metrics: dict, name: str, **labels: str) -> float:
    return sum(
        v
        for (n, labs), v in metrics.items()
        if n == name and all(dict(labs).get(k) == val for k, val in labels.items())
    )
