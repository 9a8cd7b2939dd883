"""Generated data loads as-is into TRL's RewardTrainer / DPOTrainer and OpenRLHF's reward dataset, and is learnable.

No conversion code: the stage directories are read with ``datasets.load_from_disk`` (what users and OpenRLHF's
``--data.dataset PATH`` do) and passed straight to the trainers.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from datasets import load_from_disk

from rlhf_ext.datagen import generate_dataset

CPU = dict(bf16=False, use_cpu=True, report_to="none", gradient_checkpointing=False, save_strategy="no")
CPU.update(disable_tqdm=True, seed=0)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """The packaged piecewise-preference config, small, in both formats (rapper, Shakespeare, formal, x3)."""
    root = tmp_path_factory.mktemp("datagen_train")
    out = {}
    for fmt in ("plain", "conversational"):
        generate_dataset(
            "continual-piecewise-preference",
            root / fmt,
            num_samples=120,
            overrides=[f"output.format={fmt}"],
            progress=False,
        )
        out[fmt] = root / fmt
    return out


def stage(path, index):
    return load_from_disk(str(next((path / "stages").glob(f"{index:03d}-*"))))


def test_reward_model_learns_the_preference_and_sees_the_drift(generated, tmp_path):
    """A tiny RM trained on the rapper stage ranks held-out rapper pairs and fails on the Shakespeare stage, whose
    rejected responses carry rapper phrases: preference drift reverses part of the reward."""
    from trl import RewardConfig, RewardTrainer

    from rlhf_ext.zoo.models import tiny_reward_model
    from rlhf_ext.zoo.tokenizer import train_bpe_tokenizer

    rapper = stage(generated["plain"], 0)
    tok = train_bpe_tokenizer([r[k] for r in rapper["train"] for k in ("prompt", "chosen", "rejected")], 1024)
    args = RewardConfig(
        output_dir=str(tmp_path / "rm"),
        max_steps=16,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=32,
        learning_rate=3e-3,
        warmup_steps=0.1,
        logging_steps=5,
        **CPU,
    )
    trainer = RewardTrainer(
        model=tiny_reward_model(tok, seed=0),
        args=args,
        train_dataset=rapper["train"],
        eval_dataset={
            "rapper": stage(generated["plain"], 3)["test"],
            "shakespeare": stage(generated["plain"], 1)["test"],
        },
        processing_class=tok,
    )

    def accuracy():  # TRL logs the pairwise accuracy into the metrics dict evaluate() returns
        return {k: trainer.evaluate(eval_dataset=d)["eval_accuracy"] for k, d in trainer.eval_dataset.items()}

    before = accuracy()
    trainer.train()
    after = accuracy()
    assert before["rapper"] < 0.8
    assert after["rapper"] >= 0.95  # a later cycle of the same task: held-out prompts and samples
    assert after["shakespeare"] < 0.5


def test_trl_reward_trainer_takes_conversational_data_as_is(generated, tiny_base_path, tmp_path):
    """(The plain format is what the learning test above trains on.)"""
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    data = stage(generated["conversational"], 2)
    assert data["train"][0]["chosen"][0]["role"] == "assistant"
    rm = RewardTrainer(
        model=tiny_base_path,
        args=RewardConfig(output_dir=str(tmp_path / "rm"), max_steps=2, per_device_train_batch_size=4, **CPU),
        train_dataset=data["train"],
        processing_class=AutoTokenizer.from_pretrained(tiny_base_path),
    )
    result = rm.train()
    assert math.isfinite(result.training_loss) and result.global_step == 2


@pytest.mark.parametrize("fmt", ["plain", "conversational"])
def test_trl_dpo_trainer_takes_the_data_as_is(generated, fmt, tiny_base_path, tmp_path):
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    data = stage(generated[fmt], 2)
    dpo = DPOTrainer(
        model=tiny_base_path,  # the reference model is reloaded from this checkpoint
        args=DPOConfig(
            output_dir=str(tmp_path / "dpo"), max_steps=2, per_device_train_batch_size=4, max_length=512, **CPU
        ),
        train_dataset=data["train"],
        processing_class=AutoTokenizer.from_pretrained(tiny_base_path),
    )
    result = dpo.train()
    assert math.isfinite(result.training_loss) and result.global_step == 2


@pytest.mark.parametrize("fmt", ["plain", "conversational"])
def test_openrlhf_reward_dataset_reads_a_stage_directory(generated, fmt, toy_tok):
    from openrlhf.datasets.reward_dataset import RewardDataset
    from openrlhf.datasets.utils import blending_datasets

    stage_dir = str(next((generated[fmt] / "stages").glob("001-*")))
    strategy = SimpleNamespace(
        print=lambda *a, **k: None,
        is_rank_0=lambda: False,
        args=SimpleNamespace(
            use_ms=False,
            data=SimpleNamespace(
                prompt_key="prompt",
                chosen_key="chosen",
                rejected_key="rejected",
                apply_chat_template=fmt == "conversational",
                tokenizer_chat_template=None,
            ),
        ),
    )
    raw = blending_datasets(stage_dir, strategy=strategy, dataset_split="train")
    ds = RewardDataset(raw, toy_tok, max_length=512, strategy=strategy, num_processors=1)
    assert len(ds) == len(raw)
    chosen_ids, _, rejected_ids, _, _ = ds[0]
    chosen = toy_tok.decode(chosen_ids[0])
    row = raw[0]
    text = row["chosen"] if fmt == "plain" else row["chosen"][0]["content"]
    prompt = row["prompt"] if fmt == "plain" else row["prompt"][0]["content"]
    assert prompt in chosen and text in chosen
    assert chosen_ids[0, -1].item() == toy_tok.eos_token_id and rejected_ids.shape[1] > 10
