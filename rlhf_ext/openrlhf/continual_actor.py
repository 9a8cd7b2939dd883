"""Continual RLHF in OpenRLHF 0.11.2's PPO actor: the KL to the previous task's policy (paper 000, Eq. 7).

* :class:`ContinualPolicyLoss` — ``PolicyLoss`` plus ``c * KL(pi_theta || pi_{t-1})``, the per-token KL of
  :func:`rlhf_ext.continual.per_token_kl` reduced by OpenRLHF's ``aggregate_loss`` like the policy loss; with
  ``continual_retention="cppo"`` CPPO's sample-wise weights scale advantages (alpha) and the KL term (beta).
* :class:`ContinualActorPPOTrainer` — ``training_step`` binds the previous-task policy's log-probs (one frozen
  forward) to the loss; the KL is logged as ``prev_task_kl``.
* :class:`ContinualPolicyModelActor` — the Ray policy actor building it (:func:`use_continual_actor`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import ray
import torch

from rlhf_ext.algos.continual_kl import DEFAULT_KL_COEF, ContinualKnobs, check_estimator, per_token_kl
from rlhf_ext.algos.cppo_weights import BatchStats, CPPOWeightSettings, batch_stats, cppo_sample_weights, mean_log_prob
from rlhf_ext.algos.knobs import check_knob
from rlhf_ext.openrlhf.compat import import_shims  # re-exported for callers importing more OpenRLHF modules

with import_shims():
    from openrlhf.models import Actor, PolicyLoss, aggregate_loss
    from openrlhf.trainer.ray import ppo_actor as _ppo_actor
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
    from openrlhf.utils.vlm_utils import merge_mm_train_inputs

PREV_TASK_KL_KEY = "prev_task_kl"


@dataclass
class ContinualActorSettings(ContinualKnobs):
    """Paper 000's knobs plus ``continual_previous_model`` (``None``: first task, no term), ``continual_retention``
    (``kl``: paper 000 Eq. 7; ``cppo``: also CPPO's sample-wise weights) and the ``cppo`` settings."""

    continual_previous_model: str | None = None
    continual_retention: Literal["kl", "cppo"] = "kl"
    cppo: CPPOWeightSettings = field(default_factory=CPPOWeightSettings)

    def __post_init__(self):
        self.check_continual_knobs()
        if self.continual_retention not in ("kl", "cppo"):
            raise ValueError(f"ext.continual_retention must be 'kl' or 'cppo'; got {self.continual_retention!r}")

    @classmethod
    def from_args(cls, args: Any) -> ContinualActorSettings:
        """Read the ``--ext.continual_*`` flags (``args.ext``, as OpenRLHF hierarchises them); defaults when absent."""
        ext = getattr(args, "ext", None)
        values = {f.name: getattr(ext, f.name) for f in fields(cls) if getattr(ext, f.name, None) is not None}
        cppo = values.get("cppo")
        if cppo is not None and not isinstance(cppo, CPPOWeightSettings):
            values["cppo"] = CPPOWeightSettings(**(cppo if isinstance(cppo, dict) else vars(cppo)))
        return cls(**values)


def check_continual_ext(ext: dict[str, Any]) -> None:
    """Check the ``--ext.continual_*`` values in the driver, and that ``--ext.continual_previous_model`` loads."""
    from rlhf_ext.zoo.builtins import check_model_source

    values = {k: v for k, v in ext.items() if k.startswith("continual_") and v is not None}
    ContinualActorSettings(**values)
    if values.get("continual_previous_model"):
        try:
            check_model_source(values["continual_previous_model"])
        except OSError as e:
            raise ValueError(f"--ext.continual_previous_model: {e}") from None


#: the ``PolicyLoss.__init__`` arguments a :class:`ContinualPolicyLoss` copies from the stock loss
_POLICY_LOSS_SETTINGS = (
    "clip_eps_low",
    "clip_eps_high",
    "dual_clip",
    "token_level_loss",
    "policy_loss_type",
    "is_correction_level",
    "is_correction_mode",
    "is_correction_gating",
    "is_correction_threshold",
)


class ContinualPolicyLoss(PolicyLoss):
    """``PolicyLoss`` + ``c * KL(pi_theta || pi_{t-1})`` (paper 000 Eq. 7), optionally with CPPO's sample-wise weights.

    ``forward`` also takes ``prev_log_probs`` ``[B, A]``, ``learning_weights`` (alpha, ``[B]``) and
    ``retention_weights`` (beta, ``[B]``), else from :meth:`extra_inputs`; the last unweighted KL is
    :attr:`last_prev_task_kl`."""

    def __init__(
        self, *args: Any, continual_kl_coef: float = DEFAULT_KL_COEF, continual_kl_estimator: str = "k3", **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.continual_kl_coef = check_knob(ContinualKnobs, "continual_kl_coef", continual_kl_coef)
        self.continual_kl_estimator = check_estimator(continual_kl_estimator)
        self.last_prev_task_kl: torch.Tensor | None = None
        self._extra: dict[str, Any] = {}

    @classmethod
    def from_policy_loss(cls, loss: PolicyLoss, **kwargs: Any) -> ContinualPolicyLoss:
        """A continual loss with every setting of an existing ``PolicyLoss`` plus ``kwargs``."""
        new = cls(**{name: getattr(loss, name) for name in _POLICY_LOSS_SETTINGS}, **kwargs)
        new.token_level_loss = loss.token_level_loss  # GSPO forces sequence-level in __init__; keep the final value
        return new

    @contextlib.contextmanager
    def extra_inputs(self, info: dict | None = None, **inputs: Any) -> Iterator[None]:
        """Bind ``prev_log_probs`` / ``learning_weights`` / ``retention_weights`` (and an ``info`` dict that receives
        ``prev_task_kl``) for the calls made inside the ``with`` block."""
        self._extra = {**inputs, "info": info}
        try:
            yield
        finally:
            self._extra = {}

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: torch.Tensor | None = None,
        rollout_log_probs: torch.Tensor | None = None,
        dp_size: int = 1,
        batch_num_tokens: float | None = None,
        global_batch_size: float | None = None,
        prev_log_probs: torch.Tensor | None = None,
        learning_weights: torch.Tensor | None = None,
        retention_weights: torch.Tensor | None = None,
    ):
        prev_log_probs = prev_log_probs if prev_log_probs is not None else self._extra.get("prev_log_probs")
        learning_weights = learning_weights if learning_weights is not None else self._extra.get("learning_weights")
        retention_weights = retention_weights if retention_weights is not None else self._extra.get("retention_weights")
        if learning_weights is not None:  # PPO's clipped loss is positively homogeneous in the advantage
            advantages = advantages * learning_weights.to(advantages.dtype).unsqueeze(-1)
        sizes = {"dp_size": dp_size, "batch_num_tokens": batch_num_tokens, "global_batch_size": global_batch_size}
        loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio = super().forward(
            log_probs, old_log_probs, advantages, action_mask=action_mask, rollout_log_probs=rollout_log_probs, **sizes
        )
        self.last_prev_task_kl = None
        if prev_log_probs is None or self.continual_kl_coef == 0:
            return loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio

        def aggregate(per_token: torch.Tensor) -> torch.Tensor:
            return aggregate_loss(per_token, action_mask, token_level_loss=self.token_level_loss, **sizes)

        kl_tokens = per_token_kl(log_probs, prev_log_probs.detach(), self.continual_kl_estimator)
        kl = aggregate(kl_tokens)
        term = kl
        if retention_weights is not None:
            term = aggregate(kl_tokens * retention_weights.to(kl_tokens.dtype).unsqueeze(-1))
        loss = loss + self.continual_kl_coef * term
        self.last_prev_task_kl = kl.detach()
        info = self._extra.get("info")
        if info is not None:
            info[PREV_TASK_KL_KEY] = self.last_prev_task_kl
        return loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio


def load_previous_task_actor(strategy: Any, path: str) -> Actor:
    """The previous task's policy as a frozen OpenRLHF ``Actor``, loaded like ``PolicyModelActor``'s EMA model and at
    the rollout temperature, so its log-probabilities are comparable with the actor's."""
    ds = strategy.args.ds
    model = Actor(
        path,
        attn_implementation=ds.attn_implementation,
        experts_implementation=ds.experts_implementation,
        param_dtype=ds.param_dtype,
        load_in_4bit=ds.load_in_4bit,
        ds_config=strategy.get_ds_eval_config(offload=False),
        packing_samples=ds.packing_samples,
        temperature=strategy.args.rollout.temperature,
    )
    model.requires_grad_(False)
    return strategy.prepare(model)


class ContinualActorPPOTrainer(ActorPPOTrainer):
    """``ActorPPOTrainer`` with the KL to the previous task's policy ``prev_model`` (default: loaded from
    ``settings.continual_previous_model``, if set); ``settings`` default: from ``strategy.args.ext``."""

    def __init__(
        self,
        strategy,
        *args: Any,
        prev_model: Actor | None = None,
        settings: ContinualActorSettings | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(strategy, *args, **kwargs)
        c = self.continual = settings if settings is not None else ContinualActorSettings.from_args(strategy.args)
        self.actor_loss_fn = ContinualPolicyLoss.from_policy_loss(
            self.actor_loss_fn, continual_kl_coef=c.continual_kl_coef, continual_kl_estimator=c.continual_kl_estimator
        )
        if prev_model is None and self.continual.continual_previous_model:
            prev_model = load_previous_task_actor(strategy, self.continual.continual_previous_model)
        if prev_model is not None:
            prev_model.requires_grad_(False)
            prev_model.eval()
        self.prev_model = prev_model
        self.cppo_stats: BatchStats | None = None  # None: per micro-batch statistics

    @torch.no_grad()
    def previous_task_log_probs(self, experience) -> torch.Tensor:
        """``[B, A]`` log pi_{t-1} of the experience's action tokens (one frozen forward pass)."""
        mm_inputs = {}
        if getattr(experience, "mm_train_inputs", None) and getattr(self.prev_model, "is_vlm", False):
            mm_inputs = merge_mm_train_inputs(experience.mm_train_inputs, experience.sequences.device)
        self.prev_model.eval()
        return self.prev_model(
            experience.sequences,
            experience.action_mask,
            attention_mask=experience.attention_mask,
            ring_attn_group=self.strategy.ring_attn_group,
            **mm_inputs,
        )

    @staticmethod
    def cppo_batch_stats(items) -> BatchStats:
        """CPPO thresholds' statistics over a rollout batch (single-sample ``Experience`` items of the replay buffer):
        reward and mean per-token rollout log-probability of every sample."""
        rewards = torch.stack([it.rewards.float().reshape(()) for it in items])
        logp = torch.stack([mean_log_prob(it.action_log_probs[None], it.action_mask[None])[0] for it in items])
        return batch_stats(rewards, logp)

    def ppo_train(self, kl_ctl: float):
        if self.continual.continual_retention == "cppo":  # thresholds from the whole rollout batch, as in the CPPO code
            self.cppo_stats = self.cppo_batch_stats(self.replay_buffer.items)
        return super().ppo_train(kl_ctl)

    def training_step(self, experience, kl_ctl: float, step: int, loss_batch_info: dict | None = None):
        extra: dict[str, Any] = {}
        c = self.continual
        if self.prev_model is not None and c.continual_kl_coef > 0:
            extra["prev_log_probs"] = self.previous_task_log_probs(experience)
        if c.continual_retention == "cppo":
            logp = mean_log_prob(experience.action_log_probs, experience.action_mask)
            weights = cppo_sample_weights(experience.rewards.float().reshape(-1), logp, c.cppo, stats=self.cppo_stats)
            extra["learning_weights"], extra["retention_weights"] = weights.alpha, weights.beta
        if self.prev_model is None:  # first task of a sequence: no previous policy, the term is 0 (logged as such)
            experience.info[PREV_TASK_KL_KEY] = torch.zeros(())
        with self.actor_loss_fn.extra_inputs(info=experience.info, **extra):
            return super().training_step(experience, kl_ctl, step, loss_batch_info)


@contextlib.contextmanager
def _swapped(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


class _ContinualPolicyModelActorImpl(_ppo_actor.PolicyModelActor.__ray_actor_class__):
    """``PolicyModelActor`` whose trainer is a :class:`ContinualActorPPOTrainer` (previous-task model loaded in the
    actor process, like the EMA model)."""

    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        with _swapped(_ppo_actor, "ActorPPOTrainer", ContinualActorPPOTrainer):
            return super().init_model_from_pretrained(strategy, pretrain, max_steps, vllm_engines)


ContinualPolicyModelActor = ray.remote(num_gpus=1)(_ContinualPolicyModelActorImpl)


def use_continual_actor() -> None:
    """Make ``openrlhf.cli.train_ppo_ray`` build :data:`ContinualPolicyModelActor` as its policy actor."""
    _ppo_actor.PolicyModelActor = ContinualPolicyModelActor
