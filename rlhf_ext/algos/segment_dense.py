"""From reward-model token scores to dense per-token PPO rewards (paper 003, section 2.3, Algorithm 1 second half).

:func:`dense_segment_rewards` is the one function both engines call. It segments each sampled response with the
reference (SFT) model's entropies — the ones PPO's reference forward pass produces anyway for the KL term, so no
forward pass is added — reads the segment rewards, normalizes them with a :class:`LocationNormalizer`, and
interpolates them onto tokens.

``granularity`` selects the action definition of Table 1 (the reward model decides the rest):

================== ====================================================================================================
``segment``        segments at entropy > cutoff; normalized segment rewards; interpolated (the paper's method)
``chunk``          segments of ``chunk_size`` tokens, whatever the text; otherwise as ``segment``
``token``          every response token is a segment (cutoff 0); normalized per-token rewards
``bandit``         one reward per response: the score at its last token, normalized at p = 1, on the last token
``bandit_as_segment``  Table 1 (A): a *bandit* reward model read at segment ends — computed exactly like ``segment``;
                   the name records that the reward model was trained with cutoff = inf
``segment_as_bandit``  Table 1 (B): a *segment* reward model used for a bandit reward: its sequence evaluation
                   e_phi (paper 003 Eq. 4), normalized at p = 1, on the last token
================== ====================================================================================================

``interpolation`` (Table 3): ``even_split`` gives every token of a segment r/|segment| (the paper), ``repeat`` gives
every token r, ``segment_end`` puts r on the segment's last token and 0 elsewhere ("no interpolation").

With ``segment`` the policy's text decides where the boundaries fall, so it can be paid per boundary
(``docs/segment_ppo_evidence.md``); ``chunk`` reads the reward model at fixed positions, which the text cannot move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from rlhf_ext.algos.knobs import check_knob, check_knobs, knob
from rlhf_ext.algos.location_norm import NORMALIZER_KINDS, LocationNormalizer, NormalizerKind
from rlhf_ext.algos.names import StrEnum, post_init_next
from rlhf_ext.algos.segment_reward import (
    DEFAULT_ENTROPY_CUTOFF,
    DEFAULT_TAU,
    Aggregation,
    SegmentRewardKnobs,
    Segments,
    aggregate_segments,
    gather_segment_rewards,
    segment_boundaries,
    segment_ids,
    token_entropy,
)


class Interpolation(StrEnum):
    """Within-segment reward interpolation (paper 003 Table 3; see :func:`interpolate_rewards`)."""

    EVEN_SPLIT = "even_split"
    REPEAT = "repeat"
    SEGMENT_END = "segment_end"


class Granularity(StrEnum):
    """Action definition of the dense reward (paper 003 Table 1; see the module docstring)."""

    SEGMENT = "segment"
    CHUNK = "chunk"
    TOKEN = "token"
    BANDIT = "bandit"
    BANDIT_AS_SEGMENT = "bandit_as_segment"
    SEGMENT_AS_BANDIT = "segment_as_bandit"

    @property
    def needs_entropy(self) -> bool:
        """Segments at the reference model's entropies (and so needs them)."""
        return self in (Granularity.SEGMENT, Granularity.BANDIT_AS_SEGMENT, Granularity.SEGMENT_AS_BANDIT)

    @property
    def is_bandit(self) -> bool:
        """One reward per response, on its last token."""
        return self in (Granularity.BANDIT, Granularity.SEGMENT_AS_BANDIT)


def resolve_granularity(granularity: Granularity | str | None, spans: bool) -> str:
    """The granularity of a run (its value): as given, else its reward source's default: ``chunk`` on a reward model's
    token scores (``docs/segment_ppo_evidence.md``), ``segment`` on span rewards (``chunk`` is undefined there)."""
    if granularity is None:
        return (Granularity.SEGMENT if spans else Granularity.CHUNK).value
    return Granularity(granularity).value


INTERPOLATIONS: tuple[str, ...] = Interpolation.values()
GRANULARITIES: tuple[str, ...] = Granularity.values()
#: ``chunk``'s segment length in tokens when none is given.
DEFAULT_CHUNK_SIZE = 4


class RewardValueError(ValueError):
    """The reward model produced NaN or infinite scores."""


