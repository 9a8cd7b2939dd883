"""PPO knobs outside their domain are refused where they are declared, and the recipe loader and the command line
report them in one line naming the key and its valid range (gamma 5 used to give NaN weights and an unrelated
``torch.multinomial`` traceback; a negative clip trained silently)."""

from __future__ import annotations

import math

import pytest
from click.testing import CliRunner

from rlhf_ext.algos.ppo import PPOKnobs
from rlhf_ext.cli import main
from rlhf_ext.config import RecipeError, load_recipe
from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe
from rlhf_ext.recipes import recipe_path


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gamma": 5.0}, "gamma must be a number in [0, 1]; got 5.0"),
        ({"gamma": -0.1}, "gamma must be a number in [0, 1]; got -0.1"),
        ({"gamma": math.nan}, "gamma must be a number in [0, 1]; got nan"),
        ({"lam": -1.0}, "lam must be a number in [0, 1]; got -1.0"),
        ({"lam": 1.5}, "lam must be a number in [0, 1]; got 1.5"),
        ({"value_clip": 0.0}, "value_clip must be a number > 0, or null; got 0.0"),
        ({"value_clip": -0.25}, "value_clip must be a number > 0, or null; got -0.25"),
        ({"value_clip": math.inf}, "value_clip must be a number > 0, or null; got inf"),
        ({"kl_coef": math.inf}, "kl_coef must be a number >= 0; got inf"),
        ({"reward_clip_range": [1.0, math.nan]}, "reward_clip_range[1] must be a finite number; got nan"),
        ({"reward_clip_range": [1.0, -1.0]}, "reward_clip_range must be [low, high] with low < high; got [1.0, -1.0]"),
    ],
)
def test_a_knob_outside_its_domain_is_refused_with_its_range(kwargs, message):
    with pytest.raises(ValueError) as info:
        PPOKnobs(**kwargs)
    assert str(info.value) == message


def test_the_ends_of_each_range_and_no_value_clip_are_accepted():
    for kwargs in ({"gamma": 0.0, "lam": 0.0}, {"gamma": 1.0, "lam": 1.0}, {"value_clip": None}):
        PPOKnobs(**kwargs)


@pytest.mark.parametrize(
    "override, message",
    [
        ("ppo.gamma=5", "ppo.gamma must be a number in [0, 1]; got 5.0"),
        ("ppo.lam=-1", "ppo.lam must be a number in [0, 1]; got -1.0"),
        ("ppo.clip_eps=-0.2", "ppo.clip_eps must be a number > 0; got -0.2"),
        ("ppo.clip_eps=.inf", "ppo.clip_eps must be a number > 0; got inf"),
        ("ppo.temperature=0", "ppo.temperature must be a number > 0; got 0.0"),
        ("ppo.top_p=1.5", "ppo.top_p must be a number in (0, 1]; got 1.5"),
    ],
)
def test_the_recipe_loader_names_the_key_and_its_range(override, message):
    path = recipe_path("segment_ppo_tiny")
    with pytest.raises(RecipeError) as info:
        load_recipe(SegmentPPORecipe, path, [override])
    assert str(info.value) == f"{path}: {message}"


def test_the_command_line_refuses_gamma_5_in_one_line_with_exit_2(tmp_path):
    result = CliRunner().invoke(
        main,
        ["train", "segment-ppo", "--config", "segment_ppo_tiny", "ppo.gamma=5", f"train.output_dir={tmp_path / 'r'}"],
    )
    assert result.exit_code == 2
    path = recipe_path("segment_ppo_tiny")
    assert result.output == f"error: {path}: ppo.gamma must be a number in [0, 1]; got 5.0\n"
    assert not (tmp_path / "r").exists()  # refused before anything ran


def test_the_trl_config_refuses_a_non_positive_ratio_clip(tmp_path):
    from rlhf_ext.trl.segment_ppo import DensePPOConfig

    with pytest.raises(ValueError) as info:
        DensePPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", epsilon=-0.2)
    assert str(info.value) == "epsilon must be a number > 0; got -0.2"
