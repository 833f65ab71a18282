"""``pte demo``: a real vLLM server with the plugin on the locally generated tiny model,
driven by a multi-turn agent workload, then the PTE report."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from .serving import VllmServer
from .tinymodel import build_model
from .workload import WorkloadConfig, run_workload


def _request_table(records: list[dict]) -> Table:
    t = Table(title="PTE per request (from the plugin's request log)")
    for col in (
        "request",
        "session",
        "turn",
        "prompt",
        "cached",
        "output",
        "PTE reference",
        "PTE served",
        "engine exact",
        "PTE ideal",
        "eviction tax",
        "inference s",
    ):
        t.add_column(col, justify="right")
    for r in records:
        t.add_row(
            r["request_id"][-8:],
            str(r["session_id"] or "-"),
            str(r["turn"] or "-"),
            str(r["prompt_tokens"]),
            str(r["cached_tokens"]),
            str(r["output_tokens"]),
            f"{r['pte_reference']:.1f}",
            f"{r['pte_served']:.1f}",
            "-" if r.get("engine_pte_served") is None else f"{r['engine_pte_served']:.1f}",
            f"{r['pte_ideal']:.1f}",
            f"{r['pte_eviction_tax']:.1f}",
            f"{r['inference_s']:.3f}",
        )
    return t


def _session_table(sessions: list[dict]) -> Table:
    t = Table(title="PTE per agent session (GET /pte/sessions)")
    for col in (
        "session",
        "turns",
        "prompt",
        "cached",
        "output",
        "PTE served",
        "PTE ideal",
        "eviction tax",
        "tool pause s",
    ):
        t.add_column(col, justify="right")
    for s in sessions:
        t.add_row(
            s["session_id"], str(s["turns"]), str(int(s["prompt_tokens"])), str(int(s["cached_tokens"])),
            str(int(s["output_tokens"])), f"{s['pte_served']:.1f}", f"{s['pte_ideal']:.1f}",
            f"{s['pte_eviction_tax']:.1f}", f"{s['pause_s']:.2f}",
        )  # fmt: skip
    return t


def _wait_for_records(path: Path, n: int, timeout_s: float = 10.0) -> list[dict]:
    """The stat logger sees a request a moment after its response is sent."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= n or time.monotonic() > deadline:
            return [json.loads(line) for line in lines]
        time.sleep(0.2)


def run_demo(model_dir: str = "models/tiny", port: int = 0, sessions: int = 3, turns: int = 4) -> int:
    # Tables are wide; do not squeeze them to 80 columns when piped to a file or CI log.
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(f"[bold]Building the tiny model[/] in {model_dir} (random weights, seed 0)…")
    build_model(model_dir, "tiny", seed=0)
    with tempfile.TemporaryDirectory(prefix="pte-demo-") as tmp:
        log_path = Path(tmp) / "requests.jsonl"
        server = VllmServer(
            model_dir,
            port=port,
            log_path=Path(tmp) / "vllm.log",
            extra_args=[
                "--enable-prefix-caching",
                # the engine-side step hook: exact per-step accounting beside the estimate
                "--scheduler-cls",
                "pte_instrument.vllm_adapter.scheduler.PteScheduler",
            ],
            # VLLM_PLUGINS=pte opts in to the session routes; dev mode exposes the cache reset.
            env={"PTE_REQUEST_LOG": str(log_path), "VLLM_PLUGINS": "pte", "VLLM_SERVER_DEV_MODE": "1"},
        )
        console.print("[bold]Starting vLLM[/] (CPU build) with pte-instrument; this takes about a minute…")
        with server:
            console.print(
                f"Server up at {server.url}. Running {sessions} agent sessions × {turns} turns; "
                "the prefix cache is dropped before the last turn, as a long tool pause would evict it…"
            )

            def evict_before_last_round(client: httpx.Client, round_: int) -> None:
                if round_ == turns - 2:
                    client.post("/reset_prefix_cache").raise_for_status()

            cfg = WorkloadConfig(sessions=sessions, turns=turns)
            results = run_workload(server.url, server.served_name, cfg, evict_before_last_round)
            records = _wait_for_records(log_path, len(results))
            metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
            session_rows = httpx.get(f"{server.url}/pte/sessions", timeout=10).json()["sessions"]
        records.sort(key=lambda r: (r["session_id"] or "", r["turn"] or 0))
        console.print(_request_table(records))
        console.print(_session_table(session_rows))
        total = {
            k: sum(r[k] for r in records)
            for k in (
                "pte_reference",
                "pte_served",
                "pte_ideal",
                "prompt_tokens",
                "cached_tokens",
                "output_tokens",
            )
        }
        console.print(
            f"Totals: {len(records)} requests, {total['prompt_tokens']} prompt tokens "
            f"({total['cached_tokens']} from the prefix cache), {total['output_tokens']} output tokens; "
            f"PTE reference {total['pte_reference']:.1f}, served {total['pte_served']:.1f}, ideal {total['pte_ideal']:.1f}."
        )
        if records:
            r = records[0]
            console.print(f"γ = {r['gamma']:.6g} on device profile {r['device']} (HOI {r['hoi']:.1f}).")
        console.print("\n[bold]The plugin's series on /metrics[/]:")
        for line in metrics.splitlines():
            if line.startswith("pte_") and "_created" not in line and "_bucket" not in line:
                print(line)
    console.print("Server stopped.")
    return 0 if len(records) == len(results) else 1
