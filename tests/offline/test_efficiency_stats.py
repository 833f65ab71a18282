"""Efficiency statistics (docs/efficiency-model.md): hand-computed cases for every quantity, the exact
Δlog identities on random data, solver workload and its audits, the paired bootstrap."""

import math
import zlib

import numpy as np
import pytest

from pte_instrument.offline import decomposition as stats
from pte_instrument.offline.decomposition import (
    EvalTable,
    analyze,
    compression_ratio,
    dlog_terms,
    loop_audit,
    quantities,
)
from pte_instrument.offline.statistics import bootstrap_weights, rankdata, spearman

log = math.log


def hand_table(**kw) -> EvalTable:
    """Model A and reference B on four instances (numbers used by the hand computations):

    A: S = 1 0 1 0, T = 100 200 300 400, C = 0 0 0 1, σ = .5 .5 .25 1, PTE = 1000 2000 3000 4000
    B: S = 1 1 1 0, T =  50 150 200 100, C = 0 0 0 0, σ = 1 .8 .5 .5
    W = 10 40 20 80 (an instance property)
    """
    return EvalTable.from_arrays(
        "bench",
        ["A", "B"],
        ["i0", "i1", "i2", "i3"],
        np.ones((2, 4), bool),
        correct=[[1, 0, 1, 0], [1, 1, 1, 0]],
        tokens=[[100, 200, 300, 400], [50, 150, 200, 100]],
        truncated=[[0, 0, 0, 1], [0, 0, 0, 0]],
        workload=[10, 40, 20, 80],
        sigma=[[0.5, 0.5, 0.25, 1.0], [1.0, 0.8, 0.5, 0.5]],
        pte=[[1000, 2000, 3000, 4000], [np.nan, 1, 1, 1]],
        **kw,
    )


def q(result, view, model, name):
    return result.views[view].quantities[model][name].value


def term(result, view, model, name):
    return result.views[view].decomposition[model].terms[name].value


# ----------------------------------------------------------------------------- outcome layer


def test_outcome_layer_by_hand():
    r = analyze(hand_table(), "B", n_boot=0)
    # A: ΣS = 2, ΣT = 1000 → E0 = 1000·2/1000 = 2.0 (pooled; the mean of S_i/T_i would be
    # 1000·(1/100 + 1/300)/4 = 3.33)
    assert q(r, "outcome", "A", "e0") == pytest.approx(2.0, abs=1e-12)
    assert q(r, "outcome", "A", "accuracy") == pytest.approx(0.5)  # 2/4
    assert q(r, "outcome", "A", "r_ctx") == pytest.approx(0.75)  # 1 − 1/4
    assert q(r, "outcome", "A", "r_logic") == pytest.approx(2 / 3)  # 2 / (4 − 1)
    assert q(r, "outcome", "A", "mean_tokens") == pytest.approx(250)  # 1000/4
    # PTE per correct answer: (1000+2000+3000+4000)/2 = 5000; mean PTE 10000/4 = 2500
    assert q(r, "outcome", "A", "pte_per_correct") == pytest.approx(5000)
    assert q(r, "outcome", "A", "mean_pte") == pytest.approx(2500)
    # B lacks a PTE on one answer: PTE per correct is undefined, not a partial sum
    assert math.isnan(q(r, "outcome", "B", "pte_per_correct"))
    # B: ΣS = 3, ΣT = 500 → E0 = 6; r_ctx = 1; r_logic = 3/4; E[T] = 125
    assert q(r, "outcome", "B", "e0") == pytest.approx(6.0)
    assert q(r, "outcome", "B", "r_logic") == pytest.approx(0.75)
    assert q(r, "outcome", "B", "mean_tokens") == pytest.approx(125)
    d = r.views["outcome"].decomposition["A"]
    # Δlog E0 = log(2/6) = −log 3 = −1.0986; ctx = log(.75/1) = −0.2877;
    # logic = log((2/3)/(3/4)) = log(8/9) = −0.1178; length = −log(250/125) = −log 2 = −0.6931
    assert d.dlog_e0.value == pytest.approx(-log(3), abs=1e-12)
    assert d.terms["ctx"].value == pytest.approx(log(0.75), abs=1e-12)
    assert d.terms["logic"].value == pytest.approx(log(8 / 9), abs=1e-12)
    assert d.terms["length"].value == pytest.approx(-log(2), abs=1e-12)
    assert d.n_shared == 4
    assert r.views["outcome"].decomposition["B"].dlog_e0.value == 0.0