def interpolate_rewards(seg_rewards: Tensor, segments: Segments, kind: Interpolation | str = "even_split") -> Tensor:
    """Spread ``[B, S]`` segment rewards over their tokens -> ``[B, T]``, 0 outside the response (paper 003, section
    2.3, Table 3): ``even_split`` (r/|a_t| on every token), ``repeat`` (r on every token) or ``segment_end`` (r on the
    last token)."""
    if kind not in INTERPOLATIONS:
        raise ValueError(f"interpolation must be one of {', '.join(INTERPOLATIONS)}; got {kind!r}")
    inside = segments.ids >= 0
    index = segments.ids.clamp_min(0)
    per_token = seg_rewards.gather(1, index)
    if kind == Interpolation.EVEN_SPLIT:
        per_token = per_token / segments.lengths.gather(1, index).clamp_min(1).to(per_token.dtype)
    elif kind == Interpolation.SEGMENT_END:
        inside = segments.ends
    return torch.where(inside, per_token, torch.zeros_like(per_token))


def fixed_boundaries(action_mask: Tensor, chunk_size: int) -> Tensor:
    """``[B, T]`` bool: response tokens whose index within the response is a multiple of ``chunk_size`` >= 1 (the
    starts of ``chunk`` segments); ``action_mask`` ``[B, T]`` bool, one contiguous run per row."""
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be a positive integer; got {chunk_size!r}")
    action_mask = action_mask.bool()
    index = action_mask.long().cumsum(dim=1) - 1  # 0-based index of each response token
    return action_mask & (index.remainder(chunk_size) == 0)


def check_finite_scores(token_scores: Tensor, action_mask: Tensor) -> None:
    """Raise :class:`RewardValueError` naming the samples whose response scores are NaN/inf."""
    bad = (~torch.isfinite(token_scores) & action_mask.bool()).any(dim=1)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise RewardValueError(
            f"the reward model returned NaN/inf scores for sample(s) {rows[:10]}{' ...' if len(rows) > 10 else ''} "
            "of this batch; check the reward model checkpoint (dtype overflow in fp16?) and its inputs"
        )


class DenseRewards(NamedTuple):
    """Output of :func:`dense_segment_rewards`: ``rewards`` ``[B, T]`` per-token (before the KL penalty),
    ``seg_rewards`` ``[B, S]`` normalized and ``raw_seg_rewards`` ``[B, S]`` raw segment (or sequence) rewards, the
    ``segments`` used and ``sequence_reward`` ``[B]`` (``rewards`` summed per response)."""

    rewards: Tensor
    seg_rewards: Tensor
    raw_seg_rewards: Tensor
    segments: Segments
    sequence_reward: Tensor

    @property
    def segments_per_response(self) -> Tensor:
        """``[B]`` segments (spans) per response."""
        return self.segments.counts


