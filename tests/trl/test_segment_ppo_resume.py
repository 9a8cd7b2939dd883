"""Segment PPO with a GAE critic resumed from a checkpoint trains exactly as an uninterrupted run: the checkpoint
holds the critic and its optimizer (a resumed run used to restart the critic from its initial weights, and its
policy then drifted 1.8e-4 from the uninterrupted one)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from rlhf_ext.trl.args import last_checkpoint


class Killed(Exception):
    """Stands for the process being killed."""


class KillAfterCheckpoint(TrainerCallback):
    """Stop the run right after ``checkpoint-{step}`` is written."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise Killed(f"killed after checkpoint-{self.step}")


@pytest.fixture(scope="module")
def segment_rm(cache_dir) -> str:
    from rlhf_ext.pipelines.builtins import resolve_model

    return resolve_model("builtin:tiny-segment-rm", cache_dir)


def make_trainer(output_dir, sft_path: str, reward_model: str, tokenizer, prompts, callbacks=()):
    """GAE segment PPO on the toy task: 4 steps, a checkpoint every 2."""
    from rlhf_ext.trl.segment_ppo import SegmentPPOConfig, SegmentPPOTrainer

    args = SegmentPPOConfig(
        output_dir=str(output_dir), reward_model_path=reward_model, advantage_estimator="gae",
        normalizer_kind="none", per_device_train_batch_size=4, num_generations=2, max_completion_length=16,
        learning_rate=3e-4, critic_learning_rate=1e-4, max_steps=4, save_strategy="steps", save_steps=2,
        logging_steps=1, bf16=False, use_cpu=True, report_to="none", disable_tqdm=True, seed=0,
    )  # fmt: skip
    return SegmentPPOTrainer(
        model=sft_path, args=args, train_dataset=prompts, processing_class=tokenizer, callbacks=list(callbacks)
    )


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_equal_parameters(resumed: dict[str, torch.Tensor], uninterrupted: dict[str, torch.Tensor]) -> None:
    assert resumed.keys() == uninterrupted.keys()
    differ = [name for name in resumed if not torch.equal(resumed[name], uninterrupted[name])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


@pytest.mark.slow
def test_a_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_policy_and_critic(
    tmp_path, tiny_sft_path, toy_tok, toy_data, segment_rm
):
    prompts = Dataset.from_list([{"prompt": r["prompt"]} for r in toy_data["train"]])
    uninterrupted = make_trainer(tmp_path / "whole", tiny_sft_path, segment_rm, toy_tok, prompts)
    uninterrupted.train()

    run_dir = tmp_path / "killed"
    killed = make_trainer(run_dir, tiny_sft_path, segment_rm, toy_tok, prompts, [KillAfterCheckpoint(2)])
    with pytest.raises(Killed):
        killed.train()
    assert (run_dir / "checkpoint-2" / "critic" / "training_state.pt").is_file()
    resumed = make_trainer(run_dir, tiny_sft_path, segment_rm, toy_tok, prompts)
    resumed.train(resume_from_checkpoint=last_checkpoint(run_dir))

    assert resumed.state.global_step == uninterrupted.state.global_step == 4
    assert_equal_parameters(parameters(resumed.critic.model), parameters(uninterrupted.critic.model))
    assert_equal_parameters(parameters(resumed.model), parameters(uninterrupted.model))
