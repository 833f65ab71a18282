"""The ``pte`` command. Every subcommand prints a human table by default and stable JSON
(sorted keys) with ``--json``. Bad input: one clear line on stderr, exit code 2
(:mod:`pte_instrument.cli.errors`).

``gamma``, ``devices``, ``tenant-hash`` and ``demo`` live here; ``efficiency`` and ``report`` in
:mod:`pte_instrument.cli.efficiency`, ``bench`` in :mod:`pte_instrument.cli.bench`,
``calibrate`` in :mod:`pte_instrument.cli.calibrate`, ``validate`` in
:mod:`pte_instrument.cli.validate`. Those modules import only
:mod:`pte_instrument.cli.errors` and :mod:`pte_instrument.cli.outputs` (output folders
written all or none) of this package, never this module."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from pte_instrument.cli.bench import add_bench_parser
from pte_instrument.cli.calibrate import add_calibrate_parser
from pte_instrument.cli.efficiency import add_efficiency_parser, add_report_parser
from pte_instrument.cli.errors import (
    GuardedOutput,
    OutputError,
    UsageError,
    nonempty,
    print_json,
    report_error,
    report_warning,
    whole_number,
)
from pte_instrument.cli.validate import add_validate_parser
from pte_instrument.cost.architecture import ArchitectureError, load_config, parse_shape
from pte_instrument.cost.devices import PROFILES, UnknownDeviceError, measure_profile, resolve_device
from pte_instrument.cost.model import CostModel
from pte_instrument.server.tenants import TENANT_HASH_HEX, tenant_hash


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> Table:
    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*(str(x) for x in r))
    return table


def cmd_gamma(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.model)
        shape = parse_shape(cfg, kv_cache_dtype=args.kv_cache_dtype, n_active_override=args.n_active)
        model = CostModel(shape, resolve_device(args.device, args.hoi))
    except (ArchitectureError, UnknownDeviceError) as e:
        raise UsageError(str(e)) from None
    info = model.describe()
    if info["assumed"]:  # γ rests on a guess: say so, whatever the output format
        report_warning("gamma", "; ".join(info["assumed"]))
    if args.json:
        print_json(info)
        return 0
    rows = [
        ["gamma", f"{info['gamma']:.6g}"],
        *(
            [f"  gamma (window {g['window']})", f"{g['gamma']:.6g}"]
            for g in info["gamma_groups"]
            if len(info["gamma_groups"]) > 1
        ),
        ["KV bytes / context token", f"{info['kv_bytes_per_token']:g}"],
        ["N_active", f"{info['n_active']:.4g}"],
        ["HOI (FLOP/byte)", f"{info['hoi']:.2f}"],
        ["device", info["device"]],
        [
            "attention",
            f"{info['attention']} ({info['n_heads']} q / {info['n_kv_heads']} kv heads, head_dim {info['head_dim']})",
        ],
        ["layers", info["n_layers"]],
        ["KV dtype bytes", f"{info['kv_dtype_bytes']:g}"],
    ]
    if info["moe_experts"]:
        rows.append(["MoE", f"{info['moe_experts_per_token']} of {info['moe_experts']} experts per token"])
    rows += [["assumed", a] for a in info["assumed"]]
    Console(markup=False).print(_table(f"γ for {args.model}", ["quantity", "value"], rows))
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    if args.measure_device is not None and not args.measure:
        raise UsageError("--measure-device applies only with --measure")
    profiles = list(PROFILES.values())
    if args.measure:
        try:
            profiles.append(measure_profile(args.measure_device))
        except (RuntimeError, AssertionError) as e:  # torch: an unknown device, or one it was not built for
            raise UsageError(
                f"cannot measure on {args.measure_device!r}: {' '.join(str(e).split())}"
            ) from None
    data = [
        {
            "name": p.name,
            "peak_flops": p.peak_flops,
            "mem_bandwidth": p.mem_bandwidth,
            "hoi": p.hoi,
            "measured": p.measured,
            "source": p.source,
        }
        for p in profiles
    ]
    if args.json:
        print_json(data)
        return 0
    # TFLOP/s of the dtype the source names: dense bf16 on a datasheet (fp16 for the V100),
    # fp32 for a measured CPU
    rows = [
        [
            d["name"],
            f"{d['peak_flops'] / 1e12:.4g}",
            f"{d['mem_bandwidth'] / 1e9:.4g}",
            f"{d['hoi']:.1f}",
            d["source"],
        ]
        for d in data
    ]
    Console(markup=False).print(_table("device profiles", ["name", "TFLOP/s", "GB/s", "HOI", "source"], rows))
    return 0


def cmd_tenant_hash(args: argparse.Namespace) -> int:
    """The ``PTE_TENANTS`` entry of an API key (with ``PTE_TENANT_FROM_API_KEY=1``). ``-``
    reads the key from stdin, so that it stays out of the shell's history and ``ps``."""
    # The server hashes the bearer token's bytes: so are these, a key that is not UTF-8 included
    # (argv's undecodable bytes come back through the file-system encoding, stdin is not decoded).
    key = sys.stdin.buffer.readline().rstrip(b"\r\n") if args.key == "-" else os.fsencode(args.key)
    if not key:
        raise UsageError("no API key given (pass it, or - to read one line from stdin)")
    tenant = tenant_hash(key)
    if args.json:
        print_json({"tenant": tenant})
        return 0
    Console(markup=False).print(_table("tenant of the API key", ["PTE_TENANTS entry"], [[tenant]]))
    return 0


