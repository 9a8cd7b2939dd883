"""Segment-level rewards (paper 003): entropy segmentation, soft-max aggregation and the segment BT loss.

Pure ``torch`` functions, vectorised over the batch; the TRL and OpenRLHF adapters only move tensors in and out.
:func:`segment_evaluation` computes e_phi (Eq. 4) from a reward model that is already loaded.
"""

from rlhf_ext.algos.location_norm import NORMALIZER_KINDS, LocationNormalizer, NormalizerError
from rlhf_ext.algos.segment_dense import (
    GRANULARITIES,
    INTERPOLATIONS,
    DenseRewards,
    RewardValueError,
    calibration_points,
    dense_segment_rewards,
    interpolate_rewards,
)
from rlhf_ext.algos.segment_reward import (
    AGGREGATIONS,
    DEFAULT_ENTROPY_CUTOFF,
    DEFAULT_TAU,
    Segments,
    SequenceEvaluation,
    aggregate_segments,
    evaluate_sequences,
    gather_segment_rewards,
    logprobs_and_entropy,
    segment_boundaries,
    segment_bt_loss,
    segment_ids,
    token_entropy,
)
from rlhf_ext.runtime.token_scores import segment_evaluation

__all__ = [
    "AGGREGATIONS",
    "GRANULARITIES",
    "INTERPOLATIONS",
    "NORMALIZER_KINDS",
    "DenseRewards",
    "LocationNormalizer",
    "NormalizerError",
    "RewardValueError",
    "calibration_points",
    "dense_segment_rewards",
    "interpolate_rewards",
    "DEFAULT_ENTROPY_CUTOFF",
    "DEFAULT_TAU",
    "Segments",
    "SequenceEvaluation",
    "aggregate_segments",
    "evaluate_sequences",
    "gather_segment_rewards",
    "logprobs_and_entropy",
    "segment_boundaries",
    "segment_bt_loss",
    "segment_evaluation",
    "segment_ids",
    "token_entropy",
]
