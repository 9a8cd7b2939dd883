"""Straightforward per-sample, per-token Python implementations of the segment functions.

They follow the paper's wording literally and are deliberately slow: tests use them as an independent oracle for the
vectorised functions in :mod:`rlhf_ext.segment`, and ``benchmarks/segmentation.py`` measures the speed-up against them.
"""

from __future__ import annotations

import math

import torch


def reference_segment_rewards(
    token_scores: torch.Tensor, entropy: torch.Tensor, action_mask: torch.Tensor, cutoff: float
) -> list[list[tuple[int, int, float]]]:
    """For each row: a list of (start, end_inclusive, reward) segments, reward = score at the segment's last token."""
    scores, ent, mask = token_scores.tolist(), entropy.tolist(), action_mask.tolist()
    out = []
    for row_scores, row_ent, row_mask in zip(scores, ent, mask):
        segs: list[tuple[int, int, float]] = []
        start = None
        for t, in_response in enumerate(row_mask):
            if not in_response:
                if start is not None:
                    segs.append((start, t - 1, row_scores[t - 1]))
                    start = None
                continue
            if start is None:
                start = t
            elif row_ent[t] > cutoff:
                segs.append((start, t - 1, row_scores[t - 1]))
                start = t
        if start is not None:
            last = len(row_mask) - 1
            segs.append((start, last, row_scores[last]))
        out.append(segs)
    return out


def reference_aggregate(rewards: list[float], kind: str, tau: float) -> float:
    if kind == "softmax":
        m = max(rewards)
        return m + tau * math.log(sum(math.exp((r - m) / tau) for r in rewards))
    if kind == "sum":
        return sum(rewards)
    return sum(rewards) / len(rewards)


def reference_span_rewards(
    spans: list[list[tuple[int, int, float]]],
    offsets: list[list[tuple[int, int]]],
    interpolation: str = "even_split",
) -> list[list[float]]:
    """Per-token rewards of character spans, one response and one span at a time (no normalizer, ``segment``
    granularity): a span covers the tokens whose characters intersect it (tokens without characters never), and its
    reward is split evenly over them (``even_split``), put on the last (``segment_end``) or on each (``repeat``)."""
    out = []
    for row_spans, row_offsets in zip(spans, offsets):
        rewards = [0.0] * len(row_offsets)
        for start, end, reward in row_spans:
            covered = [i for i, (s, e) in enumerate(row_offsets) if e > s and s < end and e > start]
            if not covered or end <= start:
                continue
            if interpolation == "segment_end":
                rewards[covered[-1]] += reward
            else:
                share = reward / len(covered) if interpolation == "even_split" else reward
                for i in covered:
                    rewards[i] += share
        out.append(rewards)
    return out