MAX_PORT = 65535


def cmd_demo(args: argparse.Namespace) -> int:
    from pte_instrument.devtools.demo import run_demo

    # replica i listens on --port + i: refused here, not after a minute of starting vLLM
    if args.port and args.port + args.replicas - 1 > MAX_PORT:
        raise UsageError(
            f"--port {args.port} with --replicas {args.replicas}: ports up to "
            f"{args.port + args.replicas - 1}, past {MAX_PORT}"
        )

    return run_demo(
        model_dir=args.model_dir,
        port=args.port,
        turns=args.turns,
        sessions=args.sessions,
        replicas=args.replicas,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pte", description="Prefill Token Equivalents for vLLM")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("gamma", help="γ of a model on a device, with its breakdown")
    g.add_argument("model", type=nonempty("path"), help="model directory or config.json")
    g.add_argument(
        "--device",
        type=nonempty("device name"),
        default="auto",
        help=f"device profile: auto, measured, {', '.join(PROFILES)}",
    )
    g.add_argument("--hoi", type=float, help="override the hardware operational intensity (FLOP/byte)")
    g.add_argument("--n-active", type=float, help="override N_active (e.g. the model card's figure)")
    g.add_argument(
        "--kv-cache-dtype", type=nonempty("dtype"), default=None, help="KV cache dtype (auto, fp8, bfloat16…)"
    )
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_gamma)

    d = sub.add_parser("devices", help="device profiles (datasheet, and measured with --measure)")
    d.add_argument(
        "--measure",
        action="store_true",
        help="also time a matmul (bf16 on a GPU, fp32 on a CPU) and a copy here",
    )
    d.add_argument(
        "--measure-device",
        type=nonempty("device name"),
        default=None,
        help="torch device to measure (default cuda if present, else cpu)",
    )
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_devices)

    t = sub.add_parser(
        "tenant-hash",
        help=f"an API key's tenant for PTE_TENANTS: the first {TENANT_HASH_HEX} hex digits of its SHA-256",
    )
    t.add_argument("key", help="the API key, or - to read it from stdin")
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=cmd_tenant_hash)

    m = sub.add_parser(
        "demo", help="serve the tiny model with the plugin, run an agent workload, print the PTE report"
    )
    m.add_argument("--model-dir", type=nonempty("path"), default="models/tiny")
    m.add_argument("--port", type=whole_number(0, MAX_PORT), default=0, help="0: pick a free port")
    m.add_argument("--sessions", type=whole_number(1), default=3)
    m.add_argument("--turns", type=whole_number(1), default=4)
    m.add_argument(
        "--replicas",
        type=int,
        default=1,
        choices=range(1, 5),
        metavar="N",
        help="N servers (1–4) sharing one session store on a redis-server the demo starts (Debian's "
        "redis-server package), with sessions whose turns move between them: the routing tax",
    )
    m.set_defaults(func=cmd_demo)

    add_efficiency_parser(sub)
    add_report_parser(sub)
    add_bench_parser(sub)
    add_calibrate_parser(sub)
    add_validate_parser(sub)
    return parser


# what a shell reports for a command a closed pipe stopped
EXIT_READER_LEFT = 128 + getattr(signal, "SIGPIPE", 13)


def _drop_stdout(stream: Any) -> None:
    """Point the process's standard output at the null device: what the stream still buffers
    would fail again at exit, with a message of the interpreter's own."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError):  # not a file (a test's capture)
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stdout = sys.stdout
    sys.stdout = GuardedOutput(stdout)  # type: ignore[assignment]
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, not at exit: a failure is this command's to report
        return code
    except UsageError as e:
        return report_error(args.command, e)
    except OutputError as e:
        _drop_stdout(stdout)
        if isinstance(e.error, BrokenPipeError):  # `pte … | head`: the reader has what it wanted
            return EXIT_READER_LEFT
        return report_error(args.command, f"cannot write to standard output: {e}")
    finally:
        sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
