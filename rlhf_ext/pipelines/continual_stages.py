"""The continual runner's stages (paper 000): a DPO or PPO policy stage and the per-task reward model stage,
on TRL. PPO stage: CPPO-style continual PPO (Eq. 7 of paper 000) with the task's own reward model.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from trl.trainer.utils import create_model_from_path

from rlhf_ext.algos.names import knob_values
from rlhf_ext.algos.ppo import PPOKnobs
from rlhf_ext.algos.segment_dense import Granularity
from rlhf_ext.trl.args import make_config
from rlhf_ext.trl.continual_dpo import KL_METRIC, ContinualDPOConfig, ContinualDPOTrainer

logger = logging.getLogger(__name__)


def _training_kwargs(recipe, train, seed: int, output_dir: str) -> dict[str, Any]:
    """TrainingArguments of a stage trained with the ``train`` section; every stage reports to the run's
    ``train.trl_args.report_to`` (as a flat ``--report_to`` sets it) unless its own ``trl_args`` say otherwise."""
    from rlhf_ext.trl.args import training_kwargs

    report_to = recipe.train.trl_args.get("report_to", "none")
    return dict(training_kwargs(train, output_dir, seed), save_strategy="no", disable_tqdm=True, report_to=report_to)


def warn_unread(recipe, sections: tuple[str, ...], algorithm: str) -> None:
    """One warning naming the keys of ``sections`` that differ from the recipe's defaults: the other algorithm's
    settings, which this ``algorithm`` stage does not read (``train.trl_args.report_to`` is every stage's)."""
    defaults = {f.name: f.default_factory() for f in dataclasses.fields(recipe) if f.name in sections}
    unread = []
    for name in sections:
        value, default = getattr(recipe, name), defaults[name]
        for f in dataclasses.fields(default):
            if f.name == "trl_args":
                unread += [f"{name}.trl_args.{k}" for k in value.trl_args if (name, k) != ("train", "report_to")]
            elif getattr(value, f.name) != getattr(default, f.name):
                unread.append(f"{name}.{f.name}")
    if unread:
        logger.warning("algorithm: %s; not read: %s", algorithm, ", ".join(unread))


def _train(trainer, task, stage: str, dest: Path):
    """``trainer.train()`` with its TensorBoard events kept in ``task_dir/runs/<stage>`` (the trainer's own
    ``output_dir`` is a scratch directory, deleted after the task) and one terminal line per logging step, then the
    model + tokenizer saved to ``dest`` (rename of a finished temp dir; main process only)."""
    from rlhf_ext.runtime.io import atomic_directory
    from rlhf_ext.trl.args import keep_tensorboard_logs
    from rlhf_ext.trl.console import use_console_output

    keep_tensorboard_logs(trainer, task.task_dir / "runs" / stage)
    use_console_output(trainer, name=f"task {task.index} {stage}")
    result = trainer.train()
    if trainer.accelerator.is_main_process:
        with atomic_directory(dest) as tmp:
            trainer.save_model(str(tmp))
    trainer.accelerator.wait_for_everyone()
    return result


class DPOPolicyStage:
    """The runner's DPO policy stage on TRL: trains one task with :class:`ContinualDPOTrainer`, saves the snapshot,
    and scores it on every task's test split by implicit-reward accuracy (relative to the SFT reference)."""

    name = "dpo"

    def __init__(self, recipe):
        self.recipe = recipe
        warn_unread(recipe, ("ppo",), "dpo trains the policy with the train and dpo sections")

    def run_task(self, task, test_sets: Sequence) -> dict[str, Any]:
        """Train task ``task.index``, write its snapshot to ``task.policy_dir``; return
        ``{"scores": [accuracy on each test set], "metrics": {...}}``."""
        from transformers import AutoTokenizer

        r = self.recipe
        tokenizer = AutoTokenizer.from_pretrained(task.tokenizer_path)
        work = task.work_dir / "trainer"
        kwargs = dict(
            **_training_kwargs(r, r.train, task.seed, str(work)),
            beta=r.dpo.beta,
            loss_type=[r.dpo.loss_type],
            max_length=r.data.max_length,
            continual_kl_coef=task.continual_kl_coef,
            continual_kl_estimator=r.continual.continual_kl_estimator,
        )
        args = make_config(ContinualDPOConfig, kwargs, r.train.trl_args)
        ref_model = create_model_from_path(task.reference_policy, **(args.model_init_kwargs or {}))
        prev_model = task.previous_policy if task.continual_kl_coef > 0 else None  # c = 0: plain DPO, no frozen copy
        trainer = ContinualDPOTrainer(
            model=task.init_policy,
            ref_model=ref_model,
            prev_model=prev_model,
            args=args,
            train_dataset=task.train,
            processing_class=tokenizer,
        )
        result = _train(trainer, task, self.name, task.policy_dir)
        evals = [trainer.implicit_reward_accuracy(ds, f"task{k}_test") for k, ds in enumerate(test_sets)]
        shutil.rmtree(work, ignore_errors=True)
        history = [h for h in trainer.state.log_history if "loss" in h]
        return {
            "scores": [e["accuracy"] for e in evals],
            "metrics": {
                "train_loss": result.training_loss,
                "steps": trainer.state.global_step,
                "margins": [e["margin"] for e in evals],
                "kl_to_previous": [h[KL_METRIC] for h in history if KL_METRIC in h],
                "log_history": history,
            },
        }


class RewardModelStage:
    """The runner's optional per-task reward model (paper 000 trains one per task, Appendix C): TRL's reward trainer
    through :class:`rlhf_ext.trl.SegmentRewardTrainer` with ``entropy_cutoff=inf`` (the plain Bradley-Terry model),
    initialised from the SFT model. Returns its exact per-pair accuracy on every task's test split."""

    def __init__(self, recipe):
        self.recipe = recipe

    def run_task(self, task, test_sets: Sequence) -> dict[str, Any]:
        from transformers import AutoTokenizer

        from rlhf_ext.runtime.segment_data import prepare_segment_dataset
        from rlhf_ext.trl.segment_reward import SegmentRewardConfig, SegmentRewardTrainer

        rm_train = self.recipe.reward_model.train
        tokenizer = AutoTokenizer.from_pretrained(task.tokenizer_path)
        work = task.work_dir / "rm_trainer"
        max_length = self.recipe.data.max_length
        kwargs = dict(**_training_kwargs(self.recipe, rm_train, task.seed, str(work)), max_length=max_length)
        args = make_config(SegmentRewardConfig, {**kwargs, "entropy_cutoff": float("inf")}, rm_train.trl_args)
        prepare = dict(tokenizer=tokenizer, sft_model_name_or_path=task.reference_policy, max_length=max_length)
        train = prepare_segment_dataset(task.train, **prepare)
        trainer = SegmentRewardTrainer(
            model=task.reference_policy, args=args, train_dataset=train, processing_class=tokenizer
        )
        _train(trainer, task, "reward_model", task.reward_model_dir)
        scores = [_reward_model_accuracy(trainer, prepare_segment_dataset(ds, **prepare)) for ds in test_sets]
        shutil.rmtree(work, ignore_errors=True)
        return {"scores": scores}


@torch.no_grad()
def _reward_model_accuracy(trainer, dataset) -> float:
    """Exact per-pair accuracy (``r(chosen) > r(rejected)``) of a reward trainer's model on a prepared dataset."""
    was_training = trainer.model.training
    trainer.model.eval()
    correct = []
    try:
        for batch in trainer.get_eval_dataloader(dataset):
            _, outputs = trainer.compute_loss(trainer.model, trainer._prepare_inputs(batch), return_outputs=True)
            chosen, rejected = outputs.logits.squeeze(-1).chunk(2)
            correct.append(trainer.accelerator.gather_for_metrics((chosen > rejected).float()))
    finally:
        trainer.model.train(was_training)
    return torch.cat(correct).mean().item()


class PPOPolicyStage:
    """``run_task`` trains task ``task.index`` and returns ``{"scores": [mean RM_k score per task k], "metrics"}``.
    The policy trains with the ``ppo`` section's training keys; ``train.*`` and ``dpo.*`` keys set (the DPO stage's)
    are not read, and are named in one warning."""

    name = "ppo"

    def __init__(self, recipe):
        self.recipe = recipe
        warn_unread(recipe, ("train", "dpo"), "ppo trains the policy with the ppo section's keys (ppo.max_steps, "
                    "ppo.learning_rate, ppo.trl_args ...)")  # fmt: skip

    def config(self, task, work: Path):
        """The ``DensePPOConfig`` of task ``task`` (a :class:`rlhf_ext.pipelines.continual.TaskContext`): the ``ppo``
        section's knobs and training keys (``ppo.trl_args`` last), the task's reward model and KL to its predecessor."""
        from rlhf_ext.trl.segment_ppo import DensePPOConfig

        r, ppo = self.recipe, self.recipe.ppo
        kwargs = dict(
            **_training_kwargs(r, ppo, task.seed, str(work)),
            num_generations=ppo.num_generations, max_completion_length=ppo.max_completion_length,
            reward_model_path=str(task.reward_model_dirs[task.index]),
            granularity=Granularity.BANDIT, normalizer_kind="last",
            **knob_values(ppo, PPOKnobs),
            continual_previous_model=task.previous_policy if task.continual_kl_coef > 0 else None,
            continual_kl_coef=task.continual_kl_coef, continual_kl_estimator=r.continual.continual_kl_estimator,
        )  # fmt: skip
        return make_config(DensePPOConfig, kwargs, ppo.trl_args)

    def run_task(self, task, test_sets: Sequence) -> dict[str, Any]:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlhf_ext.trl.segment_ppo import DensePPOTrainer

        if not task.reward_model_dirs:
            raise ValueError("the PPO stage needs the per-task reward models (reward_model.enabled: true)")
        tokenizer = AutoTokenizer.from_pretrained(task.tokenizer_path)
        work = task.work_dir / "ppo_trainer"
        args = self.config(task, work)  # make_config checks report_to
        prompts = Dataset.from_dict({"prompt": list(task.train["prompt"])})
        ref_model = AutoModelForCausalLM.from_pretrained(task.reference_policy)  # KL penalty to the SFT model
        trainer = DensePPOTrainer(
            model=task.init_policy,
            args=args,
            train_dataset=prompts,
            processing_class=tokenizer,
            ref_model=ref_model,
            calibration_dataset=task.train,
        )
        result = _train(trainer, task, self.name, task.policy_dir)
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
        from rlhf_ext.runtime.rewards import SequenceClassifierReward
        from rlhf_ext.runtime.sampling import HFSampler

        prompts = list(test["prompt"][: self.recipe.ppo.eval_prompts])
        sampler = HFSampler(str(policy_dir), tokenizer, max_new_tokens=self.recipe.ppo.max_completion_length,
                            temperatures=[1.0])  # fmt: skip
        responses = sampler.sample(prompts, n=1, seed=seed).flat()
        return float(SequenceClassifierReward(str(rm_dir))(prompts, responses).mean())