def test_workload_layer_by_hand():
    r = analyze(hand_table(), "B", n_boot=0)
    assert r.workload_source == "native"
    # A: VO = T/W = 10, 5, 15, 5 → V̄O = 35/4 = 8.75; E[W] = 150/4 = 37.5;
    # κ = E[T]/(E[W]·V̄O) = 250/(37.5·8.75) = 16/21 = 0.7619
    assert q(r, "workload", "A", "vo") == pytest.approx(8.75)
    assert q(r, "workload", "A", "mean_workload") == pytest.approx(37.5)
    assert q(r, "workload", "A", "kappa") == pytest.approx(16 / 21)
    # κ as the covariance form: 1 + Cov(W, VO)/(E[W]·E[VO]), computed independently
    W, VO = np.array([10, 40, 20, 80.0]), np.array([10, 5, 15, 5.0])
    cov = np.mean(W * VO) - W.mean() * VO.mean()
    assert q(r, "workload", "A", "kappa") == pytest.approx(1 + cov / (W.mean() * VO.mean()))
    # B: VO = 5, 3.75, 10, 1.25 → V̄O = 5; κ = 125/(37.5·5) = 2/3
    assert q(r, "workload", "B", "vo") == pytest.approx(5.0)
    assert q(r, "workload", "B", "kappa") == pytest.approx(2 / 3)
    # overhead = −log(8.75/5) = −log 1.75 = −0.5596; coupling = −log((16/21)/(2/3)) = −log(8/7)
    assert term(r, "workload", "A", "overhead") == pytest.approx(-log(1.75), abs=1e-12)
    assert term(r, "workload", "A", "coupling") == pytest.approx(-log(8 / 7), abs=1e-12)
    assert r.views["workload"].terms == ("ctx", "logic", "overhead", "coupling")


def test_trace_layer_by_hand():
    r = analyze(hand_table(), "B", n_boot=0)
    # A: T_sig = T·σ = 50, 100, 75, 400 → Σ = 625; q_trace = 625/1000 = 0.625;
    # E[T_sig] = 156.25; VO_sig = 5, 2.5, 3.75, 5 → 65/16 = 4.0625;
    # κ_sig = 156.25/(37.5·4.0625) = 40/39
    assert q(r, "trace", "A", "q_trace") == pytest.approx(0.625)
    assert q(r, "trace", "A", "mean_signal_tokens") == pytest.approx(156.25)
    assert q(r, "trace", "A", "vo_sig") == pytest.approx(4.0625)
    assert q(r, "trace", "A", "kappa_sig") == pytest.approx(40 / 39)
    # B: T_sig = 50, 120, 100, 50 → q = 320/500 = 0.64; VO_sig = 5, 3, 5, .625 → 109/32;
    # κ_sig = 80/(37.5·109/32) = 1024/1635
    assert q(r, "trace", "B", "q_trace") == pytest.approx(0.64)
    assert q(r, "trace", "B", "vo_sig") == pytest.approx(109 / 32)
    assert q(r, "trace", "B", "kappa_sig") == pytest.approx(1024 / 1635)
    # terms: q_trace = log(.625/.64) = log(125/128); overhead_sig = −log((65/16)/(109/32)) =
    # −log(130/109); coupling_sig = −log((40/39)/(1024/1635)) = −log(65400/39936)
    assert term(r, "trace", "A", "q_trace") == pytest.approx(log(125 / 128), abs=1e-12)
    assert term(r, "trace", "A", "overhead_sig") == pytest.approx(-log(130 / 109), abs=1e-12)
    assert term(r, "trace", "A", "coupling_sig") == pytest.approx(-log(65400 / 39936), abs=1e-12)
    # ctx + logic + q_trace + overhead_sig + coupling_sig = −log 3
    total = log(0.75) + log(8 / 9) + log(125 / 128) - log(130 / 109) - log(65400 / 39936)
    assert total == pytest.approx(-log(3), abs=1e-12)


