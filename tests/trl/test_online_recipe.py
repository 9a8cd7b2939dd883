"""Online-DPO recipes (packaged YAML -> IterativeDPOConfig), the `rlhf-ext train online-dpo` CLI and the launcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from rlhf_ext.cli import main, recipe_path
from rlhf_ext.config import RecipeError, load_recipe
from rlhf_ext.pipelines.iterative_dpo import OnlineDPORecipe
from rlhf_ext.pipelines.iterative_dpo import trl_config as recipe_to_config

SMALL = [
    "online.num_iterations=1",
    "online.prompts_per_iteration=8",
    "online.num_generations=4",
    "online.max_completion_length=48",
    "online.eval_samples_per_prompt=1",
    "data.max_eval_prompts=4",
    "data.max_train_prompts=16",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_paper_recipe_has_paper_004_settings():
    recipe = load_recipe(OnlineDPORecipe, recipe_path("online_dpo_paper"))
    args = recipe_to_config(recipe)
    assert (args.num_iterations, args.prompts_per_iteration, args.num_generations) == (3, 20000, 8)
    assert args.temperatures == [0.7, 1.0] and args.selection_rule == "max_min" and args.reference == "sft"
    assert (args.learning_rate, args.num_train_epochs, args.beta, args.lr_scheduler_type) == (5e-7, 2.0, 0.1, "cosine")
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 128
    assert args.pair_data == "accumulate" and args.top_k == 0 and args.top_p == 1.0


@pytest.mark.parametrize("name", ["online_dpo_tiny", "online_dpo_async_tiny"])
def test_tiny_recipes_load(name):
    args = recipe_to_config(load_recipe(OnlineDPORecipe, recipe_path(name)))
    assert args.bf16 is False and args.gradient_checkpointing is False and args.report_to == []


def test_recipe_errors_name_the_key(tmp_path):
    with pytest.raises(RecipeError, match="did you mean 'online.num_generations'"):
        load_recipe(OnlineDPORecipe, recipe_path("online_dpo_tiny"), ["online.num_generation=4"])
    with pytest.raises(RecipeError, match="'online.num_samples' was renamed to 'online.num_generations'"):
        load_recipe(OnlineDPORecipe, recipe_path("online_dpo_tiny"), ["online.num_samples=4"])
    with pytest.raises(RecipeError, match="online.num_generations must be an integer >= 2"):
        load_recipe(OnlineDPORecipe, recipe_path("online_dpo_tiny"), ["online.num_generations=1"])
    with pytest.raises(RecipeError, match="exactly one of reward.model"):
        load_recipe(OnlineDPORecipe, recipe_path("online_dpo_tiny"), ["reward.model=runs/rm"])
    with pytest.raises(RecipeError, match="'online.selection_rule' must be one of"):
        load_recipe(OnlineDPORecipe, recipe_path("online_dpo_tiny"), ["online.selection_rule=best"])
    with pytest.raises(RecipeError, match="'online.selection' was renamed to 'online.selection_rule'"):
        load_recipe(OnlineDPORecipe, recipe_path("online_dpo_tiny"), ["online.selection=max_min"])


def test_cli_runs_the_tiny_recipe(tmp_path, tiny_sft_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(
        main, ["train", "online-dpo", "--config", "online_dpo_tiny", f"train.output_dir={out}", *SMALL]
    )
    assert result.exit_code == 0, result.output
    assert "online DPO finished (iterative)" in result.output and "policy     1" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_policy"] == str(out / "_policies/policy_001")
    bad = CliRunner().invoke(main, ["train", "online-dpo", "--config", "online_dpo_tiny", "online.bogus=1"])
    assert bad.exit_code == 2 and "unknown key 'online.bogus'" in bad.output


def test_launcher_runs_the_async_recipe(tmp_path, tiny_sft_path):
    """``python -m rlhf_ext.launch.train_online_dpo`` runs the async recipe and exits 0 (summary in summary.json)."""
    from rlhf_ext.launch import launch

    out = tmp_path / "async"
    with pytest.raises(SystemExit) as exit_info:
        launch("train_online_dpo", ["--config", "online_dpo_async_tiny", f"train.output_dir={out}", "train.max_steps=3",
                                    *SMALL[3:]])  # fmt: skip
    assert exit_info.value.code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "online" and summary["runner"]["staleness"] == {"0": 1, "1": 2}  # JSON keys
    assert Path(summary["final_policy"], "model.safetensors").is_file()


def test_run_iterations_runs_the_same_steps_as_train(tmp_path, tiny_sft_path):
    """The pipeline's Algorithm 2 loop and ``IterativeDPOTrainer.train()`` give the same pairs, evaluations and
    weights, and a run made by one is finished (nothing redone) by the other."""
    from safetensors.torch import load_file

    from rlhf_ext.runtime.iterations import run_iterations
    from rlhf_ext.trl import IterativeDPOConfig, IterativeDPOTrainer
    from rlhf_ext.trl.args import CPU_RUN
    from rlhf_ext.zoo.toy import keyphrase_gold_reward, toy_preference_dataset

    prompts = toy_preference_dataset(n_train=32, n_test=8, seed=0)["train"]

    def trainer(out, **kw):
        args = IterativeDPOConfig(
            output_dir=str(out),
            num_iterations=2,
            prompts_per_iteration=8,
            num_generations=4,
            max_completion_length=48,
            learning_rate=1e-4,
            num_train_epochs=1,
            per_device_train_batch_size=4,
            lr_scheduler_type="constant",
            max_length=160,
            eval_num_prompts=4,
            eval_samples_per_prompt=1,
            seed=0,
            **CPU_RUN,
            logging_steps=100,
            **kw,
        )
        return IterativeDPOTrainer(tiny_sft_path, keyphrase_gold_reward, args, prompts)

    looped = run_iterations(trainer(tmp_path / "loop"))
    trained = trainer(tmp_path / "train")
    out = trained.train()
    assert out.global_step > 0

    def pairs(root):
        return [p.read_text() for p in sorted((root / "pairs").glob("iter_*/pairs.jsonl"))]

    assert pairs(tmp_path / "loop") == pairs(tmp_path / "train") and len(pairs(tmp_path / "loop")) == 2
    assert [e["mean_reward"] for e in looped["eval"]] == [e["mean_reward"] for e in trained.summary["eval"]]
    a = load_file(str(Path(looped["final_policy"], "model.safetensors")))
    b = load_file(str(Path(trained.summary["final_policy"], "model.safetensors")))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert run_iterations(trainer(tmp_path / "train")) == json.loads(json.dumps(trained.summary))
    assert trainer(tmp_path / "loop").train().global_step == 0
    with pytest.raises(ValueError, match="per-batch"):
        run_iterations(trainer(tmp_path / "online", online_mode="online"))
