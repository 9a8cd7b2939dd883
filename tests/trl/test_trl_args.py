"""rlhf_ext.trl.args: the shared recipe-to-TrainingArguments helpers."""

from __future__ import annotations

from rlhf_ext.trl.args import last_checkpoint


def test_last_checkpoint_picks_the_newest_step_and_respects_resume(tmp_path):
    assert last_checkpoint(tmp_path / "missing") is None
    assert last_checkpoint(tmp_path) is None  # no checkpoints yet
    for step in (2, 10, 9):
        (tmp_path / f"checkpoint-{step}").mkdir()
    assert last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")  # numeric, not lexicographic order
    assert last_checkpoint(tmp_path, resume=False) is None
