"""PPO building blocks shared by the engines: KL estimates, GAE, reward-to-go, whitening, the clipped value loss, and
the registry of advantage estimators. ``[B, T]`` tensors (either padding side) with a bool ``mask`` of response
positions; the backward recursions are blocked matrix products (:func:`discounted_reverse_cumsum`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlhf_ext.algos.knobs import check_knobs, knob
from rlhf_ext.algos.names import StrEnum, post_init_next


# ------------------------------------------------------------------------------------------------------------- KL
class KLEstimator(StrEnum):
    """How :func:`kl_estimate` estimates ``KL(pi || pi_ref)`` at a position (Schulman, "Approximating KL divergence",
    2020, for ``k1``-``k3``)."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"
    EXACT = "exact"


#: Every estimator :func:`kl_estimate` accepts.
KL_ESTIMATORS: tuple[str, ...] = KLEstimator.values()
#: The estimators that need only the log-probabilities of the sampled tokens (``exact`` needs full distributions).
SAMPLE_KL_ESTIMATORS: tuple[str, ...] = (KLEstimator.K1.value, KLEstimator.K2.value, KLEstimator.K3.value)

#: The one clamp of :func:`kl_estimate`: ``k3`` caps ``log r = ref_logp - logp`` here before its ``exp`` (a finite
#: penalty, e^20 ~ 5e8, instead of ``inf``).
K3_MAX_LOG_RATIO = 20.0


def check_kl_estimator(estimator: str, allowed: tuple[str, ...] = KL_ESTIMATORS) -> str:
    """Validate a KL estimator name against ``allowed`` (default: all of :class:`KLEstimator`)."""
    if estimator not in allowed:
        raise ValueError(f"KL estimator must be one of {', '.join(allowed)}; got {estimator!r}")
    return estimator


def kl_estimate(
    logp: Tensor | None,
    ref_logp: Tensor | None,
    estimator: KLEstimator | str = "k1",
    logp_full: Tensor | None = None,
    ref_logp_full: Tensor | None = None,
) -> Tensor:
    """Per-position estimate of ``KL(pi || pi_ref)``: the one KL function of the package.

    With ``log r = ref_logp - logp = log pi_ref(a|s) - log pi(a|s)`` at the sampled token ``a``:

    =========  ==========================================  =====================================================
    estimator  value                                       properties
    =========  ==========================================  =====================================================
    ``k1``     ``-log r``                                  unbiased on pi's own samples, can be negative
    ``k2``     ``(log r)^2 / 2``                           >= 0, biased, low variance
    ``k3``     ``r - 1 - log r`` (``log r <= 20``, below)  >= 0, unbiased on pi's own samples, low variance
    ``exact``  ``sum_v p_v (log p_v - log q_v)``           the KL itself, from the full distributions
    =========  ==========================================  =====================================================

    Only ``k3`` is clamped (at ``min(log r, K3_MAX_LOG_RATIO)``, in both terms); every estimator is exactly 0 where
    the policies agree. OpenRLHF 0.11.2's ``compute_approx_kl`` (same formulas) also clamps every value to
    ``[-10, 10]``; the values agree wherever that clamp is inactive.

    Args:
        logp, ref_logp: ``[B, T]`` log-probabilities of the sampled tokens under the current (differentiable) and
            reference policy; not needed for ``exact``.
        logp_full, ref_logp_full: ``[B, T, V]`` ``log_softmax`` of both policies' logits; required by ``exact``.

    Returns:
        ``[B, T]`` float32 (float64 inputs stay float64). Positions outside the response are not masked here.
    """
    check_kl_estimator(estimator)
    if estimator == KLEstimator.EXACT:
        if logp_full is None or ref_logp_full is None:
            raise ValueError(
                "the exact KL estimator needs the full [B, T, V] log-probabilities of both policies "
                "(pass logp_full= and ref_logp_full=) or use k1, k2 or k3 on the sampled tokens"
            )
        if logp_full.shape != ref_logp_full.shape:
            raise ValueError(
                f"logp_full and ref_logp_full must have the same shape [B, T, V]; got {tuple(logp_full.shape)} and "
                f"{tuple(ref_logp_full.shape)}"
            )
        dtype = torch.promote_types(logp_full.dtype, torch.float32)
        lp, lq = logp_full.to(dtype), ref_logp_full.to(dtype)
        p = lp.exp()
        # 0 * log(0 / q) = 0: entries pi gives probability 0 (log p = -inf) contribute nothing, even if q = 0 too
        return torch.where(p > 0, p * (lp - lq), torch.zeros_like(p)).sum(dim=-1)
    if logp is None or ref_logp is None:
        raise ValueError(f"the {estimator} KL estimator needs the sampled tokens' logp and ref_logp")
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"logp and ref_logp must have the same shape; got {tuple(logp.shape)} and {tuple(ref_logp.shape)}"
        )
    dtype = torch.promote_types(logp.dtype, torch.float32)
    log_r = ref_logp.to(dtype) - logp.to(dtype)  # log pi_ref - log pi
    if estimator == KLEstimator.K1:
        return -log_r
    if estimator == KLEstimator.K2:
        return 0.5 * log_r.square()
    log_r = log_r.clamp(max=K3_MAX_LOG_RATIO)
    return torch.expm1(log_r) - log_r  # r - 1 - log r, exact 0 at log r = 0


