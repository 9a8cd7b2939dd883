"""The segment-PPO recipes of the dense reward sources (``model.reward_source``): one per source, each run the way a
user runs it on TRL, and mapped onto OpenRLHF's ``train_ppo_ray`` flags with the same normalizer."""

from __future__ import annotations

import math

import pytest

from rlhf_ext.config import RecipeError, load_recipe
from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe
from rlhf_ext.recipes import recipe_path

SOURCE_RECIPES = {
    "segment_ppo_rules_tiny": "rules:builtin:toy-keyphrase",
    "segment_ppo_callable_tiny": "rlhf_ext.zoo.toy:keyphrase_spans",
    "segment_ppo_prm_tiny": "prm:builtin:tiny-segment-rm",
    "segment_ppo_span_rm_tiny": "segment-rm:builtin:tiny-segment-rm",
    "segment_ppo_server_tiny": "http://127.0.0.1:5000",
}
#: 2 PPO steps of 8 rollouts, short completions, a small calibration set
SMALL = ["train.max_steps=2", "train.batch_size=8", "train.micro_batch_size=8", "data.max_completion_length=48",
         "data.max_calibration_pairs=32", "train.logging_steps=1"]  # fmt: skip


def test_every_source_has_a_recipe_and_a_reward_is_given_once():
    for name, spec in SOURCE_RECIPES.items():
        recipe = load_recipe(SegmentPPORecipe, recipe_path(name))
        assert recipe.model.reward_source == spec and recipe.model.reward_model is None, name
    with pytest.raises(RecipeError, match="'model': reward_model and reward_source are two rewards: set reward_model"):
        load_recipe(SegmentPPORecipe, None, ["model.reward_source=rules:r.yaml"])
    with pytest.raises(RecipeError, match="'model': no reward: set reward_model"):
        load_recipe(SegmentPPORecipe, None, ["model.reward_model=null"])


def test_keyphrase_spans_pays_the_first_key_and_weak_phrase():
    from rlhf_ext.zoo.toy import keyphrase_spans

    text = "The facts about x are backed by peer-reviewed evidence. Also mostly rumours passed around online."
    chat = [{"role": "assistant", "content": "No phrase. backed by peer-reviewed evidence"}]
    assert keyphrase_spans(["p", "p", "p"], [text, "nothing", chat]) == [[(22, 54, 1.0), (61, 96, -1.0)], [],
                                                                        [(11, 43, 1.0)]]  # fmt: skip


def _argv_pairs(argv):
    return {flag: value for flag, value in zip(argv, argv[1:]) if flag.startswith("--") and not value.startswith("--")}


@pytest.mark.slow
def test_openrlhf_run_of_a_source_recipe_scores_in_the_experience_maker_with_the_trl_normalizer(tmp_path, cache_dir):
    """The OpenRLHF side of a source recipe: no reward model flag, the source (builtin names resolved to paths) for
    the experience maker, and the driver's normalizer fitted on the source's spans identical to the one
    ``DensePPOTrainer`` fits on the same calibration pairs (both engines train on the same normalised rewards)."""
    from transformers import AutoTokenizer

    from rlhf_ext.openrlhf.train_ppo_ray import parse_ext_args
    from rlhf_ext.pipelines.segment_ppo import prepare_openrlhf_run, recipe_reward_source
    from rlhf_ext.runtime.calibration import load_normalizer
    from rlhf_ext.runtime.resources import Cluster
    from rlhf_ext.runtime.spans import fit_span_normalizer
    from rlhf_ext.zoo.builtins import resolve_dataset

    overrides = [*SMALL, "engine=openrlhf", "train.bf16=true", f"train.output_dir={tmp_path / 'run'}"]
    recipe = load_recipe(SegmentPPORecipe, recipe_path("segment_ppo_prm_tiny"), overrides)
    argv, paths = prepare_openrlhf_run(recipe, Cluster((0,)))
    pairs = _argv_pairs(argv)
    assert "--reward.model_name_or_path" not in argv and "--ext.reward_model_id" not in argv
    assert pairs["--ext.reward_source"] == f"prm:{cache_dir}/models/tiny-segment-rm"
    assert pairs["--ext.step_separator"] == ". " and "--critic.model_name_or_path" not in argv  # REINFORCE
    rest, ext = parse_ext_args(argv)
    assert ext["reward_source"] == pairs["--ext.reward_source"] and ext["normalizer"] == paths["normalizer"]
    tokenizer = AutoTokenizer.from_pretrained(recipe.model.sft_model)
    trl_side = fit_span_normalizer([recipe_reward_source(recipe.model)], tokenizer,
                                   resolve_dataset("builtin:toy-keyphrase")["train"], max_pairs=32)  # fmt: skip
    openrlhf_side = load_normalizer(paths["normalizer"])
    assert openrlhf_side.to_dict() == trl_side.to_dict()
    assert openrlhf_side.kind == "regression" and openrlhf_side.reward_model == "process_reward_model"


#: README's commands of the source recipes, run here as written
README_COMMANDS = {
    "segment_ppo_rules_tiny": "python -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_rules_tiny",
    "segment_ppo_callable_tiny": "python -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_callable_tiny",
    "segment_ppo_prm_tiny": "python -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_prm_tiny",
    "segment_ppo_span_rm_tiny": "python -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_span_rm_tiny",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(README_COMMANDS))
def test_source_recipe_trains_on_trl_as_the_readme_runs_it(name, tmp_path, cache_dir):
    """Each source's recipe, run by README's command from an empty directory: its 4 PPO steps on TRL, the dense
    reward has segments at every logged step, and the trained policy is written where the recipe says."""
    import json
    import shlex
    import subprocess
    import sys

    argv = shlex.split(README_COMMANDS[name])
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "runs" / name
    curve = json.loads((out / "ppo_metrics.json").read_text())["curve"]
    assert [c["step"] for c in curve] == [1, 2, 3, 4]
    for point in curve:
        assert all(math.isfinite(v) for v in point.values()), point
        assert point["segment/segments_per_response"] > 0
    assert (out / "model.safetensors").exists()
