"""PTE variants with γ = 0.01 exactly: hand-computed expectations."""

import numpy as np
import pytest

from pte_instrument.cost.architecture import KVGroup, ModelShape
from pte_instrument.cost.devices import DeviceProfile
from pte_instrument.cost.model import (
    CostModel,
    TurnTokens,
    context_sum,
    price_trajectory,
    price_turn,
    reusable_prefix,
    session_turns,
)


def model(gamma_bytes: float = 2.0, window: int | None = None) -> CostModel:
    # γ = bytes · HOI / (2 · N_active) = 2 · 1 / (2 · 100) = 0.01
    shape = ModelShape("unit", 1, 8, 1, 1, 8, "mha", 2, (KVGroup(1, gamma_bytes, window),), 100.0, 100.0)
    return CostModel(shape, DeviceProfile("unit", 1.0, 1.0, "test"))


def test_gamma():
    assert model().gamma == pytest.approx(0.01)


def test_context_sum_closed_form():
    assert context_sum(100, 10) == 100 * 10 + 45  # Σ_{j<10} (100 + j)
    assert context_sum(5, 6, 8) == 5 + 6 + 7 + 8 + 8 + 8  # = 42, capped at the window
    assert context_sum(20, 3, 8) == 24  # already past the window
    assert context_sum(3, 2, 8) == 7  # never reaches it
    assert context_sum(7, 0) == 0
    L = np.array([5, 20, 3, 100])
    D = np.array([6, 3, 2, 10])
    np.testing.assert_array_equal(context_sum(L, D, 8), [42, 24, 7, 80])
    brute = [sum(min(ctx + j, 8) for j in range(d)) for ctx, d in zip(L, D, strict=True)]
    np.testing.assert_array_equal(context_sum(L, D, 8), brute)


def test_single_turn_variants():
    c = price_turn(
        model(),
        TurnTokens(
            prompt_tokens=100, output_tokens=10, cached_tokens=40, recomputed_tokens=5, reusable_tokens=80
        ),
    )
    # reference: full prompt + γ·L·D = 100 + 0.01·1000
    assert c.reference == pytest.approx(110.0)
    # served: (100 − 40 + 5) + 0.01·(100·10 + 10·9/2) = 65 + 10.45
    assert c.served_prefill == 65 and c.served_decode == pytest.approx(10.45)
    assert c.served == pytest.approx(75.45)
    # ideal: only the 20 tokens new since the previous turn + the same exact decode
    assert c.ideal == pytest.approx(30.45)
    # eviction tax: 80 reusable tokens, 40 came from the cache → 40 re-prefilled
    assert c.eviction_tax == pytest.approx(40.0)
    assert c.recompute == 5


def test_cache_beyond_the_session_is_not_a_tax():
    # a prefix shared with other sessions (120 cached) exceeds what this session paid (80)
    c = price_turn(model(), TurnTokens(200, 1, cached_tokens=120, reusable_tokens=80))
    assert c.eviction_tax == 0.0
    assert c.served_prefill == 80


def test_trajectory_ideal_and_eviction_tax():
    turns = session_turns(prompts=[50, 80], outputs=[10, 5])
    # turn 1 computed its 50 prompt tokens and 9 of its 10 outputs (the last was never fed back)
    assert [t.reusable_tokens for t in turns] == [0, 59]
    total = price_trajectory(model(), turns)
    # served: 50 + 0.01·(500 + 45) + 80 + 0.01·(400 + 10) = 139.55
    assert total.served == pytest.approx(139.55)
    # ideal: turn 2 prefills only the 80 − 59 = 21 tokens turn 1 never computed
    assert total.ideal == pytest.approx(139.55 - 59)
    # reference: 50 + 0.01·500 + 80 + 0.01·400
    assert total.reference == pytest.approx(139.0)
    # no cache between turns: the 59 reusable tokens were paid again
    assert total.served - total.ideal == pytest.approx(59)
    assert total.eviction_tax == pytest.approx(59)


def test_trajectory_with_cache_has_no_tax():
    turns = session_turns(prompts=[50, 80], outputs=[10, 5], cached=[0, 59])
    total = price_trajectory(model(), turns)
    assert total.served == pytest.approx(total.ideal)
    assert total.eviction_tax == 0


def test_reusable_prefix_is_block_granular():
    # 300 prompt + 40 outputs → 339 computed tokens → two whole 128-token blocks
    assert reusable_prefix(300, 40, 500, block_size=128) == 256
    assert reusable_prefix(300, 40, 200, block_size=128) == 200  # capped by this prompt
    assert reusable_prefix(300, 0, 500) == 300  # nothing generated: the prompt was computed
    turns = session_turns([300, 500], [40, 5], block_size=128)
    assert turns[1].reusable_tokens == 256


def test_rejects_impossible_counts():
    with pytest.raises(ValueError, match="exceed"):
        price_turn(model(), TurnTokens(10, 1, cached_tokens=11))
    with pytest.raises(ValueError, match="non-negative"):
        price_turn(model(), TurnTokens(10, -1))