def test_trace_view_without_workload_uses_signal_length():
    t = hand_table()
    t = EvalTable.from_arrays(
        t.benchmark, t.models, t.instances, t.present, t.correct, t.tokens, t.truncated, sigma=t.sigma
    )
    r = analyze(t, "B", n_boot=0)
    assert set(r.views) == {"outcome", "trace"}
    assert r.views["trace"].terms == ("ctx", "logic", "q_trace", "length_sig")
    # −log(E[T_sig] A / B) = −log(156.25/80)
    assert term(r, "trace", "A", "length_sig") == pytest.approx(-log(156.25 / 80), abs=1e-12)
    with pytest.raises(stats.AnalysisError, match="no workload"):
        analyze(t, "B", workload="native", n_boot=0)


def test_truncated_answers_with_all_truncated_model_are_undefined_not_crashing():
    t = EvalTable.from_arrays(
        "b",
        ["A", "B"],
        ["0", "1"],
        np.ones((2, 2), bool),
        [[0, 0], [1, 0]],
        [[5, 5], [5, 5]],
        [[1, 1], [0, 0]],
    )
    r = analyze(t, "B", n_boot=20)
    assert q(r, "outcome", "A", "r_ctx") == 0.0
    assert math.isnan(q(r, "outcome", "A", "r_logic"))  # 0/0: no completed answer
    assert r.views["outcome"].decomposition["A"].terms["ctx"].value == -math.inf
    assert r.signatures["A"].label == "context-limited"


# ----------------------------------------------------------------------------- identities


