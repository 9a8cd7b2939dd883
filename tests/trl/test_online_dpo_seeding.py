"""Per-batch online DPO (paper 001) repeats exactly: each generated batch is seeded from (seed, batch index), so two
uninterrupted runs with one seed collect the same pairs and end with the same policy (they used to differ: the
generator thread sampled from the global RNG the training thread reseeds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_ext.trl import IterativeDPOTrainer
from rlhf_ext.zoo.toy import keyphrase_gold_reward
from tests.helpers.online_dpo_args import make_args

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run_online(out: Path, sft_path: str, prompts) -> dict:
    """A short one-step asynchronous online DPO run; returns its summary."""
    train, test = prompts
    args = make_args(out, online_mode="online", async_generation=True, generation_threads=1, max_steps=3,
                     max_completion_length=48, max_length=128)  # fmt: skip
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