def per_token_kl(
    logp: Tensor,
    ref_logp: Tensor,
    estimator: KLEstimator | str = "k1",
    logp_full: Tensor | None = None,
    ref_logp_full: Tensor | None = None,
) -> Tensor:
    """:func:`kl_estimate` with the reward-penalty default ``k1`` (OpenRLHF's default ``--algo.kl.estimator``)."""
    return kl_estimate(logp, ref_logp, estimator, logp_full=logp_full, ref_logp_full=ref_logp_full)


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


def last_token_index(mask: Tensor) -> Tensor:
    """``[B]`` index of each row's last valid position (0 for an empty row)."""
    mask = mask.bool()
    return mask.shape[1] - 1 - mask.long().fliplr().argmax(dim=1)


# ----------------------------------------------------------------------------------------- advantage estimators
class AdvantageEstimator(StrEnum):
    """Advantage estimators defined on dense per-token rewards, with OpenRLHF 0.11.2's names and semantics."""

    GAE = "gae"
    REINFORCE = "reinforce"
    REINFORCE_BASELINE = "reinforce_baseline"


#: The built-in estimators' names (what the engines' command lines accept).
ESTIMATORS: tuple[str, ...] = AdvantageEstimator.values()

#: ``fn(dense, kl_penalty, mask, *, values, gamma, lam, group_size, clip_range) -> (rewards, advantages, returns)``
#: (all keyword arguments are passed, each estimator uses the ones it needs; see :func:`ppo_advantages`).
AdvantageFn = Callable[..., tuple[Tensor, Tensor, Tensor]]

