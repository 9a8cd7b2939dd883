"""One-step asynchronous segment-PPO rollouts (paper 001) are seeded per batch: the generator thread samples batch
``t`` from (seed, t) with its own generator, not from the global RNG the trainer's thread uses (two runs with one
seed used to sample different responses)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def segment_rm(cache_dir) -> str:
    from rlhf_ext.pipelines.builtins import resolve_model

    return resolve_model("builtin:tiny-segment-rm", cache_dir)


def test_an_async_rollout_batch_does_not_depend_on_the_global_rng(tmp_path, tiny_sft_path, toy_tok, toy_data,
                                                                   segment_rm):  # fmt: skip
    from rlhf_ext.trl.segment_ppo import SegmentPPOConfig, SegmentPPOTrainer

    args = SegmentPPOConfig(
        output_dir=str(tmp_path), reward_model_path=segment_rm, advantage_estimator="reinforce",
        normalizer_kind="none", async_generation=True, generation_threads=1, per_device_train_batch_size=4,
        num_generations=2, max_completion_length=24, max_steps=1, bf16=False, use_cpu=True, report_to="none",
        save_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    prompts = Dataset.from_list([{"prompt": r["prompt"]} for r in toy_data["train"]])
    trainer = SegmentPPOTrainer(model=tiny_sft_path, args=args, train_dataset=prompts, processing_class=toy_tok)
    rollout = trainer.async_rollout

    def first_batch(global_seed: int) -> dict:
        """Batch 0 as the generator thread makes it, with the global RNG in another state each time."""
        torch.manual_seed(global_seed)
        rollout._start()
        try:
            return rollout.runner.next_batch().data
        finally:
            rollout.close()

    first, again = first_batch(1), first_batch(2)
    assert first["prompts"] == again["prompts"]
    assert first["completion_ids"] == again["completion_ids"]
    assert first["logprobs"] == again["logprobs"]
