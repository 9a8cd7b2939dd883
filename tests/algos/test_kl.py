"""kl_estimate, the package's one KL function: hand-computed k1/k2/k3/exact values, the clamp policy, exact KL against
torch.distributions, unbiasedness of k1/k3 by Monte Carlo, and the two per_token_kl wrappers."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_ext.algos import continual_kl, ppo
from rlhf_ext.algos.ppo import K3_MAX_LOG_RATIO, KL_ESTIMATORS, KLEstimator, kl_estimate

LN2 = math.log(2.0)


def _t(*values: float, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=dtype)


# ------------------------------------------------------------------------------------------ hand-computed values
def test_hand_computed_k1_k2_k3():
    # pi(a) = 0.5, pi_ref(a) = 0.25: log r = log 0.25 - log 0.5 = -log 2, r = 1/2
    logp, ref = _t(math.log(0.5)), _t(math.log(0.25))
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(LN2, abs=1e-7)  # -log r
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(LN2**2 / 2, abs=1e-7)  # (log r)^2 / 2
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + LN2, abs=1e-7)  # r - 1 - log r
    # swapped: log r = +log 2, r = 2
    assert kl_estimate(ref, logp, "k1").item() == pytest.approx(-LN2, abs=1e-7)
    assert kl_estimate(ref, logp, "k2").item() == pytest.approx(LN2**2 / 2, abs=1e-7)
    assert kl_estimate(ref, logp, "k3").item() == pytest.approx(2 - 1 - LN2, abs=1e-7)


def test_hand_computed_exact():
    # p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 log 2 + 1/2 log(2/3) = 1/2 log(4/3)
    p = torch.tensor([[[0.5, 0.5]]]).log()
    q = torch.tensor([[[0.25, 0.75]]]).log()
    out = kl_estimate(None, None, "exact", logp_full=p, ref_logp_full=q)
    assert out.shape == (1, 1)
    assert out.item() == pytest.approx(0.5 * math.log(4 / 3), abs=1e-7)
    # the sampled-token arguments are ignored by exact
    assert kl_estimate(_t(-9.0), _t(3.0), KLEstimator.EXACT, logp_full=p, ref_logp_full=q).item() == out.item()


def test_exact_zero_probability_entries():
    # pi gives 0 to a token (log p = -inf): 0 * log(0 / q) = 0, even where q is 0 too
    p = torch.tensor([[[0.0, -math.inf, -math.inf]]])  # (1, 0, 0)
    q = torch.tensor([[[0.5, 0.5, 0.0]]]).log()  # (1/2, 1/2, 0)
    assert kl_estimate(None, None, "exact", logp_full=p, ref_logp_full=q).item() == pytest.approx(LN2, abs=1e-7)
    # pi_ref gives 0 where pi does not: the KL is infinite (not clamped)
    out = kl_estimate(None, None, "exact", logp_full=q, ref_logp_full=p)
    assert out.item() == math.inf


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_every_estimator_is_exactly_zero_when_the_policies_agree(estimator):
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 5, 7, generator=g).log_softmax(-1)
    logp = full[..., 0]
    out = kl_estimate(logp, logp.clone(), estimator, logp_full=full, ref_logp_full=full.clone())
    assert torch.equal(out, torch.zeros(3, 5))


# ------------------------------------------------------------------------------------------------- clamp policy
def test_k3_clamps_the_log_ratio_from_above_at_k():
    assert K3_MAX_LOG_RATIO == 20.0
    # log r = ref - logp = 1000 (a token the policy has all but ruled out): k3 saturates at e^20 - 1 - 20
    logp, ref = _t(-1000.0, -25.0, -20.0), _t(0.0, 0.0, 0.0)
    k3 = kl_estimate(logp, ref, "k3")
    assert torch.isfinite(k3).all()
    at_clamp = math.expm1(20.0) - 20.0
    assert k3[0, 0].item() == pytest.approx(at_clamp, rel=1e-6)
    assert k3[0, 1].item() == pytest.approx(at_clamp, rel=1e-6)  # log r = 25 > K: same saturated value
    assert k3[0, 2].item() == pytest.approx(at_clamp, rel=1e-6)  # log r = K exactly
    # just below the clamp the value is the plain formula
    below = kl_estimate(_t(-19.0), _t(0.0), "k3").item()
    assert below == pytest.approx(math.expm1(19.0) - 19.0, rel=1e-6)


def test_only_k3_is_clamped_and_only_from_above():
    logp, ref = _t(-1000.0, 0.0), _t(0.0, -1000.0)  # log r = +1000, -1000
    assert kl_estimate(logp, ref, "k1").tolist() == [[-1000.0, 1000.0]]
    assert kl_estimate(logp, ref, "k2").tolist() == [[500000.0, 500000.0]]
    # log r = -1000: r - 1 - log r = e^-1000 - 1 + 1000 = 999, no clamp on the negative side
    assert kl_estimate(logp, ref, "k3")[0, 1].item() == pytest.approx(999.0, rel=1e-7)


def test_k3_gradient_is_zero_beyond_the_clamp_and_finite_everywhere():
    logp = torch.tensor([[-1000.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -0.5]])
    kl_estimate(logp, ref, "k3").sum().backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0].item() == 0.0
    # d/dlogp (r - 1 - log r) with log r = ref - logp: -(r - 1) = 1 - e^0.5
    assert logp.grad[0, 1].item() == pytest.approx(1 - math.exp(0.5), rel=1e-6)


# --------------------------------------------------------------------------------- exact vs torch.distributions
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_equals_torch_kl_divergence_of_categoricals(seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(4, 6, 11, generator=g) * 3
    b = torch.randn(4, 6, 11, generator=g) * 3
    expected = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=a), torch.distributions.Categorical(logits=b)
    )
    out = kl_estimate(None, None, "exact", logp_full=a.log_softmax(-1), ref_logp_full=b.log_softmax(-1))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_exact_needs_full_distributions():
    with pytest.raises(ValueError, match="exact KL estimator needs the full"):
        kl_estimate(_t(-1.0), _t(-2.0), "exact")
    with pytest.raises(ValueError, match="exact KL estimator needs the full"):
        kl_estimate(_t(-1.0), _t(-2.0), "exact", logp_full=torch.zeros(1, 1, 2))
    with pytest.raises(ValueError, match="same shape"):
        kl_estimate(None, None, "exact", logp_full=torch.zeros(1, 1, 2), ref_logp_full=torch.zeros(1, 1, 3))


# ---------------------------------------------------------------------------------------- unbiasedness (Monte Carlo)
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_k1_and_k3_are_unbiased_estimators_of_the_exact_kl(estimator):
    """Sample N tokens from a random categorical pi; the mean of the per-token estimates is within 5 standard errors
    (from the sample std) of the exact KL(pi || pi_ref)."""
    g = torch.Generator().manual_seed(123)
    v, n = 12, 200_000
    logp_full = (torch.randn(v, generator=g, dtype=torch.float64) * 1.5).log_softmax(-1)
    ref_full = (torch.randn(v, generator=g, dtype=torch.float64) * 1.5).log_softmax(-1)
    exact = kl_estimate(None, None, "exact", logp_full=logp_full.view(1, 1, v), ref_logp_full=ref_full.view(1, 1, v))
    tokens = torch.multinomial(logp_full.exp(), n, replacement=True, generator=g)
    samples = kl_estimate(logp_full[tokens].view(1, n), ref_full[tokens].view(1, n), estimator).flatten()
    stderr = samples.std().item() / math.sqrt(n)
    assert exact.item() > 0.1  # a non-trivial KL
    assert abs(samples.mean().item() - exact.item()) < 5 * stderr


def test_k2_is_biased_on_a_far_apart_pair():
    """k2 is not an unbiased estimator: E_p[(log r)^2 / 2] differs from the KL (computed exactly over the support)."""
    p = torch.tensor([0.9, 0.1], dtype=torch.float64)
    q = torch.tensor([0.1, 0.9], dtype=torch.float64)
    exact = kl_estimate(None, None, "exact", logp_full=p.log().view(1, 1, 2), ref_logp_full=q.log().view(1, 1, 2))
    expected_k2 = (p * kl_estimate(p.log().view(1, 2), q.log().view(1, 2), "k2")).sum()
    expected_k3 = (p * kl_estimate(p.log().view(1, 2), q.log().view(1, 2), "k3")).sum()
    assert expected_k3.item() == pytest.approx(exact.item(), rel=1e-12)  # k3's expectation is the KL exactly
    assert abs(expected_k2.item() - exact.item()) > 0.1


# ------------------------------------------------------------------------------------------ dtypes, shapes, wrappers
def test_dtypes():
    logp, ref = _t(-1.0, dtype=torch.float64), _t(-2.0, dtype=torch.float64)
    assert kl_estimate(logp, ref, "k3").dtype == torch.float64
    assert kl_estimate(logp.bfloat16(), ref.bfloat16(), "k3").dtype == torch.float32
    assert kl_estimate(logp.half(), ref.half(), "k1").dtype == torch.float32


def test_unknown_estimator_and_shape_mismatch():
    with pytest.raises(ValueError, match=r"KL estimator must be one of k1, k2, k3, exact; got 'k4'"):
        kl_estimate(_t(-1.0), _t(-2.0), "k4")
    with pytest.raises(ValueError, match="same shape"):
        kl_estimate(torch.zeros(2, 3), torch.zeros(2, 4), "k1")


def test_both_per_token_kl_wrappers_are_kl_estimate_with_their_defaults():
    g = torch.Generator().manual_seed(7)
    logp = -torch.rand(3, 8, generator=g) * 30  # includes log-ratios beyond the k3 clamp
    ref = -torch.rand(3, 8, generator=g) * 30
    # rlhf_ext.algos.ppo.per_token_kl: reward-penalty default k1
    assert torch.equal(ppo.per_token_kl(logp, ref), kl_estimate(logp, ref, "k1"))
    # rlhf_ext.algos.continual_kl.per_token_kl: default k3, with the same clamp
    assert torch.equal(continual_kl.per_token_kl(logp, ref), kl_estimate(logp, ref, "k3"))
    for est in ("k1", "k2", "k3"):
        assert torch.equal(ppo.per_token_kl(logp, ref, est), continual_kl.per_token_kl(logp, ref, est))
    assert continual_kl.K3_MAX_LOG_RATIO is ppo.K3_MAX_LOG_RATIO


def test_kl_to_previous_is_the_masked_mean_of_kl_estimate():
    logp = torch.tensor([[-1.0, -30.0, -0.3], [-2.0, -0.1, -5.0]])
    prev = torch.tensor([[-1.5, -1.0, -9.0], [-0.2, -0.1, -5.5]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    for est in ("k1", "k2", "k3"):
        expected = kl_estimate(logp, prev, est)[mask].mean()
        assert continual_kl.kl_to_previous(logp, prev, mask, est).item() == pytest.approx(expected.item(), rel=1e-6)


def test_continual_kl_accepts_only_sampled_token_estimators():
    assert continual_kl.KL_ESTIMATORS == ("k1", "k2", "k3")
    with pytest.raises(ValueError, match="KL estimator must be one of k1, k2, k3; got 'exact'"):
        continual_kl.check_estimator("exact")
    with pytest.raises(ValueError, match="KL estimator must be one of k1, k2, k3"):
        continual_kl.per_token_kl(_t(-1.0), _t(-2.0), "exact")
