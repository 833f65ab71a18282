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


class OutputError(Exception):
    """Standard output could not be written (a full disk, a reader that left): reported in one
    line by the ``pte`` entry point, or not at all for a reader that left."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))
        self.error = error


class GuardedOutput:
    """A text stream (standard output) whose write errors are :class:`OutputError`, told apart
    from the errors of the files a command reads and writes; everything else is the stream's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except UnicodeEncodeError:
            # Text the stream's encoding cannot spell (a file name whose bytes are not UTF-8
            # reaches Python as surrogate escapes) is printed escaped, not lost to a traceback;
            # the stream encodes the whole text before it writes any, so nothing is doubled.
            encoding = getattr(self._stream, "encoding", None) or "utf-8"
            return self.write(text.encode(encoding, "backslashreplace").decode(encoding))
        except OSError as e:
            raise OutputError(e) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            raise OutputError(e) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


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


def nonempty(what: str = "value") -> Callable[[str], str]:
    """An argparse ``type``: any string but the empty one. An empty string (``--plots ""``, an
    unset shell variable) is no value at all: without this it reads as "not given" and the
    command goes on with its default, silently."""

    def parse(v: str) -> str:
        if not v:
            raise argparse.ArgumentTypeError(f"an empty {what}")
        return v

    return parse


def output_path(v: str) -> str:
    """An argparse ``type`` for a file or folder a command writes: neither empty nor ``-``,
    which is no file name here (these outputs do not go to standard output; ``./-`` names a
    file called ``-``)."""
    if not v:
        raise argparse.ArgumentTypeError("an empty path")
    if v == "-":
        raise argparse.ArgumentTypeError(
            "- is not standard output here: give a path (./- for a file named -)"
        )
    return v


def name_list(v: str) -> list[str]:
    """An argparse ``type``: comma-separated names, each stripped; an empty one (``a,,b``,
    ``,``, a trailing comma) is refused rather than dropped."""
    names = [x.strip() for x in v.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"an empty name in {v!r} (comma-separated names)")
    return names
