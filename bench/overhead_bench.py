"""What the plugin costs the server: output-token throughput with and without it, from
servers started side by side and loaded in alternation (one at a time, so they never
compete), plus the engine hook's own time per scheduler step (as the plugin reports it).

    python -m bench.overhead_bench [--rounds 6] [--requests 48] [--concurrency 8]

Writes bench/results/overhead-<host>-<date>.json and prints a table. A benchmark, not a
test: it asserts nothing.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.provenance import bench_parser, load_avg_1m, provenance, results_path, write_results
from pte_instrument.devtools.serving import VllmServer
from pte_instrument.devtools.tinymodel import build_model

ROOT = Path(__file__).resolve().parent.parent
HOOK = ["--scheduler-cls", "pte_instrument.vllm_adapter.scheduler.PteScheduler"]
CONFIGS = {
    # name: (environment, extra vLLM args)
    "off": ({"PTE_ENABLED": "0"}, []),
    "stat_logger": ({}, []),
    "stat_logger+hook": ({"VLLM_PLUGINS": "pte"}, HOOK),  # the /pte/summary route reports hook time
}


def load(url: str, model: str, n: int, concurrency: int, max_tokens: int, seed: int) -> tuple[int, float]:
    rng = random.Random(seed)
    prompts = [
        " ".join(rng.choice("agent tool call result value".split()) for _ in range(rng.randint(50, 400)))
        for _ in range(n)
    ]
    client = httpx.Client(base_url=url, timeout=300)

    def one(p: str) -> int:
        r = client.post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": p,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0.0,
            },
        )
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, prompts))
    return tokens, time.perf_counter() - t0


def paired_cost(config: list[float], off: list[float]) -> dict[str, float]:
    """Throughput cost vs "off" from the rounds' pairs (each round runs every server back to
    back, so host drift cancels): mean of 1 − config/off and its 95% t-interval."""
    costs = [1 - c / o for c, o in zip(config, off, strict=True)]
    mean = statistics.mean(costs)
    half = T95.get(len(costs) - 1, 2.03) * statistics.stdev(costs) / len(costs) ** 0.5
    return {"mean": mean, "ci95_low": mean - half, "ci95_high": mean + half}


# two-sided 95% Student t quantiles for 1…30 degrees of freedom
T95 = dict(
    enumerate(
        (
            12.706,
            4.303,
            3.182,
            2.776,
            2.571,
            2.447,
            2.365,
            2.306,
            2.262,
            2.228,
            2.201,
            2.179,
            2.160,
            2.145,
            2.131,
            2.120,
            2.110,
            2.101,
            2.093,
            2.086,
            2.080,
            2.074,
            2.069,
            2.064,
            2.060,
            2.056,
            2.052,
            2.048,
            2.045,
            2.042,
        ),
        start=1,
    )
)


def engine_hook_cost(url: str) -> tuple[int, float]:
    """(steps, seconds spent in the step hook) so far, as the plugin reports them."""
    hook = httpx.get(f"{url}/pte/summary", timeout=30).json()["engine_hook"]
    return sum(hook["steps"].values()), sum(hook["hook_seconds"].values())


def main() -> None:
    ap = bench_parser("bench.overhead_bench", __doc__)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    args = ap.parse_args()
    prov = provenance()  # machine.load_avg_1m at the start: other work on the host skews throughput
    model = build_model(ROOT / "models" / "tiny", "tiny", seed=0)
    work = Path(tempfile.mkdtemp(prefix="pte-overhead-"))
    servers = {}
    try:
        for name, (env, extra) in CONFIGS.items():
            servers[name] = VllmServer(
                model,
                env=env,
                extra_args=["--enable-prefix-caching", *extra],
                log_path=work / f"{name}.log",
                startup_timeout_s=900,
            ).start()
            print(f"started {name} at {servers[name].url}")
        for s in servers.values():  # warm-up
            load(s.url, s.served_name, 8, args.concurrency, 8, seed=-1)
        hooked = servers["stat_logger+hook"]
        hook_before = engine_hook_cost(hooked.url)
        results: dict[str, list[float]] = {name: [] for name in servers}
        seconds: dict[str, float] = dict.fromkeys(servers, 0.0)
        order = list(servers)
        for r in range(args.rounds):
            rotated = order[r % len(order) :] + order[: r % len(order)]
            for name in rotated if (r // len(order)) % 2 == 0 else rotated[::-1]:  # every position, both ways
                tokens, secs = load(
                    servers[name].url,
                    servers[name].served_name,
                    args.requests,
                    args.concurrency,
                    args.max_tokens,
                    seed=r,
                )
                results[name].append(tokens / secs)
                seconds[name] += secs
                print(f"round {r} {name:>18}: {tokens / secs:8.1f} output tokens/s")
        time.sleep(1)
        hook_after = engine_hook_cost(hooked.url)
    finally:
        for s in servers.values():
            s.stop()
    steps = hook_after[0] - hook_before[0]
    hook_s = hook_after[1] - hook_before[1]
    hook_per_step = {
        "steps": steps,
        "hook_us_per_step": 1e6 * hook_s / steps,
        "hook_fraction_of_load_time": hook_s / seconds["stat_logger+hook"],
    }
    base = statistics.mean(results["off"])
    summary = {
        name: {
            "tokens_per_s_mean": statistics.mean(v),
            "tokens_per_s_stdev": statistics.stdev(v),
            "rounds": v,
            "cost_vs_off": 1 - statistics.mean(v) / base,
            "cost_vs_off_paired": paired_cost(v, results["off"]),
        }
        for name, v in results.items()
    }
    report = {
        "benchmark": "overhead",
        **prov,
        "config": vars(args) | {"model": "tiny", "configs": {k: v[1] for k, v in CONFIGS.items()}},
        "throughput": summary,
        "hook_per_step": hook_per_step,
        "load_avg_1m_end": load_avg_1m(),
    }
    out = write_results(report, "overhead", results_path("overhead", args.out))
    for k, v in summary.items():
        p = v["cost_vs_off_paired"]
        print(
            f"{k:>18}: {v['tokens_per_s_mean']:8.1f} tokens/s, cost vs off {p['mean']:+.2%} "
            f"(95% CI {p['ci95_low']:+.2%} … {p['ci95_high']:+.2%})"
        )
    print("hook per step:", json.dumps(report["hook_per_step"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
