"""The length-controlled win rate (AlpacaEval 2.0's GLM read off at zero length difference)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlhf_ext.sim.evaluate import length_controlled_win_rate


def _sklearn_fit(outcome: torch.Tensor, length: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """The same GLM by scikit-learn, unpenalised, soft labels as AlpacaEval passes them (each row twice: label 1 with
    weight y, label 0 with weight 1 - y)."""
    from sklearn.linear_model import LogisticRegression

    y = outcome.double().flatten().numpy()
    delta = (length.double() - ref.double()).flatten().numpy()
    t = np.tanh(delta / delta.std(ddof=1))
    x = np.stack([np.ones_like(t), t], axis=1)
    model = LogisticRegression(penalty=None, fit_intercept=False, tol=1e-12, max_iter=10_000, solver="lbfgs")
    model.fit(np.concatenate([x, x]), np.r_[np.ones_like(y), np.zeros_like(y)], sample_weight=np.r_[y, 1 - y])
    a, b = model.coef_[0]
    return 1 / (1 + math.exp(-a)), b


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_scikit_learn_maximum_likelihood(seed):
    g = torch.Generator().manual_seed(seed)
    prompts, k = 60, 2
    length = torch.randint(50, 600, (prompts, k), generator=g).float()
    ref = torch.randint(50, 600, (prompts, k), generator=g).float()
    longer = (length > ref).float()
    outcome = torch.where(torch.rand(prompts, k, generator=g) < 0.3 + 0.4 * longer, 1.0, 0.0)
    outcome[torch.rand(prompts, k, generator=g) < 0.1] = 0.5
    lc = length_controlled_win_rate(outcome, length, ref)
    expected_lc, expected_coef = _sklearn_fit(outcome, length, ref)
    assert lc.win_rate == pytest.approx(expected_lc, abs=1e-6)  # two solvers of one convex problem
    assert lc.length_coef == pytest.approx(expected_coef, abs=1e-5)
    assert lc.length_coef > 0  # planted: longer responses win more often


def test_length_bias_is_removed_and_a_length_blind_judge_is_unchanged():
    """Planted model: the judge prefers longer responses and is otherwise indifferent, P(win) = sigmoid(2 tanh(x));
    the policy writes longer responses, so its raw win rate is high while its length-controlled one is 1/2."""
    g = torch.Generator().manual_seed(0)
    prompts, k = 4000, 2
    ref = torch.full((prompts, k), 300.0)
    length = 300 + 150 * torch.randn(prompts, k, generator=g) + 100
    x = torch.tanh((length - ref) / (length - ref).std())
    outcome = (torch.rand(prompts, k, generator=g) < torch.sigmoid(2 * x)).float()
    lc = length_controlled_win_rate(outcome, length, ref)
    assert float(outcome.mean()) > 0.6  # the raw win rate rewards length
    assert abs(lc.win_rate - 0.5) < 3 * lc.stderr
    assert lc.length_coef == pytest.approx(2.0, abs=0.15)


def test_equal_lengths_give_the_raw_win_rate():
    outcome = torch.tensor([[1.0, 0.5], [0.0, 1.0], [1.0, 1.0]])
    same = torch.full((3, 2), 100.0)
    lc = length_controlled_win_rate(outcome, same, same)
    assert lc.win_rate == float(outcome.mean())
    assert lc.length_coef == 0.0


def test_outcomes_separated_by_length_give_a_finite_fit():
    """Longer responses always win, equal lengths tie: no maximum-likelihood slope exists (the data are separable);
    the vanishing ridge keeps the slope finite, and at zero length difference the outcome is the tie, LC = 1/2."""
    outcome = torch.tensor([[1.0, 1.0], [0.5, 0.5], [0.5, 0.5]])
    length = torch.tensor([[9.0, 9.0], [3.0, 3.0], [3.0, 3.0]])
    lc = length_controlled_win_rate(outcome, length, torch.full((3, 2), 3.0))
    assert lc.win_rate == pytest.approx(0.5, abs=1e-6)
    assert math.isfinite(lc.length_coef) and lc.length_coef > 5
