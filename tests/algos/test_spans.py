"""dense_span_rewards: spans over a response's characters onto a policy's tokens (hand-computed cases, the
per-sample loop as an oracle, and the segment path as a second one)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_ext.algos.location_norm import LocationNormalizer
from rlhf_ext.algos.segment_dense import RewardValueError, dense_segment_rewards
from rlhf_ext.algos.spans import dense_span_rewards
from tests.helpers.reference import reference_span_rewards


def _batch(spans, offsets, t=None):
    """Pad python lists into the tensors of dense_span_rewards (empty spans (0, 0) pad, tokens outside the mask)."""
    k = max(1, max(len(r) for r in spans))
    t = t or max(len(r) for r in offsets)
    ss = torch.zeros(len(spans), k, dtype=torch.long)
    se, sr = ss.clone(), torch.zeros(len(spans), k)
    for i, row in enumerate(spans):
        for j, (a, b, r) in enumerate(row):
            ss[i, j], se[i, j], sr[i, j] = a, b, r
    ts = torch.zeros(len(offsets), t, dtype=torch.long)
    te, mask = ts.clone(), torch.zeros(len(offsets), t, dtype=torch.bool)
    for i, row in enumerate(offsets):
        for j, (a, b) in enumerate(row):
            ts[i, j], te[i, j], mask[i, j] = a, b, True
    return ss, se, sr, ts, te, mask


# "ab cd ef<eos>": tokens "ab" [0,2), " cd" [2,5), " ef" [5,8), EOS [8,8) (no characters)
OFFSETS = [(0, 2), (2, 5), (5, 8), (8, 8)]


def test_even_split_over_covered_tokens():
    out = dense_span_rewards(*_batch([[(0, 5, 3.0), (5, 8, 1.0)]], [OFFSETS]))
    assert out.rewards.tolist() == [[1.5, 1.5, 1.0, 0.0]]
    assert out.segments.counts.tolist() == [2] and out.segments.lengths.tolist() == [[2, 1]]
    assert out.segments.ids.tolist() == [[0, 0, 1, -1]] and out.segments.ends.tolist() == [[False, True, True, False]]
    assert out.raw_seg_rewards.tolist() == [[3.0, 1.0]] and out.sequence_reward.tolist() == [4.0]


def test_tokens_straddling_span_edges_take_a_share_of_each_span():
    # span A = "ab c" ends inside " cd", span B = "d ef" starts inside it: " cd" is covered by both
    out = dense_span_rewards(*_batch([[(0, 4, 2.0), (4, 8, 3.0)]], [OFFSETS]))
    assert out.rewards.tolist() == [[1.0, 1.0 + 1.5, 1.5, 0.0]]
    assert out.sequence_reward.tolist() == [5.0]
    # a span inside one token covers that token alone
    assert dense_span_rewards(*_batch([[(3, 4, 2.0)]], [OFFSETS])).rewards.tolist() == [[0.0, 2.0, 0.0, 0.0]]


def test_multi_byte_character_split_over_two_tokens():
    # "é!" in byte-level BPE: token 0 and token 1 hold the two UTF-8 bytes of 'é' (both carry its offsets [0, 1))
    offsets = [(0, 1), (0, 1), (1, 2)]
    out = dense_span_rewards(*_batch([[(0, 1, 2.0), (1, 2, 4.0)]], [offsets]))
    assert out.rewards.tolist() == [[1.0, 1.0, 4.0]]
    assert out.segments.lengths.tolist() == [[2, 1]]


def test_empty_spans_and_spans_past_the_end():
    spans = [[(3, 3, 5.0), (6, 100, 2.0), (50, 60, 7.0), (4, 2, 9.0)]]
    out = dense_span_rewards(*_batch(spans, [OFFSETS]))
    # only (6, 100) covers a token (" ef", [5, 8)); the empty, reversed and past-the-end spans are dropped
    assert out.rewards.tolist() == [[0.0, 0.0, 2.0, 0.0]]
    assert out.segments.counts.tolist() == [1] and out.raw_seg_rewards.tolist() == [[2.0]]
    # a row without any span that covers a token: no reward, one (padding) segment column
    none = dense_span_rewards(*_batch([[(50, 60, 7.0)]], [OFFSETS]))
    assert none.rewards.tolist() == [[0.0] * 4] and none.segments.counts.tolist() == [0]


def test_tokens_without_characters_are_never_covered_and_not_counted():
    # a special token with no characters between two text tokens: not covered, not counted in the even split
    offsets = [(0, 2), (2, 2), (2, 4)]
    out = dense_span_rewards(*_batch([[(0, 4, 3.0)]], [offsets]))
    assert out.rewards.tolist() == [[1.5, 0.0, 1.5]] and out.segments.lengths.tolist() == [[2]]


def test_interpolation_knob():
    spans, offsets = [[(0, 5, 3.0), (5, 8, 1.0)]], [OFFSETS]
    end = dense_span_rewards(*_batch(spans, offsets), interpolation="segment_end")
    assert end.rewards.tolist() == [[0.0, 3.0, 1.0, 0.0]]
    repeat = dense_span_rewards(*_batch(spans, offsets), interpolation="repeat")
    assert repeat.rewards.tolist() == [[3.0, 3.0, 1.0, 0.0]]


def test_location_normalizer_and_text_order():
    # spans given out of text order are ranked by their last token: locations 1/3, 2/3, 1
    spans = [[(5, 8, 4.0), (0, 2, 2.0), (2, 5, 3.0)]]
    norm = LocationNormalizer(kind="regression", w_mu=3.0, b_mu=0.0, w_sigma=0.0, b_sigma=math.log(2.0))
    out = dense_span_rewards(*_batch(spans, [OFFSETS]), normalizer=norm)
    assert out.raw_seg_rewards.tolist() == [[2.0, 3.0, 4.0]]
    torch.testing.assert_close(out.segments.locations, torch.tensor([[1 / 3, 2 / 3, 1.0]]))
    # (r - 3p) / 2 at p = 1/3, 2/3, 1
    torch.testing.assert_close(out.rewards, torch.tensor([[0.5, 0.5, 0.5, 0.0]]))


def test_bandit_granularities_put_one_reward_on_the_last_token():
    spans = [[(0, 5, 1.0), (5, 8, 2.0)], [(0, 2, 3.0)]]
    batch = _batch(spans, [OFFSETS, OFFSETS[:2]])
    bandit = dense_span_rewards(*batch, granularity="bandit")
    assert bandit.rewards.tolist() == [[0.0, 0.0, 0.0, 3.0], [0.0, 3.0, 0.0, 0.0]]  # on EOS / the last token
    agg = dense_span_rewards(*batch, granularity="segment_as_bandit", tau=0.5)
    expected = 0.5 * math.log(math.exp(2.0) + math.exp(4.0))
    torch.testing.assert_close(agg.sequence_reward, torch.tensor([expected, 3.0]))
    norm = LocationNormalizer(kind="global", b_mu=1.0, b_sigma=math.log(2.0))
    normed = dense_span_rewards(*batch, granularity="bandit", normalizer=norm)
    assert normed.sequence_reward.tolist() == [1.0, 1.0]  # (3 - 1) / 2, (3 - 1) / 2
    with pytest.raises(ValueError, match="segment, bandit, segment_as_bandit"):
        dense_span_rewards(*batch, granularity="chunk")


def test_non_finite_rewards_and_bad_offsets_are_refused():
    with pytest.raises(RewardValueError, match=r"response\(s\) \[0\]"):
        dense_span_rewards(*_batch([[(0, 2, float("nan"))]], [OFFSETS]))
    dense_span_rewards(*_batch([[(50, 60, float("nan"))]], [OFFSETS]))  # a dropped span's reward is never read
    with pytest.raises(ValueError, match="must not decrease"):
        dense_span_rewards(*_batch([[(0, 2, 1.0)]], [[(2, 5), (0, 2)]]))


def _random_case(seed: int, b: int = 6, t: int = 24, k: int = 7):
    g = torch.Generator().manual_seed(seed)
    offsets, spans = [], []
    for _ in range(b):
        n = int(torch.randint(1, t + 1, (1,), generator=g))
        widths = torch.randint(0, 4, (n,), generator=g).tolist()  # 0: a token without characters
        ends = torch.tensor(widths).cumsum(0).tolist()
        offsets.append([(e - w, e) for e, w in zip(ends, widths)])
        length = ends[-1] if ends else 0
        row = []
        for _ in range(int(torch.randint(0, k + 1, (1,), generator=g))):
            a, c = torch.randint(-2, length + 4, (2,), generator=g).tolist()
            row.append((a, c, float(torch.randn(1, generator=g))))
        spans.append(row)
    return spans, offsets


@pytest.mark.parametrize("interpolation", ["even_split", "segment_end", "repeat"])
def test_equals_the_per_sample_loop_on_random_spans(interpolation):
    """Gaps, overlaps, empty and reversed spans, spans past the end, tokens without characters."""
    for seed in range(20):
        spans, offsets = _random_case(seed)
        out = dense_span_rewards(*_batch(spans, offsets), interpolation=interpolation)
        expected = reference_span_rewards(spans, offsets, interpolation)
        t = out.rewards.shape[1]
        torch.testing.assert_close(out.rewards, torch.tensor([r + [0.0] * (t - len(r)) for r in expected]))
        if interpolation == "even_split":  # each span's tokens sum back to its reward
            kept = [sum(r for a, c, r in row if c > a and any(e > s and s < c and e > a for s, e in offs))
                    for row, offs in zip(spans, offsets)]  # fmt: skip
            torch.testing.assert_close(out.sequence_reward, torch.tensor(kept))


@pytest.mark.parametrize("interpolation", ["even_split", "segment_end", "repeat"])
def test_segments_as_spans_reproduce_dense_segment_rewards_exactly(interpolation):
    """A segment reward model's segments given as token spans (offsets = token index) are the segment path: the
    same normalized rewards, bit for bit."""
    g = torch.Generator().manual_seed(0)
    b, t = 5, 20
    scores, entropy = torch.randn(b, t, generator=g), torch.rand(b, t, generator=g) * 4
    lengths = torch.tensor([20, 13, 7, 1, 16])
    mask = torch.arange(t)[None] < lengths[:, None]
    norm = LocationNormalizer(kind="regression", w_mu=0.3, b_mu=-0.2, w_sigma=-0.5, b_sigma=0.1)
    segment = dense_segment_rewards(scores, mask, entropy, normalizer=norm, interpolation=interpolation)
    seg = segment.segments
    spans = []
    for row in range(b):
        tokens = [(seg.ids[row] == s).nonzero().flatten() for s in range(int(seg.counts[row]))]
        spans.append([(int(i[0]), int(i[-1]) + 1, float(segment.raw_seg_rewards[row, s])) for s, i in
                      enumerate(tokens)])  # fmt: skip
    index = torch.arange(t).expand(b, t)
    out = dense_span_rewards(*_batch(spans, [[(i, i + 1) for i in range(t)]] * b)[:3], index, index + 1, mask,
                             normalizer=norm, interpolation=interpolation)  # fmt: skip
    assert torch.equal(out.rewards, segment.rewards)
    assert torch.equal(out.seg_rewards, segment.seg_rewards)
    for name in ("ids", "lengths", "counts", "mask", "ends", "locations"):
        assert torch.equal(getattr(out.segments, name), getattr(seg, name)), name
