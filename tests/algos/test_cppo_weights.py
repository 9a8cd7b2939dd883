"""CPPO sample-wise weights: the five categories, their alpha/beta, thresholds and statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlhf_ext.algos.cppo_weights import (
    HIGH_REWARD_HIGH_PROB,
    HIGH_REWARD_LOW_PROB,
    LOW_REWARD_HIGH_PROB,
    LOW_REWARD_LOW_PROB,
    NORMAL,
)
from rlhf_ext.continual import BatchStats, CPPOWeightSettings, batch_stats, cppo_sample_weights, mean_log_prob

UNIT = BatchStats(*(torch.tensor(v, dtype=torch.float64) for v in (0.0, 1.0, 0.0, 1.0)))


def test_categories_and_weights_hand_made():
    rewards = torch.tensor([2.0, 2.0, -2.0, -2.0, 0.0, 2.0, 0.5, 0.85], dtype=torch.float64)
    logp = torch.tensor([2.0, -2.0, 2.0, -2.0, 0.0, 0.0, 3.0, 2.0], dtype=torch.float64)
    w = cppo_sample_weights(rewards, logp, stats=UNIT)  # thresholds at +-0.85
    assert w.category.tolist() == [
        HIGH_REWARD_HIGH_PROB,
        HIGH_REWARD_LOW_PROB,
        LOW_REWARD_HIGH_PROB,
        LOW_REWARD_LOW_PROB,
        NORMAL,  # both statistics inside the band
        NORMAL,  # high reward but ordinary probability
        NORMAL,  # ordinary reward, high probability
        NORMAL,  # reward exactly at the threshold: comparisons are strict
    ]
    assert w.alpha.tolist() == pytest.approx([2.0, 2.0, 2.0, 0.5, 1, 1, 1, 1])
    assert w.beta.tolist() == pytest.approx([2.0, 1.0, 0.2, 0.2, 1, 1, 1, 1])


def test_custom_settings_and_released_code_equivalent():
    rewards = torch.tensor([2.0, -2.0, -2.0])
    logp = torch.tensor([2.0, 2.0, -2.0])
    s = CPPOWeightSettings(threshold_std=1.0, alpha_high=3.0, alpha_low=0.1, beta_high=1.0, beta_low=1.0)
    w = cppo_sample_weights(rewards, logp, s, stats=UNIT)
    assert w.alpha.tolist() == pytest.approx([3.0, 3.0, 0.1])
    assert w.beta.tolist() == [1.0, 1.0, 1.0]  # beta == 1: what the released code effectively ran


def test_batch_statistics_are_mean_and_unbiased_std():
    torch.manual_seed(0)
    rewards, logp = torch.randn(16), -torch.rand(16) * 3
    stats = batch_stats(rewards, logp)
    assert stats.reward_mean.item() == pytest.approx(np.mean(rewards.numpy()), abs=1e-6)
    assert stats.reward_std.item() == pytest.approx(np.std(rewards.numpy(), ddof=1), abs=1e-6)
    assert stats.logp_std.item() == pytest.approx(np.std(logp.numpy(), ddof=1), abs=1e-6)
    default = cppo_sample_weights(rewards, logp)
    explicit = cppo_sample_weights(rewards, logp, stats=stats)
    assert torch.equal(default.category, explicit.category)
    # with k = 0.85 some samples of a random batch fall in every reward band
    assert (default.category != NORMAL).any() and (default.category == NORMAL).any()


def test_mean_log_prob_ignores_padding():
    logp = torch.tensor([[-1.0, -3.0, -100.0], [-2.0, -100.0, -100.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    assert mean_log_prob(logp, mask).tolist() == [-2.0, -2.0, 0.0]


def test_errors():
    with pytest.raises(ValueError, match="at least 2 samples"):
        cppo_sample_weights(torch.tensor([1.0]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"rewards has non-finite values at samples \[1\]"):
        cppo_sample_weights(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"must be a \[B\] vector"):
        cppo_sample_weights(torch.zeros(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="must match"):
        cppo_sample_weights(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="alpha_low must be a finite number >= 0"):
        CPPOWeightSettings(alpha_low=-1.0)
