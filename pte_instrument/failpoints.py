"""Fault injection for tests and the load/fault bench: ``PTE_FAILPOINTS=stage:prob,…``
makes ``failpoint(stage)`` raise with that probability (seeded by PTE_FAILPOINTS_SEED).
Unset, a check costs one dict lookup on an empty dict."""

from __future__ import annotations

import os
import random

_points: dict[str, float] = {}
_rng = random.Random(int(os.environ.get("PTE_FAILPOINTS_SEED", "0")))


class InjectedFault(RuntimeError):
    pass


def _parse(spec: str) -> dict[str, float]:
    points = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        stage, _, prob = item.partition(":")
        points[stage] = float(prob or 1.0)
    return points


def fires(stage: str) -> bool:
    """Whether the failpoint of ``stage`` fires now: for a fault that is not an exception
    of its own (a disk that fills in the middle of a write)."""
    return bool(_points and (p := _points.get(stage)) and _rng.random() < p)


def failpoint(stage: str) -> None:
    if fires(stage):
        raise InjectedFault(f"injected fault in {stage}")


try:
    _points.update(_parse(os.environ.get("PTE_FAILPOINTS", "")))
except ValueError:  # a malformed spec injects nothing rather than breaking the server
    _points.clear()
