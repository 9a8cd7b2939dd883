"""select_pairs (paper 004, Eq. 9): hand-made reward matrices, ties, length penalty, each rule, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_ext.online import PairSelection, select_pairs, text_ids


def _as_lists(sel: PairSelection):
    return sel.prompt_index.tolist(), sel.chosen.tolist(), sel.rejected.tolist(), sel.margin.tolist(), sel.dropped


def test_max_min_hand_made_with_ties():
    rewards = torch.tensor(
        [
            [0.1, 0.9, 0.5, 0.3],  # best 1, worst 0
            [0.4, 0.4, 0.4, 0.4],  # all tie -> dropped
            [2.0, -1.0, 2.0, -1.0],  # several maxima/minima: lowest index of each
            [0.0, 0.0, 0.0, 1e-3],  # tiny but real margin
        ]
    )
    idx, chosen, rejected, margin, dropped = _as_lists(select_pairs(rewards))
    assert idx == [0, 2, 3]
    assert chosen == [1, 0, 3]
    assert rejected == [0, 1, 0]
    assert margin == pytest.approx([0.8, 3.0, 1e-3])
    assert dropped == 1


def test_tie_tolerance_drops_near_ties():
    rewards = torch.tensor([[0.0, 1e-3], [0.0, 0.5]])
    sel = select_pairs(rewards, tie_tolerance=0.01)
    assert sel.prompt_index.tolist() == [1] and sel.dropped == 1


def test_identical_text_is_dropped_even_with_different_scores():
    # noisy annotators can score the same text differently; such a pair carries no preference signal
    rewards = torch.tensor([[0.0, 1.0, 0.5], [0.0, 1.0, 0.5]])
    texts = [["same", "same", "other"], ["a", "b", "c"]]
    sel = select_pairs(rewards, texts=texts)
    assert sel.prompt_index.tolist() == [1] and sel.dropped == 1
    # the id form gives the same answer
    assert _as_lists(select_pairs(rewards, texts=text_ids(texts))) == _as_lists(sel)


def test_text_ids_compare_within_rows():
    ids = text_ids([["x", "y", "x"], ["y", "y", "z"]])
    assert ids.shape == (2, 3)
    assert ids[0, 0] == ids[0, 2] and ids[0, 0] != ids[0, 1]
    assert ids[1, 0] == ids[1, 1] and ids[1, 0] != ids[1, 2]


def test_length_penalty_reorders_by_eq9():
    # r - lambda * |a| with lambda = 1e-3: 1.0 - 0.01 = 0.99 beats 1.2 - 0.4 = 0.8
    rewards = torch.tensor([[1.0, 1.2, 0.0]])
    lengths = torch.tensor([[10, 400, 5]])
    sel = select_pairs(rewards, lengths=lengths, length_penalty=1e-3)
    assert sel.chosen.tolist() == [0] and sel.rejected.tolist() == [2]
    assert sel.margin.tolist() == pytest.approx([0.99 - (0.0 - 0.005)])
    assert sel.reward_margin.tolist() == pytest.approx([1.0])
    # without the penalty the long response wins
    assert select_pairs(rewards, lengths=lengths).chosen.tolist() == [1]


def test_length_penalty_can_create_a_tie():
    rewards = torch.tensor([[1.0, 2.0]])
    lengths = torch.tensor([[0.0, 1000.0]])
    sel = select_pairs(rewards, lengths=lengths, length_penalty=1e-3)
    assert len(sel) == 0 and sel.dropped == 1


def test_max_random_keeps_the_best_and_draws_the_rest_uniformly():
    n, p = 4, 6000
    rewards = torch.arange(n, dtype=torch.float).repeat(p, 1)  # best is always index 3
    g = torch.Generator().manual_seed(0)
    sel = select_pairs(rewards, rule="max_random", generator=g)
    assert sel.dropped == 0
    assert (sel.chosen == n - 1).all()
    counts = torch.bincount(sel.rejected, minlength=n).float() / p
    assert counts[n - 1] == 0
    assert counts[: n - 1].tolist() == pytest.approx([1 / 3] * 3, abs=0.03)
    # seeded: the same draw twice
    again = select_pairs(rewards, rule="max_random", generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.rejected, sel.rejected)


def test_random_rule_orders_the_pair_and_covers_all_pairs():
    n, p = 3, 6000
    rewards = torch.tensor([[0.0, 1.0, 2.0]]).repeat(p, 1)
    sel = select_pairs(rewards, rule="random", generator=torch.Generator().manual_seed(1))
    assert sel.dropped == 0
    assert (sel.chosen > sel.rejected).all()  # higher reward = higher index here
    pairs = (sel.chosen * n + sel.rejected).tolist()
    freq = {k: pairs.count(k) / p for k in set(pairs)}
    assert set(freq) == {1 * n + 0, 2 * n + 0, 2 * n + 1}
    assert list(freq.values()) == pytest.approx([1 / 3] * 3, abs=0.03)


def test_random_rule_drops_ties():
    rewards = torch.tensor([[1.0, 1.0]]).repeat(50, 1)
    sel = select_pairs(rewards, rule="random", generator=torch.Generator().manual_seed(0))
    assert len(sel) == 0 and sel.dropped == 50


@pytest.mark.parametrize("bad", [torch.zeros(3, 1), torch.zeros(3, 0)])
def test_fewer_than_two_responses_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=">= 2"):
        select_pairs(bad)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match=r"\[P, n\]"):
        select_pairs(torch.zeros(4))
    with pytest.raises(ValueError, match="NaN"):
        select_pairs(torch.tensor([[0.0, float("nan")]]))
    with pytest.raises(ValueError, match="lengths"):
        select_pairs(torch.zeros(2, 2), length_penalty=0.1)
    with pytest.raises(ValueError, match=">= 0"):
        select_pairs(torch.zeros(2, 2), lengths=torch.zeros(2, 2), length_penalty=-1.0)
    with pytest.raises(ValueError, match="must match"):
        select_pairs(torch.zeros(2, 2), lengths=torch.zeros(2, 3), length_penalty=0.1)
    with pytest.raises(ValueError, match="unknown selection rule"):
        select_pairs(torch.zeros(2, 2), rule="best_worst")


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(2, 6),
    st.integers(0, 2**31 - 1),
    st.sampled_from([0.0, 0.01]),
)
def test_max_min_matches_a_per_prompt_reference(p, n, seed, lam):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 4, (p, n), generator=g).float()  # coarse values: many ties
    lengths = torch.randint(0, 50, (p, n), generator=g).float()
    sel = select_pairs(rewards, lengths=lengths, length_penalty=lam)
    expected = []
    for i in range(p):
        scores = [float(rewards[i, j] - lam * lengths[i, j]) for j in range(n)]
        best = max(range(n), key=lambda j: (scores[j], -j))
        worst = min(range(n), key=lambda j: (scores[j], j))
        if scores[best] - scores[worst] > 0:
            expected.append((i, best, worst))
    got = list(zip(sel.prompt_index.tolist(), sel.chosen.tolist(), sel.rejected.tolist()))
    assert got == expected
    assert sel.dropped == p - len(expected)
    assert (sel.margin > 0).all()
