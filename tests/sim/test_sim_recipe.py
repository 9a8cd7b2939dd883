"""The sim-compare recipe (packaged YAML), its fingerprint, and the summary statistics (mean ± s.e. over seeds)."""

from __future__ import annotations

import json
import math

import pytest

from rlhf_ext.config import RecipeError, load_recipe
from rlhf_ext.sim.compare import recipe_fingerprint
from rlhf_ext.sim.recipe import METHODS, SimCompareRecipe
from rlhf_ext.sim.report import markdown_table, result_path, summarise


def packaged(*overrides: str) -> SimCompareRecipe:
    from rlhf_ext.recipes import recipe_path

    return load_recipe(SimCompareRecipe, recipe_path("sim_compare"), overrides)


def test_packaged_recipe_lists_every_method_and_three_seeds_other_than_the_tuning_seed():
    r = packaged()
    assert r.methods == list(METHODS) and r.seeds == [1, 2, 3]
    assert not set(r.tuning.seeds) & set(r.seeds)  # settings are picked on seeds the comparison does not report
    assert set(r.tuning.methods) == {"bandit_ppo", "segment_ppo", "chunk_ppo", "token_ppo", "dpo"}
    assert r.feedback.pool.flip_prob == 0.25 and r.eval.judge == "pool"
    assert r.feedback.pairs == "sft_samples" and r.task.phrase_credit == "partial"  # AlpacaFarm's protocol, graded gold
    assert {"bandit_ppo", "segment_ppo", "chunk_ppo", "token_ppo"} <= set(r.methods)  # one `ppo` section: one budget


def test_named_budget_applies_its_overrides_under_the_command_line():
    from rlhf_ext.recipes import recipe_path
    from rlhf_ext.sim.recipe import load_compare_recipe

    path = recipe_path("sim_compare")
    default, full = load_compare_recipe(path), load_compare_recipe(path, budget="full")
    assert full.output_dir != default.output_dir  # a full run never mixes with the default run's results
    assert full.task.num_samples > default.task.num_samples and full.ppo.max_steps > default.ppo.max_steps
    assert recipe_fingerprint(full) != recipe_fingerprint(default)
    # the command line still wins over the budget
    assert load_compare_recipe(path, ["ppo.max_steps=3"], budget="full").ppo.max_steps == 3
    with pytest.raises(RecipeError, match="unknown budget 'huge'; the recipe defines: full, gate, smoke"):
        load_compare_recipe(path, budget="huge")
    with pytest.raises(RecipeError, match="budgets.x must be a list of key=value overrides"):
        load_compare_recipe(path, ["budgets={x: [3]}"])


def test_recipe_errors_name_the_key():
    with pytest.raises(RecipeError, match="unknown method"):
        packaged("methods=[sft,rlhf]")
    with pytest.raises(RecipeError, match="sft_fraction"):
        packaged("task.sft_fraction=0.7")
    with pytest.raises(RecipeError, match="did you mean 'dpo.beta'"):
        packaged("dpo.betta=0.2")
    with pytest.raises(RecipeError, match="flip_prob"):
        packaged("feedback.pool.flip_prob=0.9")


def test_fingerprint_ignores_only_the_free_keys():
    base = recipe_fingerprint(packaged())
    assert recipe_fingerprint(packaged("seeds=[5]", "methods=[dpo]", "output_dir=x", "threads=2")) == base
    assert recipe_fingerprint(packaged("tuning.seeds=[7]")) == base  # tuning runs live in their own directories
    # a method's overrides are checked per method (test_sim_tune.py), so tuned picks can join the directory
    assert recipe_fingerprint(packaged("method_overrides={dpo: [dpo.beta=0.2]}")) == base
    assert recipe_fingerprint(packaged("dpo.beta=0.2")) != base
    assert recipe_fingerprint(packaged("task.num_samples=100")) != base


def test_a_worker_processes_recipe_has_the_fingerprint_of_the_command_line_one(tmp_path):
    """``workers > 1`` hands each worker a copy made by ``to_dict``/``from_dict``; the defaults and the integers
    written for float knobs (``num_train_epochs: 1``) must come back as the same numbers, or every worker refuses the
    run directory the command just created (CI: "holds a comparison with different settings")."""
    from rlhf_ext.config import from_dict, to_dict

    path = tmp_path / "sim.yaml"
    path.write_text(
        "task: {source: toy}\nreward_model: {train: {num_train_epochs: 1}}\ndpo: {train: {learning_rate: 1}}\n"
    )
    recipe = load_recipe(SimCompareRecipe, str(path), ["workers=2"])
    assert recipe_fingerprint(from_dict(SimCompareRecipe, {**to_dict(recipe), "seeds": [1]})) == recipe_fingerprint(
        recipe
    )


def test_a_changed_number_type_is_named_among_the_changed_keys():
    from rlhf_ext.runtime.rundir import changed_keys

    assert changed_keys({"a": {"epochs": 1}, "b": [1]}, {"a": {"epochs": 1.0}, "b": [1.0]}) == ["a.epochs", "b"]


def test_summary_is_mean_and_standard_error_over_seeds(tmp_path):
    r = packaged(f"output_dir={tmp_path}", "methods=[sft,dpo]", "seeds=[0,1,2]")
    base = dict(stderr=0.04, gold_mean=0.0, kl=0.0, avg_length_chars=100.0, num_comparisons=128, num_prompts=64,
                samples_per_prompt=2, train_seconds=1.0, eval_seconds=1.0)  # fmt: skip
    for seed, wr in ((0, 0.5), (1, 0.7)):  # seed 2 of dpo not finished: summarised over the finished ones
        path = result_path(tmp_path, "dpo", seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        result = {**base, "seed": seed, "win_rate": wr, "gold_mean": 2 * wr, "lc_win_rate": wr - 0.1}
        path.write_text(json.dumps(result))
    summary = summarise(r)
    (row,) = summary["methods"]  # sft has no results and is left out
    assert row["method"] == "dpo" and row["seeds"] == [0, 1]
    assert row["win_rate"] == pytest.approx(0.6) and row["win_rate_se"] == pytest.approx(0.1)
    assert row["gold_mean"] == pytest.approx(1.2) and row["gold_mean_se"] == pytest.approx(0.2)
    assert math.isnan(summarise(packaged(f"output_dir={tmp_path}", "methods=[dpo]", "seeds=[1]"))["methods"][0][
        "win_rate_se"])  # fmt: skip
    table = markdown_table(summary)
    assert "| dpo | 0.600 ± 0.100 | 0.500 ± 0.100 | +1.20 ± 0.20 |" in table and "46.8" in table


def test_cli_budget_option_reaches_the_recipe():
    from click.testing import CliRunner

    from rlhf_ext.cli import main

    res = CliRunner().invoke(main, ["sim", "compare", "--config", "sim_compare", "--budget", "huge"])
    assert res.exit_code == 2 and "unknown budget 'huge'; the recipe defines: full, gate, smoke" in res.output
