"""The latency bench on a real vLLM server (CPU build here; any vLLM works): build the model,
start the server with the plugin (request log) and the engine hook (step log), run agent
sessions at each concurrency, then analyse and write the report.

    python -m bench.latency.run --model-preset tiny                       # concurrency 1, 16, 64
    python -m bench.latency.run --model-preset small --sessions 16 --turns 5   # the headline
    python -m bench.latency.run --model-preset tiny --concurrency 1,16 --sessions 24 --turns 8 \\
        --out bench/results/latency-tiny-<host>-<date>/
    python -m bench.latency.run --analyse bench/results/latency-tiny-<host>-<date>/   # re-analyse logs

Run it from the repository root (``bench`` is not an installed package); ``pte bench latency``
does that for you. Writes, in --out: report.md, report.json, PNG plots, run.json (config and
phase windows), the request and step logs (gzipped) and the server log.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gzip
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.provenance import bench_parser, hostname, load_avg_1m, provenance
from pte_instrument.cost.devices import DeviceProfile
from pte_instrument.validation.calibrate import measure_host_profile
from pte_instrument.validation.phases import Phase
from pte_instrument.validation.report import analyse_logs, write_report

from .driver import DriverConfig, run_phase

REPO = Path(__file__).resolve().parents[2]
HOOK_CLS = "pte_instrument.vllm_adapter.scheduler.PteScheduler"


@dataclass(frozen=True)
class PresetDefaults:
    concurrency: str
    sessions: int
    turns: int
    max_tokens: str
    tool_short: str
    tool_long: str
    task_words: str
    max_model_len: int
    kv_cache_gib: int


# Sized for a small CPU host (two cores); each results folder's run.json records how long the
# preset took there.
PRESET_DEFAULTS = {
    "tiny": PresetDefaults("1,16,64", 24, 8, "8,96", "8,60", "300,900", "20,300", 4096, 1),
    "small": PresetDefaults("1,16,64", 12, 8, "16,160", "8,60", "400,1400", "50,600", 8192, 6),
}


def _range(text: str, kind: type = int) -> tuple[Any, Any]:
    parts = [kind(x) for x in str(text).split(",") if x.strip()]
    if len(parts) == 1:
        return (parts[0], parts[0])
    if len(parts) != 2 or parts[0] > parts[1]:
        raise argparse.ArgumentTypeError(f"expected LO or LO,HI with LO ≤ HI, got {text!r}")
    return (parts[0], parts[1])


def _wait_for_requests(path: Path, prefix: str, n: int, timeout_s: float = 30.0) -> int:
    """The stat logger writes a request a moment after its response: wait for the phase's."""
    deadline = time.monotonic() + timeout_s
    needle = f'"session_id":"{prefix}-'
    while True:
        count = 0
        if path.exists():
            with path.open(encoding="utf-8", errors="replace") as fh:
                count = sum(needle in line for line in fh)
        if count >= n or time.monotonic() > deadline:
            return count
        time.sleep(0.25)


def _reset_prefix_cache(url: str) -> str | None:
    """Empty the prefix cache (vLLM's dev-mode route) so that a phase does not find the
    previous phase's prompts cached: every phase replays the same sessions. An error message
    when it could not."""
    try:
        r = httpx.post(f"{url}/reset_prefix_cache", timeout=30)
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    return None if r.status_code == 200 else f"HTTP {r.status_code}"


def _step_model(url: str) -> dict[str, Any] | None:
    """The engine's step-time model as /pte/summary shows it (engine_hook.step_model)."""
    try:
        r = httpx.get(f"{url}/pte/summary", timeout=30)
        r.raise_for_status()
        return (r.json().get("engine_hook") or {}).get("step_model")
    except (httpx.HTTPError, ValueError):
        return None


