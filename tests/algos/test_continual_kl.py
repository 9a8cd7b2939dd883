"""kl_to_previous / per_token_kl: hand-computed values, exact zeros, masking, and the direction of the gradients."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_ext.continual import K3_MAX_LOG_RATIO, kl_to_previous, masked_token_mean, per_token_kl

LOGP = torch.tensor([[-1.0, -2.0, -0.3]])
PREV = torch.tensor([[-1.5, -1.0, -9.0]])
MASK = torch.tensor([[True, True, False]])  # the third token (huge difference) is padding


def test_hand_computed_values_per_estimator():
    # d = logp - prev = [0.5, -1.0] on the two response tokens; log r = prev - logp = [-0.5, 1.0]
    assert kl_to_previous(LOGP, PREV, MASK, "k1").item() == pytest.approx((0.5 - 1.0) / 2, abs=1e-7)
    assert kl_to_previous(LOGP, PREV, MASK, "k2").item() == pytest.approx((0.125 + 0.5) / 2, abs=1e-7)
    k3 = ((math.exp(-0.5) - 1 + 0.5) + (math.exp(1.0) - 1 - 1.0)) / 2
    assert kl_to_previous(LOGP, PREV, MASK, "k3").item() == pytest.approx(k3, abs=1e-6)
    assert kl_to_previous(LOGP, PREV, MASK).item() == pytest.approx(k3, abs=1e-6)  # k3 is the default


def test_per_token_values_and_direction():
    torch.testing.assert_close(per_token_kl(LOGP, PREV, "k1")[0, :2], torch.tensor([0.5, -1.0]))
    # k3 is not symmetric: swapping the policies changes the value (reverse KL, current policy first)
    a = per_token_kl(LOGP, PREV, "k3")[0, :2]
    b = per_token_kl(PREV, LOGP, "k3")[0, :2]
    torch.testing.assert_close(a, torch.tensor([math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0]))
    torch.testing.assert_close(b, torch.tensor([math.exp(0.5) - 1.5, math.exp(-1.0)]))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_exact_zero_when_policies_agree(estimator):
    torch.manual_seed(0)
    logp = -torch.rand(4, 9) * 5
    mask = torch.rand(4, 9) > 0.3
    assert kl_to_previous(logp, logp.clone(), mask, estimator).item() == 0.0
    assert torch.equal(per_token_kl(logp, logp.clone(), estimator), torch.zeros(4, 9))


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    estimator=st.sampled_from(["k2", "k3"]),
)
def test_non_negative_and_positive_when_policies_differ(seed, estimator):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(3, 6, generator=g) * 4
    prev = logp + torch.randn(3, 6, generator=g)
    mask = torch.ones(3, 6, dtype=torch.bool)
    kl = per_token_kl(logp, prev, estimator)
    assert (kl >= 0).all()
    assert kl_to_previous(logp, prev, mask, estimator).item() > 0


def test_masked_positions_do_not_matter_and_empty_mask_is_zero():
    other = PREV.clone()
    other[0, 2] = 50.0  # only a padding position changes
    for est in ("k1", "k2", "k3"):
        assert kl_to_previous(LOGP, PREV, MASK, est).item() == kl_to_previous(LOGP, other, MASK, est).item()
    assert kl_to_previous(LOGP, PREV, torch.zeros_like(MASK)).item() == 0.0


def test_mask_mean_is_over_all_tokens_of_the_batch_not_per_row():
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    prev = torch.tensor([[-2.0, -2.0], [-3.0, -3.0]])
    mask = torch.tensor([[True, True], [True, False]])
    # k2 per token: row 0: 0.5, 0.5; row 1: 2.0 (second token masked) -> (0.5 + 0.5 + 2.0) / 3
    assert kl_to_previous(logp, prev, mask, "k2").item() == pytest.approx(1.0)


def test_sample_weights_scale_rows_and_keep_token_count_denominator():
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    prev = torch.tensor([[-2.0, -2.0], [-3.0, -3.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    w = torch.tensor([2.0, 0.5])
    # k2: row 0 tokens 0.5 each, row 1 tokens 2.0 each -> (2 * 1.0 + 0.5 * 4.0) / 4
    assert kl_to_previous(logp, prev, mask, "k2", sample_weights=w).item() == pytest.approx(1.0)
    plain = kl_to_previous(logp, prev, mask, "k2")
    assert kl_to_previous(logp, prev, mask, "k2", sample_weights=torch.ones(2)).item() == plain.item()
    with pytest.raises(ValueError, match=r"sample_weights must be \[B\]"):
        masked_token_mean(logp, mask, torch.ones(3))


def test_k3_is_finite_for_extreme_log_ratios():
    logp = torch.tensor([[-1000.0, 0.0]])
    prev = torch.tensor([[0.0, -1000.0]])
    kl = per_token_kl(logp, prev, "k3")
    assert torch.isfinite(kl).all()
    assert kl[0, 0].item() == pytest.approx(math.expm1(K3_MAX_LOG_RATIO) - K3_MAX_LOG_RATIO, rel=1e-6)
    assert kl[0, 1].item() == pytest.approx(math.expm1(-1000.0) + 1000.0)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="same shape"):
        kl_to_previous(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must have the shape"):
        kl_to_previous(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        kl_to_previous(torch.zeros(6), torch.zeros(6), torch.ones(6, dtype=torch.bool))
    with pytest.raises(ValueError, match="KL estimator must be one of k1, k2, k3"):
        kl_to_previous(LOGP, PREV, MASK, "k4")


# ------------------------------------------------------------------------------------------- gradient behaviour
def _exact_kl(q_logits: torch.Tensor, p_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(q || p) summed over T positions of categorical distributions ``[T, V]``."""
    lq, lp = q_logits.log_softmax(-1), p_logits.log_softmax(-1)
    return (lq.exp() * (lq - lp)).sum()


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_gradient_descent_moves_a_toy_policy_to_the_previous_one(estimator):
    """Minimising the penalty on a fixed batch of tokens (every vocabulary entry at every position) pulls the
    current categorical policy onto the previous one: the exact KL between them falls by >95 %."""
    torch.manual_seed(0)
    t, v = 4, 7
    prev_logits = torch.randn(t, v) * 2
    theta = torch.randn(t, v, requires_grad=True)
    prev_logp = prev_logits.log_softmax(-1).T  # [B=V tokens, T]
    mask = torch.ones(v, t, dtype=torch.bool)
    start = _exact_kl(theta.detach(), prev_logits).item()
    opt = torch.optim.SGD([theta], lr=5.0)
    for _ in range(100):
        opt.zero_grad()
        kl_to_previous(theta.log_softmax(-1).T, prev_logp, mask, estimator).backward()
        opt.step()
    end = _exact_kl(theta.detach(), prev_logits).item()
    assert start > 0.5
    assert end < 0.05 * start


def test_on_policy_expected_gradients_are_the_kl_gradients():
    """Weighting each token's pathwise gradient by its probability under the current policy (the on-policy
    expectation): k2 gives grad KL(pi_theta || pi_prev) and k3 gives grad KL(pi_prev || pi_theta), k1 gives 0."""
    torch.manual_seed(1)
    v = 9
    prev_logits = torch.randn(1, v)
    prev_logp = prev_logits.log_softmax(-1)

    def expected_grad(estimator):
        theta = torch.randn(1, v, generator=torch.Generator().manual_seed(5), requires_grad=True)
        logp = theta.log_softmax(-1)
        (logp.detach().exp() * per_token_kl(logp, prev_logp, estimator)).sum().backward()
        return theta.grad

    def exact_grad(reverse: bool):
        theta = torch.randn(1, v, generator=torch.Generator().manual_seed(5), requires_grad=True)
        (_exact_kl(theta, prev_logits) if reverse else _exact_kl(prev_logits, theta)).backward()
        return theta.grad

    torch.testing.assert_close(expected_grad("k2"), exact_grad(reverse=True), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(expected_grad("k3"), exact_grad(reverse=False), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(expected_grad("k1"), torch.zeros(1, v), atol=1e-6, rtol=0)
