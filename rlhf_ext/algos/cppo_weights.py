"""CPPO's sample-wise weights: learning weight alpha and retention weight beta (optional; not part of paper 000 Eq. 7).

CPPO (Zhang et al., ICLR 2024) is only described by paper 000 at the level of Eq. 7; the weights follow the CPPO
authors' released code (AIF-GEN's ``benchmarks/COPR/trlx/models/modeling_cppo.py``, ``CPPOConfig.detect_track``,
"constant" branch; github.com/amgadelgamal/AIF-Gen, commit ``45e526f``).

For a rollout batch, with ``r`` the reward of each sample (the scalar score, placed on its last response token) and
``p`` the mean per-token log-probability of the sample under the rollout policy, and ``k`` the threshold in
standard deviations (batch mean and unbiased standard deviation):

============================  =======================  ===========================  ===============  ==============
category (constant below)     reward                   generation log-prob          alpha (learn)    beta (retain)
============================  =======================  ===========================  ===============  ==============
``HIGH_REWARD_HIGH_PROB``     ``r > mu_r + k sd_r``    ``p > mu_p + k sd_p``        ``alpha_high``   ``beta_high``
``HIGH_REWARD_LOW_PROB``      ``r > mu_r + k sd_r``    ``p < mu_p - k sd_p``        ``alpha_high``   1
``LOW_REWARD_HIGH_PROB``      ``r < mu_r - k sd_r``    ``p > mu_p + k sd_p``        ``alpha_high``   ``beta_low``
``LOW_REWARD_LOW_PROB``       ``r < mu_r - k sd_r``    ``p < mu_p - k sd_p``        ``alpha_low``    ``beta_low``
``NORMAL``                    anything else                                         1                1
============================  =======================  ===========================  ===============  ==============

Defaults: ``k = 0.85``, ``alpha_high = 2.0``, ``alpha_low = 0.5``, ``beta_high = 2.0``, ``beta_low = 0.2`` (the
released "constant" values; its "balance" variant is ``alpha_* = beta_* = (ub, lb)``).

alpha scales each sample's policy-gradient loss (in OpenRLHF: its advantages, equivalent for the clipped loss);
beta weights each sample's term of the paper 000 Eq. 7 KL to the previous task's policy
(:func:`rlhf_ext.continual.kl_to_previous`, ``sample_weights=``; the released code's retention term effectively runs
with beta = 1, which ``beta_high = beta_low = 1`` reproduces). Applied only with ``retention="cppo"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

NORMAL = 0
HIGH_REWARD_HIGH_PROB = 1
HIGH_REWARD_LOW_PROB = 2
LOW_REWARD_HIGH_PROB = 3
LOW_REWARD_LOW_PROB = 4
CATEGORY_NAMES = {
    NORMAL: "normal",
    HIGH_REWARD_HIGH_PROB: "high_reward_high_prob",
    HIGH_REWARD_LOW_PROB: "high_reward_low_prob",
    LOW_REWARD_HIGH_PROB: "low_reward_high_prob",
    LOW_REWARD_LOW_PROB: "low_reward_low_prob",
}


@dataclass(frozen=True)
class CPPOWeightSettings:
    """Thresholds and weight values of the CPPO sample classification (released-code defaults, see module doc)."""

    threshold_std: float = 0.85
    alpha_high: float = 2.0
    alpha_low: float = 0.5
    beta_high: float = 2.0
    beta_low: float = 0.2

    def __post_init__(self):
        for name in ("threshold_std", "alpha_high", "alpha_low", "beta_high", "beta_low"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"CPPO weight setting {name} must be a finite number >= 0; got {value!r}")


class BatchStats(NamedTuple):
    """Means and standard deviations the thresholds are built from (reward ``r`` and mean log-prob ``p``)."""

    reward_mean: Tensor
    reward_std: Tensor
    logp_mean: Tensor
    logp_std: Tensor


class CPPOWeights(NamedTuple):
    """Per-sample weights: ``alpha`` ``[B]`` (learning), ``beta`` ``[B]`` (retention), ``category`` ``[B]`` int64."""

    alpha: Tensor
    beta: Tensor
    category: Tensor


def _check_vectors(rewards: Tensor, mean_logp: Tensor) -> None:
    for x, name in ((rewards, "rewards"), (mean_logp, "mean_logp")):
        if x.dim() != 1:
            raise ValueError(f"{name} must be a [B] vector (one value per sample); got shape {tuple(x.shape)}")
        if not torch.isfinite(x).all():
            bad = torch.nonzero(~torch.isfinite(x)).flatten().tolist()[:5]
            raise ValueError(f"{name} has non-finite values at samples {bad}; check the reward model / log-probs")
    if rewards.shape != mean_logp.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and mean_logp {tuple(mean_logp.shape)} must match")


def batch_stats(rewards: Tensor, mean_logp: Tensor) -> BatchStats:
    """Mean and unbiased standard deviation of ``rewards`` ``[B]`` and ``mean_logp`` ``[B]`` (``B >= 2``)."""
    _check_vectors(rewards, mean_logp)
    if rewards.numel() < 2:
        raise ValueError("CPPO thresholds need at least 2 samples to estimate a standard deviation")
    r, p = rewards.double(), mean_logp.double()
    return BatchStats(r.mean(), r.std(), p.mean(), p.std())


def mean_log_prob(logp: Tensor, mask: Tensor) -> Tensor:
    """``[B]`` mean per-token log-probability of each response (the released code's generation-probability statistic).

    ``logp``/``mask`` are ``[B, T]``; rows with an empty mask give 0.
    """
    m = mask.to(logp.dtype)
    return (logp * m).sum(-1) / m.sum(-1).clamp_min(1.0)


def cppo_sample_weights(
    rewards: Tensor,
    mean_logp: Tensor,
    settings: CPPOWeightSettings | None = None,
    stats: BatchStats | None = None,
) -> CPPOWeights:
    """Classify samples by reward and generation probability and return CPPO's alpha / beta (table in module doc).

    ``rewards`` ``[B]`` and ``mean_logp`` ``[B]`` (:func:`mean_log_prob` under the rollout policy); ``stats`` default
    to :func:`batch_stats` of these inputs. Returns float32 :class:`CPPOWeights`; comparisons are strict, as in the
    released code.
    """
    settings = settings or CPPOWeightSettings()
    _check_vectors(rewards, mean_logp)
    stats = stats if stats is not None else batch_stats(rewards, mean_logp)
    k = settings.threshold_std
    r, p = rewards.double(), mean_logp.double()
    high_r = r > stats.reward_mean + k * stats.reward_std
    low_r = r < stats.reward_mean - k * stats.reward_std
    high_p = p > stats.logp_mean + k * stats.logp_std
    low_p = p < stats.logp_mean - k * stats.logp_std

    category = torch.full(rewards.shape, NORMAL, dtype=torch.long, device=rewards.device)
    category[high_r & high_p] = HIGH_REWARD_HIGH_PROB
    category[high_r & low_p] = HIGH_REWARD_LOW_PROB
    category[low_r & high_p] = LOW_REWARD_HIGH_PROB
    category[low_r & low_p] = LOW_REWARD_LOW_PROB

    s = settings
    alpha_table = torch.tensor([1.0, s.alpha_high, s.alpha_high, s.alpha_high, s.alpha_low], device=rewards.device)
    beta_table = torch.tensor([1.0, s.beta_high, 1.0, s.beta_low, s.beta_low], device=rewards.device)
    return CPPOWeights(alpha_table[category], beta_table[category], category)
