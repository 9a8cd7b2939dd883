"""Normalizers (Eq. 6, Table 2), interpolation (Table 3), dense rewards (Table 1) and the PPO building blocks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_ext.algos.location_norm import LocationNormalizer, NormalizerError
from rlhf_ext.algos.ppo import (
    clipped_value_loss,
    discounted_reverse_cumsum,
    gae_advantages,
    masked_whiten,
    per_token_kl,
    ppo_advantages,
    reinforce_advantages,
    reward_to_go,
)
from rlhf_ext.algos.segment_dense import RewardValueError, dense_segment_rewards, interpolate_rewards
from rlhf_ext.runtime.calibration import load_normalizer, save_normalizer
from rlhf_ext.segment import segment_boundaries, segment_ids

F, T_ = False, True


# ---------------------------------------------------------------------------------------------- normalizer
def _synthetic(n_resp=400, seed=0, w_mu=2.0, b_mu=-1.0, w_s=-1.0, b_s=0.5):
    g = torch.Generator().manual_seed(seed)
    ps, rs = [], []
    for _ in range(n_resp):
        t_total = int(torch.randint(2, 9, (1,), generator=g))
        p = torch.arange(1, t_total + 1, dtype=torch.float64) / t_total
        r = w_mu * p + b_mu + torch.exp(w_s * p + b_s) * torch.randn(t_total, generator=g, dtype=torch.float64)
        ps.append(p)
        rs.append(r)
    return torch.cat(ps), torch.cat(rs)


def test_regression_recovers_known_coefficients():
    p, r = _synthetic(n_resp=20000)
    norm = LocationNormalizer.fit(p, r, kind="regression", reward_model="rm-A")
    assert norm.w_mu == pytest.approx(2.0, abs=0.1) and norm.b_mu == pytest.approx(-1.0, abs=0.06)
    assert norm.w_sigma == pytest.approx(-1.0, abs=0.15) and norm.b_sigma == pytest.approx(0.5, abs=0.1)
    assert norm.r2_mean > 0.9 and norm.num_points == p.numel() and norm.fallback is None
    z = norm.normalize(r, p)
    assert abs(z.mean().item()) < 0.05 and z.std().item() == pytest.approx(1.0, abs=0.05)


def test_log_basis_fits_log_p():
    g = torch.Generator().manual_seed(1)
    p = torch.randint(1, 11, (5000,), generator=g).double() / 10
    r = 0.7 * p.log() + 0.2 + 0.1 * torch.randn(5000, generator=g, dtype=torch.float64)
    norm = LocationNormalizer.fit(p, r, kind="regression", basis="log")
    assert norm.w_mu == pytest.approx(0.7, abs=0.02) and norm.b_mu == pytest.approx(0.2, abs=0.02)
    assert norm.mean(torch.tensor(0.5)).item() == pytest.approx(norm.w_mu * math.log(0.5) + norm.b_mu, abs=1e-6)
    last = r[p == 1.0]  # the last segment has its own statistics, not the line's value at p = 1
    assert norm.mean(torch.tensor(1.0)).item() == pytest.approx(last.mean().item(), abs=1e-6)
    assert norm.std(torch.tensor(1.0)).item() == pytest.approx(last.std().item(), abs=1e-6)


def test_last_segment_gets_its_own_statistics_hand_computed():
    """p = 1 is left out of the line and normalised by its own sample mean and std (the bandit normalizer); the
    interior locations 1/4, 1/2, 3/4 carry the line."""
    p = torch.tensor([0.25, 0.5, 0.75, 1.0] * 3, dtype=torch.float64)
    r = torch.tensor([0.0, 1.0, 2.0, 10.0, 0.5, 1.5, 2.5, 12.0, 1.0, 2.0, 3.0, 14.0], dtype=torch.float64)
    norm = LocationNormalizer.fit(p, r, kind="regression", min_points=4)
    # interior means 0.5, 1.5, 2.5 at p = 1/4, 1/2, 3/4: slope 4, intercept -0.5 exactly
    assert norm.w_mu == pytest.approx(4.0) and norm.b_mu == pytest.approx(-0.5)
    assert norm.mu_last == pytest.approx(12.0) and norm.sigma_last == pytest.approx(2.0)
    z = norm.normalize(torch.tensor([12.0, 1.5]), torch.tensor([1.0, 0.5]))
    assert z[0].item() == pytest.approx(0.0) and z[1].item() == pytest.approx(0.0, abs=1e-6)
    back = LocationNormalizer.from_dict(norm.to_dict())
    assert back == norm


def test_global_and_last_equal_hand_computed_values():
    p = torch.tensor([0.5, 1.0, 1 / 3, 2 / 3, 1.0])
    r = torch.tensor([1.0, 3.0, 0.0, 2.0, 5.0])
    glob = LocationNormalizer.fit(p, r, kind="global")
    assert glob.b_mu == pytest.approx(2.2) and math.exp(glob.b_sigma) == pytest.approx(r.double().std().item())
    last = LocationNormalizer.fit(p, r, kind="last")  # last segments are the points at p = 1: rewards 3 and 5
    assert last.b_mu == pytest.approx(4.0) and math.exp(last.b_sigma) == pytest.approx(math.sqrt(2.0))
    assert last.normalize(torch.tensor([4.0]), torch.tensor([0.3])).item() == pytest.approx(0.0)
    none = LocationNormalizer.fit(p, r, kind="none")
    assert torch.equal(none.normalize(r, p), r)


def test_save_load_round_trip_and_wrong_reward_model_is_refused(tmp_path):
    p, r = _synthetic(200)
    norm = LocationNormalizer.fit(p, r, reward_model="runs/rm-a")
    path = tmp_path / "norm.json"
    save_normalizer(norm, path)
    loaded = load_normalizer(path, reward_model="runs/rm-a")
    assert loaded == norm
    q = torch.rand(10)
    torch.testing.assert_close(loaded.normalize(r[:10], q + 0.01), norm.normalize(r[:10], q + 0.01))
    with pytest.raises(NormalizerError, match="fitted for reward model 'runs/rm-a', not 'runs/rm-b'"):
        load_normalizer(path, reward_model="runs/rm-b")
    with pytest.raises(NormalizerError, match="does not exist"):
        load_normalizer(tmp_path / "missing.json")


@pytest.mark.parametrize(
    ("p", "r", "expect"),
    [
        (torch.tensor([1.0, 1.0, 1.0]), torch.tensor([1.0, 2.0, 3.0]), "points"),  # too few points
        (torch.ones(20), torch.arange(20.0), "single location"),  # one location
        (torch.rand(50) * 0.9 + 0.1, torch.full((50,), 2.0), "zero variance"),  # constant rewards
    ],
)
def test_degenerate_calibration_falls_back_with_a_warning(p, r, expect):
    with pytest.warns(UserWarning):
        norm = LocationNormalizer.fit(p, r, kind="regression")
    assert norm.fallback is not None
    out = norm.normalize(r, p)
    assert torch.isfinite(out).all()


def test_nan_calibration_data_is_refused():
    with pytest.raises(ValueError, match="NaN/inf at indices"):
        LocationNormalizer.fit(torch.tensor([0.5, 1.0]), torch.tensor([0.0, float("nan")]))


# -------------------------------------------------------------------------------------------- interpolation
def _segs():
    mask = torch.tensor([[F, T_, T_, T_, T_, T_, F]])
    ent = torch.tensor([[0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0]])
    return segment_ids(segment_boundaries(ent, mask, 2.0), mask)  # segments [1,2] and [3,4,5]


def test_interpolation_kinds_hand_computed():
    seg = _segs()
    r = torch.tensor([[2.0, 3.0]])
    torch.testing.assert_close(interpolate_rewards(r, seg, "even_split"), torch.tensor([[0, 1, 1, 1, 1, 1, 0.0]]))
    torch.testing.assert_close(interpolate_rewards(r, seg, "repeat"), torch.tensor([[0, 2, 2, 3, 3, 3, 0.0]]))
    torch.testing.assert_close(interpolate_rewards(r, seg, "segment_end"), torch.tensor([[0, 0, 2, 0, 0, 3, 0.0]]))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 4), st.integers(3, 16))
def test_interpolation_properties(seed, b, t):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, t - 1, (b, 1), generator=g)
    length = torch.randint(1, t, (b, 1), generator=g).clamp(max=t - prompt)
    pos = torch.arange(t)
    mask = (pos >= prompt) & (pos < prompt + length)
    seg = segment_ids(segment_boundaries(torch.rand(b, t, generator=g) * 4, mask, 2.0), mask)
    r = torch.randn(seg.mask.shape, generator=g) * seg.mask
    even = interpolate_rewards(r, seg, "even_split")
    rep = interpolate_rewards(r, seg, "repeat")
    end = interpolate_rewards(r, seg, "segment_end")
    for x in (even, rep, end):
        assert (x[~mask] == 0).all()  # padding stays zero
    sums = torch.zeros_like(r).scatter_add_(1, seg.ids.clamp_min(0), torch.where(mask, even, 0.0))
    torch.testing.assert_close(sums, r, atol=1e-5, rtol=1e-5)  # even split sums back to each segment's reward
    torch.testing.assert_close(rep.sum(1), (r * seg.lengths).sum(1), atol=1e-4, rtol=1e-4)  # repeat = r * length
    torch.testing.assert_close(end.sum(1), r.sum(1), atol=1e-5, rtol=1e-5)
    assert ((end != 0) <= seg.ends).all()  # only segment ends carry a reward


# ---------------------------------------------------------------------------------------------- dense rewards
def test_bandit_places_normalized_score_on_last_token():
    mask = torch.tensor([[F, T_, T_, T_, F], [T_, T_, F, F, F]])
    scores = torch.tensor([[9.0, 1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 9.0, 9.0, 9.0]])
    norm = LocationNormalizer(kind="global", b_mu=1.0, b_sigma=math.log(2.0))
    out = dense_segment_rewards(scores, mask, granularity="bandit", normalizer=norm)
    expected = torch.tensor([[0, 0, 0, 1.0, 0], [0, 2.0, 0, 0, 0]])
    torch.testing.assert_close(out.rewards, expected)
    torch.testing.assert_close(out.sequence_reward, torch.tensor([1.0, 2.0]))


def test_segment_granularity_with_inf_cutoff_equals_bandit():
    torch.manual_seed(0)
    mask = torch.tensor([[F, T_, T_, T_, T_], [F, F, T_, T_, F]])
    scores, ent = torch.randn(2, 5), torch.rand(2, 5) * 5
    norm = LocationNormalizer(kind="global", b_mu=0.3, b_sigma=0.2)
    a = dense_segment_rewards(scores, mask, ent, normalizer=norm, entropy_cutoff=math.inf, interpolation="segment_end")
    b = dense_segment_rewards(scores, mask, normalizer=norm, granularity="bandit")
    torch.testing.assert_close(a.rewards, b.rewards)


def test_segment_as_bandit_uses_the_sequence_evaluation():
    mask = torch.tensor([[F, T_, T_, T_, T_]])
    ent = torch.tensor([[0.0, 0.0, 0.0, 5.0, 0.0]])
    scores = torch.tensor([[0.0, 0.0, 1.0, 0.0, 2.0]])
    out = dense_segment_rewards(scores, mask, ent, granularity="segment_as_bandit", tau=0.5)
    e = 0.5 * math.log(math.exp(2.0) + math.exp(4.0))
    torch.testing.assert_close(out.rewards, torch.tensor([[0, 0, 0, 0, e]]))


def test_token_granularity_rewards_every_token():
    mask = torch.tensor([[F, T_, T_, T_]])
    scores = torch.tensor([[5.0, 1.0, 2.0, 3.0]])
    out = dense_segment_rewards(scores, mask, granularity="token")
    torch.testing.assert_close(out.rewards, torch.tensor([[0.0, 1.0, 2.0, 3.0]]))
    assert out.segments.counts.tolist() == [3]


def test_dense_rewards_from_logits_equal_from_entropy():
    from rlhf_ext.segment import token_entropy

    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11) * 3
    mask = torch.tensor([[F, F, T_, T_, T_, T_], [F, T_, T_, T_, F, F]])
    scores = torch.randn(2, 6)
    a = dense_segment_rewards(scores, mask, logits=logits, entropy_cutoff=1.5)
    b = dense_segment_rewards(scores, mask, entropy=token_entropy(logits), entropy_cutoff=1.5)
    torch.testing.assert_close(a.rewards, b.rewards)


def test_nan_scores_name_the_sample():
    mask = torch.tensor([[F, T_, T_], [F, T_, T_]])
    scores = torch.tensor([[0.0, 1.0, 2.0], [0.0, float("nan"), 1.0]])
    with pytest.raises(RewardValueError, match=r"sample\(s\) \[1\]"):
        dense_segment_rewards(scores, mask, torch.zeros(2, 3))
    # NaN outside the response (padding, prompt) is harmless
    scores[1, 1] = 0.0
    scores[0, 0] = float("inf")
    dense_segment_rewards(scores, mask, torch.zeros(2, 3))


# ------------------------------------------------------------------------------------------------- PPO pieces
def _loop_discounted(x, d):
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        acc = 0.0
        for t in reversed(range(x.shape[1])):
            acc = x[b, t].item() + d * acc
            out[b, t] = acc
    return out


@pytest.mark.parametrize("t", [1, 7, 300, 600])
@pytest.mark.parametrize("d", [0.0, 0.5, 0.95, 1.0])
def test_discounted_reverse_cumsum_matches_loop(t, d):
    x = torch.randn(3, t, generator=torch.Generator().manual_seed(t))
    torch.testing.assert_close(discounted_reverse_cumsum(x, d, block=64), _loop_discounted(x, d), atol=1e-3, rtol=1e-4)


def test_gae_matches_openrlhf_style_loop():
    torch.manual_seed(0)
    rewards, values = torch.randn(2, 6), torch.randn(2, 6)
    mask = torch.tensor([[T_] * 6, [T_] * 4 + [F] * 2])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    for b in range(2):  # reference: the textbook reverse recursion
        last, n = 0.0, int(mask[b].sum())
        for t in reversed(range(n)):
            nv = values[b, t + 1].item() if t + 1 < n else 0.0
            delta = rewards[b, t].item() + 0.9 * nv - values[b, t].item()
            last = delta + 0.9 * 0.8 * last
            assert adv[b, t].item() == pytest.approx(last, abs=1e-5)
            assert ret[b, t].item() == pytest.approx(last + values[b, t].item(), abs=1e-5)
    assert (adv[1, 4:] == 0).all() and (ret[1, 4:] == 0).all()


def test_reinforce_and_group_baseline_by_hand():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0], [2.0, 0.0], [0.0, 0.0]])
    mask = torch.ones(4, 2, dtype=torch.bool)
    adv, ret = reinforce_advantages(rewards, mask)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0], [3.0, 3.0], [2.0, 0.0], [0.0, 0.0]]))
    torch.testing.assert_close(adv, ret)
    torch.testing.assert_close(reward_to_go(rewards, mask), ret)
    # reinforce_baseline: group means 2 and 1 subtracted at the last token, no KL, no whitening
    _, adv, ret = ppo_advantages(rewards, torch.zeros(4, 2), mask, 0.0, None, "reinforce_baseline", group_size=2,
                                 whiten=False)  # fmt: skip
    torch.testing.assert_close(ret, torch.tensor([[-1.0, -1.0], [1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]]))
    # clip after the baseline, per token: 3 - 2 = 1 -> clipped to 0.5
    _, _, ret = ppo_advantages(rewards, torch.zeros(4, 2), mask, 0.0, None, "reinforce_baseline", group_size=2,
                               whiten=False, clip_range=(-0.5, 0.5))  # fmt: skip
    torch.testing.assert_close(ret, torch.tensor([[-0.5, -0.5], [0.5, 0.5], [0.0, -0.5], [-0.5, -0.5]]))


def test_per_token_kl_estimators_and_whiten_and_value_loss():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0])
    assert per_token_kl(logp, ref, "k1").tolist() == pytest.approx([0.5, 0.0])
    assert per_token_kl(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.0])
    assert per_token_kl(logp, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) - 1 + 0.5, 0.0])
    x, m = torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[T_, T_, T_, F]])
    w = masked_whiten(x, m)
    assert w[0, :3].mean().item() == pytest.approx(0.0, abs=1e-6) and w[0, 3].item() == 0.0
    v, old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    loss, frac = clipped_value_loss(v, old, ret, torch.ones(1, 2, dtype=torch.bool), clip=0.25)
    # token 0: unclipped err 1, clipped (0.25)^2 -> max 1; token 1: err 1 both -> mean 0.5 * 1
    assert loss.item() == pytest.approx(0.5) and frac.item() == 0.0


def test_chunk_rewards_are_invariant_to_any_entropy_segmentation_of_a_fixed_response():
    """The robust mode's property (random batches): scoring fixed responses with entropies that a policy could steer
    (lowered by any amount, shuffled, all above the cutoff) gives exactly the same per-token rewards as with the SFT
    model's own entropies: bound 0. The paper's mode has no such bound: lowering the cutoff multiplies segments and,
    where normalized segment rewards are positive, the summed reward grows with them."""
    g = torch.Generator().manual_seed(0)
    norm = LocationNormalizer(kind="regression", w_mu=0.4, b_mu=-1.0, w_sigma=-0.3, b_sigma=0.0)
    for _ in range(20):
        b, t = 6, 40
        lengths = torch.randint(1, t + 1, (b,), generator=g)
        mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
        scores = torch.randn(b, t, generator=g)
        entropy = torch.rand(b, t, generator=g) * 4
        steered = [entropy - 10, entropy[:, torch.randperm(t, generator=g)], torch.full_like(entropy, 9.0)]
        base = dense_segment_rewards(scores, mask, entropy, normalizer=norm, granularity="chunk", chunk_size=3)
        for other in steered:
            again = dense_segment_rewards(scores, mask, other, normalizer=norm, granularity="chunk", chunk_size=3)
            assert torch.equal(base.rewards, again.rewards) and torch.equal(base.sequence_reward, again.sequence_reward)
    # the paper's mode: every token a boundary (text the SFT model finds uncertain everywhere) pays per boundary
    scores = torch.full((1, 12), 2.0)  # a reward model that scores every prefix above the calibration mean
    mask = torch.ones(1, 12, dtype=torch.bool)
    calm, uncertain = torch.zeros(1, 12), torch.full((1, 12), 9.0)
    few = dense_segment_rewards(scores, mask, calm, normalizer=norm, granularity="segment").sequence_reward
    many = dense_segment_rewards(scores, mask, uncertain, normalizer=norm, granularity="segment").sequence_reward
    assert many.item() > 5 * few.item() > 0


def test_segmentation_rates_and_the_monitor_hand_computed():
    from rlhf_ext.algos.segment_dense import SegmentationMonitor, SegmentationRates, segmentation_rates

    mask = torch.tensor([[T_, T_, T_, T_, F], [T_, T_, F, F, F]])
    entropy = torch.tensor([[0.0, 3.0, 1.0, 2.5, 9.0], [3.0, 0.5, 9.0, 9.0, 9.0]])  # padding entropies never count
    counts = torch.tensor([3, 1])
    rates = segmentation_rates(counts, mask, entropy, cutoff=2.0)
    assert rates == SegmentationRates(4 / 6, 3 / 6)  # token-weighted: 4 segments, 3 tokens above 2.0, 6 tokens
    assert math.isnan(segmentation_rates(counts, mask, None, 2.0).above_cutoff_share)

    monitor = SegmentationMonitor(SegmentationRates(0.25, 0.25), "segment")
    assert monitor.ratios(rates) == {"segments_per_token": pytest.approx(8 / 3), "above_cutoff_share": 2.0}
    assert monitor.check(SegmentationRates(0.3, 0.3), step=1) is None  # 1.2x: below the threshold
    message = monitor.check(rates, step=7)
    assert message.startswith("reward hacking monitor at step 7: segments_per_token 0.667 = 2.67x the SFT model's")
    assert "granularity 'chunk'" in message
    assert monitor.check(rates, step=8) is None  # once per run
    chunk = SegmentationMonitor(SegmentationRates(0.25, 0.25), "chunk")
    assert "chunk rewards do not depend on entropy boundaries" in chunk.check(rates)
    assert SegmentationMonitor(None).check(rates) is None  # no reference (e.g. a released normalizer): silent


def test_segmentation_totals_of_ranks_with_different_lengths_add_up_to_the_whole_batch():
    """Under DDP each rank pads to its own longest response: the monitor gathers ``[3]`` sums, never ``[B, T]``
    tensors (gloo's all_gather needs one shape; the [B, T] gather aborted a 2-process torchrun in CI)."""
    from rlhf_ext.algos.segment_dense import SegmentationRates, segmentation_rates, segmentation_totals

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 12, (8,), generator=g)
    mask = torch.arange(12) < lengths[:, None]
    entropy = torch.rand(8, 12, generator=g) * 4
    counts = torch.randint(1, 5, (8,), generator=g)
    whole = segmentation_rates(counts, mask, entropy, 2.0)
    ranks = [(slice(0, 3), int(lengths[:3].max())), (slice(3, 8), int(lengths[3:].max()))]
    totals = sum(segmentation_totals(counts[r], mask[r, :t], entropy[r, :t], 2.0) for r, t in ranks)
    assert SegmentationRates.of_totals(totals) == whole
