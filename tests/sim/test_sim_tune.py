"""``sim tune``: grid points, the tuning runs' recipes, the pick, and per-method overrides in a comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_ext.config import RecipeError, load_recipe
from rlhf_ext.sim.compare import SimRun
from rlhf_ext.sim.recipe import SimCompareRecipe
from rlhf_ext.sim.report import result_path
from rlhf_ext.sim.tune import grid_points, link_shared, point_name, point_recipe, summarise_tuning


def packaged(*overrides: str) -> SimCompareRecipe:
    from rlhf_ext.recipes import recipe_path

    return load_recipe(SimCompareRecipe, recipe_path("sim_compare"), overrides)


def test_grid_points_are_the_product_in_key_order():
    grid = {"ppo.learning_rate": [1e-4, 3e-4], "ppo.kl_coef": [0.01, 0.05, 0.1]}
    points = grid_points(grid)
    assert len(points) == 6
    assert points[0] == {"ppo.learning_rate": 1e-4, "ppo.kl_coef": 0.01}
    assert points[-1] == {"ppo.learning_rate": 3e-4, "ppo.kl_coef": 0.1}
    assert point_name(points[1]) == "learning_rate=0.0001,kl_coef=0.05"
    assert grid_points({}) == [{}]


def test_a_tuning_run_is_the_method_alone_at_the_point_on_validation_prompts(tmp_path):
    recipe = packaged(f"output_dir={tmp_path}", "method_overrides={segment_ppo: [ppo.learning_rate=0.5]}")
    sub = point_recipe(recipe, "segment_ppo", {"ppo.learning_rate": 1e-3, "ppo.kl_coef": 0.01}, seed=0)
    assert sub.methods == ["segment_ppo"] and sub.seeds == [0] and sub.eval.split == "validation"
    assert sub.ppo.learning_rate == 1e-3 and sub.ppo.kl_coef == 0.01  # the point, not the recipe's override
    assert sub.method_overrides == {}
    assert Path(sub.output_dir) == tmp_path / "tuning" / "segment_ppo" / "learning_rate=0.001,kl_coef=0.01"


def test_shared_artefacts_are_links_to_the_main_directory(tmp_path):
    main, sub = tmp_path / "main", tmp_path / "main" / "tuning" / "m" / "p"
    for name in ("data", "sft", "seed-0/feedback", "seed-0/rm_segment"):
        (main / name).mkdir(parents=True)
    link_shared(main, sub, 0)
    assert (sub / "sft").resolve() == (main / "sft").resolve() and (sub / "seed-0" / "rm_segment").is_symlink()
    assert not (sub / "base").exists()  # nothing to link yet: the run builds (or fails on) it itself


def _result(root: Path, method: str, seed: int, lc: float, win: float) -> None:
    path = result_path(root, method, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"seed": seed, "lc_win_rate": lc, "win_rate": win, "gold_mean": 0.0, "kl": 1.0,
                                "avg_length_chars": 100.0, "segments_per_response": 5.0}))  # fmt: skip


def test_the_pick_is_the_best_mean_length_controlled_win_rate_not_the_raw_one(tmp_path):
    recipe = packaged(
        f"output_dir={tmp_path}", "tuning.seeds=[0,4]", "tuning.methods=[bandit_ppo]",
        "tuning.grid={ppo.learning_rate: [0.001, 0.002]}",
    )  # fmt: skip
    points = grid_points(recipe.tuning.grid)
    roots = [Path(point_recipe(recipe, "bandit_ppo", p, 0).output_dir) for p in points]
    _result(roots[0], "bandit_ppo", 0, lc=0.60, win=0.90)  # long responses: high raw, lower LC
    _result(roots[0], "bandit_ppo", 4, lc=0.62, win=0.88)
    _result(roots[1], "bandit_ppo", 0, lc=0.70, win=0.70)
    _result(roots[1], "bandit_ppo", 4, lc=0.64, win=0.66)
    summary = summarise_tuning(recipe)["methods"]["bandit_ppo"]
    assert summary["picked"] == {"ppo.learning_rate": 0.002}
    assert summary["overrides"] == ["ppo.learning_rate=0.002"]
    assert summary["points"][1]["lc_win_rate"] == pytest.approx(0.67)
    assert summary["points"][0]["seeds"] == [0, 4]


def test_method_overrides_reach_only_their_method(tmp_path):
    recipe = packaged(f"output_dir={tmp_path}", "method_overrides={segment_ppo: [ppo.kl_coef=0.2]}")
    run = SimRun(recipe)
    assert run.for_method("segment_ppo").recipe.ppo.kl_coef == 0.2
    assert run.for_method("bandit_ppo").recipe.ppo.kl_coef == recipe.ppo.kl_coef
    assert run.for_method("bandit_ppo") is run
    with pytest.raises(RecipeError, match="method_overrides.dpo must be a list of key=value overrides"):
        packaged("method_overrides={dpo: [beta]}")
    with pytest.raises(RecipeError, match="unknown method"):
        packaged("method_overrides={rlhf: [x=1]}")


def test_tuned_comparison_runs_each_method_at_its_picked_point(tmp_path):
    from rlhf_ext.config import RecipeError
    from rlhf_ext.sim.tune import apply_tuning

    recipe = packaged(f"output_dir={tmp_path}", "method_overrides={dpo: [dpo.beta=0.3]}")
    with pytest.raises(RecipeError, match="does not exist; run `rlhf-ext sim tune --out"):
        apply_tuning(recipe, tmp_path)
    (tmp_path / "tuning").mkdir()
    picks = {"segment_ppo": {"picked": {"ppo.kl_coef": 0.2}, "overrides": ["ppo.kl_coef=0.2"]},
             "token_ppo": {"picked": None, "overrides": []}}  # fmt: skip
    (tmp_path / "tuning" / "tuning.json").write_text(json.dumps({"methods": picks}))
    tuned = apply_tuning(recipe, tmp_path)
    assert tuned.method_overrides == {"dpo": ["dpo.beta=0.3"], "segment_ppo": ["ppo.kl_coef=0.2"]}
    assert SimRun(tuned).for_method("segment_ppo").recipe.ppo.kl_coef == 0.2


def test_compare_with_tuning_runs_in_the_directory_sim_tune_used(tmp_path):
    """The recipe's workflow: `sim tune --out X`, then `sim compare --tuning X --out X`. The picks are new
    per-method settings, not a changed comparison: the directory that holds the shared SFT model accepts them."""
    from rlhf_ext.sim.tune import apply_tuning

    recipe = packaged(f"output_dir={tmp_path}")
    SimRun(recipe).check_directory()  # what `sim tune` does with the main directory
    (tmp_path / "tuning").mkdir()
    picks = {"segment_ppo": {"picked": {"ppo.kl_coef": 0.2}, "overrides": ["ppo.kl_coef=0.2"]}}
    (tmp_path / "tuning" / "tuning.json").write_text(json.dumps({"methods": picks}))
    SimRun(apply_tuning(recipe, tmp_path)).check_directory()


def test_a_method_that_ran_is_not_rerun_silently_at_other_overrides(tmp_path):
    from rlhf_ext.sim.compare import record_method_overrides

    tuned = packaged(f"output_dir={tmp_path}", "method_overrides={segment_ppo: [ppo.kl_coef=0.2]}")
    run = SimRun(tuned)
    record_method_overrides(run.check_directory(), tuned, "segment_ppo")  # what training segment_ppo records
    SimRun(tuned).check_directory()  # the same overrides: reused
    other = packaged(f"output_dir={tmp_path}", "method_overrides={segment_ppo: [ppo.kl_coef=0.5]}")
    with pytest.raises(RecipeError, match=r"segment_ppo was run here with method_overrides \['ppo.kl_coef=0.2'\]"):
        SimRun(other).check_directory()
    # a method that has not run here may take any overrides; one that is not run now is not checked
    both = "method_overrides={segment_ppo: [ppo.kl_coef=0.2], token_ppo: [ppo.kl_coef=0.5]}"
    SimRun(packaged(f"output_dir={tmp_path}", both)).check_directory()
    SimRun(packaged(f"output_dir={tmp_path}", "methods=[sft]")).check_directory()


def test_a_directory_from_before_per_method_records_keeps_its_results(tmp_path):
    """Directories whose recipe.json fingerprinted method_overrides with the rest: the overrides of every method
    with results become its record, and the directory is reused."""
    from rlhf_ext.runtime.io import atomic_write_json
    from rlhf_ext.runtime.rundir import fingerprint
    from rlhf_ext.sim.compare import recipe_settings

    tuned = packaged(f"output_dir={tmp_path}", "method_overrides={segment_ppo: [ppo.kl_coef=0.2]}")
    old = {**recipe_settings(tuned), "method_overrides": {"segment_ppo": ["ppo.kl_coef=0.2"]}}
    atomic_write_json(tmp_path / "recipe.json", {"kind": "sim-compare", "fingerprint": fingerprint(old),
                                                 "settings": old})  # fmt: skip
    _result(tmp_path, "segment_ppo", 1, lc=0.5, win=0.5)
    _result(tmp_path, "bandit_ppo", 1, lc=0.5, win=0.5)
    (tmp_path / "seed-2" / "token_ppo").mkdir(parents=True)  # a checkpoint whose evaluation never finished
    SimRun(tuned).check_directory()
    assert result_path(tmp_path, "segment_ppo", 1).exists()
    for method in ("bandit_ppo", "token_ppo"):
        changed = f"method_overrides={{segment_ppo: [ppo.kl_coef=0.2], {method}: [ppo.kl_coef=0.5]}}"
        with pytest.raises(RecipeError, match=rf"{method} was run here with method_overrides \[\]"):
            SimRun(packaged(f"output_dir={tmp_path}", changed)).check_directory()
    SimRun(
        packaged(f"output_dir={tmp_path}", "method_overrides={dpo: [dpo.beta=0.5]}", "methods=[dpo]")
    ).check_directory()


def test_a_method_with_its_own_grid_is_tuned_and_picked_on_it(tmp_path):
    """DPO has no ``ppo.*`` keys: ``tuning.method_grids.dpo`` replaces the shared grid for it (the packaged recipe
    gives it the PPO grid's shape, 3 learning rates x 2 strengths of the pull to the SFT model), and its pick is the
    best mean LC win rate over its own points."""
    recipe = packaged(f"output_dir={tmp_path}")
    assert recipe.tuning.methods[-1] == "dpo" and recipe.tuning.grid_of("bandit_ppo") is recipe.tuning.grid
    dpo_points = grid_points(recipe.tuning.grid_of("dpo"))
    assert dpo_points[0] == {"dpo.train.learning_rate": 1e-4, "dpo.beta": 0.1} and len(dpo_points) == 6
    assert grid_points(recipe.tuning.grid_of("chunk_ppo"))[0] == {"ppo.learning_rate": 1e-4, "ppo.kl_coef": 0.05}
    sub = point_recipe(recipe, "dpo", dpo_points[5], 0)
    assert (sub.dpo.train.learning_rate, sub.dpo.beta, sub.methods) == (1e-3, 0.3, ["dpo"])
    for point, lc in zip(dpo_points, [0.50, 0.55, 0.60, 0.58, 0.70, 0.65]):
        _result(Path(point_recipe(recipe, "dpo", point, 0).output_dir), "dpo", 0, lc=lc, win=0.5)
    summary = summarise_tuning(recipe)
    assert summary["methods"]["dpo"]["overrides"] == ["dpo.train.learning_rate=0.001", "dpo.beta=0.1"]
    assert summary["methods"]["bandit_ppo"]["points"] == []  # no result yet: nothing picked, nothing invented
    assert summary["method_grids"] == {"dpo": recipe.tuning.grid_of("dpo")}
    with pytest.raises(RecipeError, match="unknown method"):
        packaged("tuning.method_grids={rlhf: {dpo.beta: [0.1]}}")
    with pytest.raises(RecipeError, match=r"tuning.method_grids.dpo.dpo.beta must be a non-empty list"):
        packaged("tuning.method_grids={dpo: {dpo.beta: []}}")
    with pytest.raises(RecipeError, match=r"tuning.grid.ppo.kl_coef must be a non-empty list"):
        packaged("tuning.grid={ppo.kl_coef: []}")


def test_tuning_again_after_the_tuned_comparison_reuses_the_directory(tmp_path):
    """`sim tune --out X`, `sim compare --tuning X --out X`, then `sim tune --out X` again (a method added to the
    tuning, a grid widened): the comparison's methods ran in X at their picks, and tuning runs none of them there, so
    it does not refuse the directory for the recipe's own (empty) method_overrides."""
    from rlhf_ext.sim.compare import record_method_overrides
    from rlhf_ext.sim.tune import apply_tuning, shared_run

    recipe = packaged(f"output_dir={tmp_path}")
    shared_run(recipe).check_directory()  # the first `sim tune`
    (tmp_path / "tuning").mkdir()
    picks = {"bandit_ppo": {"picked": {"ppo.kl_coef": 0.2}, "overrides": ["ppo.kl_coef=0.2"]}}
    (tmp_path / "tuning" / "tuning.json").write_text(json.dumps({"methods": picks}))
    tuned = apply_tuning(recipe, tmp_path)
    record_method_overrides(SimRun(tuned).check_directory(), tuned, "bandit_ppo")  # the comparison ran bandit_ppo
    with pytest.raises(RecipeError, match=r"bandit_ppo was run here with method_overrides \['ppo.kl_coef=0.2'\]"):
        SimRun(recipe).check_directory()  # an untuned comparison of it would mix results: refused
    shared = shared_run(recipe)
    shared.check_directory()  # tuning again: accepted
    assert shared.recipe.seeds == recipe.tuning.seeds and shared.recipe.methods == ["sft"]
