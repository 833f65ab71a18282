"""The one error convention of the ``pte`` command line, shared by every sub-command module.

Bad input from the user (a missing file, an unknown device, a malformed record) is a
:class:`UsageError`: it is reported as one line on stderr, ``pte <command>: error: <what>``,
and the command exits with :data:`EXIT_BAD_INPUT` — never a traceback. A traceback means a
bug. Machine-readable output goes through :func:`print_json`.

This module imports nothing else of the package, so every sub-command module (``main``,
``bench``, ``efficiency``) can import it without importing each other.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

EXIT_OK = 0
EXIT_BAD_INPUT = 2  # argparse's own exit code for a bad command line: one code for all bad input


class UsageError(Exception):
    """Bad input from the user: reported in one line, never as a traceback."""


def report_error(command: str, message: object) -> int:
    """Print ``pte <command>: error: <message>`` on stderr; return :data:`EXIT_BAD_INPUT`."""
    print(f"pte {command}: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def report_warning(command: str, message: object) -> None:
    """Print ``pte <command>: warning: <message>`` on stderr."""
    print(f"pte {command}: warning: {message}", file=sys.stderr)


def print_json(data: Any) -> None:
    """Stable JSON on stdout: indented, keys sorted. ``allow_nan=False``: every command turns
    undefined numbers into null, so a NaN here is a bug and raises."""
    print(json.dumps(data, indent=2, sort_keys=True, allow_nan=False))


def whole_number(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer from ``low`` (up to ``high`` when given)."""

    def parse(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {v!r}") from None
        if high is None and n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
        if high is not None and not low <= n <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {n}")
        return n

    return parse
