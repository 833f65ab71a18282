"""Counting and logging the plugin's own faults: the plugin never takes the server down."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable

log = logging.getLogger("pte_instrument")


def install_log_handler() -> None:
    """Give the plugin's logger a handler of its own: vLLM configures only its own loggers.
    Called by the entry points when vLLM loads them, never at import."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [pte-instrument] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def say_configuration(problems: Iterable[str]) -> None:
    """One line for each setting value the plugin does not take (each problem names the
    value and the default used instead)."""
    for problem in problems:
        log.error("pte-instrument configuration: %s", problem)


class FaultTracker:
    """Counts faults per stage; logs the first with its traceback, then at most one line
    per stage every ``log_interval_s`` so a persistent fault cannot flood the log."""

    def __init__(self, on_fault: Callable[[str], None] | None = None, log_interval_s: float = 60.0):
        self.counts: Counter[str] = Counter()
        self._on_fault = on_fault
        self._interval = log_interval_s
        self._last_log: dict[str, float] = {}
        self._lock = threading.Lock()

    def record(self, stage: str, exc: BaseException, *, logged: bool = False) -> None:
        """``logged``: the caller has already explained this fault in a line of its own."""
        with self._lock:
            self.counts[stage] += 1
            n = self.counts[stage]
            now = time.monotonic()
            due = not logged and now - self._last_log.get(stage, -self._interval) >= self._interval
            if due:
                self._last_log[stage] = now
        if self._on_fault is not None:
            with contextlib.suppress(Exception):  # the fault counter must not raise either
                self._on_fault(stage)
        if logged:
            return
        # disk, permissions, or an error whose class says its message names the place and why
        if n == 1 and (isinstance(exc, OSError) or getattr(exc, "says_it_all", False)):
            log.error("pte-instrument: fault in stage %r (serving continues): %s", stage, exc)
        elif n == 1:
            log.error("pte-instrument: fault in stage %r (serving continues)", stage, exc_info=exc)
        elif due:
            log.error("pte-instrument: %d faults so far in stage %r, latest: %r", n, stage, exc)
