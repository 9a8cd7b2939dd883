"""Nothing stuck: the real commands killed (SIGKILL) at their riskiest point, then rerun: the rerun succeeds and, where
the command is deterministic, its result is identical to an uninterrupted run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.kill_points import run_cli, was_killed

pytestmark = pytest.mark.usefixtures("cache_dir")

ONLINE_DPO = [
    "train", "online-dpo", "--config", "online_dpo_tiny", "online.num_iterations=2", "online.prompts_per_iteration=8",
    "online.num_generations=4", "online.max_completion_length=24", "data.max_eval_prompts=4",
    "online.eval_samples_per_prompt=1", "train.batch_size=4", "train.micro_batch_size=4", "train.num_train_epochs=1",
    "train.logging_steps=100",
]  # fmt: skip
SEGMENT_RM = [
    "train", "segment-rm", "--config", "segment_rm_tiny", "data.max_train_samples=24", "data.max_eval_samples=8",
    "data.max_length=64", "train.batch_size=8", "train.micro_batch_size=8", "train.max_steps=3", "train.save_steps=1",
]  # fmt: skip


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    assert [name for name in wa if not torch.equal(wa[name], wb[name])] == []


def _hidden(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*") if p.name != ".gitignore")


@pytest.mark.slow
def test_online_dpo_killed_after_saving_a_policy_before_recording_it_resumes_to_the_same_weights(
    tmp_path, tiny_sft_path
):
    """Killed with the first trained policy saved and state.json not updated yet (checkpoints of its DPO run still
    there): every rerun used to fail with `OSError: Directory not empty` (renaming the policy it trained again onto
    the saved one)."""
    args = [*ONLINE_DPO, f"policy.sft_model={tiny_sft_path}", "train.save_steps=1"]
    full_dir, out = tmp_path / "full", tmp_path / "killed"
    full = run_cli([*args, f"train.output_dir={full_dir}"])
    assert full.returncode == 0, full.stderr[-3000:]
    policies = sorted(p.name for p in (full_dir / "_policies").iterdir())
    assert policies, "no iteration trained a policy: pick settings where some prompts' responses differ in reward"

    killed = run_cli([*args, f"train.output_dir={out}"], fault_at="committed:policy_*")
    assert was_killed(killed), killed.stderr[-3000:]
    saved = json.loads((out / "state.json").read_text())["policies"] if (out / "state.json").exists() else {}
    assert str(out / "_policies" / policies[0]) not in saved.values() and (out / "_policies" / policies[0]).is_dir()

    rerun = run_cli([*args, f"train.output_dir={out}"])
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "online DPO finished" in rerun.stdout
    assert sorted(p.name for p in (out / "_policies").iterdir()) == policies
    for name in policies:
        _assert_same_weights(out / "_policies" / name, full_dir / "_policies" / name)
    summary, expected = (json.loads((d / "summary.json").read_text().replace(str(d), "RUN")) for d in (out, full_dir))
    assert summary == expected  # the same pairs, evaluations and final policy
    assert _hidden(out) == [] and not list((out / "iterations").rglob("checkpoint-*"))


@pytest.mark.slow
def test_segment_rm_killed_while_writing_a_checkpoint_resumes_from_the_last_complete_one(tmp_path, tiny_sft_path):
    """Killed while checkpoint-2 was written (its trainer_state.json cut halfway): every rerun used to fail with
    "Can't find a valid checkpoint". It resumes from checkpoint-1 and ends with the uninterrupted run's weights."""
    args = [*SEGMENT_RM, f"model.sft_model={tiny_sft_path}", f"train.segment_cache_dir={tmp_path / 'segments'}"]
    full = run_cli([*args, f"train.output_dir={tmp_path / 'full'}"])
    assert full.returncode == 0, full.stderr[-3000:]

    out = tmp_path / "killed"
    killed = run_cli([*args, f"train.output_dir={out}"], truncate_checkpoint=2)
    assert was_killed(killed), killed.stderr[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]

    rerun = run_cli([*args, f"train.output_dir={out}"])
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "segment reward model trained" in rerun.stdout
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    _assert_same_weights(out, tmp_path / "full")
    _assert_same_weights(out / "checkpoint-2", tmp_path / "full" / "checkpoint-2")


@pytest.mark.slow
def test_segment_rm_rerun_after_the_newest_checkpoints_weights_were_truncated_resumes_from_the_one_before(
    tmp_path, tiny_sft_path
):
    """Issue 23 item 9: a truncated ``model.safetensors`` in the newest checkpoint (its trainer_state.json intact)
    made every rerun fail with a traceback. The rerun falls back to checkpoint-2, says so, and ends with the weights
    of the run that was never damaged — and (item 12) metrics.json counts the tokens of every step, not only of the
    steps after the resume."""
    args = [*SEGMENT_RM, f"model.sft_model={tiny_sft_path}", f"train.segment_cache_dir={tmp_path / 'segments'}"]
    out = tmp_path / "run"
    first = run_cli([*args, f"train.output_dir={out}"])
    assert first.returncode == 0, first.stderr[-3000:]
    reference = {k: v.clone() for k, v in _weights(out).items()}
    tokens = json.loads((out / "metrics.json").read_text())["eval"]["eval_num_tokens"]
    weights = out / "checkpoint-3" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    rerun = run_cli([*args, f"train.output_dir={out}"])
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"{out / 'checkpoint-3'} cannot be resumed from (model.safetensors has" in rerun.stderr
    assert f"resuming from {out / 'checkpoint-2'}, the newest checkpoint that loads" in rerun.stderr
    final = _weights(out)
    assert [name for name in reference if not torch.equal(reference[name], final[name])] == []
    assert json.loads((out / "metrics.json").read_text())["eval"]["eval_num_tokens"] == tokens > 0
