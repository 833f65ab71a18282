"""``pte bench …``: the benchmarks of the source tree's ``bench/`` folder.

``bench/`` is not part of the installed package (it needs a checkout: the tiny model builder,
vLLM, results folders), so each bench runs as module ``bench.<name>`` in a subprocess with the
repository root — found next to this package, which is where an editable install
(``pip install -e .``, what ``make`` does) leaves it — first on ``sys.path``. The working
directory stays the caller's, so relative paths (``--out``) mean what they say. Every
argument after the bench's name is passed through unchanged:

    pte bench latency --model-preset tiny --concurrency 1,16
    pte bench latency --help
    pte bench gpu-latency --device cpu --tiny
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

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


# Runs a module of the checkout as __main__ with the checkout first on sys.path, whatever
# the working directory (``python -m`` would look in the working directory instead).
_RUNNER = (
    "import runpy, sys; root, mod = sys.argv[1:3]; sys.path.insert(0, root); "
    "sys.argv = [mod, *sys.argv[3:]]; runpy.run_module(mod, run_name='__main__', alter_sys=True)"
)


def bench_command(name: str, args: list[str], root: Path) -> list[str]:
    module, marker, _ = BENCHES[name]
    if not (root / marker).is_file():
        raise FileNotFoundError(f"{root / marker} not found")
    return [sys.executable, "-c", _RUNNER, str(root), module, *args]


def cmd_bench(args: argparse.Namespace) -> int:
    from pte_instrument.cli.main import UsageError

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
    env = dict(os.environ)  # children (the vLLM server) import the checkout's package too
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.call(cmd, env=env)


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
