"""Fault injection for tests and the load/fault bench: ``PTE_FAILPOINTS=stage:prob,…``
makes ``failpoint(stage)`` raise with that probability (seeded by PTE_FAILPOINTS_SEED).
Unset, a check costs one dict lookup on an empty dict. A malformed spec injects nothing
and a malformed seed means 0: the settings name either in one line."""

from __future__ import annotations

import math
import os
import random

# The stages with a failpoint (``request_log``: a disk that fills in the middle of a record).
STAGES = ("engine_step", "prometheus", "request_log", "routes", "session_store", "transport")
SPEC_ENV = "PTE_FAILPOINTS"
SEED_ENV = "PTE_FAILPOINTS_SEED"


class InjectedFault(RuntimeError):
    pass


def parse(spec: str | None) -> tuple[dict[str, float], str | None]:
    """The points of a spec, and why it is unusable (None: it is; else no point at all)."""
    points: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        stage, _, raw = item.partition(":")
        try:
            prob = float(raw) if raw.strip() else 1.0
        except ValueError:
            prob = math.nan
        if stage.strip() not in STAGES or not 0.0 <= prob <= 1.0:  # NaN fails both
            return {}, (
                f"{item[:40]!r} is not stage:probability (a stage of {', '.join(STAGES)}; a number "
                "from 0 to 1); no fault is injected"
            )
        points[stage.strip()] = prob
    return points, None


def parse_seed(raw: str | None) -> tuple[int, str | None]:
    if raw is None:
        return 0, None
    if raw.strip().isdigit():
        return int(raw), None
    return 0, "not a whole number of 0 or more; using 0"


_points, _ = parse(os.environ.get(SPEC_ENV))
_rng = random.Random(parse_seed(os.environ.get(SEED_ENV))[0])


def fires(stage: str) -> bool:
    """Whether the failpoint of ``stage`` fires now: for a fault that is not an exception
    of its own (a disk that fills in the middle of a write)."""
    return bool(_points and (p := _points.get(stage)) and _rng.random() < p)


def failpoint(stage: str) -> None:
    if fires(stage):
        raise InjectedFault(f"injected fault in {stage}")