#: name -> estimator function; extend with :func:`register_advantage_estimator`.
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_advantage_estimator(name: AdvantageEstimator | str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering an advantage estimator under ``name`` for :func:`ppo_advantages` (cf. verl's
    ``register_adv_est``). Registering a name twice raises ``ValueError``."""
    key = str(name)

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if key in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS[key] is not fn:
            raise ValueError(f"advantage estimator {key!r} is already registered")
        ADVANTAGE_ESTIMATORS[key] = fn
        return fn

    return decorator


def get_advantage_estimator(name: AdvantageEstimator | str) -> AdvantageFn:
    """The registered estimator function called ``name``; ``ValueError`` listing the registered names otherwise."""
    fn = ADVANTAGE_ESTIMATORS.get(name) if isinstance(name, str) else None
    if fn is None:
        raise ValueError(f"advantage estimator must be one of {', '.join(ADVANTAGE_ESTIMATORS)}; got {name!r}")
    return fn


def shape_rewards(
    dense: Tensor, kl_penalty: Tensor, mask: Tensor, clip_range: tuple[float, float] | None = None
) -> Tensor:
    """``r_t = clip(dense_t) - kl_penalty_t`` on valid positions, 0 elsewhere (paper 003 Eq. 5 with
    ``kl_penalty = beta * KL``; the clip is OpenRLHF's ``--reward.clip_range``)."""
    if clip_range is not None:
        dense = dense.clamp(min=clip_range[0], max=clip_range[1])
    return torch.where(mask, dense - kl_penalty, 0.0)


@register_advantage_estimator(AdvantageEstimator.GAE)
def gae_estimator(
    dense: Tensor,
    kl_penalty: Tensor,
    mask: Tensor,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    clip_range: tuple[float, float] | None = None,
    **_,
) -> tuple[Tensor, Tensor, Tensor]:
    """``gae``: shaped rewards, then :func:`gae_advantages` with the critic's ``values`` (required)."""
    if values is None:
        raise ValueError("the gae estimator needs critic values")
    rewards = shape_rewards(dense, kl_penalty, mask, clip_range)
    return (rewards, *gae_advantages(rewards, values, mask, gamma, lam))


@register_advantage_estimator(AdvantageEstimator.REINFORCE)
def reinforce_estimator(
    dense: Tensor,
    kl_penalty: Tensor,
    mask: Tensor,
    *,
    gamma: float = 1.0,
    clip_range: tuple[float, float] | None = None,
    **_,
) -> tuple[Tensor, Tensor, Tensor]:
    """``reinforce``: shaped rewards, then the reward-to-go (:func:`reinforce_advantages`); no critic."""
    rewards = shape_rewards(dense, kl_penalty, mask, clip_range)
    return (rewards, *reinforce_advantages(rewards, mask, gamma))


@register_advantage_estimator(AdvantageEstimator.REINFORCE_BASELINE)
def reinforce_baseline_estimator(
    dense: Tensor, kl_penalty: Tensor, mask: Tensor, *, group_size: int = 1, **kwargs
) -> tuple[Tensor, Tensor, Tensor]:
    """``reinforce_baseline``: the prompt group's mean sequence reward (``dense.sum(1)``, :func:`group_mean_baseline`)
    is subtracted at each response's last token *before* the clip, then as ``reinforce`` (OpenRLHF's order)."""
    baseline = group_mean_baseline(dense.sum(dim=1), group_size)
    dense = dense.scatter_add(1, last_token_index(mask)[:, None], -baseline[:, None])
    return reinforce_estimator(dense, kl_penalty, mask, **kwargs)


def ppo_advantages(
    dense_rewards: Tensor,
    kl: Tensor,
    mask: Tensor,
    kl_coef: float,
    values: Tensor | None = None,
    estimator: AdvantageEstimator | str = "gae",
    gamma: float = 1.0,
    lam: float = 0.95,
    group_size: int = 1,
    whiten: bool = True,
    clip_range: tuple[float, float] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token PPO rewards ``r_t = clip(dense_t) - kl_coef * KL_t`` (paper 003 Eq. 5) -> (rewards, advantages,
    returns), in OpenRLHF 0.11.2's order: the estimator registered as ``estimator`` (``reinforce_baseline``'s group
    baseline, the clip to ``clip_range``, the KL penalty, GAE or reward-to-go), then whitening when ``whiten``.

    Shapes: ``dense_rewards``, ``kl``, ``mask``, ``values`` ``[B, T]``; rows grouped by prompt.
    """
    fn = get_advantage_estimator(estimator)
    mask = mask.bool()
    dense = torch.where(mask, dense_rewards.float(), 0.0)
    rewards, advantages, returns = fn(
        dense,
        kl_coef * kl.float(),
        mask,
        values=values,
        gamma=gamma,
        lam=lam,
        group_size=group_size,
        clip_range=clip_range,
    )
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return rewards, advantages, returns


@dataclass
class PPOKnobs:
    """PPO knobs shared by the engines, declared once (paper 003 Table 8 and OpenRLHF 0.11.2's defaults):
    ``DensePPOConfig``, the recipes' ``ppo:`` sections and the generated OpenRLHF command line use these names.
    ``kl_coef`` is beta of paper 003 Eq. 5; ``value_clip`` ``None`` means no clip (paper 003 Appendix C: 0.25 dense,
    0.2 bandit); ``reward_clip_range`` is OpenRLHF's ``--reward.clip_range`` (before the KL penalty).
    """

    kl_coef: float = knob(0.01, ge=0, help="beta of paper 003 Eq. 5 (0.01)")
    kl_estimator: KLEstimator = field(default=KLEstimator.K1.value, metadata={"help": "k1 | k2 | k3"})
    advantage_estimator: AdvantageEstimator = field(
        default=AdvantageEstimator.GAE.value, metadata={"help": "gae | reinforce | reinforce_baseline"}
    )
    gamma: float = knob(1.0, ge=0, le=1, help="Discount.")
    lam: float = knob(0.95, ge=0, le=1, help="GAE lambda.")
    value_clip: float | None = knob(0.25, gt=0, help="Value clip (0.25 dense, 0.2 bandit).")
    reward_clip_range: list[float] | None = knob(
        default_factory=lambda: [-10.0, 10.0], help="Per-token reward clip [low, high] (+-10)."
    )
    whiten_advantages: bool = field(default=True, metadata={"help": "Standardise advantages per rollout batch."})

    def __post_init__(self) -> None:
        post_init_next(self, __class__)  # a config that lists the knobs before TRL's class runs TRL's checks too
        self.check_ppo_knobs()

    def check_ppo_knobs(self) -> None:
        """Validate the knobs (called by every config that embeds them); each error names the knob and its range."""
        check_knobs(self)
        for name, allowed in (("kl_estimator", SAMPLE_KL_ESTIMATORS), ("advantage_estimator", ESTIMATORS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if self.reward_clip_range is not None and (
            len(self.reward_clip_range) != 2 or not self.reward_clip_range[0] < self.reward_clip_range[1]
        ):
            raise ValueError(f"reward_clip_range must be [low, high] with low < high; got {self.reward_clip_range}")
