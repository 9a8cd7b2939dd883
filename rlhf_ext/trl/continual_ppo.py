"""The continual runner's PPO policy stage on TRL: CPPO-style continual PPO (paper 000, Eq. 7).

Each task trains the policy with :class:`rlhf_ext.trl.SegmentPPOTrainer` against the task's own reward model (a
bandit Bradley-Terry model from the runner's reward-model stage), with the KL penalty to the SFT model in the reward
and ``c_t`` x KL(pi_theta || pi_{t-1}) to the previous task's frozen snapshot in the loss (``prev_kl_coef``; 0 for the
first task = sequential PPO). Every snapshot is scored on every task by that task's reward model: the mean score of
the policy's samples on the task's held-out prompts (paper 000 evaluates PPO with the per-task reward models).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from typing import Any

import torch


class PPOPolicyStage:
    """``run_task`` trains task ``task.index`` and returns ``{"scores": [mean RM_k score per task k], "metrics"}``."""

    name = "ppo"

    def __init__(self, recipe):
        self.recipe = recipe

    def run_task(self, task, test_sets: Sequence) -> dict[str, Any]:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlhf_ext.trl.continual_dpo import _save_atomically
        from rlhf_ext.trl.segment_ppo import SegmentPPOConfig, SegmentPPOTrainer

        r, ppo = self.recipe, self.recipe.ppo
        if not task.reward_model_dirs:
            raise ValueError("the PPO stage needs the per-task reward models (reward_model.enabled: true)")
        tokenizer = AutoTokenizer.from_pretrained(task.tokenizer_path)
        work = task.work_dir / "ppo_trainer"
        args = SegmentPPOConfig(
            output_dir=str(work), max_steps=ppo.steps_per_task, per_device_train_batch_size=ppo.batch_size,
            num_generations=ppo.num_generations, max_completion_length=ppo.max_completion_length,
            learning_rate=ppo.learning_rate, seed=task.seed, bf16=False, use_cpu=not torch.cuda.is_available(),
            report_to="none", save_strategy="no", gradient_checkpointing=False, disable_tqdm=True, logging_steps=1,
            reward_model_path=str(task.reward_model_dirs[task.index]), granularity="bandit", normalizer_kind="last",
            kl_coef=ppo.kl_coef, advantage_estimator=ppo.advantage_estimator,
            prev_policy_path=task.previous_policy if task.kl_coef > 0 else None,
            prev_kl_coef=task.kl_coef, prev_kl_estimator=r.continual.estimator,
        )  # fmt: skip
        trainer = SegmentPPOTrainer(
            model=task.init_policy,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": list(task.train["prompt"])}),
            processing_class=tokenizer,
            ref_model=AutoModelForCausalLM.from_pretrained(task.reference_policy),  # KL penalty to the SFT model
            calibration_dataset=task.train,
        )
        result = trainer.train()
        _save_atomically(trainer, task.policy_dir)
        scores = [
            self.score(task.policy_dir, tokenizer, rm_dir, ds, task.seed)
            for rm_dir, ds in zip(task.reward_model_dirs, test_sets)
        ]
        shutil.rmtree(work, ignore_errors=True)
        history = [h for h in trainer.state.log_history if "reward" in h]
        return {
            "scores": scores,
            "metrics": {
                "train_loss": result.training_loss,
                "steps": trainer.state.global_step,
                "kl_to_previous": [h["continual/kl_to_previous"] for h in history if "continual/kl_to_previous" in h],
                "kl_to_sft": [h["segment/kl"] for h in history],
                "log_history": history,
            },
        }

    def score(self, policy_dir, tokenizer, rm_dir, test, seed: int) -> float:
        """Mean score of reward model ``rm_dir`` on one sample per held-out prompt of ``test``."""
        from rlhf_ext.online.rollout import HFSampler, SequenceClassifierReward

        prompts = list(test["prompt"][: self.recipe.ppo.eval_prompts])
        sampler = HFSampler(str(policy_dir), tokenizer, max_new_tokens=self.recipe.ppo.max_completion_length,
                            temperatures=[1.0])  # fmt: skip
        responses = sampler.sample(prompts, n=1, seed=seed).flat()
        return float(SequenceClassifierReward(str(rm_dir))(prompts, responses).mean())
