"""rlhf_ext.trl.args: the shared recipe-to-TrainingArguments helpers."""

from __future__ import annotations

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
