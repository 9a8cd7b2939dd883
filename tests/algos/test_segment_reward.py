"""Segmentation, gathering and aggregation: hand-computed examples, properties, and the per-sample oracle."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_ext.segment import (
    aggregate_segments,
    evaluate_sequences,
    gather_segment_rewards,
    segment_boundaries,
    segment_bt_loss,
    segment_ids,
    token_entropy,
)
from tests.helpers.reference import reference_aggregate, reference_segment_rewards

F, T_ = False, True


# ----------------------------------------------------------------------------------------------- token_entropy
def test_token_entropy_uniform_and_peaked():
    v = 8
    logits = torch.zeros(1, 2, v)
    logits[0, 1, 3] = 1e4  # a point mass
    ent = token_entropy(logits, shift=False)
    assert ent[0, 0].item() == pytest.approx(math.log(v), abs=1e-6)
    assert ent[0, 1].item() == pytest.approx(0.0, abs=1e-6)
    shifted = token_entropy(logits, shift=True)
    assert shifted[0, 0].item() == 0.0
    assert shifted[0, 1].item() == pytest.approx(math.log(v), abs=1e-6)


def test_token_entropy_matches_definition_and_handles_minus_inf():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 3
    logits[0, 0, :5] = float("-inf")  # masked vocabulary entries
    p = torch.softmax(logits, -1)
    expected = -(torch.where(p > 0, p * torch.log(p), torch.zeros_like(p))).sum(-1)
    got = token_entropy(logits, shift=False, chunk_size=2)  # chunks that cut rows of a batch element
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()


def test_token_entropy_is_chunk_invariant_and_low_precision_safe():
    torch.manual_seed(1)
    logits = (torch.randn(2, 7, 50) * 20).bfloat16()
    a = token_entropy(logits, chunk_size=1)
    b = token_entropy(logits, chunk_size=1000)
    assert torch.equal(a, b)
    assert a.dtype == torch.float32


# ------------------------------------------------------------------------------------------ segment_boundaries
def test_boundaries_hand_computed_right_padding():
    # prompt (2 tokens) | response (5 tokens) | pad (1)
    mask = torch.tensor([[F, F, T_, T_, T_, T_, T_, F]])
    ent = torch.tensor([[9.0, 9.0, 0.1, 2.5, 1.0, 2.0, 3.0, 9.0]])
    starts = segment_boundaries(ent, mask, cutoff=2.0)
    # first response token always starts; 2.5 > 2 starts; 2.0 is not > 2.0; 3.0 starts; pads/prompt never
    assert starts.tolist() == [[F, F, T_, T_, F, F, T_, F]]
    seg = segment_ids(starts, mask)
    assert seg.ids.tolist() == [[-1, -1, 0, 1, 1, 1, 2, -1]]
    assert seg.counts.tolist() == [3]
    assert seg.lengths.tolist() == [[1, 3, 1]]
    assert seg.ends.tolist() == [[F, F, T_, F, F, T_, T_, F]]
    torch.testing.assert_close(seg.locations, torch.tensor([[1 / 3, 2 / 3, 1.0]]))


def test_boundaries_left_padding_and_mixed_padding():
    # row 0: left padded; row 1: padded on both sides (OpenRLHF's RM trainer can produce this)
    mask = torch.tensor([[F, F, F, T_, T_, T_], [F, F, T_, T_, F, F]])
    ent = torch.tensor([[5.0, 5.0, 5.0, 5.0, 0.0, 5.0], [5.0, 5.0, 0.0, 5.0, 5.0, 5.0]])
    seg = segment_ids(segment_boundaries(ent, mask, 2.0), mask)
    assert seg.ids.tolist() == [[-1, -1, -1, 0, 0, 1], [-1, -1, 0, 1, -1, -1]]
    scores = torch.arange(12, dtype=torch.float32).view(2, 6)
    rewards = gather_segment_rewards(scores, seg)
    # row 0 segments end at t=4 and t=5; row 1 at t=2 and t=3
    assert rewards.tolist() == [[4.0, 5.0], [8.0, 9.0]]


def test_truncated_response_without_eos_ends_last_segment_at_last_token():
    mask = torch.tensor([[F, T_, T_, T_]])  # response runs to the end of the tensor, no EOS
    ent = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    seg = segment_ids(segment_boundaries(ent, mask, 2.0), mask)
    rewards = gather_segment_rewards(torch.tensor([[10.0, 11.0, 12.0, 13.0]]), seg)
    assert rewards.tolist() == [[13.0]]


def test_cutoff_inf_is_one_segment_and_zero_is_one_per_token():
    torch.manual_seed(0)
    mask = torch.tensor([[F, T_, T_, T_, T_, F]])
    ent = torch.rand(1, 6) + 0.01
    inf_seg = segment_ids(segment_boundaries(ent, mask, float("inf")), mask)
    assert inf_seg.counts.tolist() == [1]
    zero_seg = segment_ids(segment_boundaries(ent, mask, 0.0), mask)
    assert zero_seg.counts.tolist() == [4]
    assert zero_seg.lengths.tolist() == [[1, 1, 1, 1]]


def test_empty_response_has_no_segment_and_aggregation_refuses_it():
    mask = torch.tensor([[F, T_, T_], [F, F, F]])
    seg = segment_ids(segment_boundaries(torch.zeros(2, 3), mask, 2.0), mask)
    assert seg.counts.tolist() == [1, 0]
    assert seg.mask.tolist() == [[True], [False]]
    rewards = gather_segment_rewards(torch.ones(2, 3), seg)
    with pytest.raises(ValueError, match=r"batch index \[1\] are empty"):
        aggregate_segments(rewards, seg.mask)


@pytest.mark.parametrize("cutoff", [-0.1, float("nan")])
def test_bad_cutoff_is_refused(cutoff):
    with pytest.raises(ValueError, match=r"entropy cutoff must be a number >= 0 \(or inf\)"):
        segment_boundaries(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), cutoff)


@pytest.mark.parametrize("tau", [0.0, -1.0, float("inf")])
def test_bad_tau_is_refused(tau):
    with pytest.raises(ValueError, match="tau must be"):
        aggregate_segments(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), "softmax", tau)


def test_unknown_aggregation_is_refused():
    with pytest.raises(ValueError, match="aggregation must be one of"):
        aggregate_segments(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), "max")


# ---------------------------------------------------------------------------------------------- aggregation
def test_softmax_aggregation_hand_computed():
    r = torch.tensor([[1.0, 2.0, 0.0]])
    m = torch.tensor([[T_, T_, F]])
    got = aggregate_segments(r, m, "softmax", 0.5)
    expected = 0.5 * math.log(math.exp(2.0) + math.exp(4.0))
    assert got.item() == pytest.approx(expected, rel=1e-6)
    assert aggregate_segments(r, m, "sum").item() == pytest.approx(3.0)
    assert aggregate_segments(r, m, "mean").item() == pytest.approx(1.5)


def test_softmax_tends_to_max_and_single_segment_is_identity():
    r = torch.tensor([[0.3, -1.2, 0.9, 0.1]])
    m = torch.ones_like(r, dtype=torch.bool)
    gaps = [abs(aggregate_segments(r, m, "softmax", tau).item() - 0.9) for tau in (1.0, 0.1, 0.01, 0.001)]
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] < 1e-3
    one = torch.tensor([[0.7, 5.0]])
    assert aggregate_segments(one, torch.tensor([[T_, F]]), "softmax", 0.5).item() == pytest.approx(0.7, abs=1e-6)


def test_gradients_flow_to_segment_end_tokens_only():
    mask = torch.tensor([[F, T_, T_, T_, T_]])
    ent = torch.tensor([[0.0, 0.0, 0.0, 3.0, 0.0]])
    scores = torch.zeros(1, 5, requires_grad=True)
    ev = evaluate_sequences(scores, ent, mask, 2.0, "softmax", 0.5)
    ev.values.sum().backward()
    # segments [1,2] and [3,4]; each end token gets d/dr softmax = 0.5 (equal rewards)
    torch.testing.assert_close(scores.grad, torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.5]]))


def test_bt_loss_value_and_margin():
    c = torch.tensor([1.0, 0.0])
    r = torch.tensor([0.0, 0.0])
    expected = -(math.log(1 / (1 + math.exp(-1.0))) + math.log(0.5)) / 2
    assert segment_bt_loss(c, r).item() == pytest.approx(expected, rel=1e-6)
    assert segment_bt_loss(c, r, margin=torch.tensor([1.0, 0.0])).item() == pytest.approx(math.log(2), rel=1e-6)


# --------------------------------------------------------------------------------- properties vs the oracle
@st.composite
def batches(draw):
    b = draw(st.integers(1, 4))
    t = draw(st.integers(2, 12))
    rows = []
    for _ in range(b):
        prompt = draw(st.integers(0, t - 1))
        resp = draw(st.integers(1, t - prompt))
        left_pad = draw(st.booleans())
        pad = t - prompt - resp
        row = ([F] * pad + [F] * prompt + [T_] * resp) if left_pad else ([F] * prompt + [T_] * resp + [F] * pad)
        rows.append(row)
    mask = torch.tensor(rows)
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    ent = torch.rand(b, t, generator=g) * 4
    scores = torch.randn(b, t, generator=g)
    cutoff = draw(st.sampled_from([0.0, 1.0, 2.0, 3.5, float("inf")]))
    return scores, ent, mask, cutoff


@settings(max_examples=150, deadline=None)
@given(batches(), st.sampled_from(["softmax", "sum", "mean"]), st.sampled_from([0.1, 0.5, 2.0]))
def test_vectorised_equals_per_sample_reference(batch, kind, tau):
    # in float64, as the oracle: a float32 sum of rewards that nearly cancel (e.g. 0.0057 from seven terms of size ~1)
    # is exact only to ~n * 6e-8 * sum |r|, far more than a relative 1e-5 of the small result; in float64 that bound
    # is < 1e-13 here (n <= 12, |r| < 5)
    scores, ent, mask, cutoff = batch
    scores, ent = scores.double(), ent.double()
    ev = evaluate_sequences(scores, ent, mask, cutoff, kind, tau)
    ref = reference_segment_rewards(scores, ent, mask, cutoff)
    for b, segs in enumerate(ref):
        n = len(segs)
        assert ev.segments.counts[b].item() == n
        assert ev.seg_rewards[b, :n].tolist() == pytest.approx([r for _, _, r in segs])
        assert ev.segments.lengths[b, :n].tolist() == [e - s + 1 for s, e, _ in segs]
        assert (ev.seg_rewards[b, n:] == 0).all()
        assert ev.values[b].item() == pytest.approx(
            reference_aggregate([r for *_, r in segs], kind, tau), rel=1e-9, abs=1e-12
        )
    # every response token belongs to exactly one segment, nothing outside does
    assert ((ev.segments.ids >= 0) == mask).all()
    assert (ev.segments.lengths.sum(1) == mask.sum(1)).all()


@settings(max_examples=50, deadline=None)
@given(batches())
def test_cutoff_inf_reward_is_score_at_last_response_token(batch):
    scores, ent, mask, _ = batch
    ev = evaluate_sequences(scores, ent, mask, float("inf"), "softmax", 0.5)
    last = mask.shape[1] - 1 - mask.long().fliplr().argmax(dim=1)
    torch.testing.assert_close(ev.values, scores.gather(1, last[:, None]).squeeze(1))
