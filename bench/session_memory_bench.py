"""Memory of the API server under many distinct agent-session ids: a real vLLM
server with the plugin (default ledger caps), one short request per id, each with its own
``X-Session-Id``; the API-server process's RSS and the ledger's counters are sampled as
the ids pile up. A benchmark, not a test: it asserts nothing.

    python -m bench.session_memory_bench [--ids 100000] [--concurrency 32] [--every 5000]

Writes bench/results/session-memory-<host>-<date>.json and prints one line per sample.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from bench.provenance import bench_parser, load_avg_1m, provenance, results_path, write_results
from pte_instrument.devtools.serving import VllmServer
from pte_instrument.devtools.tinymodel import build_model

ROOT = Path(__file__).resolve().parent.parent


async def send(url: str, first: int, count: int, concurrency: int) -> int:
    """``count`` requests, session ids ``first`` … ``first + count - 1``; returns failures."""
    failures = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(first, first + count):
        queue.put_nowait(i)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal failures
        while not queue.empty():
            i = queue.get_nowait()
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 1}
            r = await client.post("/v1/completions", json=body, headers={"X-Session-Id": f"agent-{i:06d}"})
            failures += r.status_code != 200

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return failures


def main() -> None:
    ap = bench_parser("bench.session_memory_bench", __doc__)
    ap.add_argument("--ids", type=int, default=100_000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--every", type=int, default=5_000, help="ids between samples")
    ap.add_argument("--plugin-off", action="store_true", help="baseline: the same requests, no plugin loaded")
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    args = ap.parse_args()
    prov = provenance()
    model = build_model(ROOT / "models" / "tiny", "tiny", seed=0)
    work = Path(tempfile.mkdtemp(prefix="pte-session-memory-"))
    # off: vLLM loads none of the plugin's entry points (an allow-list naming no plugin)
    env = {"VLLM_PLUGINS": "no-plugin", "PTE_ENABLED": "0"} if args.plugin_off else {"VLLM_PLUGINS": "pte"}
    server = VllmServer(model, env=env, log_path=work / "vllm.log", startup_timeout_s=900)
    samples = []
    t0 = time.monotonic()
    with server:
        api = psutil.Process(server.proc.pid)  # type: ignore[union-attr]

        def sample(ids: int, failures: int) -> None:
            summary = (
                {}
                if args.plugin_off
                else httpx.get(f"{server.url}/pte/summary", timeout=30).json()["sessions"]
            )
            row = {
                "ids": ids,
                "rss_mib": api.memory_info().rss / 2**20,
                "failures": failures,
                "seconds": time.monotonic() - t0,
                **summary,
            }
            samples.append(row)
            print(
                f"{ids:>7} ids  RSS {row['rss_mib']:7.1f} MiB  live {row.get('live', '-'):>5}  evicted "
                f"{row.get('evicted', '-'):>6}  pending {row.get('pending_requests', '-')}  failures {failures}  "
                f"{row['seconds']:6.0f} s",
                flush=True,
            )

        asyncio.run(send(server.url, -args.concurrency, args.concurrency, args.concurrency))  # warm-up
        sample(0, 0)
        failures = 0
        for first in range(0, args.ids, args.every):
            count = min(args.every, args.ids - first)
            failures += asyncio.run(send(server.url, first, count, args.concurrency))
            sample(first + count, failures)
    report = {
        "benchmark": "session-memory",
        **prov,
        "config": vars(args)
        | {
            "model": "tiny",
            "ledger": "defaults (PTE_MAX_SESSIONS 5000, TTL 1 h)",
            "plugin": "not loaded" if args.plugin_off else "on",
        },
        "samples": samples,
        "load_avg_1m_end": load_avg_1m(),
    }
    kind = "session-memory-plugin-off" if args.plugin_off else "session-memory"
    out = write_results(report, kind, results_path(kind, args.out))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
