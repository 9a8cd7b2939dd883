"""Per-batch online DPO (paper 001) repeats exactly: each generated batch is seeded from (seed, batch index), so two
uninterrupted runs with one seed collect the same pairs and end with the same policy (they used to differ: the
generator thread sampled from the global RNG the training thread reseeds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_ext.trl import IterativeDPOConfig, IterativeDPOTrainer
from rlhf_ext.trl.args import CPU_RUN
from rlhf_ext.zoo.toy import keyphrase_gold_reward

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run_online(out: Path, sft_path: str, prompts) -> dict:
    """A short one-step asynchronous online DPO run; returns its summary."""
    train, test = prompts
    args = IterativeDPOConfig(
        output_dir=str(out),
        online_mode="online",
        async_generation=True,
        generation_threads=1,
        max_steps=3,
        num_samples=4,
        max_new_tokens=48,
        per_device_train_batch_size=4,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        beta=0.1,
        max_length=128,
        eval_num_prompts=4,
        eval_samples_per_prompt=1,
        eval_temperature=0.7,
        logging_steps=100,
        seed=0,
        **CPU_RUN,
    )
    trainer = IterativeDPOTrainer(
        sft_path, args=args, train_dataset=train, eval_dataset=test, reward_funcs=keyphrase_gold_reward
    )
    trainer.train()
    return trainer.summary


def stored_pairs(out: Path) -> list[str]:
    return [(out / f"pairs/iter_{i:03d}/pairs.jsonl").read_text() for i in range(3)]


def test_two_uninterrupted_runs_collect_the_same_pairs_and_end_with_the_same_policy(tmp_path, tiny_sft_path):
    from rlhf_ext.zoo.toy import toy_preference_dataset

    data = toy_preference_dataset(n_train=64, n_test=16, seed=0)
    prompts = data["train"], data["test"]
    first = run_online(tmp_path / "a", tiny_sft_path, prompts)
    second = run_online(tmp_path / "b", tiny_sft_path, prompts)

    assert stored_pairs(tmp_path / "a") == stored_pairs(tmp_path / "b")
    a = load_file(str(Path(first["final_policy"]) / "model.safetensors"))
    b = load_file(str(Path(second["final_policy"]) / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    evaluations = [{k: v for k, v in e.items() if k != "path"} for e in first["eval"]]
    assert evaluations == [{k: v for k, v in e.items() if k != "path"} for e in second["eval"]]
    assert first["runner"]["trained"] == second["runner"]["trained"]
