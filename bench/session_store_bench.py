"""Benchmark (not a test) of the shared session store: what a priced request pays on the
pricing thread for its session (``context_for`` + ``add``), and how many turns per second
the store commits with several processes writing it at once: the API servers of one server
on its SQLite file (``--store sqlite``), or the replicas of a fleet on one Redis server
(``--store redis``: a ``redis-server`` started for each run, AOF on with fsync every second,
as a deployment would keep it; ``--redis-url`` names one instead).

Each process (``--processes``: API servers or replicas) runs ``--streams`` agent sessions
round-robin, ``--turns`` turns each, every turn priced from the tiny model's cost model and
handed to its own ledger, as the pricer does. Sessions of one process continue on the other
(turn t of a session goes to process t mod P), so every context read crosses processes, as
with fresh connections behind a kernel-balanced port or a router without affinity.

Figures:
  request_path_us  per turn, in the pricing thread: context_for + add (the queue put)
  commit_turns_s   turns committed per second by all processes together (first add → the
                   last process's flush returned)
  lag_ms           per process: its last add → its flush returned (the writer's backlog)

Writes bench/results/session-store[-redis]-<hostname>-<YYYY-MM-DD>.json and prints a table.

    python -m bench.session_store_bench [--store sqlite|redis] [--processes 2] [--streams 256] [--turns 8]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.provenance import header_line, print_table, provenance, write_results
from pte_instrument.devtools.redis_server import RedisServer

MODEL = Path("models/tiny/config.json")


def _worker(args: tuple[str, int, int, int, int, Any]) -> dict[str, float]:
    path, index, processes, streams, turns, start = args
    from pte_instrument.cost.architecture import load_config, parse_shape
    from pte_instrument.cost.devices import PROFILES
    from pte_instrument.cost.model import CostModel
    from pte_instrument.server.records import FinishedRequest, price_request
    from pte_instrument.server.redis_store import open_ledger

    cost = CostModel(parse_shape(load_config(MODEL)), PROFILES["h100-sxm"])
    replica = f"replica-{index}"
    ledger = open_ledger(path, max_sessions=100_000, block_size=16, server_id=replica)
    start.wait()
    add_s = ctx_s = 0.0
    n = 0
    t_first = time.time()
    for t in range(turns):
        if t % processes != index:
            # the other process's turn: let it land before this process reads the session
            time.sleep(0.002)
            continue
        for k in range(streams):
            sid = f"agent-{k}"
            prompt = 200 + 60 * t
            t0 = time.perf_counter()
            ctx = ledger.context_for(sid, time.time(), prompt)
            ctx_s += time.perf_counter() - t0
            req = FinishedRequest(
                f"{sid}-{t}",
                "tiny",
                prompt,
                0,
                16,
                "stop",
                session_id=sid,
                turn=ctx.turn,
                reusable_tokens=ctx.reusable_tokens,
                pause_s=ctx.pause_s,
                replica=replica,
                previous_replica=ctx.previous_replica,
            )
            record = price_request(cost, req, time.time())
            t1 = time.perf_counter()
            ledger.add(record)
            add_s += time.perf_counter() - t1
            n += 1
        ledger.flush(timeout=300)  # the next turn of these sessions follows their answers
    t_last_add = time.time()
    ledger.flush(timeout=300)
    done = time.time()
    ledger.close()
    return {
        "turns": n,
        "first": t_first,
        "done": done,
        "lag_ms": (done - t_last_add) * 1e3,
        "add_us": add_s / max(n, 1) * 1e6,
        "context_us": ctx_s / max(n, 1) * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", choices=("sqlite", "redis"), default="sqlite")
    ap.add_argument("--redis-url", help="with --store redis: this server (its prefix pte: is written over)")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    runs = []
    ctx = mp.get_context("spawn")
    for _ in range(args.repeats):
        with contextlib.ExitStack() as stack:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="pte-store-bench-"))
            if args.store == "sqlite":
                path = str(Path(tmp) / "sessions.sqlite3")
            elif args.redis_url:
                path = args.redis_url
                import redis

                for key in redis.Redis.from_url(path).scan_iter("pte:*"):
                    redis.Redis.from_url(path).delete(key)
            else:
                path = stack.enter_context(RedisServer(tmp)).url
            start = ctx.Manager().Event()
            with ctx.Pool(args.processes) as pool:
                pending = pool.map_async(
                    _worker,
                    [
                        (path, i, args.processes, args.streams, args.turns, start)
                        for i in range(args.processes)
                    ],
                )
                time.sleep(2.0)  # every process has opened the store
                start.set()
                results = pending.get(timeout=900)
            turns = sum(r["turns"] for r in results)
            wall = max(r["done"] for r in results) - min(r["first"] for r in results)
            runs.append(
                {
                    "turns": turns,
                    "wall_s": wall,
                    "commit_turns_s": turns / wall,
                    "add_us": statistics.mean(r["add_us"] for r in results),
                    "context_us": statistics.mean(r["context_us"] for r in results),
                    "lag_ms": max(r["lag_ms"] for r in results),
                }
            )
    report: dict[str, Any] = {
        "benchmark": "session_store",
        **provenance(),
        "config": {
            "store": args.store,
            "processes": args.processes,
            "streams": args.streams,
            "turns": args.turns,
            "repeats": args.repeats,
        },
        "runs": runs,
        "median": {k: statistics.median(r[k] for r in runs) for k in runs[0]},
    }
    m = report["median"]
    print_table(
        [
            "processes × streams",
            "turns",
            "context_for µs",
            "add µs",
            "pricing thread µs",
            "turns/s committed",
            "writer lag ms",
        ],
        [
            [
                f"{args.processes} × {args.streams}",
                m["turns"],
                f"{m['context_us']:.1f}",
                f"{m['add_us']:.1f}",
                f"{m['context_us'] + m['add_us']:.1f}",
                f"{m['commit_turns_s']:.0f}",
                f"{m['lag_ms']:.1f}",
            ]
        ],
    )
    name = "session-store" if args.store == "sqlite" else "session-store-redis"
    out = write_results(report, name, args.out)
    print(header_line(report, "sqlite WAL" if args.store == "sqlite" else "redis"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