def dense_segment_rewards(
    token_scores: Tensor,
    action_mask: Tensor,
    entropy: Tensor | None = None,
    logits: Tensor | None = None,
    normalizer: LocationNormalizer | None = None,
    granularity: Granularity | str = "segment",
    interpolation: Interpolation | str = "even_split",
    entropy_cutoff: float = DEFAULT_ENTROPY_CUTOFF,
    aggregation: Aggregation | str = "softmax",
    tau: float = DEFAULT_TAU,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> DenseRewards:
    """Per-token PPO rewards from a reward model's token scores (paper 003, Algorithm 1 lines 23-27).

    Args:
        token_scores: ``[B, T]`` reward-model score after reading each token.
        action_mask: ``[B, T]`` bool, true at response tokens.
        entropy: ``[B, T]`` reference-model entropy of the distribution each token was sampled from. Give this, or
            ``logits`` (``[B, T, V]``, logits at t predicting t + 1) from which it is computed; not needed for
            ``bandit``/``token``.
        granularity, interpolation: see the module docstring.
        aggregation, tau: sequence evaluation for ``segment_as_bandit`` (paper 003 Eq. 4).
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}; got {granularity!r}")
    granularity = Granularity(granularity)
    action_mask = action_mask.bool()
    check_finite_scores(token_scores, action_mask)
    normalizer = normalizer or LocationNormalizer()
    token_scores = token_scores.float()
    if granularity.needs_entropy:
        if entropy is None:
            if logits is None:
                raise ValueError(f"granularity '{granularity}' needs the reference model's entropy (or its logits)")
            entropy = token_entropy(logits, shift=True)
        cutoff = check_knob(SegmentRewardKnobs, "entropy_cutoff", entropy_cutoff, "entropy cutoff")
    else:
        entropy = torch.zeros_like(token_scores)
        cutoff = math.inf if granularity == Granularity.BANDIT else 0.0
    if granularity == Granularity.TOKEN:
        starts = action_mask  # every response token is its own segment, whatever the entropies are
    elif granularity == Granularity.CHUNK:
        starts = fixed_boundaries(action_mask, chunk_size)
    else:
        starts = segment_boundaries(entropy, action_mask, cutoff)
    segments = segment_ids(starts, action_mask)
    raw = gather_segment_rewards(token_scores, segments)
    if granularity.is_bandit:
        if granularity == Granularity.SEGMENT_AS_BANDIT:
            seq = aggregate_segments(raw, segments.mask, aggregation, tau)
        else:
            seq = raw[:, 0]
        seq_norm = normalizer.normalize(seq, torch.ones_like(seq), segments.counts > 0)
        last = segments.ends & (segments.ids == (segments.counts - 1).unsqueeze(1))
        rewards = torch.where(last, seq_norm.unsqueeze(1), torch.zeros_like(token_scores))
        return DenseRewards(rewards, seq_norm.unsqueeze(1), seq.unsqueeze(1), segments, seq_norm)
    normalized = normalizer.normalize(raw, segments.locations, segments.mask)
    kind = Interpolation.SEGMENT_END if granularity == Granularity.TOKEN else interpolation
    rewards = interpolate_rewards(normalized, segments, kind)
    return DenseRewards(rewards, normalized, raw, segments, rewards.sum(dim=1))


class SegmentationRates(NamedTuple):
    """How a batch of responses is segmented: ``segments_per_token`` and ``above_cutoff_share`` (share of response
    tokens whose reference entropy exceeds the cutoff; NaN without entropies)."""

    segments_per_token: float
    above_cutoff_share: float

    @classmethod
    def of_totals(cls, totals: Tensor) -> SegmentationRates:
        """The rates of :func:`segmentation_totals` (summed over any number of batches or ranks)."""
        segments, tokens, above = totals.tolist()
        tokens = max(tokens, 1.0)
        return cls(segments / tokens, above / tokens)


def segmentation_totals(counts: Tensor, action_mask: Tensor, entropy: Tensor | None, cutoff: float) -> Tensor:
    """``[3]`` float64 sums of a batch (they add up across batches and ranks): segments, response tokens, and response
    tokens whose reference entropy exceeds ``cutoff`` (NaN without entropies). ``counts`` ``[B]``, ``action_mask``
    and ``entropy`` ``[B, T]``."""
    action_mask = action_mask.bool()
    above = float("nan") if entropy is None else (action_mask & (entropy > cutoff)).sum().item()
    return torch.tensor([counts.sum().item(), action_mask.sum().item(), above], dtype=torch.float64)


def segmentation_rates(counts: Tensor, action_mask: Tensor, entropy: Tensor | None, cutoff: float) -> SegmentationRates:
    """:class:`SegmentationRates` of one batch (:func:`segmentation_totals`)."""
    return SegmentationRates.of_totals(segmentation_totals(counts, action_mask, entropy, cutoff))


class SegmentationMonitor:
    """Reward-hacking monitor of dense PPO: a one-line warning, once per run, when a rollout batch's
    :class:`SegmentationRates` pass ``threshold`` times the SFT model's on the calibration responses (``reference``)."""

    def __init__(
        self, reference: SegmentationRates | None, granularity: Granularity | str = "segment", threshold: float = 1.5
    ):
        self.reference = reference
        self.granularity = Granularity(granularity)
        self.threshold = threshold
        self.warned = False

    @classmethod
    def for_normalizer(cls, normalizer: LocationNormalizer, granularity: Granularity | str) -> SegmentationMonitor:
        """The monitor whose reference is ``normalizer``'s recorded SFT rates (if any)."""
        rates = normalizer.segments_per_token, normalizer.above_cutoff_share
        return cls(SegmentationRates(*rates) if None not in rates else None, granularity)

    def ratios(self, rates: SegmentationRates) -> dict[str, float]:
        """``{rate name: batch / reference}`` for the rates with a positive finite reference."""
        if self.reference is None:
            return {}
        out = {}
        for name, ref, now in zip(rates._fields, self.reference, rates):
            if ref is not None and math.isfinite(ref) and ref > 0 and math.isfinite(now):
                out[name] = now / ref
        return out

    def values(self, rates: SegmentationRates) -> dict[str, float]:
        """What the engines log: the batch's rates and, as ``<rate>_vs_sft``, their :meth:`ratios`."""
        return {**rates._asdict(), **{f"{name}_vs_sft": ratio for name, ratio in self.ratios(rates).items()}}

    def check(self, rates: SegmentationRates, step: int | None = None) -> str | None:
        """The warning for this batch (the first time a ratio passes the threshold), else None."""
        ratios = self.ratios(rates)
        over = {k: v for k, v in ratios.items() if v > self.threshold}
        if self.warned or not over:
            return None
        self.warned = True
        at = f" at step {step}" if step is not None else ""
        parts = ", ".join(
            f"{k} {getattr(rates, k):.3f} = {v:.2f}x the SFT model's {getattr(self.reference, k):.3f}"
            for k, v in over.items()
        )
        if self.granularity.needs_entropy:
            verdict = (
                "the policy may be buying segment rewards with boundaries (docs/segment_ppo_evidence.md): use "
                "granularity 'chunk', whose rewards do not depend on them"
            )
        else:
            verdict = (
                f"the policy writes text the SFT model finds uncertain; {self.granularity} rewards do not depend on "
                "entropy boundaries, but check the KL and the samples"
            )
        return f"reward hacking monitor{at}: {parts} on the calibration responses; {verdict}"


def calibration_points(token_scores: Tensor, entropy: Tensor, action_mask: Tensor, cutoff: float):
    """(locations ``[N]``, segment rewards ``[N]``) of every segment in a batch, for :meth:`LocationNormalizer.fit`."""
    segments = segment_ids(segment_boundaries(entropy, action_mask, cutoff), action_mask)
    rewards = gather_segment_rewards(token_scores.float(), segments)
    return segments.locations[segments.mask], rewards[segments.mask]


@dataclass
class DenseRewardKnobs:
    """The knobs of paper 003's dense rewards for PPO (Tables 1-3; see the module docstring), declared once:
    ``DensePPOConfig``, the segment PPO recipe's ``segment:`` section and OpenRLHF's ``--ext.*`` flags use these
    names and defaults. ``granularity`` ``None``: the reward source's own (:func:`resolve_granularity`)."""

    granularity: Granularity | None = field(
        default=None, metadata={"help": "paper 003 Table 1; unset: chunk on a reward model, segment on span rewards"}
    )
    interpolation: Interpolation = field(default=Interpolation.EVEN_SPLIT.value, metadata={"help": "paper 003 Table 3"})
    normalizer_kind: NormalizerKind = field(
        default=NormalizerKind.REGRESSION.value, metadata={"help": "Eq. 6 / Table 2"}
    )
    normalizer_basis: Literal["linear", "log"] = field(default="linear", metadata={"help": "linear (paper) | log"})
    chunk_size: int = knob(DEFAULT_CHUNK_SIZE, ge=1, help="Tokens per segment for granularity chunk")

    def __post_init__(self) -> None:
        post_init_next(self, __class__)  # a config that lists the knobs before TRL's class runs TRL's checks too
        self.check_dense_reward_knobs()

    def check_dense_reward_knobs(self) -> None:
        """Validate the knobs (called by every config that embeds them), and the ranged fields of that config."""
        check_knobs(self)
        for name, allowed in (
            ("granularity", GRANULARITIES),
            ("interpolation", INTERPOLATIONS),
            ("normalizer_kind", NORMALIZER_KINDS),
            ("normalizer_basis", ("linear", "log")),
        ):
            if getattr(self, name) not in allowed and not (name == "granularity" and self.granularity is None):
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
