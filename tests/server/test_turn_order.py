"""The turn-order watermark of one process: its session turns on their way to the store."""

import math

from pte_instrument.server import turn_order
from pte_instrument.server.turn_order import Unlanded


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_the_watermark_stays_at_the_earliest_turn_not_landed():
    clock = Clock()
    unlanded = Unlanded(clock)
    assert unlanded.watermark() == 1000.0 and unlanded.unpriced_since() == math.inf  # nothing on its way
    unlanded.told("a")
    clock.t = 1001.0
    unlanded.told("b")
    clock.t = 1002.0
    assert unlanded.watermark() == 1000.0 and unlanded.unpriced_since() == 1000.0
    unlanded.priced("a")  # priced: this process sees it, the others not yet
    assert unlanded.unpriced_since() == 1001.0 and unlanded.watermark() == 1000.0
    assert unlanded.watermark(landing=["a"]) == 1001.0  # the batch that commits it
    unlanded.landed(["a"])
    assert unlanded.watermark() == 1001.0
    unlanded.landed(["b"])  # given up unpriced (its pricing failed)
    assert unlanded.watermark() == 1002.0 and unlanded.unpriced_since() == math.inf and len(unlanded) == 0


def test_a_turn_that_never_lands_holds_the_watermark_back_only_so_long():
    clock = Clock()
    unlanded = Unlanded(clock)
    unlanded.told("stuck")
    clock.t += 1.0
    unlanded.told("next")
    clock.t = 1000.0 + turn_order.UNLANDED_FOR_S - 0.5
    assert unlanded.watermark() == 1000.0
    clock.t = 1000.0 + turn_order.UNLANDED_FOR_S + 0.5
    assert unlanded.watermark() == 1001.0 and unlanded.unpriced_since() == 1001.0 and len(unlanded) == 1
