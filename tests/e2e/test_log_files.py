"""The log files against real servers: a request log moved away (logrotate) or deleted with
its directory, a full disk, and request and step logs that cannot be written at start-up.
Every request gets exactly one complete line in the file at the configured path, or is
counted as lost; serving never stops."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import scrape, start_server
from tests.helpers import fill, jsonl, wait

HOOK = ["--scheduler-cls", "pte_instrument.vllm_adapter.scheduler.PteScheduler"]
REQUEST_LOG_LINE = "request log PTE_REQUEST_LOG="
STEP_LOG_LINE = "step log PTE_STEP_LOG="


def chat(client: httpx.Client, model: str, text: str) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2,
        "ignore_eos": True,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def lines(path: Path, settled: bool = True) -> list[dict]:
    """The file's records; fails on a partial line or one that is not a whole record.
    ``settled=False``: while the server may still be writing, a last line without its
    newline is a record being appended (or, on a full disk, about to be cut): left out."""
    if not settled:
        return jsonl(path)
    if not path.exists():
        return []
    text = path.read_text()
    assert not text or text.endswith("\n"), f"partial last line: {text[-120:]!r}"
    return [json.loads(line) for line in text.splitlines()]


def by_id(path: Path, settled: bool = True) -> dict[str, int]:
    """How many lines each request id has."""
    out: dict[str, int] = {}
    for rec in lines(path, settled):
        out[rec["request_id"]] = out.get(rec["request_id"], 0) + 1
    return out


def faults(client: httpx.Client) -> dict[str, float]:
    return {
        dict(labels)["stage"]: v
        for (name, labels), v in scrape(client).items()
        if name == "pte_plugin_faults_total"
    }


def priced(client: httpx.Client) -> float:
    return sum(v for (name, _), v in scrape(client).items() if name == "pte_requests_total")


# --- a request log that is rotated, deleted, and runs out of space ----------------------


@pytest.fixture(scope="module")
def rotating(tiny_model, tmp_path_factory) -> Iterator[tuple[httpx.Client, str, Path, bool]]:
    """The request log two directories below ``logs``: ``logs`` is a 64 KiB tmpfs where the
    kernel allows mounting one (a real full disk), else a plain directory."""
    work = tmp_path_factory.mktemp("rotating")
    logs = work / "logs"
    logs.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(logs)], capture_output=True
        ).returncode
        == 0
    )
    path = logs / "sub" / "requests.jsonl"
    vllm = start_server(tiny_model, work, {"PTE_REQUEST_LOG": str(path)})
    try:
        yield httpx.Client(base_url=vllm.url, timeout=60), vllm.served_name, path, mounted
    finally:
        vllm.stop()
        if mounted:
            subprocess.run(["umount", "--lazy", str(logs)], check=True)


def each_once(client: httpx.Client, model: str, path: Path, tag: str, n: int = 3) -> set[str]:
    """``n`` requests; each gets exactly one line in the file at ``path``."""
    ids = {chat(client, model, f"{tag} {i}") for i in range(n)}
    assert wait(lambda: ids <= set(by_id(path, settled=False))), f"{tag}: entries missing at {path}"
    found = by_id(path)
    assert all(found[i] == 1 for i in ids), f"{tag}: one line each"
    return ids


def test_a_moved_or_deleted_request_log_is_reopened_at_its_path(rotating):
    client, model, path, _ = rotating
    first = each_once(client, model, path, "before")
    rotated = path.with_name("requests.jsonl.1")
    path.rename(rotated)  # logrotate: mv, no signal to the server
    moved = each_once(client, model, path, "after mv")
    assert set(by_id(rotated)) == first  # nothing more went to the moved file
    assert set(by_id(path)) == moved
    shutil.rmtree(path.parent)  # the whole directory
    deleted = each_once(client, model, path, "after rm -rf")
    assert set(by_id(path)) == deleted
    assert faults(client)["request_log"] == 0


def test_a_real_full_disk_leaves_no_partial_line_and_counts_the_losses(rotating):
    client, model, path, mounted = rotating
    if not mounted:
        pytest.skip("cannot mount a tmpfs here; the simulated full disk below still runs")
    each_once(client, model, path, "space", n=1)
    lost_before = faults(client)["request_log"]
    filler = fill(path.parent.parent)
    ids = {chat(client, model, f"full {i}") for i in range(8)}

    def lost() -> float:
        return faults(client)["request_log"] - lost_before

    assert wait(lambda: len(ids & set(by_id(path, settled=False))) + lost() == 8), (lost(), by_id(path))
    written = ids & set(by_id(path))  # by_id reads every line: none partial
    assert lost() > 0
    filler.unlink()
    each_once(client, model, path, "space again")  # whole lines, none glued to a partial one
    assert lost() == 8 - len(written)
    print(f"\nreal full disk: {len(written)} of 8 entries written, {lost():.0f} lost and counted")


# --- request and step logs unwritable at start-up; then a (simulated) full disk ---------


@pytest.fixture(scope="module")
def broken(tiny_model, tmp_path_factory) -> Iterator[tuple[httpx.Client, str, Path, Path, Callable[[], str]]]:
    """Both logs below a file instead of a directory; half of all writes to the request log
    fail as a full disk would (half a record written, then ENOSPC) once its path works."""
    work = tmp_path_factory.mktemp("broken")
    request_blocker, step_blocker = work / "requests-dir", work / "steps-dir"
    request_blocker.write_text("")
    step_blocker.write_text("")
    env = {
        "VLLM_PLUGINS": "pte",
        "PTE_REQUEST_LOG": str(request_blocker / "requests.jsonl"),
        "PTE_STEP_LOG": str(step_blocker / "steps.jsonl"),
        "PTE_FAILPOINTS": "request_log:0.5",
        "PTE_FAILPOINTS_SEED": "3",
    }
    vllm = start_server(tiny_model, work, env, HOOK)
    try:
        yield (
            httpx.Client(base_url=vllm.url, timeout=60),
            vllm.served_name,
            request_blocker,
            request_blocker / "requests.jsonl",
            lambda: vllm.log_path.read_text(errors="replace"),
        )
    finally:
        vllm.stop()


def test_unwritable_logs_at_start_up_are_reported_once_and_serving_continues(broken):
    client, model, _, _, vllm_log = broken
    text = vllm_log()
    for needle in (REQUEST_LOG_LINE, STEP_LOG_LINE):
        found = [line for line in text.splitlines() if needle in line]
        assert len(found) == 1 and "is not writable" in found[0], (needle, found)
        print(f"\n{found[0]}")
    assert "Traceback" not in text  # one line each, no traceback
    for i in range(3):
        chat(client, model, f"unwritable {i}")
    assert wait(lambda: faults(client)["request_log"] == 3), faults(client)  # every lost entry counted
    summary = client.get("/pte/summary").json()
    hook = summary["engine_hook"]
    assert hook["engines"] == [0] and hook["steps"]["0"] > 0  # the hook runs without its step log
    assert summary["request_log"]["lost"] == 3
    f = faults(client)
    assert f["engine_step_log"] == 1 and f["engine_setup"] == 0, f
    assert priced(client) == 3  # Prometheus still prices every request
    assert client.get("/health").status_code == 200
    print(f"faults: { {k: v for k, v in f.items() if v} }")


def test_a_fixed_path_recovers_and_a_full_disk_leaves_no_partial_line(broken):
    client, model, blocker, path, vllm_log = broken
    lost_before = faults(client)["request_log"]
    blocker.unlink()  # the directory can now be created
    ids = [chat(client, model, f"disk {i}") for i in range(16)]

    def accounted() -> bool:
        return (
            len(set(ids) & set(by_id(path, settled=False))) + faults(client)["request_log"] - lost_before
            == 16
        )

    assert wait(accounted), (faults(client), by_id(path))
    lost = faults(client)["request_log"] - lost_before
    found = by_id(path)  # every line whole
    written = [i for i in ids if i in found]
    assert all(found[i] == 1 for i in written)
    assert 0 < lost < 16 and len(written) + lost == 16, (lost, len(written))
    assert all(rec["engine_pte_served"] is not None for rec in lines(path))  # exact engine totals
    assert client.get("/pte/summary").json()["request_log"]["lost"] == lost_before + lost
    assert "Traceback" not in vllm_log()
    print(f"\nsimulated full disk: {len(written)} of 16 entries written whole, {lost:.0f} lost and counted")
