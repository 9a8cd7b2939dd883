"""Rank correlations, seed bootstrap and ordering check of rlhf_ext.sim.fidelity (hand-computed values and scipy)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlhf_ext.sim.fidelity import (
    average_ranks,
    bootstrap_rank_correlation,
    bootstrap_seed_means,
    kendall_tau_b,
    mean_and_stderr,
    ordering_agrees,
    spearman_rho,
)


def test_average_ranks_share_the_mean_rank_of_ties():
    assert average_ranks([10, 20, 20, 5]).tolist() == [2.0, 3.5, 3.5, 1.0]
    assert average_ranks([3, 3, 3]).tolist() == [2.0, 2.0, 2.0]


def test_perfect_and_reversed_order():
    x = [0.1, 0.4, 0.2, 0.9]
    y = [1.0, 3.0, 2.0, 7.0]
    assert spearman_rho(x, y) == pytest.approx(1.0)
    assert kendall_tau_b(x, y) == pytest.approx(1.0)
    assert spearman_rho(x, [-v for v in y]) == pytest.approx(-1.0)
    assert kendall_tau_b(x, [-v for v in y]) == pytest.approx(-1.0)


def test_tie_case_by_hand():
    # x = [1, 2, 2, 3], y = [1, 2, 3, 4]: 6 pairs, one tied in x, the other 5 concordant.
    # tau_b = (5 - 0) / sqrt((6 - 1) * (6 - 0)) = 5 / sqrt(30).
    # ranks x = [1, 2.5, 2.5, 4], y = [1, 2, 3, 4]: centred [-1.5, 0, 0, 1.5] and [-1.5, -0.5, 0.5, 1.5];
    # rho = 4.5 / sqrt(4.5 * 5) = sqrt(0.9).
    x = [1, 2, 2, 3]
    y = [1, 2, 3, 4]
    assert kendall_tau_b(x, y) == pytest.approx(5 / math.sqrt(30))
    assert spearman_rho(x, y) == pytest.approx(math.sqrt(0.9))


def test_ties_on_both_sides_by_hand():
    # x = [1, 1, 2], y = [1, 1, 2]: pair (0, 1) tied in both, pairs (0, 2), (1, 2) concordant.
    # tau_b = 2 / sqrt((3 - 1) * (3 - 1)) = 1; ranks equal on both sides -> rho = 1.
    assert kendall_tau_b([1, 1, 2], [1, 1, 2]) == pytest.approx(1.0)
    assert spearman_rho([1, 1, 2], [1, 1, 2]) == pytest.approx(1.0)
    # x = [1, 1, 2], y = [2, 1, 1]: (0,1) tied in x, (1,2) tied in y, (0,2) discordant: -1 / sqrt(2 * 2) = -0.5
    assert kendall_tau_b([1, 1, 2], [2, 1, 1]) == pytest.approx(-0.5)


def test_constant_side_is_undefined():
    assert math.isnan(spearman_rho([1, 1, 1], [1, 2, 3]))
    assert math.isnan(kendall_tau_b([1, 2, 3], [4, 4, 4]))


def test_rejects_mismatched_or_too_short_inputs():
    with pytest.raises(ValueError, match="one length"):
        spearman_rho([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="at least two items"):
        kendall_tau_b([1], [1])


@pytest.mark.parametrize("seed", range(20))
def test_equal_to_scipy_on_random_inputs(seed):
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 15))
    if seed % 2:  # small integer range: many ties on both sides
        x, y = rng.integers(0, 4, n).astype(float), rng.integers(0, 4, n).astype(float)
    else:
        x, y = rng.normal(size=n), rng.normal(size=n)
    expected_rho = stats.spearmanr(x, y).statistic
    expected_tau = stats.kendalltau(x, y).statistic  # tau-b by default
    for ours, expected in ((spearman_rho(x, y), expected_rho), (kendall_tau_b(x, y), expected_tau)):
        if math.isnan(expected):
            assert math.isnan(ours)
        else:
            assert ours == pytest.approx(expected, abs=1e-12)


def test_bootstrap_is_deterministic_for_a_seed():
    per_seed = [[0.5, 0.6, 0.55], [0.7, 0.6, 0.65], [0.4, 0.45, 0.5], [0.52, 0.58, 0.61]]
    reference = [36.7, 45.0, 32.4, 46.8]
    first = bootstrap_rank_correlation(per_seed, reference, "spearman", num_resamples=500, seed=3)
    again = bootstrap_rank_correlation(per_seed, reference, "spearman", num_resamples=500, seed=3)
    assert first == again
    # the correlation takes few values (percentiles may coincide across seeds); the resampled means do not
    assert np.array_equal(bootstrap_seed_means(per_seed, 100, seed=1), bootstrap_seed_means(per_seed, 100, seed=1))
    assert not np.array_equal(bootstrap_seed_means(per_seed, 100, seed=1), bootstrap_seed_means(per_seed, 100, seed=2))


def test_bootstrap_means_are_means_of_resampled_seeds():
    means = bootstrap_seed_means([[1.0, 2.0], [5.0]], num_resamples=200, seed=0)
    assert means.shape == (200, 2)
    assert set(means[:, 0].tolist()) <= {1.0, 1.5, 2.0}
    assert means[:, 1].tolist() == [5.0] * 200


def test_bootstrap_with_one_seed_per_method_is_the_point_estimate():
    # one seed per method: every resample is the observed order, so the interval collapses onto the point value
    per_seed = [[0.1], [0.3], [0.2], [0.4]]
    reference = [1.0, 2.0, 3.0, 4.0]
    rho = spearman_rho([0.1, 0.3, 0.2, 0.4], reference)  # ranks [1, 3, 2, 4] vs [1, 2, 3, 4]: 1 - 6*2/(4*15) = 0.8
    assert rho == pytest.approx(0.8)
    interval = bootstrap_rank_correlation(per_seed, reference, "spearman", num_resamples=50, seed=0)
    assert interval.low == pytest.approx(0.8)
    assert interval.high == pytest.approx(0.8)
    assert interval.fraction_positive == 1.0
    assert interval.num_undefined == 0
    tau = bootstrap_rank_correlation(per_seed, reference, "kendall", num_resamples=50, seed=0)
    assert tau.low == pytest.approx(4 / 6)  # 5 concordant, 1 discordant of 6 pairs
    assert tau.high == pytest.approx(4 / 6)


def test_bootstrap_counts_undefined_resamples():
    # all methods equal in every resample: the correlation is undefined throughout
    interval = bootstrap_rank_correlation([[0.5], [0.5]], [1.0, 2.0], "kendall", num_resamples=10, seed=0)
    assert interval.num_undefined == 10
    assert interval.fraction_positive == 0.0
    assert math.isnan(interval.low) and math.isnan(interval.high)


def test_bootstrap_rejects_unknown_statistic_and_length_mismatch():
    with pytest.raises(ValueError, match="statistic must be one of"):
        bootstrap_rank_correlation([[1.0], [2.0]], [1.0, 2.0], "pearson")
    with pytest.raises(ValueError, match="2 methods but 3 reference values"):
        bootstrap_rank_correlation([[1.0], [2.0]], [1.0, 2.0, 3.0])


def test_mean_and_stderr_by_hand():
    mean, se = mean_and_stderr([0.5, 0.6, 0.7])  # var = (0.01 + 0 + 0.01) / 2 = 0.01; se = 0.1 / sqrt(3)
    assert mean == pytest.approx(0.6)
    assert se == pytest.approx(0.1 / math.sqrt(3))
    assert math.isnan(mean_and_stderr([0.4])[1])


def test_ordering_agrees_over_present_methods():
    order = ("segment_ppo", "token_ppo", "bandit_ppo")
    assert ordering_agrees({"segment_ppo": 0.6, "token_ppo": 0.55, "bandit_ppo": 0.5}, order) is True
    assert ordering_agrees({"segment_ppo": 0.53, "bandit_ppo": 0.52}, order) is True
    assert ordering_agrees({"segment_ppo": 0.5, "bandit_ppo": 0.52}, order) is False
    assert ordering_agrees({"segment_ppo": 0.5, "bandit_ppo": 0.5}, order) is False  # a tie is no agreement
    assert ordering_agrees({"bandit_ppo": 0.5}, order) is None
