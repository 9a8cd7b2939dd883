"""rlhf_ext.trl.args: the shared recipe-to-TrainingArguments helpers."""

from __future__ import annotations

import pytest

from rlhf_ext.trl.args import last_checkpoint


def test_last_checkpoint_picks_the_newest_step_and_respects_resume(tmp_path):
    assert last_checkpoint(tmp_path / "missing") is None
    assert last_checkpoint(tmp_path) is None  # no checkpoints yet
    for step in (2, 10, 9):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    assert last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")  # numeric, not lexicographic order
    assert last_checkpoint(tmp_path, resume=False) is None


def test_activation_checkpointing_uses_the_name_transformers_has(monkeypatch):
    """transformers 5.15 knows ``gradient_checkpointing``; 5.2x renamed it ``activation_checkpointing`` and warns on
    the old name, so the keyword follows the installed ``TrainingArguments``."""
    import dataclasses

    from transformers import TrainingArguments

    from rlhf_ext.trl.args import activation_checkpointing

    fields = dict(TrainingArguments.__dataclass_fields__)
    fields.pop("activation_checkpointing", None)
    monkeypatch.setattr(TrainingArguments, "__dataclass_fields__", fields)
    assert activation_checkpointing(True) == {"gradient_checkpointing": True}
    monkeypatch.setattr(
        TrainingArguments, "__dataclass_fields__", {**fields, "activation_checkpointing": dataclasses.field()}
    )
    assert activation_checkpointing(False) == {"activation_checkpointing": False}


@pytest.mark.parametrize("name", ["DensePPOConfig", "SegmentRewardConfig", "IterativeDPOConfig", "ContinualDPOConfig"])
def test_an_unset_bf16_follows_the_hardware_and_an_explicit_one_is_kept(name, tmp_path, monkeypatch):
    """TRL defaults ``bf16`` to True, which transformers refuses on a machine without a bf16 GPU ("Your setup doesn't
    support bf16/gpu": the README's snippets failed on CPU). Unset: False there and TRL's True where a bf16 GPU is."""
    import transformers.utils

    import rlhf_ext.trl as ext

    config = getattr(ext, name)
    assert config(output_dir=str(tmp_path)).bf16 is False
    assert config(output_dir=str(tmp_path), bf16=True, use_cpu=True).bf16 is True
    monkeypatch.setattr(transformers.utils, "is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    assert config(output_dir=str(tmp_path), use_cpu=True).bf16 is True  # TRL's default where the hardware has bf16
