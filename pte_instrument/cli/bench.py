"""``pte bench …``: the benchmarks of the source tree's ``bench/`` folder.

``bench/`` is not part of the installed package (it needs a checkout: the tiny model builder,
vLLM, results folders), so each bench runs as module ``bench.<name>`` of the repository root —
found next to this package, which is where an editable install (``pip install -e .``, what
``make`` does) leaves it — in a subprocess that has the root first on ``sys.path`` and on
``PYTHONPATH``. Children of the bench (the vLLM server) inherit that environment, so they import
the checkout's package too. The working directory stays the caller's, so relative paths
(``--out``) mean what they say. Every argument after the bench's name is passed through
unchanged:

    pte bench latency --model-preset tiny --concurrency 1,16
    pte bench latency --help
    pte bench gpu-latency --device cpu --tiny
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from pte_instrument.cli.errors import UsageError

# name → (module under the repository root, file that must exist, help)
BENCHES: dict[str, tuple[str, str, str]] = {
    "latency": (
        "bench.latency.run",
        "bench/latency/run.py",
        "latency validation on a real vLLM server: does PTE track wall-clock time? (all args passed on)",
    ),
    "gpu-latency": (
        "bench.gpu_latency",
        "bench/gpu_latency.py",
        "γ measured on a GPU with torch + transformers only, no vLLM (all args passed on)",
    ),
}


def repo_root(start: Path | None = None) -> Path | None:
    """The source checkout holding ``bench/``: the folder above the ``pte_instrument`` package."""
    root = start or Path(__file__).resolve().parents[2]
    return root if (root / "bench").is_dir() else None


# ``python -m`` would put the working directory first on sys.path, ahead of PYTHONPATH, so a
# bench/ folder or bench.py there (the caller's own project) would run instead of the checkout's.
# The child puts the root in that place instead, then runs the module as ``-m`` does.
RUN_FROM_ROOT = (
    "import runpy, sys; sys.path[0] = sys.argv.pop(1); "
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"
)


def bench_command(name: str, args: list[str], root: Path) -> list[str]:
    """The command line that runs bench ``name`` of the checkout at ``root`` with ``args``; run it
    with :func:`bench_env`'s environment."""
    module, marker, _ = BENCHES[name]
    if not (root / marker).is_file():
        raise FileNotFoundError(f"{root / marker} not found")
    return [sys.executable, "-c", RUN_FROM_ROOT, str(root), module, *args]


def bench_env(root: Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's environment) with ``root`` first on ``PYTHONPATH``."""
    env = dict(os.environ if environ is None else environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return env


def cmd_bench(args: argparse.Namespace) -> int:
    root = repo_root()
    if root is None:
        raise UsageError(
            "the benches live in the source tree's bench/ folder, which this installation lacks; "
            "run from a checkout installed with `pip install -e .`"
        )
    try:
        cmd = bench_command(args.bench_name, list(args.bench_args), root)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    return subprocess.call(cmd, env=bench_env(root))


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``pte bench <name> [args…]`` to the ``pte`` parser."""
    b = subparsers.add_parser("bench", help="benchmarks of the source tree (latency validation, GPU γ)")
    sub = b.add_subparsers(dest="bench_name", required=True, metavar="{" + ",".join(BENCHES) + "}")
    for name, (_module, _marker, help_text) in BENCHES.items():
        # add_help=False: --help goes to the bench itself, which documents its options.
        # prefix_chars="\0": no option of its own, so "--flag" strings stay in bench_args.
        p = sub.add_parser(name, help=help_text, add_help=False, prefix_chars="\0")
        p.add_argument("bench_args", nargs=argparse.REMAINDER)
        p.set_defaults(func=cmd_bench)
