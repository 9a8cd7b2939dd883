"""Truncated importance-sampling correction for PPO-style losses on off-policy samples (paper 001; off by default).

In one-step asynchronous training (paper 001 Appendix D) a batch is sampled by ``pi_rollout`` (``theta_{t-1}``, maybe
vLLM) but the loss's behaviour policy is ``pi_old`` (``theta_t``); Proximal RLOO (paper 001 Eq. 1) keeps PPO's ratio
``pi_theta / pi_old`` and the mismatch ``pi_old / pi_rollout`` is corrected per token with a truncated weight:

    w_t = clip(pi_old(y_t) / pi_rollout(y_t), low, high)                (mode="clip", level="token": TIS)
    w_t = ratio_t * 1[low <= ratio_t <= high]                           (mode="mask", level="token")
    w_t = ratio_t * 1[low <= exp(mean_t log ratio_t) <= high]           (mode="mask", level="seq")

multiplying the per-token policy loss (no gradient through ``w_t``), as OpenRLHF 0.11.2's
``--algo.advantage.is_correction_{level,mode,threshold}``. Online DPO never applies it (paper 001, section 3.3).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

CorrectionLevel = Literal["token", "seq"]
CorrectionMode = Literal["clip", "mask"]


class ImportanceWeights(NamedTuple):
    """``weights``: ``[B, T]`` per-token factors for the policy loss (0 on masked-out positions);
    ``filtered``: fraction of units (tokens or sequences) that were clipped or masked."""

    weights: Tensor
    filtered: Tensor


def truncated_importance_weights(
    train_logps: Tensor,
    rollout_logps: Tensor,
    action_mask: Tensor,
    level: CorrectionLevel = "token",
    mode: CorrectionMode = "clip",
    low: float = 0.0,
    high: float = 2.0,
) -> ImportanceWeights:
    """Per-token truncated importance weights ``pi_train / pi_rollout`` for a PPO-style loss (see module docstring).

    Args:
        train_logps, rollout_logps: ``[B, T]`` log-probabilities of the sampled tokens under ``pi_old`` and under the
            policy that sampled them.
        action_mask: ``[B, T]`` bool, true on response tokens.
        level: ``token`` or ``seq`` (gate each sequence by the geometric mean of its ratios).
        mode: ``clip`` (clamp into ``[low, high]``, token level only) or ``mask`` (zero the units outside it).
        low, high: the band, ``0 <= low < high``.
    """
    if train_logps.shape != rollout_logps.shape or train_logps.shape != action_mask.shape:
        raise ValueError(
            f"train_logps {tuple(train_logps.shape)}, rollout_logps {tuple(rollout_logps.shape)} and action_mask "
            f"{tuple(action_mask.shape)} must have the same [B, T] shape"
        )
    if level not in ("token", "seq"):
        raise ValueError(f"level must be 'token' or 'seq', got {level!r}")
    if mode not in ("clip", "mask"):
        raise ValueError(f"mode must be 'clip' or 'mask', got {mode!r}")
    if mode == "clip" and level == "seq":
        raise ValueError("mode='clip' clamps per-token ratios; use level='token' (or mode='mask' for sequences)")
    if not (0.0 <= low < high):
        raise ValueError(f"the band must satisfy 0 <= low < high; got low={low}, high={high}")
    mask = action_mask.bool()
    log_ratio = (train_logps - rollout_logps).detach().float().masked_fill(~mask, 0.0)
    ratio = log_ratio.exp()
    if level == "seq":
        counts = mask.sum(-1).clamp_min(1)
        stat = (log_ratio.sum(-1) / counts).exp().unsqueeze(-1).expand_as(ratio)
    else:
        stat = ratio
    out_of_band = (stat < low) | (stat > high)
    weights = ratio.clamp(min=low, max=high) if mode == "clip" else torch.where(out_of_band, 0.0, ratio)
    weights = weights.masked_fill(~mask, 0.0)
    if level == "seq":
        has_tokens = mask.any(-1)
        filtered = out_of_band[:, 0][has_tokens].float().mean() if has_tokens.any() else ratio.new_zeros(())
    else:
        filtered = (out_of_band & mask).sum() / mask.sum().clamp_min(1)
    return ImportanceWeights(weights, filtered.float())
