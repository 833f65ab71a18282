"""``pte demo``: a real vLLM server with the plugin on the locally generated tiny model,
driven by a multi-turn agent workload, then the PTE report. ``--replicas N``: N servers
sharing one session store on Redis, and sessions that move between them (routing tax)."""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table
from rich.text import Text

from pte_instrument.devtools.redis_server import RedisServer
from pte_instrument.devtools.serving import VllmServer
from pte_instrument.devtools.tinymodel import build_model
from pte_instrument.devtools.workload import WorkloadConfig, run_workload

Column = tuple[str, Callable[[dict], str]]  # header, cell of a row


def _dash(value: object, fmt: str = "") -> str:
    return "-" if value is None else format(value, fmt)


REQUEST_COLUMNS: tuple[Column, ...] = (
    ("request", lambda r: r["request_id"][-8:]),
    ("session", lambda r: _dash(r["session_id"])),
    ("turn", lambda r: _dash(r["turn"])),
    ("prompt", lambda r: str(r["prompt_tokens"])),
    ("cached", lambda r: str(r["cached_tokens"])),
    ("output", lambda r: str(r["output_tokens"])),
    ("PTE reference", lambda r: f"{r['pte_reference']:.1f}"),
    ("PTE served", lambda r: f"{r['pte_served']:.1f}"),
    ("engine exact", lambda r: _dash(r.get("engine_pte_served"), ".1f")),
    ("PTE ideal", lambda r: f"{r['pte_ideal']:.1f}"),
    ("eviction tax", lambda r: f"{r['pte_eviction_tax']:.1f}"),
    ("routing tax", lambda r: f"{r.get('pte_routing_tax', 0.0):.1f}"),
    ("replica", lambda r: _dash(r.get("replica"))),
    ("inference s", lambda r: f"{r['inference_s']:.3f}"),
)
SESSION_COLUMNS: tuple[Column, ...] = (
    ("session", lambda s: s["session_id"]),
    ("turns", lambda s: str(s["turns"])),
    ("prompt", lambda s: str(int(s["prompt_tokens"]))),
    ("cached", lambda s: str(int(s["cached_tokens"]))),
    ("output", lambda s: str(int(s["output_tokens"]))),
    ("PTE served", lambda s: f"{s['pte_served']:.1f}"),
    ("PTE ideal", lambda s: f"{s['pte_ideal']:.1f}"),
    ("eviction tax", lambda s: f"{s['pte_eviction_tax']:.1f}"),
    ("routing tax", lambda s: f"{s.get('pte_routing_tax', 0.0):.1f}"),
    ("tool pause s", lambda s: f"{s['pause_s']:.2f}"),
)


def _table(title: str, columns: tuple[Column, ...], rows: list[dict]) -> Table:
    t = Table(title=title)
    for header, _ in columns:
        t.add_column(header, justify="right")
    for row in rows:
        t.add_row(*(cell(row) for _, cell in columns))
    return t


def _wait_for_all(paths: list[Path], n: int, timeout_s: float = 10.0) -> list[dict]:
    """The records of ``n`` requests in the request logs ``paths`` (the stat logger sees a
    request a moment after its response is sent); what is there after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [line for p in paths if p.exists() for line in p.read_text().splitlines()]
        if len(lines) >= n or time.monotonic() > deadline:
            return [json.loads(line) for line in lines]
        time.sleep(0.2)


def run_demo(
    model_dir: str = "models/tiny", port: int = 0, sessions: int = 3, turns: int = 4, replicas: int = 1
) -> int:
    """``replicas`` > 1: that many vLLM servers sharing one session store on a redis-server
    the demo starts, and sessions whose turns move between them (routing tax)."""
    # Tables are wide; do not squeeze them to 80 columns when piped to a file or CI log.
    # markup off: paths and URLs are text, whatever brackets they hold
    console = Console(width=None if sys.stdout.isatty() else 160, markup=False)
    console.print(
        Text.assemble(("Building the tiny model", "bold"), f" in {model_dir} (random weights, seed 0)…")
    )
    build_model(model_dir, "tiny", seed=0)
    with tempfile.TemporaryDirectory(prefix="pte-demo-") as tmp, contextlib.ExitStack() as running:
        env = {"VLLM_PLUGINS": "pte", "VLLM_SERVER_DEV_MODE": "1"}
        if replicas > 1:
            redis = running.enter_context(RedisServer(tmp))
            env["PTE_SESSION_STORE"] = redis.url
            console.print(f"Session store shared by {replicas} replicas: redis-server at {redis.url}")
        logs = [Path(tmp) / f"requests-{i}.jsonl" for i in range(replicas)]
        servers = [
            VllmServer(
                model_dir,
                port=port + i if port else 0,
                log_path=Path(tmp) / f"vllm-{i}.log",
                extra_args=[
                    "--enable-prefix-caching",
                    # the engine-side step hook: exact per-step accounting beside the estimate
                    "--scheduler-cls",
                    "pte_instrument.vllm_adapter.scheduler.PteScheduler",
                ],
                # VLLM_PLUGINS=pte opts in to the session routes; dev mode exposes the cache reset.
                env={**env, "PTE_REQUEST_LOG": str(log), "PTE_INSTANCE": f"replica-{i}"},
            )
            for i, log in enumerate(logs)
        ]
        console.print(
            Text.assemble(
                ("Starting vLLM", "bold"), " (CPU build) with pte-instrument; this takes about a minute…"
            )
        )
        for server in servers:  # side by side
            running.callback(server.stop)
            server.launch()
        for server in servers:
            server.wait_ready()
        where = servers[0].url if replicas == 1 else ", ".join(s.url for s in servers)
        moving = (
            "" if replicas == 1 else "; the first session stays on replica-0, the others move at every turn"
        )
        console.print(
            f"Server up at {where}. Running {sessions} agent sessions × {turns} turns{moving}; "
            "the prefix cache is dropped before the last turn, as a long tool pause would evict it…"
        )

        def evict_before_last_round(client: httpx.Client, round_: int) -> None:
            if round_ == turns - 2:
                client.post("/reset_prefix_cache").raise_for_status()

        cfg = WorkloadConfig(sessions=sessions, turns=turns)
        results = run_workload([s.url for s in servers], servers[0].served_name, cfg, evict_before_last_round)
        records = _wait_for_all(logs, len(results))
        metrics = httpx.get(f"{servers[0].url}/metrics", timeout=10).text
        session_rows = httpx.get(f"{servers[0].url}/pte/sessions", timeout=10).json()["sessions"]
        records.sort(key=lambda r: (r["session_id"] or "", r["turn"] or 0))
        console.print(_table("PTE per request (from the plugin's request logs)", REQUEST_COLUMNS, records))
        console.print(_table("PTE per agent session (GET /pte/sessions)", SESSION_COLUMNS, session_rows))
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
        console.print(Text.assemble("\n", (f"The plugin's series on {servers[0].url}/metrics", "bold"), ":"))
        for line in metrics.splitlines():
            if line.startswith("pte_") and "_created" not in line and "_bucket" not in line:
                print(line)
    console.print("Servers stopped." if replicas > 1 else "Server stopped.")
    return 0 if len(records) == len(results) else 1