def _gzip(path: Path) -> Path | None:
    if not path.exists():
        return None
    gz = path.with_name(path.name + ".gz")
    with path.open("rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return gz


def _log_path(out: Path, name: str) -> Path:
    """A log in the run folder, plain or gzipped (after a finished run)."""
    plain = out / name
    gz = out / (name + ".gz")
    if plain.exists() or not gz.exists():
        return plain
    return gz


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("bench.latency.run", __doc__)
    p.add_argument("--model-preset", choices=sorted(PRESET_DEFAULTS), default="tiny")
    p.add_argument("--model-dir", help="model directory (default models/<preset>; built if missing)")
    p.add_argument("--concurrency", help="comma-separated concurrencies, one phase each (1 … 256)")
    p.add_argument(
        "--sessions",
        type=int,
        help="agent sessions per phase (a phase under load runs at "
        "least 1.5×concurrency so the load is sustained)",
    )
    p.add_argument("--turns", type=int, help="turns per session")
    p.add_argument("--max-tokens", help="reasoning length per turn: LO,HI tokens (uniform), or N")
    p.add_argument("--tool-short", help="short tool result: LO,HI words")
    p.add_argument("--tool-long", help="long (unfiltered) tool result: LO,HI words")
    p.add_argument("--p-long", type=float, default=0.3, help="share of tool results that are long")
    p.add_argument("--task-words", help="first-turn task length: LO,HI words")
    p.add_argument("--tool-pause", default="0,0.05", help="tool pause between turns: LO,HI seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int)
    p.add_argument(
        "--dtype", default="float32", help="served dtype (CPU: float32; bf16 is emulated and ~100× slower)"
    )
    p.add_argument("--kv-cache-gib", type=int, help="VLLM_CPU_KVCACHE_SPACE for the CPU build")
    hook = p.add_mutually_exclusive_group()
    hook.add_argument(
        "--engine-hook",
        choices=["auto", "on", "off"],
        default="auto",
        help=f"--scheduler-cls {HOOK_CLS} (step log); auto: on when the module exists",
    )
    hook.add_argument("--no-engine-hook", dest="engine_hook", action="store_const", const="off")
    p.add_argument("--pte-device", default=None, help="PTE_DEVICE for the plugin (default: its own, auto)")
    p.add_argument(
        "--pte-hoi",
        default="measured",
        help="PTE_HOI for the plugin: 'measured' (this host, served dtype, 1 thread — what the "
        "engine uses), 'none' (the device profile's), or a number",
    )
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--out", help="output folder (default bench/results/latency-<preset>-<host>-<date>/)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--keep-plain-logs", action="store_true", help="do not gzip the JSONL logs")
    p.add_argument("--analyse", metavar="DIR", help="only re-analyse the logs of a finished run in DIR")
    return p


def _config(args: argparse.Namespace) -> dict[str, Any]:
    d = PRESET_DEFAULTS[args.model_preset]
    conc = [int(c) for c in (args.concurrency or d.concurrency).split(",") if c.strip()]
    if not conc or min(conc) < 1 or max(conc) > 256:
        raise SystemExit("--concurrency: values from 1 to 256")
    return {
        "model_preset": args.model_preset,
        "model_dir": str(Path(args.model_dir or REPO / "models" / args.model_preset)),
        "concurrency": conc,
        "sessions": args.sessions or d.sessions,
        "turns": args.turns or d.turns,
        "max_tokens": _range(args.max_tokens or d.max_tokens),
        "tool_short_words": _range(args.tool_short or d.tool_short),
        "tool_long_words": _range(args.tool_long or d.tool_long),
        "p_long": args.p_long,
        "task_words": _range(args.task_words or d.task_words),
        "tool_pause_s": _range(args.tool_pause, float),
        "seed": args.seed,
        "max_model_len": args.max_model_len or d.max_model_len,
        "dtype": args.dtype,
        "kv_cache_gib": args.kv_cache_gib or d.kv_cache_gib,
        "engine_hook": args.engine_hook,
        "pte_device": args.pte_device,
        "pte_hoi": args.pte_hoi,
        "bootstrap": args.bootstrap,
    }


def _driver_config(cfg: dict[str, Any], concurrency: int) -> DriverConfig:
    # Under load, 1.5× as many sessions as slots: when the first ones finish, others are
    # still mid-way, so most of the phase runs at the stated concurrency.
    sessions = cfg["sessions"] if concurrency == 1 else max(cfg["sessions"], concurrency + concurrency // 2)
    return DriverConfig(
        sessions=sessions,
        turns=cfg["turns"],
        concurrency=concurrency,
        output_tokens=cfg["max_tokens"],
        tool_short_words=cfg["tool_short_words"],
        tool_long_words=cfg["tool_long_words"],
        p_long=cfg["p_long"],
        task_words=cfg["task_words"],
        tool_pause_s=cfg["tool_pause_s"],
        max_model_len=cfg["max_model_len"],
        seed=cfg["seed"],
        session_prefix=f"c{concurrency}",
    )


def analyse_dir(out: Path, plots: bool = True) -> list[Path]:
    """(Re-)analyse a run folder from its run.json and logs."""
    run = json.loads((out / "run.json").read_text())
    phases = [Phase(**p) for p in run["phases"]]
    host = run.get("host_profile")
    host_profile = DeviceProfile(**host) if host else None
    cfg = run["config"]
    analysis = None
    req_path = _log_path(out, "requests.jsonl")
    if req_path.exists():
        runs = run.get("phases_run") or []
        analysis = analyse_logs(
            req_path,
            _log_path(out, "steps.jsonl"),
            phases,
            n_boot=cfg.get("bootstrap", 1000),
            seed=cfg.get("seed", 0),
            host_profile=host_profile,
            model_dir=cfg.get("model_dir"),
            dtype=cfg.get("dtype", "float32"),
            engine_step_model=runs[-1].get("step_model") if runs else None,
        )
    meta = {k: v for k, v in run.items() if k not in ("phases",)}
    # The run's provenance is that of the measurement; the analysis may be newer code.
    meta["analysed"] = {k: v for k, v in provenance().items() if k != "machine"}
    return write_report(analysis, meta, out, plots=plots)


def print_targets(out: Path) -> None:
    """The targets of report.json, one line each: what was measured, its interval, met or not."""
    data = json.loads((out / "report.json").read_text())
    for t in (data.get("analysis") or {}).get("targets") or []:
        v, ci = t.get("value"), t.get("ci")
        value = "n/a" if v is None else f"{v:.4f}"
        interval = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci and None not in ci else ""
        met = {True: "met", False: "MISSED", None: "n/a"}[t.get("met")]
        print(f"  {met:6s} {t['name']}: {value}{interval} (wanted {t['target']})")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.analyse:
        files = analyse_dir(Path(args.analyse), plots=not args.no_plots)
        print("\n".join(str(f) for f in files))
        print_targets(Path(args.analyse))
        return 0
    t_begin = time.time()
    cfg = _config(args)
    out = Path(
        args.out
        or REPO / "bench" / "results" / f"latency-{cfg['model_preset']}-{hostname()}-{dt.date.today()}"
    )
    out.mkdir(parents=True, exist_ok=True)
    for name in ("requests.jsonl", "steps.jsonl", "requests.jsonl.gz", "steps.jsonl.gz"):
        with contextlib.suppress(FileNotFoundError):
            (out / name).unlink()
    notes: list[str] = []
    meta: dict[str, Any] = {**provenance(), "config": cfg, "notes": notes}
    say = print

    from pte_instrument.devtools.serving import VllmServer
    from pte_instrument.devtools.tinymodel import build_model

    say(f"[latency] building/checking the {cfg['model_preset']} model in {cfg['model_dir']} …", flush=True)
    build_model(cfg["model_dir"], cfg["model_preset"], seed=0)

    host_profile = measure_host_profile(cfg["dtype"]) if cfg["pte_hoi"] != "none" else None
    env = {
        "PTE_REQUEST_LOG": str(out / "requests.jsonl"),
        "PTE_STEP_LOG": str(out / "steps.jsonl"),
        "VLLM_PLUGINS": "pte",  # session routes: the request log gets session ids and turns
        "VLLM_CPU_KVCACHE_SPACE": str(cfg["kv_cache_gib"]),
        "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache between phases
    }
    # the server's session store is its working state, not a result: outside the run folder
    store_dir = Path(tempfile.mkdtemp(prefix="pte-latency-"))
    env["PTE_SESSION_STORE"] = str(store_dir / "sessions.sqlite3")
    if cfg["pte_device"]:
        env["PTE_DEVICE"] = cfg["pte_device"]
    if cfg["pte_hoi"] == "measured" and host_profile is not None:
        env["PTE_HOI"] = f"{host_profile.hoi:.6g}"
        say(f"[latency] host HOI {host_profile.hoi:.2f} ({host_profile.source}) → PTE_HOI", flush=True)
    elif cfg["pte_hoi"] not in ("none", "measured"):
        env["PTE_HOI"] = str(float(cfg["pte_hoi"]))
    hook_exists = importlib.util.find_spec("pte_instrument.vllm_adapter.scheduler") is not None
    use_hook = cfg["engine_hook"] == "on" or (cfg["engine_hook"] == "auto" and hook_exists)
    if cfg["engine_hook"] == "auto" and not hook_exists:
        notes.append("engine hook module not found: ran without it (no step log)")
    base_args = [
        "--enable-prefix-caching",
        "--dtype",
        cfg["dtype"],
        "--max-model-len",
        str(cfg["max_model_len"]),
    ]

    def make_server(hook: bool) -> VllmServer:
        return VllmServer(
            cfg["model_dir"],
            served_name=cfg["model_preset"],
            port=args.port,
            extra_args=base_args + (["--scheduler-cls", HOOK_CLS] if hook else []),
            env=env,
            log_path=out / "vllm.log",
            startup_timeout_s=600,
        )

    server = make_server(use_hook)
    say(f"[latency] starting vLLM (engine hook {'on' if use_hook else 'off'}) …", flush=True)
    t0 = time.time()
    try:
        server.start()
    except (RuntimeError, TimeoutError) as e:
        if not use_hook:
            raise
        notes.append(f"vLLM did not start with the engine hook ({str(e).splitlines()[0]}); ran without it")
        shutil.copy(out / "vllm.log", out / "vllm-hook-failed.log")
        use_hook = False
        server = make_server(False)
        server.start()
    startup_s = time.time() - t0
    say(f"[latency] server up in {startup_s:.0f}s at {server.url}", flush=True)
    phases: list[Phase] = []
    summaries: list[dict[str, Any]] = []
    turns_out = out / "turns.jsonl"
    try:
        # Warm-up: the first requests pay one-off costs (compilation of new shapes, allocator),
        # and the engine's online step-time fit (refitted every 256 steps) needs a few hundred
        # steps, prefill and decode, before its predicted seconds are a fit's rather than theory's.
        run_phase(
            server.url,
            server.served_name,
            DriverConfig(
                sessions=6,
                turns=3,
                concurrency=2,
                output_tokens=(24, 64),
                max_model_len=cfg["max_model_len"],
                session_prefix="warmup",
                seed=cfg["seed"] + 10_000,
            ),
            progress=False,
        )
        time.sleep(0.5)
        with turns_out.open("w") as tf:
            for c in cfg["concurrency"]:
                dcfg = _driver_config(cfg, c)
                err = _reset_prefix_cache(server.url)
                if err is not None:
                    notes.append(f"phase c{c}: the prefix cache could not be reset ({err})")
                say(
                    f"[latency] phase c{c}: {dcfg.sessions} sessions × {dcfg.turns} turns, concurrency {c}",
                    flush=True,
                )
                res = run_phase(server.url, server.served_name, dcfg, progress=not args.no_progress)
                for t in res.turns:
                    tf.write(json.dumps(asdict(t)) + "\n")
                ok = sum(t.error is None for t in res.turns)
                got = _wait_for_requests(out / "requests.jsonl", dcfg.session_prefix, ok)
                if got < ok:
                    notes.append(f"phase c{c}: {got} of {ok} requests reached the request log")
                phases.append(Phase(f"c{c}", c, res.t_start, res.t_end, dcfg.session_prefix))
                summaries.append(
                    {
                        "name": f"c{c}",
                        **res.summary(),
                        "step_model": _step_model(server.url),
                        "load_avg_1m_end": load_avg_1m(),
                    }
                )
                say(
                    f"[latency] phase c{c} done in {res.wall_s:.1f}s ({ok} turns, {res.errors} errors)",
                    flush=True,
                )
                time.sleep(0.5)  # keeps the phases' step windows apart
    finally:
        server.stop()  # flushes the engine's buffered step log
        shutil.rmtree(store_dir, ignore_errors=True)
    meta.update(
        {
            "phases": [p.to_dict() for p in phases],
            "phases_run": summaries,
            "host_profile": asdict(host_profile) if host_profile else None,
            "server": {
                "args": server.command()[3:],
                "env": env,
                "engine_hook": use_hook,
                "startup_s": round(startup_s, 1),
            },
            "load_avg_1m_end": load_avg_1m(),
        }
    )
    meta["wall_s_until_analysis"] = round(time.time() - t_begin, 1)
    (out / "run.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    say("[latency] analysing …", flush=True)
    files = analyse_dir(out, plots=not args.no_plots)
    if not args.keep_plain_logs:
        for name in ("requests.jsonl", "steps.jsonl", "turns.jsonl"):
            _gzip(out / name)
    meta["wall_s_total"] = round(time.time() - t_begin, 1)
    (out / "run.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    say(f"[latency] done in {meta['wall_s_total']:.0f}s; report: {out / 'report.md'}", flush=True)
    for f in files:
        say(f"  {f}")
    print_targets(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
