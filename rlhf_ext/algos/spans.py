"""Span rewards onto any policy tokenizer's tokens: the one dense-reward contract (paper 003, section 2.3).

A dense reward source answers, per response, with spans ``(start, end, reward)``: characters ``[start, end)`` of the
decoded response text earned ``reward``. :func:`dense_span_rewards` maps them onto the policy's tokens, given each
token's character offsets, and applies the same normalizer and knobs as paper 003's segment rewards
(:func:`~rlhf_ext.algos.segment_dense.dense_segment_rewards`): each span is one segment.

**Coverage.** A span covers the response tokens whose characters intersect it (``token_start < span_end`` and
``token_end > span_start``); a token straddling two spans gets both shares. Tokens with no characters (EOS) are
covered by no span; spans covering no token are dropped. Token-index spans work with ``token_start = index``,
``token_end = index + 1``.

**Knobs** (:class:`~rlhf_ext.algos.segment_dense.DenseRewardKnobs`, one name each):

* ``granularity``: ``segment`` (each span normalized at ``p = (s + 1) / S`` in text order, then spread by
  ``interpolation``), ``bandit`` (the sum of the span rewards on the last token, normalized at ``p = 1``) or
  ``segment_as_bandit`` (their aggregate, paper 003 Eq. 4, on the last token).
* ``interpolation``: ``even_split`` (``r / n`` on each of the ``n`` covered tokens), ``segment_end`` or ``repeat``.
* ``normalizer``: a :class:`~rlhf_ext.algos.location_norm.LocationNormalizer` (paper 003 Eq. 6).

Overlapping spans add up on the tokens they share.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_ext.algos.location_norm import LocationNormalizer
from rlhf_ext.algos.segment_dense import DenseRewards, Granularity, Interpolation, RewardValueError
from rlhf_ext.algos.segment_reward import DEFAULT_TAU, Aggregation, Segments, aggregate_segments, check_aggregation

#: The granularities defined on spans (see the module docstring).
SPAN_GRANULARITIES: tuple[str, ...] = (Granularity.SEGMENT, Granularity.BANDIT, Granularity.SEGMENT_AS_BANDIT)


def check_span_granularity(granularity: str) -> Granularity:
    """The :class:`Granularity` of ``granularity`` if it is defined on spans, else one ``ValueError`` line."""
    if granularity not in SPAN_GRANULARITIES:
        raise ValueError(
            f"granularity {granularity!r} segments a reward model's token scores; span rewards come segmented by "
            f"their source: use {', '.join(SPAN_GRANULARITIES)}"
        )
    return Granularity(granularity)


def _monotone(offsets: Tensor, valid: Tensor) -> Tensor:
    """``offsets`` with every invalid position set to the running maximum of the valid ones before it (0 before the
    first), so that a row whose valid offsets do not decrease is sorted, as :func:`torch.searchsorted` needs."""
    running = torch.cummax(torch.where(valid, offsets, torch.zeros_like(offsets)), dim=1).values
    return torch.where(valid, offsets, running)


def _last_true_index(mask: Tensor) -> Tensor:
    """``[B]`` index of the last true position of each row (0 for an all-false row)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, torch.zeros_like(positions)).amax(dim=1)


