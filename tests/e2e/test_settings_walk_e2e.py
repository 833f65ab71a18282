"""Every setting, with every class of garbage value, through a real server start: the server
comes up, each value the plugin does not take is named in exactly one configuration line,
and a request is priced. Each start gives every setting one class (the classes rotate over
the settings from start to start); ``tests/test_settings_garbage.py`` walks every pair
through the same parsing without a server."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import httpx
import pytest

from pte_instrument.settings import NAMES, Settings
from tests.conftest import scrape, start_server
from tests.helpers import wait

HOOK = ["--scheduler-cls", "pte_instrument.vllm_adapter.scheduler.PteScheduler"]
PATHS = {"PTE_REQUEST_LOG", "PTE_STEP_LOG", "PTE_SESSION_STORE"}  # any text is a path: given one that works
LINE = re.compile(r"pte-instrument configuration: (PTE_[A-Z0-9_]+)")
STARTS = {  # per start, the classes handed round the settings in turn
    "empty": [""],
    "nan-or-text": ["nan", "abc"],
    "negative-or-inf": ["-1", "inf"],
    "huge": ["1e308", "9" * 4000],
}


def garbage_env(classes: list[str], tmp: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for i, name in enumerate(sorted(NAMES - PATHS)):
        env[name] = classes[i % len(classes)]
    if classes == [""]:
        env.update(dict.fromkeys(PATHS, ""))
    else:
        env.update(
            PTE_REQUEST_LOG=str(tmp / "requests.jsonl"),
            PTE_STEP_LOG=str(tmp / "steps.jsonl"),
            PTE_SESSION_STORE=str(tmp / "sessions.sqlite3"),
        )
    return env


def named(lines: list[str]) -> Counter[str]:
    return Counter(m.group(1) for line in lines if (m := LINE.search(line)))


@pytest.mark.parametrize("start", STARTS)
def test_no_value_of_any_setting_stops_the_server_and_each_rejected_one_is_said_once(
    tiny_model, tmp_path, start
):
    env = garbage_env(STARTS[start], tmp_path)
    # What the server must say: the settings' own verdict on these values (an empty store
    # path, replica name or transport is filled in before the settings are read: none is said).
    filled_in = ("PTE_SESSION_STORE", "PTE_INSTANCE", "PTE_ENGINE_TRANSPORT")
    filled = {k: v for k, v in env.items() if not (k in filled_in and not v)}
    expected = named([f"pte-instrument configuration: {e}" for e in Settings.from_env(filled).errors])
    assert expected, "garbage that every setting takes proves nothing"
    vllm = start_server(tiny_model, tmp_path, env, HOOK)
    try:
        with httpx.Client(base_url=vllm.url, timeout=60) as client:
            r = client.post(
                "/v1/completions", json={"model": vllm.served_name, "prompt": "walk", "max_tokens": 2}
            )
            assert r.status_code == 200, r.text
            priced = lambda: sum(v for (n, _), v in scrape(client).items() if n == "pte_requests_total")  # noqa: E731
            assert wait(lambda: priced() == 1, timeout_s=30), priced()
        said = named(vllm.log_path.read_text(errors="replace").splitlines())
        assert said == expected, {"missing": expected - said, "extra": said - expected}
        assert "Traceback" not in vllm.log_path.read_text(errors="replace")
        print(f"\n{start}: {sum(said.values())} lines for {len(said)} settings; server up, request priced")
    finally:
        vllm.stop()
