"""KL to the previous task's policy: the plain regulariser of paper 000 Eq. 7 (Appendix A.2).

Continual RLHF keeps the policy being trained on task ``t`` close to the frozen policy ``pi_{t-1}`` taken at the end
of task ``t - 1``:

    L_t = L_t^{PPO/DPO}  +  c_t * KL( pi_theta(. | x) || pi_{t-1}(. | x) )            (paper 000 Eq. 7, section 4)

(paper 000 Eq. 7 writes the PPO *objective* minus the KL, i.e. unit weight; as a loss to minimise the term is added, and
section 4 notes the weight ``c_t`` may be relaxed or set to 0 when preferences shift sharply.) The KL is the
*reverse* KL, current policy first. This module estimates it per token from the log-probabilities both policies give
the tokens of a batch, with the three estimators of Schulman ("Approximating KL divergence", 2020). With
``log r = prev_logp - logp = log pi_{t-1}(a|s) - log pi_theta(a|s)``:

=========  ====================================  ===========================================================
estimator  per-token value                       properties
=========  ====================================  ===========================================================
``k1``     ``-log r = logp - prev_logp``         unbiased for KL(pi_theta || pi_{t-1}) when tokens are sampled
                                                 from pi_theta; can be negative per token; its pathwise gradient
                                                 has zero expectation on-policy and, on fixed tokens, lowers
                                                 ``logp`` without bound, so it is a value monitor, not a loss
``k2``     ``(log r)^2 / 2``                     >= 0, biased, low variance; its pathwise gradient on pi_theta's
                                                 own samples is exactly grad KL(pi_theta || pi_{t-1}); on fixed
                                                 tokens it is minimised at ``logp == prev_logp``. The CPPO
                                                 authors' retention term is ``(logp - logp_old)^2`` = 2 x k2
``k3``     ``r - 1 - log r``                     >= 0 (``e^x >= 1 + x``), unbiased on pi_theta's samples, low
                                                 variance (default, as in the issue); minimised at
                                                 ``logp == prev_logp``
=========  ====================================  ===========================================================

On *offline* data (DPO pairs, which were not sampled from pi_theta) none of the three is an unbiased KL estimate;
they are per-token penalties on the batch's tokens that vanish exactly when the two policies give the same
log-probabilities, which is how the continual DPO trainer uses them. The reduction is the masked *mean over tokens*
(OpenRLHF's ``token-mean``); the sequence-level KL of paper 000 Eq. 7 is this times the response length.

The per-token values come from :func:`rlhf_ext.algos.ppo.kl_estimate`, the package's one KL function (its clamp
policy applies: only ``k3`` caps ``log r`` at :data:`K3_MAX_LOG_RATIO`); :func:`per_token_kl` here is that function
with ``ref_logp = prev_logp``, the default ``k3`` and only the sampled-token estimators.

All functions are pure ``torch``, vectorised over ``[B, T]``, and used unchanged by the TRL and OpenRLHF adapters.
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
    ``--ext.continual_*`` flags use these names and defaults.

    Args:
        continual_kl_coef: weight ``c`` of ``KL(pi_theta || pi_{t-1})`` (>= 0). Paper 000 Eq. 7 adds the KL with unit
            weight: default 1.0. 0 switches the term off (sequential fine-tuning, no frozen-model forward). Section 4:
            set it low or to 0 for a transition where preferences shift sharply.
        continual_kl_estimator: ``k1`` / ``k2`` / ``k3`` on the sampled tokens (default ``k3``: non-negative and
            unbiased on the policy's own samples; :func:`rlhf_ext.algos.ppo.kl_estimate`).
    """

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

    :func:`rlhf_ext.algos.ppo.kl_estimate` with ``ref_logp = prev_logp``, the default ``k3`` and only the sampled-token
    estimators; its clamp policy applies (``k3`` caps ``log r`` at :data:`K3_MAX_LOG_RATIO`, nothing else is capped).

    Args:
        logp: ``[B, T]`` log pi_theta(a_t | s_t) of the current policy (differentiable).
        prev_logp: ``[B, T]`` log pi_{t-1}(a_t | s_t) of the frozen previous-task policy (no gradient is taken
            through it; detach it or compute it under ``no_grad``).
        estimator: ``k1`` (``logp - prev_logp``), ``k2`` (``(logp - prev_logp)^2 / 2``) or ``k3``
            (``exp(prev_logp - logp) - 1 - (prev_logp - logp)``, log-ratio capped at :data:`K3_MAX_LOG_RATIO`).

    Returns:
        ``[B, T]`` float32 (float64 stays float64). Every estimator is exactly 0 where ``logp == prev_logp``.
        Positions outside the response are not masked here; use :func:`kl_to_previous` for the reduction.
    """
    _check_pair(logp, prev_logp, None)
    check_estimator(estimator)
    return kl_estimate(logp, prev_logp, estimator)


def masked_token_mean(values: Tensor, mask: Tensor, sample_weights: Tensor | None = None) -> Tensor:
    """``sum_bt w_b m_bt v_bt / sum_bt m_bt``: the mean over response tokens, optionally weighting each sample.

    Args:
        values: ``[B, T]``.
        mask: ``[B, T]`` bool (or 0/1) response-token mask.
        sample_weights: optional ``[B]`` non-negative per-sample weights (the CPPO retention weights beta). The
            denominator stays the token count, so all-ones weights give the plain masked mean and the weights
            rescale individual samples' contributions (OpenRLHF's ``token-mean`` normalisation).

    Returns:
        scalar tensor; ``0`` when the mask is empty (no response tokens in the batch).
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

    This is the *plain* regulariser of paper 000 Eq. 7 (every token weighs the same). Passing ``sample_weights``
    (the CPPO retention weights beta of :func:`rlhf_ext.continual.cppo_sample_weights`) turns it into the
    CPPO-weighted retention term; leave it ``None`` for paper 000 Eq. 7.

    Args:
        logp: ``[B, T]`` current-policy log-probabilities of the batch's tokens.
        prev_logp: ``[B, T]`` previous-task policy log-probabilities of the same tokens.
        mask: ``[B, T]`` bool, true at response tokens (prompt and padding excluded).
        estimator: ``k1`` / ``k2`` / ``k3`` (see :func:`per_token_kl`).
        sample_weights: optional ``[B]`` per-sample weights (see :func:`masked_token_mean`).

    Returns:
        scalar: ``sum_bt w_b m_bt kl_bt / sum_bt m_bt`` (0 for an empty mask). Exactly 0 when the policies agree.
    """
    _check_pair(logp, prev_logp, mask)
    return masked_token_mean(per_token_kl(logp, prev_logp, estimator), mask, sample_weights)
