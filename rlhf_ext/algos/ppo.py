"""PPO building blocks shared by the engines: KL penalty, GAE, reward-to-go, whitening, the clipped value loss.

All functions take right- or left-padded ``[B, T]`` tensors with a bool ``mask`` of valid (response) positions and
are vectorised over the batch; the backward recursions of GAE and reward-to-go run as blocked matrix products
(:func:`discounted_reverse_cumsum`), not as a Python loop over tokens.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

KLEstimator = Literal["k1", "k2", "k3"]


def per_token_kl(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator = "k1") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of the sampled tokens (Schulman's estimators).

    With ``log_r = ref_logp - logp``: ``k1 = -log_r`` (unbiased, can be negative), ``k2 = log_r**2 / 2``,
    ``k3 = exp(log_r) - 1 - log_r`` (unbiased and >= 0). OpenRLHF's reward penalty uses ``k1`` by default.
    """
    log_r = ref_logp.float() - logp.float()
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"KL estimator must be k1, k2 or k3; got {estimator!r}")


def discounted_reverse_cumsum(x: Tensor, discount: float, block: int = 256) -> Tensor:
    """``out[:, t] = sum_{t' >= t} discount**(t' - t) * x[:, t']`` for ``[B, T]`` ``x``.

    Computed block by block from the end: inside a block it is a product with an upper-triangular discount matrix,
    across blocks a carried value. Stable for any discount in [0, 1] (no division by ``discount**t``).
    """
    b, t = x.shape
    x = x.float()
    if t == 0:
        return x.clone()
    size = min(block, t)
    idx = torch.arange(size, device=x.device)
    expo = (idx.unsqueeze(0) - idx.unsqueeze(1)).float()  # [i, j] = j - i
    tri = torch.where(expo >= 0, torch.tensor(discount, device=x.device).pow(expo.clamp_min(0)), 0.0)
    out = torch.empty_like(x)
    carry = x.new_zeros(b)
    end = t
    while end > 0:
        start = max(0, end - size)
        n = end - start
        chunk = x[:, start:end] @ tri[:n, :n].T  # chunk[:, i] = sum_j tri[i, j] x[:, start + j]
        decay = torch.tensor(discount, device=x.device).pow(torch.arange(n, 0, -1, device=x.device).float())
        chunk = chunk + carry.unsqueeze(1) * decay.unsqueeze(0)
        out[:, start:end] = chunk
        carry = chunk[:, 0]
        end = start
    return out


