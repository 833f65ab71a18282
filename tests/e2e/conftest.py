"""Every test in this folder starts a real vLLM engine (the CPU build): marked here once."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import start_server

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.vllm)


@contextlib.contextmanager
def serving(
    tiny_model: Path, work: Path, env: dict[str, str], args: list[str]
) -> Iterator[tuple[Any, httpx.Client]]:
    """A server of its own for a test module, and a client for it; stopped however the
    module ends."""
    vllm = start_server(tiny_model, work, env, args)
    try:
        yield vllm, httpx.Client(base_url=vllm.url, timeout=120)
    finally:
        vllm.stop()


PRICE = 2.5  # USD per GPU-hour, of the timed server


@pytest.fixture(scope="session")
def timed_server(tiny_model, tmp_path_factory) -> Iterator[tuple[Any, Path, httpx.Client]]:
    """A server with the step hook, a request log, a step log, the routes plugin and a price:
    GPU seconds and money on every request. Shared by the files of ``SERVER_GROUPS["timed_server"]``."""
    work = tmp_path_factory.mktemp("timed-server")
    env = {
        "PTE_REQUEST_LOG": str(work / "requests.jsonl"),
        "PTE_STEP_LOG": str(work / "steps.jsonl"),
        "VLLM_PLUGINS": "pte",
        "PTE_GPU_HOURLY_PRICE": str(PRICE),
    }
    args = ["--scheduler-cls", "pte_instrument.vllm_adapter.scheduler.PteScheduler", "--max-num-seqs", "8"]
    with serving(tiny_model, work, env, args) as (vllm, client):
        yield vllm, work, client
