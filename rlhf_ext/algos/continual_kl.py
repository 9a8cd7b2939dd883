"""KL to the previous task's policy: the plain regulariser of paper 000 Eq. 7 (Appendix A.2).

Continual RLHF keeps the policy being trained on task ``t`` close to the frozen policy ``pi_{t-1}`` taken at the end
of task ``t - 1``:

    L_t = L_t^{PPO/DPO}  +  c_t * KL( pi_theta(. | x) || pi_{t-1}(. | x) )            (paper 000 Eq. 7, section 4)

(a loss, so the term is added; section 4: ``c_t`` may be lowered or 0 when preferences shift sharply). The *reverse*
KL is estimated per token with Schulman's ("Approximating KL divergence", 2020) estimators via
:func:`rlhf_ext.algos.ppo.kl_estimate`, with ``log r = prev_logp - logp``: ``k1 = -log r`` (can be negative; a value
monitor, not a loss), ``k2 = (log r)^2 / 2`` (the CPPO authors' retention term is 2 x k2) and ``k3 = r - 1 - log r``
(>= 0, unbiased on pi_theta's samples; the default). On offline data (DPO pairs) they are per-token penalties that
vanish exactly when the policies agree. The reduction is the masked mean over tokens (OpenRLHF's ``token-mean``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from rlhf_ext.algos.knobs import check_knobs, knob
from rlhf_ext.algos.names import post_init_next
from rlhf_ext.algos.ppo import K3_MAX_LOG_RATIO, SAMPLE_KL_ESTIMATORS, KLEstimator, kl_estimate

__all__ = [
    "DEFAULT_KL_COEF",
    "ContinualKnobs",
    "K3_MAX_LOG_RATIO",
    "KL_ESTIMATORS",
    "KLEstimator",
    "check_estimator",
    "kl_to_previous",
    "masked_token_mean",
    "per_token_kl",
]

#: The estimators the KL-to-previous-task term accepts: the sampled-token ones (the trainers only have the log-probs
#: of the batch's tokens, not full distributions, so :data:`rlhf_ext.algos.ppo.KL_ESTIMATORS`' ``exact`` is left out).
KL_ESTIMATORS: tuple[str, ...] = SAMPLE_KL_ESTIMATORS

#: Default weight of the KL-to-previous-task term: paper 000 Eq. 7 adds the KL with unit weight.
DEFAULT_KL_COEF = 1.0


@dataclass
class ContinualKnobs:
    """The knobs of paper 000's regulariser toward the previous task's policy (Eq. 7), declared once: the TRL configs
    (``ContinualDPOConfig``, ``DensePPOConfig``), the continual recipe's ``continual:`` section and OpenRLHF's
    ``--ext.continual_*`` flags use these names and defaults. ``continual_kl_coef`` 0 switches the term off."""

    continual_kl_coef: float = knob(DEFAULT_KL_COEF, ge=0, help="c of paper 000 Eq. 7 (1.0); 0 switches it off.")
    continual_kl_estimator: str = field(default="k3", metadata={"help": "k1 | k2 | k3 (k3)."})

    def __post_init__(self) -> None:
        post_init_next(self, __class__)  # a config that lists the knobs before TRL's class runs TRL's checks too
        self.check_continual_knobs()

    def check_continual_knobs(self) -> None:
        """Validate the knobs in place (called by every config that embeds them)."""
        check_knobs(self)
        check_estimator(self.continual_kl_estimator)


def check_estimator(estimator: str) -> str:
    """Validate a KL estimator name (``k1``, ``k2`` or ``k3``)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"KL estimator must be one of {', '.join(KL_ESTIMATORS)}; got {estimator!r} "
            "(k3 is the default: non-negative and unbiased on the policy's own samples)"
        )
    return estimator


def _check_pair(logp: Tensor, prev_logp: Tensor, mask: Tensor | None) -> None:
    if logp.shape != prev_logp.shape:
        raise ValueError(
            f"logp and prev_logp must have the same shape [B, T]; got {tuple(logp.shape)} and {tuple(prev_logp.shape)}"
        )
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T] per-token log-probabilities; got shape {tuple(logp.shape)}")
    if mask is not None and mask.shape != logp.shape:
        raise ValueError(f"mask must have the shape of logp {tuple(logp.shape)}; got {tuple(mask.shape)}")


def per_token_kl(logp: Tensor, prev_logp: Tensor, estimator: KLEstimator | str = "k3") -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_{t-1}) at the batch's tokens (paper 000 Eq. 7; see the module table).

    :func:`rlhf_ext.algos.ppo.kl_estimate` with ``ref_logp = prev_logp`` and the sampled-token estimators only.

    Args:
        logp: ``[B, T]`` log pi_theta(a_t | s_t) of the current policy (differentiable).
        prev_logp: ``[B, T]`` log pi_{t-1}(a_t | s_t) of the frozen previous-task policy (detached).

    Returns:
        ``[B, T]`` float32 (float64 stays float64), not masked.
    """
    _check_pair(logp, prev_logp, None)
    check_estimator(estimator)
    return kl_estimate(logp, prev_logp, estimator)


def masked_token_mean(values: Tensor, mask: Tensor, sample_weights: Tensor | None = None) -> Tensor:
    """``sum_bt w_b m_bt v_bt / sum_bt m_bt``: the mean over response tokens, optionally weighting each sample.

    ``values`` and ``mask`` (bool or 0/1) ``[B, T]``; ``sample_weights`` optional ``[B]`` (the CPPO retention weights
    beta; the denominator stays the token count). Returns a scalar, 0 for an empty mask.
    """
    m = mask.to(values.dtype)
    if sample_weights is not None:
        if sample_weights.shape != values.shape[:1]:
            raise ValueError(
                f"sample_weights must be [B] = [{values.shape[0]}] (one weight per sample); "
                f"got shape {tuple(sample_weights.shape)}"
            )
        m = m * sample_weights.to(values.dtype).unsqueeze(-1)
    return (values * m).sum() / mask.to(values.dtype).sum().clamp_min(1.0)


def kl_to_previous(
    logp: Tensor,
    prev_logp: Tensor,
    mask: Tensor,
    estimator: KLEstimator = "k3",
    sample_weights: Tensor | None = None,
) -> Tensor:
    """Masked mean over response tokens of the per-token KL(pi_theta || pi_{t-1}) (paper 000 Eq. 7).

    ``logp``, ``prev_logp`` and ``mask`` (response tokens) ``[B, T]``; ``sample_weights`` (optional ``[B]``, the CPPO
    retention weights beta) make it CPPO's weighted retention term. Returns a scalar, 0 for an empty mask.
    """
    _check_pair(logp, prev_logp, mask)
    return masked_token_mean(per_token_kl(logp, prev_logp, estimator), mask, sample_weights)
