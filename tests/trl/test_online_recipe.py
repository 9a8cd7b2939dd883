"""Online-DPO recipes (packaged YAML -> IterativeDPOConfig), the `rlhf-ext train online-dpo` CLI and the launcher."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlhf_ext.cli import main, recipe_path
from rlhf_ext.config import RecipeError, load_recipe
from rlhf_ext.pipelines.iterative_dpo import OnlineDPORecipe
from rlhf_ext.pipelines.iterative_dpo import trl_config as recipe_to_config

LAUNCHER = Path(__file__).resolve().parents[2] / "launch" / "train_online_dpo.py"
SMALL = [
    "online.iterations=1",
    "online.prompts_per_iteration=8",
    "online.num_samples=4",
    "online.max_new_tokens=48",
    "online.eval_samples_per_prompt=1",
    "data.max_eval_prompts=4",
    "data.max_train_prompts=16",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_paper_recipe_has_paper_004_settings():
    recipe = load_recipe(OnlineDPORecipe, recipe_path("online_dpo_paper"))
    args = recipe_to_config(recipe)
    assert (args.num_iterations, args.prompts_per_iteration, args.num_samples) == (3, 20000, 8)
    assert args.temperatures == [0.7, 1.0] and args.selection_rule == "max_min" and args.reference == "sft"
    assert (args.learning_rate, args.num_train_epochs, args.beta, args.lr_scheduler_type) == (5e-7, 2.0, 0.1, "cosine")
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 128
    assert args.pair_data == "accumulate" and args.top_k == 0 and args.top_p == 1.0


@pytest.mark.parametrize("name", ["online_dpo_tiny", "online_dpo_async_tiny"])
def test_tiny_recipes_load(name):
    args = recipe_to_config(load_recipe(OnlineDPORecipe, recipe_path(name)))
    assert args.bf16 is False and args.gradient_checkpointing is False and args.report_to == []


def test_recipe_errors_name_the_key(tmp_path):
    with pytest.raises(RecipeError, match="did you mean 'online.num_samples'"):
        load_recipe(OnlineDPORecipe, recipe_path("online_dpo_tiny"), ["online.num_sample=4"])
    with pytest.raises(RecipeError, match="online.num_samples must be an integer >= 2"):
        load_recipe(OnlineDPORecipe, recipe_path("online_dpo_tiny"), ["online.num_samples=1"])
    with pytest.raises(RecipeError, match="exactly one of reward.model"):
        load_recipe(OnlineDPORecipe, recipe_path("online_dpo_tiny"), ["reward.model=runs/rm"])
    with pytest.raises(RecipeError, match="'online.selection' must be one of"):
        load_recipe(OnlineDPORecipe, recipe_path("online_dpo_tiny"), ["online.selection=best"])


def test_cli_runs_the_tiny_recipe(tmp_path, tiny_sft_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(
        main, ["train", "online-dpo", "--config", "online_dpo_tiny", f"train.output_dir={out}", *SMALL]
    )
    assert result.exit_code == 0, result.output
    assert "online DPO finished (iterative)" in result.output and "policy     1" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_policy"] == str(out / "policies/policy_001")
    bad = CliRunner().invoke(main, ["train", "online-dpo", "--config", "online_dpo_tiny", "online.bogus=1"])
    assert bad.exit_code == 2 and "unknown key 'online.bogus'" in bad.output


def test_launcher_runs_the_async_recipe(tmp_path, tiny_sft_path):
    spec = importlib.util.spec_from_file_location("train_online_dpo", LAUNCHER)
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    out = tmp_path / "async"
    summary = launcher.main(
        ["--config", "online_dpo_async_tiny", f"train.output_dir={out}", "train.max_steps=3", *SMALL[3:]]
    )
    assert summary["mode"] == "online" and summary["runner"]["staleness"] == {0: 1, 1: 2}
    assert Path(summary["final_policy"], "model.safetensors").is_file()
