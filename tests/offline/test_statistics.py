"""The shared statistics: ranks, Pearson and Spearman, resample counts, weighted resample
correlations and percentile intervals — hand-computed values, and the one small-sample rule
(fewer than three pairs, a constant side, or fewer than ten finite resamples: NaN, silently)."""

import math
import warnings

import numpy as np
import pytest

from pte_instrument.offline import statistics as S

# ----------------------------------------------------------------------------- ranks


def test_rankdata_by_hand():
    np.testing.assert_array_equal(S.rankdata([10, 20, 20, 30]), [1, 2.5, 2.5, 4])
    np.testing.assert_array_equal(S.rankdata([3, 1, 2]), [3, 1, 2])
    np.testing.assert_array_equal(S.rankdata([7, 7, 7, 7]), [2.5, 2.5, 2.5, 2.5])
    # rows ranked independently: row 2 ties the two 1s at (1 + 2)/2 after the 0
    rows = S.rankdata(np.array([[3, 1, 2, 2], [1, 1, 9, 0]]))
    np.testing.assert_array_equal(rows, [[4, 1, 2.5, 2.5], [2.5, 2.5, 4, 1]])
    assert S.rankdata([]).shape == (0,)


# ----------------------------------------------------------------------------- correlations


def test_pearson_by_hand():
    # x centred −2 −1 0 1 2, y centred −2 0 1 0 1: Σxy = 4 + 0 + 0 + 0 + 2 = 6, Σx² = 10, Σy² = 6
    assert S.pearson([1, 2, 3, 4, 5], [2, 4, 5, 4, 5]) == pytest.approx(6 / math.sqrt(60), abs=1e-12)
    # three points, x centred −1 0 1, y centred −1 1 0: Σxy = 1, Σx² = Σy² = 2 → 1/2
    assert S.pearson([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5, abs=1e-12)
    assert S.pearson([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    # a scale and shift of one side leaves r unchanged
    assert S.pearson([1, 2, 3], [5, 11, 8]) == pytest.approx(0.5, abs=1e-12)


def test_spearman_by_hand():
    # ranks of y: 1, 4, 2.5, 2.5; centred x −1.5 −.5 .5 1.5, y −1.5 1.5 0 0:
    # Σxy = 2.25 − .75 = 1.5, Σx² = 5, Σy² = 4.5 → 1.5/√22.5
    assert S.spearman([1, 2, 3, 4], [1, 3, 2, 2]) == pytest.approx(1.5 / math.sqrt(22.5), abs=1e-12)
    # ranks of y (1, 2.5, 4.5, 2.5, 4.5): centred −2 −.5 1.5 −.5 1.5, Σxy = 7, Σy² = 9 → 7/√90
    assert S.spearman([1, 2, 3, 4, 5], [2, 4, 5, 4, 5]) == pytest.approx(7 / math.sqrt(90), abs=1e-12)
    x = np.arange(1.0, 11.0)
    assert S.spearman(x, x**3) == pytest.approx(1.0)  # monotone: ρ = 1 where r < 1
    assert S.pearson(x, x**3) < 0.95
    assert S.spearman(x, -np.exp(x)) == pytest.approx(-1.0)


def test_non_finite_pairs_are_dropped():
    # the NaN and inf pairs go; what is left is exactly (1, 2, 3) against (1, 3, 2)
    assert S.pearson([1, np.nan, 2, 3, 4], [1, 5, 3, 2, np.inf]) == pytest.approx(0.5, abs=1e-12)
    assert S.spearman([1, 2, np.nan, 3], [1, 2, 9, 3]) == pytest.approx(1.0)
    x, y = S.finite_pairs([1, np.nan, 3, -np.inf], [np.inf, 2, 3, 4])
    np.testing.assert_array_equal(x, [3])
    np.testing.assert_array_equal(y, [3])


def test_small_samples_are_nan_without_warning():
    assert S.MIN_PAIRS == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any RuntimeWarning fails the test
        for f in (S.pearson, S.spearman):
            assert math.isnan(f([], []))
            assert math.isnan(f([1], [2]))
            assert math.isnan(f([1, 2], [2, 1]))  # two points always give ±1: says nothing
            assert math.isnan(f([1, 2, np.nan], [2, 1, 0]))  # three pairs, two finite
            assert math.isnan(f([1, 2, 3], [5, 5, 5]))  # zero variance on one side
            assert math.isnan(f([4, 4, 4, 4], [1, 2, 3, 4]))
            assert math.isnan(f([np.nan] * 4, [np.nan] * 4))
        # a constant float row whose mean is not exact (3 · 0.1 ≠ 0.3): still undefined, not ±1
        assert math.isnan(S.pearson([0.1, 0.1, 0.1], [1, 2, 3]))
        assert math.isnan(S.pearson([1, 2, 3], [0.7, 0.7, 0.7]))
        np.testing.assert_array_equal(S.pearson_rows(np.ones((2, 2)), np.ones((2, 2))), [np.nan, np.nan])


def test_length_mismatch_is_a_caller_error():
    with pytest.raises(ValueError, match="length mismatch"):
        S.pearson([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="shape mismatch"):
        S.pearson_rows(np.ones((2, 3)), np.ones((2, 4)))


def test_pearson_rows_row_by_row():
    x = np.array([[1, 2, 3], [1, 2, 3], [2, 2, 2]])
    y = np.array([[1, 3, 2], [3, 2, 1], [1, 2, 3]])
    r = S.pearson_rows(x, y)
    np.testing.assert_allclose(r[:2], [0.5, -1.0], atol=1e-12)
    assert math.isnan(r[2])  # constant row


# ----------------------------------------------------------------------------- resampling


def test_counts_of_an_index_matrix_by_hand():
    idx = np.array([[0, 0, 2], [1, 2, 2]])
    np.testing.assert_array_equal(S.counts_of(idx, 3), [[2, 0, 1], [0, 1, 2]])
    assert S.counts_of(idx, 3).dtype == np.float64


def test_bootstrap_weights_are_counts_of_one_index_matrix():
    K = S.bootstrap_weights(5, 4, np.random.default_rng(7))
    idx = np.random.default_rng(7).integers(0, 5, size=(4, 5))
    np.testing.assert_array_equal(K, S.counts_of(idx, 5))
    assert (K.sum(axis=1) == 5).all()
    assert S.bootstrap_weights(5, 0, np.random.default_rng(0)).shape == (0, 5)
    assert S.bootstrap_weights(0, 3, np.random.default_rng(0)).shape == (0, 0)


def test_chunks_do_not_change_the_draws():
    whole = np.concatenate(list(S.index_chunks(6, 7, np.random.default_rng(1), 10_000)))
    small = list(S.index_chunks(6, 7, np.random.default_rng(1), 12))  # 2 resamples a chunk
    assert [c.shape[0] for c in small] == [2, 2, 2, 1]
    np.testing.assert_array_equal(np.concatenate(small), whole)
    counts = np.concatenate(list(S.count_chunks(6, 7, np.random.default_rng(1), 12)))
    np.testing.assert_array_equal(counts, S.counts_of(whole, 6))
    assert list(S.index_chunks(6, 0, np.random.default_rng(1), 12)) == []


def test_bootstrap_means_by_hand():
    x = np.array([1.0, 2.0, 10.0])
    idx = np.random.default_rng(5).integers(0, 3, size=(6, 3))
    means = S.bootstrap_means(x, 6, np.random.default_rng(5))
    np.testing.assert_allclose(means, x[idx].mean(axis=1), rtol=1e-15)
    assert np.isnan(S.bootstrap_means([], 4, np.random.default_rng(0))).all()
    assert S.bootstrap_means([], 4, np.random.default_rng(0)).shape == (4,)
    assert S.bootstrap_means(x, 0, np.random.default_rng(0)).shape == (0,)


def test_weighted_pearson_by_hand():
    a = np.array([1.0, 2.0, 3.0, 4.0])
    b = np.array([2.0, 1.0, 4.0, 3.0])
    # resample 1 draws rows 0, 0, 1, 2: a = 1 1 2 3, b = 2 2 1 4; centred a −.75 −.75 .25 1.25,
    # b −.25 −.25 −1.25 1.75: Σab = 2.25, Σa² = 2.75, Σb² = 4.75
    # resample 2 draws row 1 four times: a constant, r undefined
    # resample 3 is the original sample: centred a −1.5 −.5 .5 1.5, b −.5 −1.5 1.5 .5 → 3/5
    W = np.array([[2.0, 1, 1, 0], [0, 4, 0, 0], [1, 1, 1, 1]])
    r = S.weighted_pearson(W, a, b)
    assert r[0] == pytest.approx(2.25 / math.sqrt(2.75 * 4.75), rel=1e-12)
    assert math.isnan(r[1])
    assert r[2] == pytest.approx(0.6, rel=1e-12)
    # the same with per-resample values (B, n), as ranks are passed
    r2 = S.weighted_pearson(W, np.broadcast_to(a, W.shape), b)
    np.testing.assert_allclose(r2, r, rtol=1e-12)
    # fewer than three rows: undefined for every resample
    assert np.isnan(S.weighted_pearson(np.array([[1.0, 1.0]]), a[:2], b[:2])).all()


def test_resample_ranks_by_hand():
    x = np.array([10.0, 20.0, 20.0, 30.0])
    # rows 0, 0, 1, 2 drawn: values 10 10 20 20 → ranks 1.5 (the two 10s) and 3.5 (the two 20s);
    # row 3 is not drawn: it would come after all 4 copies, 4 + (0 + 1)/2 = 4.5
    W = np.array([[2.0, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(S.resample_ranks(W, x), [[1.5, 3.5, 3.5, 4.5], [1, 2.5, 2.5, 4]])


# ----------------------------------------------------------------------------- intervals


def test_percentile_interval_by_hand():
    s = np.arange(101.0)  # 0 … 100: the q-th percentile (linear) is q itself
    assert S.interval_bounds(s) == pytest.approx((2.5, 97.5), abs=1e-12)
    assert S.interval_bounds(s, 0.9) == pytest.approx((5.0, 95.0), abs=1e-12)
    lo, hi = S.percentile_interval(np.column_stack([s, 2 * s]))
    np.testing.assert_allclose(lo, [2.5, 5.0], atol=1e-12)
    np.testing.assert_allclose(hi, [97.5, 195.0], atol=1e-12)


def test_interval_drops_undefined_resamples_per_column():
    col_a = np.r_[np.arange(11.0), [np.nan, np.inf, -np.inf, np.nan]]  # 11 finite: 0 … 10
    col_b = np.r_[np.arange(9.0), [np.nan] * 6]  # 9 finite: too few
    col_c = np.full(15, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lo, hi = S.percentile_interval(np.column_stack([col_a, col_b, col_c]))
    # over 0 … 10 the 2.5th percentile sits at position 0.025·10 = 0.25
    assert lo[0] == pytest.approx(0.25, abs=1e-12) and hi[0] == pytest.approx(9.75, abs=1e-12)
    assert np.isnan(lo[1:]).all() and np.isnan(hi[1:]).all()


def test_too_few_resamples_give_no_interval():
    assert S.MIN_RESAMPLES == 10
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(math.isnan(v) for v in S.interval_bounds(np.arange(9.0)))
        assert all(math.isnan(v) for v in S.interval_bounds([]))
        lo, hi = S.percentile_interval(np.zeros((0, 3)))
    assert lo.shape == hi.shape == (3,) and np.isnan(lo).all() and np.isnan(hi).all()
    assert S.interval_bounds(np.arange(10.0)) == pytest.approx((0.225, 8.775), abs=1e-12)


# ----------------------------------------------------------------------------- one implementation


def test_every_consumer_uses_these_functions():
    from pte_instrument import offline
    from pte_instrument.offline import decomposition, patterns
    from pte_instrument.validation import analysis

    assert offline.spearman is S.spearman
    assert decomposition.spearman is S.spearman and patterns.spearman is S.spearman
    assert analysis.pearson is S.pearson and analysis.spearman is S.spearman
    assert analysis.rankdata is S.rankdata and analysis.pearson_rows is S.pearson_rows
    assert decomposition.count_chunks is S.count_chunks
    # the latency bench's correlations follow the same small-sample rule
    c = analysis.bootstrap_corr([1, 2], [2, 1], n_boot=50)
    assert c.n == 2 and math.isnan(c.pearson) and math.isnan(c.spearman)
    assert all(math.isnan(v) for v in (*c.pearson_ci, *c.spearman_ci))