def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over response tokens (OpenRLHF defaults gamma = 1, lambda = 0.95).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` (V = 0 past the end), ``A_t = sum_l (gamma*lam)**l delta_{t+l}``,
    returns ``R_t = A_t + V_t``. Positions outside ``mask`` are zero in both outputs.

    Args:
        rewards, values: ``[B, T]``; ``values[:, t]`` is V(s_t), the critic's value before emitting token t.
        mask: ``[B, T]`` bool response mask (contiguous per row).
    """
    mask = mask.bool()
    v = torch.where(mask, values.float(), 0.0)
    r = torch.where(mask, rewards.float(), 0.0)
    next_v = torch.zeros_like(v)
    next_v[:, :-1] = v[:, 1:]
    delta = torch.where(mask, r + gamma * next_v - v, 0.0)
    adv = discounted_reverse_cumsum(delta, gamma * lam)
    adv = torch.where(mask, adv, 0.0)
    return adv, torch.where(mask, adv + v, 0.0)


def reward_to_go(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``G_t = sum_{t' >= t} gamma**(t' - t) r_{t'}`` over response tokens, 0 outside ``mask``."""
    mask = mask.bool()
    return torch.where(mask, discounted_reverse_cumsum(torch.where(mask, rewards.float(), 0.0), gamma), 0.0)


def reinforce_advantages(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> tuple[Tensor, Tensor]:
    """Critic-free advantages: the per-token reward-to-go itself (OpenRLHF's ``reinforce``; the batch mean is removed
    by the whitening that follows); returns (advantages, returns)."""
    returns = reward_to_go(rewards, mask.bool(), gamma)
    return returns, returns


def group_mean_baseline(sequence_reward: Tensor, group_size: int) -> Tensor:
    """``[B]`` mean sequence reward of each sample's prompt group (rows grouped by prompt, ``group_size`` apart):
    OpenRLHF's ``reinforce_baseline`` (RLOO-style variance reduction, paper 001 Appendix B)."""
    if sequence_reward.numel() % group_size:
        raise ValueError(f"batch of {sequence_reward.numel()} is not a whole number of groups of {group_size}")
    grouped = sequence_reward.view(-1, group_size)
    return grouped.mean(dim=1, keepdim=True).expand_as(grouped).reshape(-1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Standardize ``x`` over the valid positions (OpenRLHF's advantage normalization); 0 outside ``mask``."""
    mask = mask.bool()
    n = mask.sum().clamp_min(1)
    mean = torch.where(mask, x, 0.0).sum() / n
    var = torch.where(mask, (x - mean) ** 2, 0.0).sum() / n
    out = (x - mean) * var.clamp_min(eps).rsqrt()
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, 0.0)


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None = 0.2
) -> tuple[Tensor, Tensor]:
    """PPO value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)`` with ``V_clip = V_old + clip(V - V_old, +-clip)``.

    Paper 003 uses ``clip = 0.25`` for dense (segment/token) rewards and 0.2 for bandit rewards (Appendix C).
    Returns (masked mean loss, fraction of positions where the clipped term was the larger one).
    """
    mask = mask.bool()
    err = (values - returns) ** 2
    if clip is None:
        loss, clipped = err, torch.zeros_like(err, dtype=torch.bool)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        err_clip = (v_clip - returns) ** 2
        loss, clipped = torch.maximum(err, err_clip), err_clip > err
    n = mask.sum().clamp_min(1)
    return 0.5 * torch.where(mask, loss, 0.0).sum() / n, torch.where(mask, clipped.float(), 0.0).sum() / n


#: Advantage estimators defined on dense per-token rewards, with OpenRLHF 0.11.2's names and semantics.
ESTIMATORS: tuple[str, ...] = ("gae", "reinforce", "reinforce_baseline")


def last_token_index(mask: Tensor) -> Tensor:
    """``[B]`` index of each row's last valid position (0 for an empty row)."""
    mask = mask.bool()
    return mask.shape[1] - 1 - mask.long().fliplr().argmax(dim=1)


def ppo_advantages(
    dense_rewards: Tensor,
    kl: Tensor,
    mask: Tensor,
    kl_coef: float,
    values: Tensor | None = None,
    estimator: str = "gae",
    gamma: float = 1.0,
    lam: float = 0.95,
    group_size: int = 1,
    whiten: bool = True,
    clip_range: tuple[float, float] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token PPO rewards ``r_t = clip(dense_t) - kl_coef * KL_t`` (paper 003 Eq. 5) -> (rewards, advantages,
    returns), in OpenRLHF 0.11.2's order so that both engines compute the same numbers:

    1. ``reinforce_baseline``: the prompt group's mean sequence reward (``dense.sum(1)``) is subtracted at each
       response's last token (for a bandit reward this is exactly OpenRLHF's scalar baseline);
    2. every token's reward is clipped to ``clip_range`` (OpenRLHF's ``--reward.clip_range``, applied to its scalar);
    3. minus ``kl_coef * KL``; GAE (needs ``values``) or reward-to-go (``reinforce*``);
    4. advantages whitened over the batch when ``whiten`` (OpenRLHF whitens all three estimators).

    Shapes: ``dense_rewards``, ``kl``, ``mask``, ``values`` ``[B, T]``; rows grouped by prompt for step 1.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage estimator must be one of {', '.join(ESTIMATORS)}; got {estimator!r}")
    mask = mask.bool()
    dense = torch.where(mask, dense_rewards.float(), 0.0)
    if estimator == "reinforce_baseline":
        baseline = group_mean_baseline(dense.sum(dim=1), group_size)
        dense = dense.scatter_add(1, last_token_index(mask)[:, None], -baseline[:, None])
    if clip_range is not None:
        dense = dense.clamp(min=clip_range[0], max=clip_range[1])
    rewards = torch.where(mask, dense - kl_coef * kl.float(), 0.0)
    if estimator == "gae":
        if values is None:
            raise ValueError("the gae estimator needs critic values")
        advantages, returns = gae_advantages(rewards, values, mask, gamma, lam)
    else:
        advantages, returns = reinforce_advantages(rewards, mask, gamma)
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return rewards, advantages, returns
