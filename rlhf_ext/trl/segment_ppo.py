"""Segment-level PPO on TRL 1.16: ``DensePPOConfig`` + ``DensePPOTrainer`` (paper 003, section 2.3).

TRL 1.16 has no PPO trainer; ``DensePPOTrainer`` keeps ``GRPOTrainer``'s generation and clipped policy-gradient loss
(which accepts per-token advantages ``[B, T]``) and replaces the reward and advantage computation of each rollout:

1. one reference (SFT) forward gives the reference log-probs *and* the entropies used for segmentation;
2. one reward-model forward gives token scores; :func:`rlhf_ext.segment.dense_segment_rewards` turns them into
   normalized, interpolated per-token rewards (as OpenRLHF's experience maker does). GRPO's ``reward_funcs`` give
   instead a bandit reward on the last token (as GRPO sums them), or spans / per-token rewards mapped onto the
   policy's tokens by :func:`rlhf_ext.runtime.spans.dense_rewards`;
3. per-token reward ``r_t = dense_t - kl_coef * KL_t`` with the KL of the policy that sampled (k1 by default);
4. advantages by GAE with a critic (initialised from the reward model, clipped value loss) or critic-free REINFORCE
   (reward-to-go minus a leave-one-out baseline), whitened over the batch.

On-policy steps with one loss call per rollout batch finish the KL reward and advantages inside the loss
(:func:`finishes_in_loss`); otherwise a no-grad forward at rollout time computes the old log-probs. The policy loss is
GRPO's clipped objective (``loss_type="bnpo"``, ``beta = 0``: the KL is in the reward). The critic (single process and
DDP; with DeepSpeed use ``advantage_estimator="reinforce"``) is saved and resumed with each ``checkpoint-N``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import get_config_model_id

from rlhf_ext.algos.continual_kl import ContinualKnobs
from rlhf_ext.algos.knobs import knob, knob_like
from rlhf_ext.algos.location_norm import LocationNormalizer
from rlhf_ext.algos.ppo import PPOKnobs, per_token_kl, ppo_advantages
from rlhf_ext.algos.segment_dense import DenseRewardKnobs, Granularity, SegmentationMonitor, dense_segment_rewards
from rlhf_ext.algos.segment_reward import SegmentRewardKnobs
from rlhf_ext.runtime.calibration import run_normalizer, save_normalizer
from rlhf_ext.runtime.rewards import reward_sources
from rlhf_ext.runtime.segment_data import check_shared_vocabulary, reward_model_source, segment_settings
from rlhf_ext.runtime.spans import capture_sources, captured_dense_rewards
from rlhf_ext.runtime.token_scores import TokenScoreCapture, load_value_model, position_scores
from rlhf_ext.trl.args import CheckpointRecords, HardwareBF16Default
from rlhf_ext.trl.critic import gae_critic
from rlhf_ext.trl.reference_head import add_reference_head
from rlhf_ext.trl.rollout_metrics import (
    drop_grpo_reward_metrics,
    log_dense_rewards,
    log_kl_reward,
    monitor_segmentation,
)


@dataclass
class DensePPOConfig(DenseRewardKnobs, PPOKnobs, ContinualKnobs, HardwareBF16Default, GRPOConfig):
    """``GRPOConfig`` plus the knobs of paper 003's dense rewards
    (:class:`~rlhf_ext.algos.segment_dense.DenseRewardKnobs`), PPO (:class:`~rlhf_ext.algos.ppo.PPOKnobs`) and paper
    000's continual KL (:class:`~rlhf_ext.algos.continual_kl.ContinualKnobs`), and:

    Args:
        reward_model_path: the (segment) reward model; its ``segment_config.json`` supplies cutoff/aggregation/tau.
            Unset when the trainer gets GRPO's ``reward_funcs``.
        entropy_cutoff / aggregation / tau: ``None`` = the reward model's recorded settings (else 2.0/softmax/0.5).
        normalizer_path: a saved :class:`LocationNormalizer`; ``None`` fits one at start-up on ``calibration_dataset``
            (kind ``normalizer_kind``, basis ``normalizer_basis``), or uses none if there is no calibration data.
        async_generation, generation_threads: one-step asynchronous off-policy rollouts (paper 001, Appendix D;
            :class:`~rlhf_ext.trl.async_rollout.OneStepAsyncRollout`).
        continual_previous_model: the frozen previous-task policy of paper 000 Eq. 7; the loss gains
            ``continual_kl_coef * KL(pi_theta || pi_prev)`` on the response tokens. Unset = plain PPO.
    """

    reward_model_path: str | None = field(default=None, metadata={"help": "Segment reward model checkpoint."})
    entropy_cutoff: float | None = knob_like(SegmentRewardKnobs, "entropy_cutoff", None, help="None = the RM's.")
    aggregation: str | None = field(default=None, metadata={"help": "For segment_as_bandit; None = the RM's."})
    tau: float | None = knob_like(SegmentRewardKnobs, "tau", None, help="Soft-max temperature; None = the RM's.")
    normalizer_path: str | None = field(default=None, metadata={"help": "Saved LocationNormalizer JSON."})
    calibration_max_pairs: int | None = knob(512, ge=1, help="Pairs used to fit the normalizer.")
    critic_model_path: str | None = field(default=None, metadata={"help": "Critic init (default: reward model)."})
    critic_learning_rate: float = knob(9e-6, gt=0, help="Critic learning rate (Table 8).")
    continual_previous_model: str | None = field(default=None, metadata={"help": "Frozen previous-task policy."})
    async_generation: bool = field(default=False, metadata={"help": "One-step off-policy rollouts (paper 001)."})
    generation_threads: int | None = knob(None, ge=1, help="Torch threads of the async generator.")
    #: GRPOConfig's PPO ratio clip (paper 003 Appendix C: 0.2), declared here with its range
    epsilon: float = knob(0.2, gt=0, help="PPO ratio clip epsilon (0.2).")
    epsilon_high: float | None = knob(None, gt=0, help="Upper ratio clip (default: epsilon).")

    def __post_init__(self):
        if self.beta != 0.0:
            raise ValueError("DensePPOConfig puts the KL penalty in the reward: set kl_coef, not beta")
        if self.num_generations is None or self.num_generations == 8:  # GRPO's group default; PPO needs no groups
            self.num_generations = 2
        if self.loss_type == "dapo":  # GRPO's default; PPO averages over the tokens of the micro-batch
            self.loss_type = "bnpo"
        self.scale_rewards = "none"
        super().__post_init__()  # the knob dataclasses check every ranged field (rlhf_ext.algos.knobs)


def segment_reward(prompts, completions, **kwargs):
    """The reward-function slot GRPO requires; never called (DensePPOTrainer computes rewards per token)."""
    raise RuntimeError("segment rewards are computed by DensePPOTrainer from token ids, not as a reward function")


def finishes_in_loss(args: DensePPOConfig, out: dict, mode: str) -> bool:
    """Whether a rollout's old log-probs can be the loss forward's own (detached) policy log-probs (``out``: GRPO's
    rollout dict): an on-policy step, no asynchronous behaviour policy, and one loss call for the whole rollout batch
    (``steps_per_generation == 1`` in training)."""
    return (
        "old_per_token_logps" not in out
        and not (args.async_generation and mode == "train")
        and (mode == "eval" or args.steps_per_generation == 1)
    )


class DensePPOTrainer(GRPOTrainer):
    """PPO with dense per-token rewards on top of TRL's ``GRPOTrainer``, at any granularity (paper 003 Table 1):
    ``segment`` is paper 003's segment-level PPO (Eq. 5, Algorithm 1), ``bandit`` stock sequence-level PPO.

    Takes ``GRPOTrainer``'s arguments in its order, plus keyword-only ones:

    Args:
        reward_funcs: GRPO's reward functions, weighted by ``args.reward_weights``: a float per response is a bandit
            reward on the last token; spans or per-token rewards (e.g.
            :class:`~rlhf_ext.runtime.dense_sources.KeywordCredit`) are mapped onto the policy's tokens with
            ``granularity``, ``interpolation`` and the normalizer. Give this *or* a segment reward model.
        reward_model: the segment reward model (default: ``args.reward_model_path``).
        ref_model: the reference (SFT) policy (default: the policy's checkpoint).
        critic: the GAE critic (default: ``args.critic_model_path``, else the reward model, else the policy).
        normalizer, calibration_dataset: a :class:`LocationNormalizer`, or pairs to fit one on.
        prev_model: the previous task's policy for the continual KL term (default: ``args.continual_previous_model``).
    """

    _tag_names = ["trl", "rlhf-ext", "segment-ppo"]

    def __init__(
        self, model, reward_funcs=None, args: DensePPOConfig | None = None, train_dataset=None, eval_dataset=None,
        processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
        quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None, *,
        reward_model=None, ref_model=None, critic=None, normalizer: LocationNormalizer | None = None,
        calibration_dataset=None, prev_model=None,
    ):  # fmt: skip
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = DensePPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-SegmentPPO")
        if not isinstance(args, DensePPOConfig):
            raise TypeError(f"args must be a DensePPOConfig, got {type(args).__name__}")
        reward_funcs, self.uses_reward_funcs = reward_sources(args, reward_funcs, reward_model, environment_factory)
        self.async_rollout = None  # one-step off-policy rollouts (paper 001)
        if args.async_generation:
            if rollout_func is not None:
                raise ValueError("async_generation=True supplies its own rollout_func; pass one or the other")
            from rlhf_ext.trl.async_rollout import OneStepAsyncRollout

            self.async_rollout = rollout_func = OneStepAsyncRollout(generator_threads=args.generation_threads)
        funcs = reward_funcs if reward_funcs is not None else ([] if self.uses_reward_funcs else [segment_reward])
        super().__init__(
            model, funcs, args, train_dataset, eval_dataset, processing_class, reward_processing_classes, callbacks,
            optimizers, quantization_config, peft_config, tools, rollout_func, environment_factory,
        )  # fmt: skip
        self.add_callback(CheckpointRecords())  # rlhf-ext's record in every checkpoint (resume and clean-up)
        if self.async_rollout is not None:
            self.async_rollout.attach(self)
        # what GRPO's reward loop calls: each function wrapped so that its spans wait for the rollout's dense rewards
        self._captured_funcs = capture_sources(self.reward_funcs)
        # on-policy steps finish the advantages from the loss's own policy forward (see the module doc)
        self._reuse_policy_logps = True
        self._loss_inputs: dict | None = None
        self._rewards_per_func: torch.Tensor | None = None
        self._last_policy_logps: torch.Tensor | None = None
        self._in_policy_loss = False
        if not self.uses_reward_funcs and reward_model is None:
            reward_model = load_value_model(args.reward_model_path, "reward model", self.model.dtype)
        rm_source = reward_model_source(args, reward_model)
        self.entropy_cutoff, self.aggregation, self.seg_tau = segment_settings(args, reward_model is not None)
        policy_id = get_config_model_id(self.accelerator.unwrap_model(self.model).config)

        # the reference (SFT) model: log-probs for the KL reward and, for segmenting granularities and the dense ones'
        # reward-hacking monitor, entropies, in one forward
        granularity = Granularity(args.granularity)
        self.needs_reference_entropy = not self.uses_reward_funcs and (
            granularity.needs_entropy or not granularity.is_bandit
        )
        if ref_model is None:
            ref_model = AutoModelForCausalLM.from_pretrained(policy_id, dtype=self.model.dtype)
        self.segment_ref_model = self._frozen(ref_model, entropy=self.needs_reference_entropy)
        self.reward_model = None
        if reward_model is not None:
            check_shared_vocabulary(reward_model, self.accelerator.unwrap_model(self.model))
            self.reward_model = self.accelerator.prepare_model(reward_model.eval(), evaluation_mode=True)
            self._reward_capture = TokenScoreCapture(self.reward_model)
        self.normalizer = run_normalizer(
            args, normalizer, calibration_dataset, self._tokenizer if self.uses_reward_funcs else self.processing_class,
            rm_source, span_funcs=self._captured_funcs if self.uses_reward_funcs else None,
            reward_model=self.accelerator.unwrap_model(self.reward_model) if self.reward_model is not None else None,
            sft_model=self.accelerator.unwrap_model(self.segment_ref_model), entropy_cutoff=self.entropy_cutoff,
            aggregation=self.aggregation, tau=self.seg_tau,
        )  # fmt: skip
        self.monitor = SegmentationMonitor.for_normalizer(self.normalizer, args.granularity)
        # paper 000 Eq. 7's frozen previous-task policy: prev_model, else args.continual_previous_model loaded
        if args.continual_kl_coef > 0 and prev_model is None and args.continual_previous_model is not None:
            prev_model = AutoModelForCausalLM.from_pretrained(args.continual_previous_model, dtype=self.model.dtype)
        self.prev_model = self._frozen(prev_model) if prev_model is not None and args.continual_kl_coef > 0 else None
        source = args.critic_model_path or rm_source or policy_id
        self.critic = gae_critic(args, critic, source, self.accelerator, self.uses_reward_funcs)

    def _frozen(self, model, entropy: bool = False):
        """``model`` with the fused reference head (entropies too with ``entropy``), prepared for no-grad evaluation."""
        add_reference_head(model, self.temperature, entropy, self.args.cast_lm_head_to_fp32)
        return self.accelerator.prepare_model(model.eval(), evaluation_mode=True)

    # ----------------------------------------------------------------------------------------------- helpers
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """GRPO's reward functions when given (kept for the rollout); otherwise zeros (rewards are per token)."""
        if not self.uses_reward_funcs:
            return torch.zeros(len(prompts), len(self.reward_funcs), device=self.accelerator.device)
        funcs, self.reward_funcs = self.reward_funcs, self._captured_funcs
        try:
            self._rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            self.reward_funcs = funcs
        return self._rewards_per_func

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        """GRPO's log-probs; inside the loss they also finish a rollout left to it and are kept for the Eq. 7 term."""
        out = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        if self._loss_inputs is not None:
            inputs, self._loss_inputs = self._loss_inputs, None
            self._finish_advantages(inputs, out[0].detach())
        if self._in_policy_loss:
            self._last_policy_logps = out[0]
        return out

    # ------------------------------------------------------------------------------------------- the rollout
    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)  # generation; GRPO's reward/advantages are replaced
        mode = "train" if self.model.training else "eval"
        args = self.args
        prompt_ids, prompt_mask = out["prompt_ids"], out["prompt_mask"]
        completion_ids, completion_mask = out["completion_ids"], out["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        c = completion_ids.size(1)
        mask = completion_mask.bool() if "tool_mask" not in out else (completion_mask * out["tool_mask"]).bool()
        batch_size = args.per_device_train_batch_size if mode == "train" else args.per_device_eval_batch_size
        finish_in_loss = self._reuse_policy_logps and finishes_in_loss(args, out, mode)

        def forward(model, **kw):
            return self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, c, batch_size=batch_size, **kw
            )

        with torch.no_grad():
            old_logps = out.get("old_per_token_logps")
            if old_logps is None and self.args.async_generation and mode == "train":
                old_logps = out["sampling_per_token_logps"]  # the behaviour policy, one version behind
            if old_logps is None and not finish_in_loss:
                old_logps, _, _ = forward(self.model)
            ref_logps, ref_entropy, _ = forward(self.segment_ref_model, compute_entropy=self.needs_reference_entropy)
            if self.prev_model is not None:
                out["prev_per_token_logps"], _, _ = forward(self.prev_model)
            dense, scores = self._dense_rewards(input_ids, attention_mask, completion_ids, mask, ref_entropy)
            clip_range = tuple(args.reward_clip_range) if args.reward_clip_range else None
            values = None
            if self.critic is not None:
                values = torch.where(mask, self.critic.values(input_ids, attention_mask, c), 0.0)
                out["old_values"] = values
            if finish_in_loss:
                # the per-row part now (group baseline before GRPO shuffles the rows, reward clip); the KL term,
                # GAE or reward-to-go and whitening in the loss (_finish_advantages) from the loss forward's log-probs
                shaped, _, _ = ppo_advantages(
                    dense.rewards, torch.zeros_like(ref_logps), mask, 0.0, values, args.advantage_estimator,
                    args.gamma, args.lam, self.num_generations, False, clip_range,
                )  # fmt: skip
                out.pop("advantages")  # GRPO's sequence advantages; ours are set in the loss
                out["ppo_shaped_rewards"], out["ppo_ref_logps"] = shaped, ref_logps
                out["ppo_sequence_reward"] = dense.sequence_reward
            else:
                kl = torch.where(mask, per_token_kl(old_logps, ref_logps, args.kl_estimator), 0.0)
                _, advantages, returns = ppo_advantages(
                    dense.rewards, kl, mask, args.kl_coef, values, args.advantage_estimator, args.gamma, args.lam,
                    self.num_generations, args.whiten_advantages, clip_range,
                )  # fmt: skip
                if values is not None:
                    out["returns"] = returns
                out["advantages"] = advantages
                out["old_per_token_logps"] = old_logps

        metrics, gather = self._metrics[mode], self.accelerator.gather
        placeholder_names = None if self.uses_reward_funcs else self.reward_func_names
        drop_grpo_reward_metrics(metrics, gather, placeholder_names, dense.sequence_reward, self.num_generations)
        if not finish_in_loss:
            log_kl_reward(metrics, gather, dense.sequence_reward, kl, args.kl_coef)
        log_dense_rewards(metrics, gather, dense, scores, mask)
        if not self.uses_reward_funcs and not Granularity(args.granularity).is_bandit:
            monitor_segmentation(
                metrics, gather, self.monitor, dense.segments_per_response, mask, ref_entropy, self.entropy_cutoff,
                self.state.global_step if mode == "train" else None, self.accelerator.is_main_process,
            )  # fmt: skip
        return out

    def _dense_rewards(self, input_ids, attention_mask, completion_ids, mask, ref_entropy):
        """The rollout's :class:`~rlhf_ext.runtime.spans.DenseBatch` and the ``[B, C]`` scores it came from (the
        reward functions', or the segment reward model's made dense by :func:`dense_segment_rewards`)."""
        c, args = completion_ids.size(1), self.args
        if self.uses_reward_funcs:  # this process's rows of GRPO's rewards per function (_calculate_rewards)
            n, per_func, self._rewards_per_func = len(mask), self._rewards_per_func, None
            dense = captured_dense_rewards(
                self._captured_funcs, self.reward_func_names, per_func[self.accelerator.process_index * n :][:n],
                self.reward_weights.tolist(), self._tokenizer, completion_ids, mask, normalizer=self.normalizer,
                granularity=args.granularity, interpolation=args.interpolation, aggregation=self.aggregation,
                tau=self.seg_tau,
            )  # fmt: skip
            return dense, dense.sequence_reward[:, None].expand(-1, c)
        scores = position_scores(self._reward_capture, self.reward_model, input_ids, attention_mask)[:, -c:]
        return dense_segment_rewards(
            scores, mask, ref_entropy, normalizer=self.normalizer, granularity=args.granularity,
            interpolation=args.interpolation, entropy_cutoff=self.entropy_cutoff, aggregation=self.aggregation,
            tau=self.seg_tau, chunk_size=args.chunk_size,
        ), scores  # fmt: skip

    @torch.no_grad()
    def _finish_advantages(self, inputs: dict, policy_logps: torch.Tensor) -> None:
        """The rest of :func:`ppo_advantages` for a rollout left to the loss, from the loss forward's log-probs
        ``[B, C]``: ``r_t = shaped_t - kl_coef * KL_t`` (paper 003 Eq. 5), GAE or reward-to-go, whitening."""
        args = self.args
        mask = inputs["completion_mask"]
        mask = (mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]).bool()
        kl = torch.where(mask, per_token_kl(policy_logps, inputs.pop("ppo_ref_logps"), args.kl_estimator), 0.0)
        values = inputs.get("old_values")
        _, inputs["advantages"], returns = ppo_advantages(
            inputs.pop("ppo_shaped_rewards"), kl, mask, args.kl_coef, values, "reinforce" if values is None else "gae",
            args.gamma, args.lam, 1, args.whiten_advantages, None,
        )  # fmt: skip
        if values is not None:
            inputs["returns"] = returns
        metrics = self._metrics["train" if self.model.training else "eval"]
        log_kl_reward(metrics, self.accelerator.gather, inputs.pop("ppo_sequence_reward"), kl, args.kl_coef)

    # ------------------------------------------------------------------------------------------------ losses
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._last_policy_logps, self._in_policy_loss = None, self.prev_model is not None
        self._loss_inputs = inputs if "ppo_shaped_rewards" in inputs else None
        try:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self._in_policy_loss, self._loss_inputs = False, None
        if self.prev_model is not None and "prev_per_token_logps" in inputs:
            from rlhf_ext.algos.continual_kl import kl_to_previous

            mask = inputs["completion_mask"].bool()
            kl = kl_to_previous(
                self._last_policy_logps, inputs["prev_per_token_logps"], mask, self.args.continual_kl_estimator
            )
            mode = "train" if self.model.training else "eval"
            scale = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.args.continual_kl_coef * kl / scale
            self._metrics[mode]["continual/kl_to_previous"].append(self.accelerator.gather(kl.detach()).mean().item())
        if self.critic is not None and "returns" in inputs and self.model.training:
            self._critic_step(inputs)
        return loss

    def _critic_step(self, inputs) -> None:
        """The critic's clipped value-loss step on this micro-batch (:meth:`Critic.step`), logged."""
        args = self.args
        loss, clip_frac = self.critic.step(inputs, self.current_gradient_accumulation_steps, args.max_grad_norm,
                                           args.value_clip)  # fmt: skip
        metrics = self._metrics["train"]
        metrics["critic/value_loss"].append(self.accelerator.gather(loss).mean().item())
        metrics["critic/value_clip_frac"].append(self.accelerator.gather(clip_frac).mean().item())

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        if self.args.should_save:
            save_normalizer(self.normalizer, os.path.join(output_dir, "normalizer.json"))
            if self.critic is not None:
                self.critic.save_weights(output_dir)

    # ----------------------------------------------------------------------------------- checkpoint / resume
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The policy's optimizer and scheduler, and the critic's optimizer state (``critic/``)."""
        super()._save_optimizer_and_scheduler(output_dir)
        if self.critic is not None and self.args.should_save:
            self.critic.save_state(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """On resume, the policy's optimizer and scheduler, then the critic's weights and optimizer state."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.critic is not None:
            self.critic.load(checkpoint)


#: Paper 003's names for the same classes (segment-level PPO is :class:`DensePPOTrainer` on a segment reward model).
SegmentPPOConfig = DensePPOConfig
SegmentPPOTrainer = DensePPOTrainer
