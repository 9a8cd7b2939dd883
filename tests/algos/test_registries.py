"""The str enums of rlhf_ext.algos (values = the old strings, plain strings still accepted, old error messages kept)
and the advantage-estimator registry (dispatch = calling the estimator functions directly)."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_ext.algos import ppo
from rlhf_ext.algos.location_norm import NORMALIZER_KINDS, LocationNormalizer, NormalizerError, NormalizerKind
from rlhf_ext.algos.pair_selection import SELECTION_RULES, SelectionRule, select_pairs
from rlhf_ext.algos.ppo import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATORS,
    KL_ESTIMATORS,
    AdvantageEstimator,
    KLEstimator,
    check_kl_estimator,
    gae_advantages,
    masked_whiten,
    ppo_advantages,
    register_advantage_estimator,
    reinforce_advantages,
)
from rlhf_ext.algos.segment_dense import (
    GRANULARITIES,
    INTERPOLATIONS,
    Granularity,
    Interpolation,
    dense_segment_rewards,
    interpolate_rewards,
)
from rlhf_ext.algos.segment_reward import (
    AGGREGATIONS,
    Aggregation,
    aggregate_segments,
    check_aggregation,
    segment_boundaries,
    segment_ids,
)

OLD_VALUES = [
    (Granularity, GRANULARITIES, ("segment", "chunk", "token", "bandit", "bandit_as_segment", "segment_as_bandit")),
    (Interpolation, INTERPOLATIONS, ("even_split", "repeat", "segment_end")),
    (NormalizerKind, NORMALIZER_KINDS, ("none", "global", "last", "regression")),
    (AdvantageEstimator, ESTIMATORS, ("gae", "reinforce", "reinforce_baseline")),
    (SelectionRule, SELECTION_RULES, ("max_min", "max_random", "random")),
    (KLEstimator, KL_ESTIMATORS, ("k1", "k2", "k3", "exact")),
    (Aggregation, AGGREGATIONS, ("softmax", "sum", "mean")),
]


# ------------------------------------------------------------------------------------------------------- enums
@pytest.mark.parametrize(("enum", "constant", "old"), OLD_VALUES, ids=lambda x: getattr(x, "__name__", None))
def test_enum_values_are_the_old_strings_and_the_tuples_are_derived(enum, constant, old):
    assert tuple(m.value for m in enum) == old
    assert constant == old
    assert all(type(v) is str for v in constant)  # plain strings, as before
    for member, value in zip(enum, old, strict=True):
        assert member == value and value == member
        assert hash(member) == hash(value)  # interchangeable as dict keys / set members
        assert member in old and value in set(enum)
        assert str(member) == value and f"{member}" == value and f"{member:>20}" == f"{value:>20}"
        assert enum(value) is member
        assert json.dumps(member) == json.dumps(value)


def test_granularity_bandit_equals_bandit():
    assert Granularity.BANDIT == "bandit"
    assert ", ".join(Granularity) == ", ".join(GRANULARITIES)


def test_reexported_tuples_are_unchanged():
    import rlhf_ext.online as online
    import rlhf_ext.segment as segment

    assert segment.GRANULARITIES == GRANULARITIES
    assert segment.INTERPOLATIONS == INTERPOLATIONS
    assert segment.NORMALIZER_KINDS == NORMALIZER_KINDS
    assert segment.AGGREGATIONS == AGGREGATIONS
    assert online.SELECTION_RULES == SELECTION_RULES


# ------------------------------------------------------------------------------------ unknown names keep messages
def _segments():
    entropy = torch.tensor([[0.0, 3.0, 0.5, 2.5, 0.1]])
    mask = torch.tensor([[False, True, True, True, True]])
    return segment_ids(segment_boundaries(entropy, mask, 2.0), mask), entropy, mask


def test_unknown_names_raise_the_existing_messages():
    segments, entropy, mask = _segments()
    scores = torch.arange(5.0).view(1, 5)
    with pytest.raises(ValueError, match=r"^interpolation must be one of even_split, repeat, segment_end; got 'sp'$"):
        interpolate_rewards(torch.ones(1, 2), segments, "sp")
    with pytest.raises(
        ValueError,
        match=r"^granularity must be one of segment, chunk, token, bandit, bandit_as_segment, segment_as_bandit; "
        r"got 'x'$",
    ):
        dense_segment_rewards(scores, mask, entropy=entropy, granularity="x")
    with pytest.raises(
        NormalizerError, match=r"^normalizer kind must be one of none, global, last, regression; got 'z'"
    ):
        LocationNormalizer(kind="z")
    with pytest.raises(ValueError, match=r"^aggregation must be one of softmax, sum, mean; got 'max'$"):
        check_aggregation("max")
    with pytest.raises(ValueError, match=r"^aggregation must be one of"):
        aggregate_segments(torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), "max")
    with pytest.raises(ValueError, match=r"^unknown selection rule 'best'; choose one of max_min, max_random, random$"):
        select_pairs(torch.tensor([[1.0, 2.0]]), rule="best")
    with pytest.raises(
        ValueError, match=r"^advantage estimator must be one of gae, reinforce, reinforce_baseline; got 'grpo'$"
    ):
        ppo_advantages(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), 0.1, estimator="grpo")
    with pytest.raises(ValueError, match=r"^KL estimator must be one of k1, k2, k3, exact; got 'k9'$"):
        check_kl_estimator("k9")


# ------------------------------------------------------------------------------------ members work like strings
def test_members_and_strings_give_the_same_results():
    segments, entropy, mask = _segments()
    scores = torch.tensor([[0.0, 1.0, -2.0, 0.5, 3.0]])
    for member in Interpolation:
        seg = torch.tensor([[1.0, -2.0]])
        assert torch.equal(interpolate_rewards(seg, segments, member), interpolate_rewards(seg, segments, member.value))
    for member in Granularity:
        a = dense_segment_rewards(scores, mask, entropy=entropy, granularity=member)
        b = dense_segment_rewards(scores, mask, entropy=entropy, granularity=member.value)
        assert torch.equal(a.rewards, b.rewards)
    for member in Aggregation:
        seg, seg_mask = torch.tensor([[1.0, -2.0]]), torch.ones(1, 2, dtype=torch.bool)
        assert torch.equal(aggregate_segments(seg, seg_mask, member), aggregate_segments(seg, seg_mask, member.value))
    rewards = torch.tensor([[1.0, 3.0, 2.0], [0.0, -1.0, 5.0]])
    for member in SelectionRule:
        a = select_pairs(rewards, rule=member, generator=torch.Generator().manual_seed(0))
        b = select_pairs(rewards, rule=member.value, generator=torch.Generator().manual_seed(0))
        assert torch.equal(a.chosen, b.chosen) and torch.equal(a.rejected, b.rejected)


def test_normalizer_kind_member_is_stored_as_a_plain_string():
    p = torch.tensor([0.5, 1.0, 0.5, 1.0] * 4)
    r = torch.arange(16.0)
    for member in NormalizerKind:
        fitted = LocationNormalizer.fit(p, r, kind=member)
        assert type(fitted.kind) is str and fitted.kind == member.value
        plain = LocationNormalizer.fit(p, r, kind=member.value)
        assert fitted == plain
        json.dumps(fitted.to_dict())


# ------------------------------------------------------------------------------------ advantage-estimator registry
def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(4, 6, generator=g)
    kl = torch.randn(4, 6, generator=g).abs()
    values = torch.randn(4, 6, generator=g)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, :2] = False  # left padding
    return dense, kl, values, mask


def test_registry_holds_the_builtin_estimators():
    assert tuple(ADVANTAGE_ESTIMATORS)[:3] == ESTIMATORS
    assert ADVANTAGE_ESTIMATORS[AdvantageEstimator.GAE] is ppo.gae_estimator
    assert ADVANTAGE_ESTIMATORS["reinforce"] is ppo.reinforce_estimator
    assert ADVANTAGE_ESTIMATORS[AdvantageEstimator.REINFORCE_BASELINE] is ppo.reinforce_baseline_estimator


@pytest.mark.parametrize("whiten", [False, True])
def test_dispatch_equals_calling_the_estimator_functions_directly(whiten):
    dense, kl, values, mask = _batch()
    kl_coef, gamma, lam = 0.05, 0.99, 0.9
    shaped = torch.where(mask, dense - kl_coef * kl, 0.0)

    def maybe_whiten(adv):
        return masked_whiten(adv, mask) if whiten else adv

    # gae
    r, adv, ret = ppo_advantages(dense, kl, mask, kl_coef, values, "gae", gamma, lam, whiten=whiten)
    direct_adv, direct_ret = gae_advantages(shaped, values, mask, gamma, lam)
    torch.testing.assert_close(r, shaped)
    torch.testing.assert_close(adv, maybe_whiten(direct_adv))
    torch.testing.assert_close(ret, direct_ret)
    # reinforce
    r, adv, ret = ppo_advantages(
        dense, kl, mask, kl_coef, estimator=AdvantageEstimator.REINFORCE, gamma=gamma, whiten=whiten
    )
    direct_adv, direct_ret = reinforce_advantages(shaped, mask, gamma)
    torch.testing.assert_close(adv, maybe_whiten(direct_adv))
    torch.testing.assert_close(ret, direct_ret)
    # reinforce_baseline, groups of 2: the group mean of dense.sum(1) comes off each response's last token
    r, adv, ret = ppo_advantages(
        dense, kl, mask, kl_coef, estimator="reinforce_baseline", gamma=gamma, group_size=2, whiten=whiten
    )
    seq = torch.where(mask, dense, 0.0).sum(1)
    baseline = seq.view(2, 2).mean(1).repeat_interleave(2)
    last = torch.tensor([5, 3, 5, 5])
    adjusted = torch.where(mask, dense, 0.0)
    adjusted[torch.arange(4), last] -= baseline
    shaped_b = torch.where(mask, adjusted - kl_coef * kl, 0.0)
    direct_adv, direct_ret = reinforce_advantages(shaped_b, mask, gamma)
    torch.testing.assert_close(r, shaped_b)
    torch.testing.assert_close(adv, maybe_whiten(direct_adv))
    torch.testing.assert_close(ret, direct_ret)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_registry_entry_called_directly_equals_ppo_advantages(name):
    dense, kl, values, mask = _batch(1)
    kwargs = dict(values=values, gamma=0.97, lam=0.8, group_size=2, clip_range=(-1.0, 1.0))
    out = ppo_advantages(dense, kl, mask, 0.1, estimator=name, whiten=False, **kwargs)
    direct = ADVANTAGE_ESTIMATORS[name](torch.where(mask, dense, 0.0), 0.1 * kl, mask, **kwargs)
    for a, b in zip(out, direct, strict=True):
        assert torch.equal(a, b)


def test_register_a_new_estimator_and_refuse_duplicates():
    dense, kl, values, mask = _batch(2)
    try:

        @register_advantage_estimator("constant_one")
        def constant_one(dense, kl_penalty, mask, **_):
            rewards = torch.where(mask, dense - kl_penalty, 0.0)
            ones = mask.float()
            return rewards, ones, ones

        _, adv, ret = ppo_advantages(dense, kl, mask, 0.1, estimator="constant_one", whiten=False)
        assert torch.equal(adv, mask.float()) and torch.equal(ret, mask.float())
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("constant_one")(lambda *a, **k: None)
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator(AdvantageEstimator.GAE)(lambda *a, **k: None)
        # the engines' command-line choices stay OpenRLHF's three names
        assert ESTIMATORS == ("gae", "reinforce", "reinforce_baseline")
    finally:
        ADVANTAGE_ESTIMATORS.pop("constant_one", None)
    with pytest.raises(ValueError, match="advantage estimator must be one of gae, reinforce, reinforce_baseline"):
        ppo_advantages(dense, kl, mask, 0.1, estimator="constant_one")


def test_gae_without_values_still_raises():
    dense, kl, _, mask = _batch()
    with pytest.raises(ValueError, match="the gae estimator needs critic values"):
        ppo_advantages(dense, kl, mask, 0.1, estimator="gae")