def dense_span_rewards(
    span_start: Tensor,
    span_end: Tensor,
    span_reward: Tensor,
    token_start: Tensor,
    token_end: Tensor,
    action_mask: Tensor,
    normalizer: LocationNormalizer | None = None,
    granularity: Granularity | str = "segment",
    interpolation: Interpolation | str = "even_split",
    aggregation: Aggregation | str = "softmax",
    tau: float = DEFAULT_TAU,
) -> DenseRewards:
    """Per-token PPO rewards from span rewards over each response's text (see the module docstring).

    Args:
        span_start, span_end: ``[B, K]`` long, characters ``[start, end)`` of each span (pad with ``start = end``).
        span_reward: ``[B, K]`` float (NaN/inf at a real span is an error).
        token_start, token_end: ``[B, T]`` long, characters of each token, non-decreasing along the response.
        action_mask: ``[B, T]`` bool, true at response tokens.
        aggregation, tau: the sequence evaluation for ``segment_as_bandit`` (paper 003 Eq. 4).

    Returns:
        :class:`~rlhf_ext.algos.segment_dense.DenseRewards`, spans ``[B, S]`` in text order (by last covered token,
        then first, then input order).
    """
    granularity = check_span_granularity(granularity)
    if interpolation not in Interpolation.values():
        raise ValueError(f"interpolation must be one of {', '.join(Interpolation.values())}; got {interpolation!r}")
    check_aggregation(aggregation)
    if span_start.shape != span_end.shape or span_start.shape != span_reward.shape:
        raise ValueError(
            f"span_start {tuple(span_start.shape)}, span_end {tuple(span_end.shape)} and span_reward "
            f"{tuple(span_reward.shape)} must have one shape [B, K]"
        )
    if token_start.shape != action_mask.shape or token_end.shape != action_mask.shape:
        raise ValueError(
            f"token_start {tuple(token_start.shape)}, token_end {tuple(token_end.shape)} and action_mask "
            f"{tuple(action_mask.shape)} must have one shape [B, T]"
        )
    if span_start.shape[0] != action_mask.shape[0]:
        raise ValueError(f"spans are for {span_start.shape[0]} responses, tokens for {action_mask.shape[0]}")
    normalizer = normalizer or LocationNormalizer()
    action_mask = action_mask.bool()
    b, t = action_mask.shape
    k = span_start.shape[1]
    device = action_mask.device
    span_start, span_end = span_start.long(), span_end.long()
    span_reward = span_reward.float()

    # tokens that can be covered: response tokens holding at least one character
    valid = action_mask & (token_end > token_start)
    starts, ends = _monotone(token_start.long(), valid), _monotone(token_end.long(), valid)
    if bool(((starts[:, 1:] < starts[:, :-1]) | (ends[:, 1:] < ends[:, :-1])).any()):
        raise ValueError("token character offsets must not decrease along a response")
    positions = torch.arange(t, device=device).expand(b, t)
    # [first, last]: the tokens whose characters intersect [span_start, span_end) (offsets sorted per row)
    first = torch.searchsorted(ends, span_start, right=True)  # first token ending after the span's start
    after = torch.searchsorted(starts, span_end, right=False)  # tokens starting before the span's end
    covered_before = torch.nn.functional.pad(valid.long().cumsum(dim=1), (1, 0))  # [B, T + 1]
    n = (covered_before.gather(1, after) - covered_before.gather(1, first.clamp(max=t))).clamp_min(0)
    real = (span_end > span_start) & (n > 0)
    bad = real & ~torch.isfinite(span_reward)
    if bool(bad.any()):
        rows = bad.any(dim=1).nonzero().flatten().tolist()
        raise RewardValueError(f"the reward source returned NaN/inf span rewards for response(s) {rows[:10]}")
    # the first and last covered tokens (covered tokens are valid tokens in [first, after))
    last_valid = torch.cummax(torch.where(valid, positions, torch.full_like(positions, -1)), dim=1).values
    next_valid = torch.where(valid, positions, torch.full_like(positions, t)).flip(1).cummin(dim=1).values.flip(1)
    last_tok = torch.where(real, last_valid.gather(1, (after - 1).clamp(0, t - 1)), 0)
    first_tok = torch.where(real, next_valid.gather(1, first.clamp(max=t - 1)), 0)

    # text order: by last covered token, then first, then input order; dropped spans last
    key = torch.where(real, last_tok * (t + 1) + first_tok, torch.full_like(last_tok, (t + 1) ** 2))
    order = torch.sort(key, dim=1, stable=True).indices
    counts = real.sum(dim=1)
    s = max(int(counts.max()) if counts.numel() else 0, 1)
    order = order[:, :s] if k else order.new_zeros(b, s)

    def sort(x: Tensor) -> Tensor:
        return x.gather(1, order) if k else x.new_zeros(b, s)

    mask = torch.arange(s, device=device).unsqueeze(0) < counts.unsqueeze(1)
    raw = torch.where(mask, sort(span_reward), 0.0)
    lengths = torch.where(mask, sort(n), 0)
    first_tok, last_tok = torch.where(mask, sort(first_tok), 0), torch.where(mask, sort(last_tok), 0)
    locations = torch.where(mask, (torch.arange(s, device=device) + 1).float() / counts.clamp_min(1)[:, None], 0.0)

    # expand each span to the token positions from its first to its last covered token (tokens of no text skipped)
    width = torch.where(mask, last_tok - first_tok + 1, 0).flatten()
    span_of = torch.repeat_interleave(torch.arange(b * s, device=device), width)
    within = torch.arange(span_of.numel(), device=device) - (width.cumsum(0) - width)[span_of]
    row = span_of // s
    token = first_tok.flatten()[span_of] + within
    keep = valid[row, token]
    span_of, flat = span_of[keep], (row * t + token)[keep]
    ends_mask = torch.zeros(b * t, dtype=torch.bool, device=device)
    ends_mask[(torch.arange(b, device=device)[:, None] * t + last_tok)[mask]] = True
    rank = torch.arange(s, device=device).repeat(b)
    ids = torch.full((b * t,), -1, dtype=torch.long, device=device)
    ids.scatter_reduce_(0, flat, rank[span_of], reduce="amax")
    segments = Segments(
        ids=ids.view(b, t), lengths=lengths, counts=counts, locations=locations, mask=mask, ends=ends_mask.view(b, t)
    )

    if granularity.is_bandit:
        if granularity == Granularity.SEGMENT_AS_BANDIT:
            scored = counts > 0
            safe = torch.where(scored[:, None], mask, torch.ones_like(mask))  # rows without spans: aggregate of 0s
            seq = torch.where(scored, aggregate_segments(raw, safe, aggregation, tau), 0.0)
        else:
            seq = raw.sum(dim=1)
        has_response = action_mask.any(dim=1)
        seq_norm = normalizer.normalize(seq, torch.ones_like(seq), has_response)
        last = positions == _last_true_index(action_mask)[:, None]
        rewards = torch.where(last & has_response[:, None], seq_norm[:, None], 0.0)
        return DenseRewards(rewards, seq_norm[:, None], seq[:, None], segments, seq_norm)

    normalized = normalizer.normalize(raw, locations, mask)
    rewards = torch.zeros(b * t, dtype=normalized.dtype, device=device)
    if interpolation == Interpolation.SEGMENT_END:
        rewards.index_add_(0, (torch.arange(b, device=device)[:, None] * t + last_tok)[mask], normalized[mask])
    else:
        per_token = normalized / lengths.clamp_min(1).to(normalized.dtype)
        values = (per_token if interpolation == Interpolation.EVEN_SPLIT else normalized).flatten()
        rewards.index_add_(0, flat, values[span_of])
    rewards = rewards.view(b, t)
    return DenseRewards(rewards, normalized, raw, segments, rewards.sum(dim=1))
