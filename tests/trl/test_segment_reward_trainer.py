"""SegmentRewardTrainer on TRL 1.16: equivalence with the stock trainer, learning, settings, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from datasets import Dataset

from rlhf_ext.runtime.segment_data import prepare_segment_dataset
from rlhf_ext.trl.args import CPU_RUN


def _args(tmp_path, **kw):
    from rlhf_ext.trl import SegmentRewardConfig

    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        learning_rate=1e-3,
        **CPU_RUN,
        logging_steps=1,
        seed=0,
    )
    base.update(kw)
    return SegmentRewardConfig(**base)


@pytest.fixture(scope="module")
def prepared(tiny_sft_path, toy_tok, toy_data):
    return prepare_segment_dataset(toy_data["train"].select(range(16)), toy_tok, sft_model_name_or_path=tiny_sft_path)


def test_cutoff_inf_equals_stock_reward_trainer_loss(tmp_path, tiny_sft_path, toy_tok, prepared):
    """Bandit model = segment model with c_ent = inf: same loss as TRL's RewardTrainer on the same batch (1e-6)."""
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer
    from trl.trainer.reward_trainer import DataCollatorForPreference

    from rlhf_ext.trl import SegmentPreferenceCollator, SegmentRewardTrainer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_sft_path, num_labels=1).eval()
    ours = SegmentRewardTrainer(
        model=model, args=_args(tmp_path, entropy_cutoff=math.inf), train_dataset=prepared, processing_class=toy_tok
    )
    stock_args = RewardConfig(output_dir=str(tmp_path / "stock"), bf16=False, use_cpu=True, report_to="none")
    stock = RewardTrainer(
        model=model,
        args=stock_args,
        train_dataset=prepared.select_columns(["chosen_ids", "rejected_ids"]),
        processing_class=toy_tok,
    )
    examples = [prepared[i] for i in range(8)]
    stock_batch = DataCollatorForPreference(pad_token_id=toy_tok.pad_token_id)(
        [{"chosen_ids": e["chosen_ids"], "rejected_ids": e["rejected_ids"]} for e in examples]
    )
    our_batch = SegmentPreferenceCollator(toy_tok.pad_token_id)(examples)
    assert torch.equal(stock_batch["input_ids"], our_batch["input_ids"])
    with torch.no_grad():
        stock_loss = stock.compute_loss(model, dict(stock_batch))
        our_loss = ours.compute_loss(model, dict(our_batch))
    assert abs(stock_loss.item() - our_loss.item()) < 1e-6
    # and a finite cutoff gives a different loss on the same batch (the segment loss is really in use)
    ours.args.entropy_cutoff = 2.0
    with torch.no_grad():
        seg_loss = ours.compute_loss(model, dict(our_batch))
    assert abs(seg_loss.item() - stock_loss.item()) > 1e-4


def test_tiny_model_learns_key_phrase_task(tmp_path, tiny_sft_path, toy_tok, toy_data):
    """Held-out accuracy > 0.9 where the chosen response holds a key multi-token phrase the rejected one lacks."""
    from rlhf_ext.trl import SegmentRewardTrainer

    args = _args(tmp_path, num_train_epochs=1, logging_steps=50, segment_cache_dir=str(tmp_path / "cache"))
    trainer = SegmentRewardTrainer(
        model=tiny_sft_path,
        args=args,
        train_dataset=toy_data["train"],
        eval_dataset=toy_data["test"],
        processing_class=toy_tok,
    )
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_accuracy"] > 0.9, after
    assert after["eval_accuracy"] > before
    # responses are split into several phrase-like segments (4 sentences of 2+ phrases each)
    assert 4 <= after["eval_segments_per_response"] <= 12
    assert after["eval_mean_segment_length"] > 2


def test_settings_saved_with_checkpoint(tmp_path, tiny_sft_path, toy_tok, prepared):
    from rlhf_ext.runtime.segment_data import load_segment_settings
    from rlhf_ext.trl import SegmentRewardTrainer

    args = _args(tmp_path, entropy_cutoff=1.5, tau=0.3, aggregation="sum", max_steps=1)
    trainer = SegmentRewardTrainer(model=tiny_sft_path, args=args, train_dataset=prepared, processing_class=toy_tok)
    trainer.train()
    trainer.save_model()
    settings = load_segment_settings(args.output_dir)
    assert settings == {
        "entropy_cutoff": 1.5,
        "aggregation": "sum",
        "tau": 0.3,
        "sft_model_name_or_path": tiny_sft_path,
    }
    # inf survives the JSON round trip
    args.entropy_cutoff = math.inf
    trainer.save_model()
    assert json.loads((tmp_path / "out" / "segment_config.json").read_text())["entropy_cutoff"] == "inf"
    assert math.isinf(load_segment_settings(args.output_dir)["entropy_cutoff"])


def test_margin_column_enters_the_loss(tmp_path, tiny_sft_path, toy_tok, prepared):
    from rlhf_ext.trl import SegmentPreferenceCollator, SegmentRewardTrainer

    trainer = SegmentRewardTrainer(
        model=tiny_sft_path, args=_args(tmp_path), train_dataset=prepared, processing_class=toy_tok
    )
    examples = [dict(prepared[i]) for i in range(4)]
    batch = SegmentPreferenceCollator(toy_tok.pad_token_id)(examples)
    with_margin = SegmentPreferenceCollator(toy_tok.pad_token_id)([{**e, "margin": 3.0} for e in examples])
    with torch.no_grad():
        plain = trainer.compute_loss(trainer.model, dict(batch))
        margin = trainer.compute_loss(trainer.model, dict(with_margin))
    assert margin.item() > plain.item() + 0.5  # a margin of 3 must make the BT loss clearly larger


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"entropy_cutoff": -1.0}, r"entropy_cutoff must be a number >= 0 \(or inf\); got -1.0"),
        ({"tau": 0.0}, "tau must be a number > 0; got 0.0"),
        ({"aggregation": "max"}, "aggregation must be one of"),
    ],
)
def test_bad_settings_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _args(tmp_path, **kwargs)


def test_dataset_without_chosen_column_is_named(tmp_path, tiny_sft_path, toy_tok):
    from rlhf_ext.trl import SegmentRewardTrainer

    ds = Dataset.from_list([{"prompt": "p", "answer": "a", "rejected": "b"}])
    with pytest.raises(ValueError, match="no column 'chosen'"):
        SegmentRewardTrainer(model=tiny_sft_path, args=_args(tmp_path), train_dataset=ds, processing_class=toy_tok)


def test_instantiated_model_needs_an_sft_model(tmp_path, toy_tok, toy_data):
    from rlhf_ext.trl import SegmentRewardTrainer
    from rlhf_ext.zoo.models import tiny_reward_model

    model = tiny_reward_model(toy_tok)
    with pytest.raises(ValueError, match="needs the SFT model"):
        SegmentRewardTrainer(
            model=model, args=_args(tmp_path), train_dataset=toy_data["train"], processing_class=toy_tok
        )
