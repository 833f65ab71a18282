"""Fault injection for tests and the load/fault bench: ``PTE_FAILPOINTS=stage:prob,…``
makes ``failpoint(stage)`` raise with that probability (seeded by PTE_FAILPOINTS_SEED).
Unset, a check costs one dict lookup on an empty dict. A malformed spec injects nothing
and a malformed seed means 0: the settings name either in one line."""

from __future__ import annotations

import random

from pte_instrument import settings

STAGES = settings.FAILPOINT_STAGES
SPEC_ENV = "PTE_FAILPOINTS"
SEED_ENV = "PTE_FAILPOINTS_SEED"


class InjectedFault(RuntimeError):
    pass


points = dict(settings.read(SPEC_ENV)[0])  # stage → probability; empty: none armed
_rng = random.Random(settings.read(SEED_ENV)[0])


def fires(stage: str) -> bool:
    """Whether the failpoint of ``stage`` fires now: for a fault that is not an exception
    of its own (a disk that fills in the middle of a write)."""
    return bool(points and (p := points.get(stage)) and _rng.random() < p)


def failpoint(stage: str) -> None:
    if fires(stage):
        raise InjectedFault(f"injected fault in {stage}")
