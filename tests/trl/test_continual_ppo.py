"""CPPO-style continual PPO through the task-sequence runner (paper 000, Eq. 7) at a tiny size."""

from __future__ import annotations

import json
import math

from rlhf_ext.config import load_recipe
from rlhf_ext.pipelines.continual import run_continual
from rlhf_ext.pipelines.continual_recipe import ContinualRecipe
from rlhf_ext.recipes import recipe_path

SMALL = [
    "data.num_tasks=2", "data.max_train_samples=32", "data.max_test_samples=8", "ppo.steps_per_task=2",
    "ppo.batch_size=8", "ppo.max_completion_length=32", "ppo.eval_prompts=8", "reward_model.train.epochs=1",
    "plots=false",
]  # fmt: skip


def test_continual_ppo_applies_the_kl_to_the_previous_task_only_after_the_first(tmp_path, cache_dir, tiny_sft_path):
    out = tmp_path / "cppo"
    recipe = load_recipe(ContinualRecipe, recipe_path("continual_ppo_tiny"), [*SMALL, f"output_dir={out}"])
    summary = run_continual(recipe)
    assert summary["finished_tasks"] == 2 and summary["kl_coefs"] == [0.0, 1.0]
    matrix = json.loads((out / "performance.json").read_text())["performance_matrix"]
    assert len(matrix) == 2 and all(len(row) == 2 for row in matrix)
    assert all(math.isfinite(v) for row in matrix for v in row)
    assert (out / "task_01" / "policy" / "config.json").exists()
    first = json.loads((out / "task_00" / "result.json").read_text())["metrics"]["kl_to_previous"]
    second = json.loads((out / "task_01" / "result.json").read_text())["metrics"]["kl_to_previous"]
    assert first == []  # task 0 has no predecessor: plain PPO, no frozen copy
    assert second and all(k >= 0 for k in second)  # the Eq. 7 term ran against task 0's snapshot
