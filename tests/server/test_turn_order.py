"""The watermarks of one process: its session turns, and its requests, on their way to the store."""

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
    assert unlanded.watermark() == 1000.0 and unlanded.unpriced_since("s") == math.inf  # nothing on its way
    unlanded.told("a", "s")
    clock.t = 1001.0
    unlanded.told("b", "s")
    clock.t = 1002.0
    assert unlanded.watermark() == 1000.0 and unlanded.unpriced_since("s") == 1000.0
    unlanded.priced("a")  # priced: this process sees it, the others not yet
    assert unlanded.unpriced_since("s") == 1001.0 and unlanded.watermark() == 1000.0
    assert unlanded.watermark(landing=["a"]) == 1001.0  # the batch that commits it
    unlanded.landed(["a"])
    assert unlanded.watermark() == 1001.0
    unlanded.landed(["b"])  # given up unpriced (its pricing failed)
    assert unlanded.watermark() == 1002.0 and unlanded.unpriced_since("s") == math.inf and len(unlanded) == 0


def test_a_request_of_no_session_holds_back_the_requests_watermark_only():
    """What the turns of other processes wait for is not held by a request of no session;
    what a label sent to another API server waits for is, until it lands."""
    clock = Clock()
    unlanded = Unlanded(clock)
    unlanded.told("r", None)
    clock.t = 1001.0
    unlanded.told("t", "s")
    clock.t = 1002.0
    assert unlanded.watermarks() == (1001.0, 1000.0) and unlanded.unpriced_since("s") == 1001.0
    assert unlanded.watermarks(landing=["r"]) == (1001.0, 1001.0)
    unlanded.landed(["r", "t"])
    assert unlanded.watermarks() == (1002.0, 1002.0) and len(unlanded) == 0


def test_a_turn_that_never_lands_holds_the_watermark_back_only_so_long():
    clock = Clock()
    unlanded = Unlanded(clock)
    unlanded.told("stuck", "s")
    clock.t += 1.0
    unlanded.told("next", "s")
    clock.t = 1000.0 + turn_order.UNLANDED_FOR_S - 0.5
    assert unlanded.watermark() == 1000.0
    clock.t = 1000.0 + turn_order.UNLANDED_FOR_S + 0.5
    assert unlanded.watermark() == 1001.0 and unlanded.unpriced_since("s") == 1001.0 and len(unlanded) == 1


def test_a_session_waits_only_for_its_own_unpriced_turns():
    clock = Clock()
    unlanded = Unlanded(clock)
    unlanded.told("x-1", "x")
    clock.t = 1001.0
    unlanded.told("y-1", "y")
    assert unlanded.unpriced_since("x") == 1000.0 and unlanded.unpriced_since("y") == 1001.0
    assert unlanded.unpriced_since("z") == math.inf
    clock.t = 1002.0
    unlanded.told("x-1", "z")  # a client reused the id, for another session
    assert unlanded.unpriced_since("x") == math.inf and unlanded.unpriced_since("z") == 1002.0
    unlanded.priced("y-1")
    assert unlanded.unpriced_since("y") == math.inf
    assert unlanded.watermark() == 1000.0  # both requests under "x-1" are on their way
    assert unlanded.watermark(landing=["x-1", "x-1"]) == 1001.0  # y-1: priced, not landed


def test_an_id_told_once_per_parallel_sample_is_on_its_way_until_every_sample_lands():
    """vLLM reports each sample of an n > 1 request finished under the parent's id: the id
    holds the watermark from its first sample until the last lands, and its session waits
    until the last is priced."""
    clock = Clock()
    unlanded = Unlanded(clock)
    unlanded.told("p", "s")
    clock.t = 1001.0
    unlanded.told("p", "s")
    clock.t = 1002.0
    unlanded.priced("p")
    assert unlanded.unpriced_since("s") == 1000.0 and unlanded.watermark(landing=["p"]) == 1000.0
    unlanded.priced("p")
    assert unlanded.unpriced_since("s") == math.inf and unlanded.watermark(landing=["p", "p"]) == 1002.0
    unlanded.landed(["p"])
    assert unlanded.watermark() == 1000.0 and len(unlanded) == 1
    unlanded.landed(["p"])
    assert unlanded.watermark() == 1002.0 and len(unlanded) == 0