def random_table(seed=0, M=6, N=400, partial=True, trace=True, workload=True) -> EvalTable:
    rng = np.random.default_rng(seed)
    present = rng.random((M, N)) < 0.9 if partial else np.ones((M, N), bool)
    present[0] = True  # the reference answers everything
    trunc = rng.random((M, N)) < 0.1
    correct = (rng.random((M, N)) < rng.uniform(0.3, 0.8, (M, 1))) & ~trunc
    tokens = rng.integers(1, 4000, (M, N))
    W = rng.uniform(1, 100, N) if workload else None
    if workload:
        W[rng.random(N) < 0.05] = np.nan  # some instances without a workload
    sigma = rng.uniform(0.1, 1.0, (M, N)) if trace else None
    if trace:
        sigma[rng.random((M, N)) < 0.05] = np.nan
    return EvalTable.from_arrays(
        "rnd",
        [f"m{k}" for k in range(M)],
        [str(i) for i in range(N)],
        present,
        correct,
        tokens,
        trunc,
        W,
        sigma,
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decomposition_identities_on_random_data(seed):
    t = random_table(seed)
    r = analyze(t, "m0", n_boot=30, seed=seed)
    assert set(r.views) == {"outcome", "workload", "trace"}
    for v in r.views.values():
        for m, d in v.decomposition.items():
            total = sum(d.terms[x].value for x in v.terms)
            assert abs(d.dlog_e0.value - total) < 1e-12, (v.name, m)
            assert abs(d.residual) < 1e-12
        for m in t.models:
            qq = v.quantities[m]
            # E0 = 1000·r_ctx·r_logic/E[T]
            assert qq["e0"].value == pytest.approx(
                1000 * qq["r_ctx"].value * qq["r_logic"].value / qq["mean_tokens"].value, rel=1e-12
            )
    for m in t.models:  # E[T] = E[W]·V̄O·κ and E[T_sig] = E[W]·V̄O_sig·κ_sig
        w, tr = r.views["workload"].quantities[m], r.views["trace"].quantities[m]
        assert w["mean_tokens"].value == pytest.approx(
            w["mean_workload"].value * w["vo"].value * w["kappa"].value, rel=1e-12
        )
        assert tr["mean_signal_tokens"].value == pytest.approx(
            tr["mean_workload"].value * tr["vo_sig"].value * tr["kappa_sig"].value, rel=1e-12
        )


def test_identity_holds_in_every_bootstrap_resample():
    t = random_table(5, M=4, N=300)
    K = bootstrap_weights(300, 50, np.random.default_rng(0))
    req = t.present & np.isfinite(t.workload)[None] & np.isfinite(t.sigma)
    shared = req & req[0][None]
    sm = stats._sums(K, stats._value_stack(t, t.workload, np.arange(4), shared))
    sr = stats._sums(K, stats._value_stack(t, t.workload, np.zeros(4, int), shared))
    sr["w"] = sm["w"]
    terms = stats.view_terms("trace", True)
    dlog, parts = dlog_terms(terms, quantities(sm), quantities(sr))
    assert np.nanmax(np.abs(dlog - sum(parts.values()))) < 1e-12


# ----------------------------------------------------------------------------- bootstrap


def test_bootstrap_weights_are_counts_of_one_index_matrix():
    K = bootstrap_weights(7, 5, np.random.default_rng(3))
    idx = np.random.default_rng(3).integers(0, 7, size=(5, 7))
    assert K.shape == (5, 7)
    assert (K.sum(axis=1) == 7).all()
    for b in range(5):
        np.testing.assert_array_equal(K[b], np.bincount(idx[b], minlength=7))


def test_bootstrap_interval_matches_a_naive_resampling_loop():
    t = random_table(7, M=3, N=200, partial=False, trace=False, workload=False)
    r = analyze(t, "m0", n_boot=200, seed=11)
    # the same draws, recomputed one resample at a time (the naive way)
    idx = stats._rng(11, "rnd", 0).integers(0, 200, size=(200, 200))
    S, T = t.correct[1], t.tokens[1]
    e0 = [1000 * S[i].sum() / T[i].sum() for i in idx]
    lo, hi = np.percentile(e0, [2.5, 97.5])
    est = r.views["outcome"].quantities["m1"]["e0"]
    assert est.low == pytest.approx(lo, rel=1e-12)
    assert est.high == pytest.approx(hi, rel=1e-12)
    assert est.low < est.value < est.high


def test_bootstrap_reproducible_with_seed():
    t = random_table(3)
    a = analyze(t, "m0", n_boot=50, seed=4)
    b = analyze(t, "m0", n_boot=50, seed=4)
    c = analyze(t, "m0", n_boot=50, seed=5)
    ea = a.views["workload"].decomposition["m2"].terms["overhead"]
    assert ea == b.views["workload"].decomposition["m2"].terms["overhead"]
    assert ea != c.views["workload"].decomposition["m2"].terms["overhead"]
    assert ea.value == c.views["workload"].decomposition["m2"].terms["overhead"].value


def test_the_bootstrap_is_drawn_in_chunks_of_bounded_size_with_the_same_results(monkeypatch):
    """100 000 resamples of 14 000 instances are a 10 GiB count matrix at once: the resamples
    are drawn and summed a chunk at a time, and the chunks are the rows of the one matrix, so
    a seed gives the same intervals whatever the chunk size."""
    from pte_instrument.offline import statistics

    t = random_table(9, M=4, N=60)
    whole = analyze(t, "m0", workload="solver", n_boot=40, n_splits=0, seed=3)
    shapes: list[tuple[int, ...]] = []
    counts_of = statistics.counts_of

    def spy(idx: np.ndarray, n: int) -> np.ndarray:
        shapes.append(idx.shape)
        return counts_of(idx, n)

    monkeypatch.setattr(statistics, "counts_of", spy)
    monkeypatch.setattr(stats, "MAX_BOOT_ELEMS", 7 * 60, raising=False)  # 7 resamples a chunk
    chunked = analyze(t, "m0", workload="solver", n_boot=40, n_splits=0, seed=3)
    assert shapes and max(b * n for b, n in shapes) <= 7 * 60
    for name, view in whole.views.items():
        for m in t.models:
            for k, est in view.quantities[m].items():
                other = chunked.views[name].quantities[m][k]
                assert (est.low, est.high) == pytest.approx((other.low, other.high), rel=1e-12, nan_ok=True)
        for m, d in view.decomposition.items():
            for k, est in d.terms.items():
                other = chunked.views[name].decomposition[m].terms[k]
                assert (est.low, est.high) == pytest.approx((other.low, other.high), rel=1e-12, nan_ok=True)
    assert whole.solver.top1_share == chunked.solver.top1_share
    assert whole.solver.shares == chunked.solver.shares


def test_bootstrap_is_paired_across_models():
    # C is the reference with every answer twice as long; D an exact copy. With paired
    # resampling each resample gives exactly −log 2 and 0; unpaired it would scatter.
    rng = np.random.default_rng(0)
    S = (rng.random(100) < 0.5).astype(float)
    T = rng.integers(10, 1000, 100).astype(float)
    t = EvalTable.from_arrays(
        "p",
        ["C", "D", "R"],
        [str(i) for i in range(100)],
        np.ones((3, 100), bool),
        [S, S, S],
        [2 * T, T, T],
        np.zeros((3, 100)),
    )
    r = analyze(t, "R", n_boot=100)
    length = r.views["outcome"].decomposition["C"].terms["length"]
    assert length.low == pytest.approx(-log(2), abs=1e-12)
    assert length.high == pytest.approx(-log(2), abs=1e-12)
    copy = r.views["outcome"].decomposition["D"].dlog_e0
    assert copy.low == pytest.approx(0.0, abs=1e-12) and copy.high == pytest.approx(0.0, abs=1e-12)


# ----------------------------------------------------------------------------- solver workload


def solver_table() -> EvalTable:
    """Pool P, Q, R on five instances ('-' = P did not answer i2):

    P: S = 1 0 - 0 1, T = 10 20 - 30 10   → ΣS 2, ΣT 70,  E0 28.6
    Q: S = 1 1 0 0 1, T = 40 50 60 70 40  → ΣS 3, ΣT 260, E0 11.5
    R: S = 0 0 1 0 0, T = 80 90 100 110 50 → ΣS 1, ΣT 430, E0 2.33
    """
    present = np.ones((3, 5), bool)
    present[0, 2] = False
    return EvalTable.from_arrays(
        "s",
        ["Q", "R", "P"],
        [f"i{k}" for k in range(5)],
        present[[1, 2, 0]],
        [[1, 1, 0, 0, 1], [0, 0, 1, 0, 0], [1, 0, 0, 0, 1]],
        [[40, 50, 60, 70, 40], [80, 90, 100, 110, 50], [10, 20, 1, 30, 10]],
        np.zeros((3, 5)),
    )


def test_solver_workload_falls_through_the_ranking():
    r = analyze(solver_table(), "Q", workload="solver", n_boot=0, n_splits=0)
    s = r.solver
    assert [m for m, _ in s.ordering] == ["P", "Q", "R"]
    assert s.ordering[0][1] == pytest.approx(2000 / 70)
    # i0 → P; i1 → P wrong → Q; i2 → P absent, Q wrong → R; i3 → nobody; i4 → P
    assert s.instance_solver == {"i0": "P", "i1": "Q", "i2": "R", "i3": None, "i4": "P"}
    assert s.n_covered == 4
    assert s.coverage.value == pytest.approx(0.8)  # 4/5
    assert s.shares["P"].value == pytest.approx(0.5)  # 2 of 4
    assert s.shares["Q"].value == pytest.approx(0.25)
    assert s.top1_share.value == pytest.approx(0.5)
    assert s.top3_share.value == pytest.approx(1.0)
    assert s.effective_solvers.value == pytest.approx(1 / (0.25 + 0.0625 + 0.0625))  # 2.667
    # W = 10, 50, 100, –, 10.  P over i0 i1 i4: VO = 1, .4, 1 → 0.8; κ = (40/3)/((70/3)·.8) = 5/7
    assert q(r, "workload", "P", "vo") == pytest.approx(0.8)
    assert q(r, "workload", "P", "kappa") == pytest.approx(5 / 7)
    # Q over i0 i1 i2 i4: VO = 4, 1, .6, 4 → 2.4; κ = 47.5/(42.5·2.4) = 95/204
    assert q(r, "workload", "Q", "vo") == pytest.approx(2.4)
    assert q(r, "workload", "Q", "kappa") == pytest.approx(95 / 204)
    # R: VO = 8, 1.8, 1, 5 → 3.95; κ = 80/(42.5·3.95)
    assert q(r, "workload", "R", "vo") == pytest.approx(3.95)
    assert q(r, "workload", "R", "kappa") == pytest.approx(80 / (42.5 * 3.95))
    assert q(r, "workload", "Q", "n") == 4  # i3 nobody solved: drops out


def test_declared_pool_restricts_the_solvers():
    r = analyze(solver_table(), "Q", workload="solver", pool=["Q", "R"], n_boot=0, n_splits=0)
    # without P: i0 → Q, i1 → Q, i2 → R, i3 none, i4 → Q
    assert r.solver.instance_solver == {"i0": "Q", "i1": "Q", "i2": "R", "i3": None, "i4": "Q"}
    assert q(r, "workload", "P", "vo") == pytest.approx((10 / 40 + 20 / 50 + 10 / 40) / 3)
    with pytest.raises(stats.AnalysisError, match="not in benchmark"):
        analyze(solver_table(), "Q", workload="solver", pool=["Q", "nope"], n_boot=0)


def planted_pool() -> EvalTable:
    """Everyone answers everything correctly, so the solver is the top model by E0 (the
    fewest tokens). Two instance types, X and Y, alternate:

        A: X 1,  Y 10  (total 11: the top solver)      B: X 10, Y 2   (12)
        C: X 4,  Y 10  (14)                            D: X 2,  Y 14  (16)
    """
    x = np.array([[1, 10, 4, 2]]).T
    y = np.array([[10, 2, 10, 14]]).T
    tokens = np.tile(np.hstack([x, y]), 5)  # 10 instances: X Y X Y …
    return EvalTable.from_arrays(
        "planted",
        list("ABCD"),
        [str(i) for i in range(10)],
        np.ones((4, 10), bool),
        np.ones((4, 10)),
        tokens,
        np.zeros((4, 10)),
    )


def test_audits_on_a_planted_pool():
    r = analyze(planted_pool(), "A", workload="solver", n_boot=0, n_splits=10)
    a = r.solver.audits
    # full pool W = T_A: V̄O = A 1, B (10+.2)/2 = 5.1, C (4+1)/2 = 2.5, D (2+1.4)/2 = 1.7
    assert [q(r, "workload", m, "vo") for m in "ABCD"] == pytest.approx([1, 5.1, 2.5, 1.7])
    # leave-top-1 removes A (share 1) → W = T_B: V̄O = A 2.55, B 1, C 2.7, D 3.6.
    # ranks full A1 B4 C3 D2, without A A2 B1 C3 D4: Σd² = 1+9+0+4 = 14 → ρ = 1 − 84/60 = −0.4
    assert a.leave_top_k[1]["removed"] == ["A"]
    assert a.leave_top_k[1]["vo"] == pytest.approx(-0.4)
    # κ full: A 1, B 6/(5.5·5.1), C 7/(5.5·2.5), D 8/(5.5·1.7) → ranks A4 B1 C2 D3;
    # without A (E[W] 6): A 5.5/15.3, B 1, C 7/16.2, D 8/21.6 → A1 B4 C3 D2 → ρ = −1
    assert a.leave_top_k[1]["kappa"] == pytest.approx(-1.0)
    # leave-top-3 removes A, then B, C (zero shares, reference order) → W = T_D:
    # V̄O = A .607, B 2.571, C 1.357, D 1 → same ranking as the full pool: ρ = 1
    assert a.leave_top_k[3]["removed"] == ["A", "B", "C"]
    assert a.leave_top_k[3]["vo"] == pytest.approx(1.0)
    assert 5 not in a.leave_top_k  # needs more than 5 pool models
    # leave-self-out: only A's W changes (to T_B): A 2.55 B 5.1 C 2.5 D 1.7 → ranks A3 B4 C2 D1
    # vs A1 B4 C3 D2: Σd² = 4+0+1+1 = 6 → ρ = 1 − 36/60 = 0.4
    assert a.leave_self_out["vo"] == pytest.approx(0.4)
    # four pool models: each held-out half has two models, too few for a ρ
    assert a.held_out["vo"].n_valid == 0 and math.isnan(a.held_out["vo"].median)


def test_held_out_splits_match_a_naive_implementation():
    t = random_table(9, M=7, N=150, partial=True, trace=False, workload=False)
    r = analyze(t, "m0", workload="solver", n_boot=0, n_splits=25, seed=2)
    order = [t.models.index(m) for m, _ in r.solver.ordering]

    def naive_vo(pool):
        W = []
        for i in range(len(t.instances)):  # walk the ranking per instance
            w = math.nan
            for m in pool:
                if t.present[m, i] and t.correct[m, i]:
                    w = t.tokens[m, i]
                    break
            W.append(w)
        vo = []
        for m in range(len(t.models)):
            ratios = [
                t.tokens[m, i] / W[i] for i in range(len(W)) if t.present[m, i] and not math.isnan(W[i])
            ]
            vo.append(sum(ratios) / len(ratios))
        return np.array(vo)

    full = naive_vo(order)
    rng = stats._rng(2, "rnd", 1)
    rhos = []
    for _ in range(25):
        perm = rng.permutation(7)
        held = [order[j] for j in perm[3:]]
        vo = naive_vo([order[j] for j in sorted(perm[:3])])
        rhos.append(spearman(vo[held], full[held]))
    h = r.solver.audits.held_out["vo"]
    assert h.n_valid == 25
    assert h.median == pytest.approx(np.median(rhos))
    assert h.p5 == pytest.approx(np.percentile(rhos, 5))
    assert h.p95 == pytest.approx(np.percentile(rhos, 95))


# ----------------------------------------------------------------------------- ranks, traces


def test_rank_and_spearman_by_hand():
    np.testing.assert_array_equal(rankdata([10, 20, 20, 30]), [1, 2.5, 2.5, 4])
    np.testing.assert_array_equal(rankdata([3, 1, 2]), [3, 1, 2])
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks b = 1, 4, 2.5, 2.5; centred: a −1.5 −.5 .5 1.5, b −1.5 1.5 0 0;
    # Σab = 2.25 − .75 = 1.5, Σa² = 5, Σb² = 4.5 → ρ = 1.5/√22.5 = 0.3162
    assert spearman([1, 2, 3, 4], [1, 3, 2, 2]) == pytest.approx(1.5 / math.sqrt(22.5))
    assert math.isnan(spearman([1, 2], [2, 1]))  # fewer than three pairs
    assert math.isnan(spearman([1, 2, 3], [5, 5, 5]))  # constant
    assert spearman([1, 2, np.nan, 3], [1, 2, 9, 3]) == pytest.approx(1.0)  # NaN pair dropped


def test_compression_ratio():
    # zlib of b"a" is 9 bytes (2 header + 3 deflate + 4 adler) → 9/1, capped at 1
    assert len(zlib.compress(b"a")) == 9
    assert compression_ratio("a") == 1.0
    # bytes, not characters: "é" is two UTF-8 bytes
    text = "é" * 1000
    assert compression_ratio(text) == len(zlib.compress(text.encode())) / 2000
    assert compression_ratio("abc " * 500) < 0.05  # a loop compresses to almost nothing
    with pytest.raises(ValueError):
        compression_ratio("")


def test_loop_audit_by_hand():
    # 4-grams of "a b c d a b c d": abcd bcda cdab dabc abcd → 5, 4 distinct → 1 − 4/5 = 0.2;
    # prompt "x a b c d y" has xabc, abcd, bcdy → 2 of the 5 window 4-grams → 0.4
    assert loop_audit("a b c d a b c d", "x a b c d y") == pytest.approx((0.2, 0.4))
    # the window keeps the last 8 words; without it 9 grams with 8 distinct → 1/9
    trace = "q r s t a b c d a b c d"
    assert loop_audit(trace, window=8)[0] == pytest.approx(0.2)
    assert loop_audit(trace)[0] == pytest.approx(1 / 9)
    assert math.isnan(loop_audit(trace)[1])  # no prompt
    assert all(math.isnan(x) for x in loop_audit("too short", "p"))


# ----------------------------------------------------------------------------- diagnosis


def signature_table() -> EvalTable:
    """Reference R: 40 instances, every other one correct, T = 100, σ = 0.5, W = 10.
    ctx: 10 wrong answers truncated instead (r_ctx .75, r_logic 2/3 ↑); logic: 10 correct;
    verb: T = 200, σ = 0.5; redun: T = 200, σ = 0.25 (same T_sig as R); lean: T = 50."""
    n = 40
    s_ref = np.arange(n) % 2 == 0
    trunc = np.zeros(n)
    trunc[1:20:2] = 1  # 10 of the wrong answers hit the budget
    logic = np.zeros(n)
    logic[:20:2] = 1  # 10 correct
    rows = {  # model: (S, T, C, σ)
        "R": (s_ref, 100, 0, 0.5),
        "ctx": (s_ref, 100, trunc, 0.5),
        "logic": (logic, 100, 0, 0.5),
        "verb": (s_ref, 200, 0, 0.5),
        "redun": (s_ref, 200, 0, 0.25),
        "lean": (s_ref, 50, 0, 0.5),
    }
    models = list(rows)
    full = lambda k: np.array([np.broadcast_to(rows[m][k], n) for m in models], float)  # noqa: E731
    return EvalTable.from_arrays(
        "sig",
        models,
        [str(i) for i in range(n)],
        np.ones((6, n), bool),
        full(0),
        full(1),
        full(2),
        np.full(n, 10.0),
        full(3),
    )


def test_diagnostic_signatures_on_planted_models():
    r = analyze(signature_table(), "R", n_boot=100)
    sig = r.signatures
    assert sig["R"].label == "reference"
    # ctx: Δlog r_ctx = log .75 = −0.288 (logic gains +0.288)
    assert sig["ctx"].label == "context-limited" and sig["ctx"].term == "ctx"
    assert sig["ctx"].value == pytest.approx(log(0.75))
    # logic: Δlog r_logic = log(10/20) = −0.693
    assert sig["logic"].label == "logic-limited" and sig["logic"].value == pytest.approx(-log(2))
    # verb: −Δlog V̄O = −log 2; trace view: q_trace unchanged, V̄O_sig doubled → stays verbosity
    assert sig["verb"].label == "verbosity-limited" and sig["verb"].term == "overhead"
    assert sig["verb"].value == pytest.approx(-log(2)) and sig["verb"].significant is True
    # redun: same length penalty, but q_trace = log(.25/.5) = −log 2 carries it all
    assert sig["redun"].label == "redundancy-limited" and sig["redun"].term == "q_trace"
    assert sig["redun"].value == pytest.approx(-log(2))
    assert sig["lean"].label.startswith("not limited")


def test_unknown_reference_is_a_clear_error():
    with pytest.raises(stats.AnalysisError, match="'nobody' not in benchmark"):
        analyze(hand_table(), "nobody", n_boot=0)
