"""The task-sequence runner with real DPO on the tiny model: the CLI end to end, and a killed sequence resumed to
exactly the uninterrupted result (matrix and final weights)."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

OVERRIDES = [
    "data.num_tasks=2",
    "data.max_train_samples=8",
    "data.max_test_samples=6",
    "data.max_length=96",
    "train.batch_size=4",
    "train.micro_batch_size=4",
    "train.max_steps=2",
    "train.logging_steps=1",
    "continual.kl_coef=0.5",
]


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_cli_run_and_resumed_run_equal_the_uninterrupted_one(tiny_sft_path, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from rlhf_ext.cli import main, recipe_path
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.continual import ContinualRunner
    from rlhf_ext.pipelines.continual_recipe import ContinualRecipe
    from rlhf_ext.pipelines.continual_stages import DPOPolicyStage

    model = f"model.sft_model={tiny_sft_path}"
    full_dir = tmp_path / "full"
    result = CliRunner().invoke(
        main,
        ["train", "continual", "--config", "continual_dpo_tiny", model, f"output_dir={full_dir}", *OVERRIDES],
    )
    assert result.exit_code == 0, result.output
    assert "after 01" in result.output and "backward transfer" in result.output
    full = json.loads((full_dir / "performance.json").read_text())
    assert full["finished_tasks"] == 2 and (full_dir / "performance.png").exists()
    for row in full["performance_matrix"]:
        assert all(0.0 <= v <= 1.0 for v in row)
    assert full["kl_coefs"] == [0.0, 0.5]
    logged_kl = json.loads((full_dir / "task_01" / "result.json").read_text())["metrics"]["kl_to_previous"]
    assert len(logged_kl) == 2 and logged_kl[0] == pytest.approx(0.0, abs=1e-6)  # step 1: policy == snapshot

    recipe = load_recipe(ContinualRecipe, recipe_path("continual_dpo_tiny"), [model, *OVERRIDES])
    recipe.output_dir = str(tmp_path / "killed")

    class KilledDuringTask1(DPOPolicyStage):
        def run_task(self, task, test_sets):
            if task.index == 1:
                (task.work_dir / "trainer").mkdir(parents=True)  # what a kill mid-training leaves behind
                raise KeyboardInterrupt
            return super().run_task(task, test_sets)

    with pytest.raises(KeyboardInterrupt):
        ContinualRunner(recipe, policy_stage=KilledDuringTask1(recipe)).run()
    killed_dir = tmp_path / "killed"
    snapshot0 = (killed_dir / "task_00" / "policy" / "model.safetensors").stat().st_mtime_ns
    resumed = ContinualRunner(recipe).run()
    assert (killed_dir / "task_00" / "policy" / "model.safetensors").stat().st_mtime_ns == snapshot0
    assert resumed["performance_matrix"] == full["performance_matrix"]
    assert resumed["metrics"] == full["metrics"]
    for name in ("task_00", "task_01"):
        a, b = _weights(full_dir / name / "policy"), _weights(killed_dir / name / "policy")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_per_task_reward_model_stage(tiny_sft_path, tmp_path):
    """reward_model.enabled trains a Bradley-Terry reward model per task, saved next to the policy snapshot, and
    scores it on every task's test split."""
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.continual import run_continual
    from rlhf_ext.pipelines.continual_recipe import ContinualRecipe
    from rlhf_ext.recipes import recipe_path

    overrides = [o for o in OVERRIDES if not o.startswith("data.num_tasks")]
    rm_train = ["batch_size=4", "micro_batch_size=4", "max_steps=2", "learning_rate=1e-3"]
    recipe = load_recipe(
        ContinualRecipe,
        recipe_path("continual_dpo_tiny"),
        [
            f"model.sft_model={tiny_sft_path}",
            f"output_dir={tmp_path}",
            "plots=false",
            "data.num_tasks=1",
            *overrides,
            "reward_model.enabled=true",
            *(f"reward_model.train.{o}" for o in rm_train),
        ],
    )
    summary = run_continual(recipe)
    rm_dir = tmp_path / "task_00" / "reward_model"
    assert (rm_dir / "config.json").exists() and (tmp_path / "task_00" / "policy" / "config.json").exists()
    (acc,) = summary["reward_model_accuracy"][0]
    assert 0.0 <= acc <= 1.0
    record = json.loads((tmp_path / "task_00" / "reward_model.json").read_text())
    assert record["path"] == str(rm_dir) and record["scores"] == [acc]
