"""Typed recipes: unknown or mistyped keys are errors that name the key; overrides; packaged recipes load."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from rlhf_ext.config import RecipeError, apply_overrides, from_dict, load_recipe, parse_override
from rlhf_ext.pipelines.segment_rm import SegmentRMRecipe
from rlhf_ext.recipes import recipe_names, recipe_path


def test_unknown_key_is_named_with_suggestion():
    with pytest.raises(
        RecipeError, match=r"unknown key 'segment.entropy_cuttoff' \(did you mean 'segment.entropy_cutoff'"
    ):
        from_dict(SegmentRMRecipe, {"segment": {"entropy_cuttoff": 2.0}})


def test_unknown_top_level_section_is_named():
    with pytest.raises(RecipeError, match="unknown key 'optimiser'"):
        from_dict(SegmentRMRecipe, {"optimiser": {}})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"train": {"batch_size": "big"}}, "'train.batch_size' must be an integer; got 'big'"),
        ({"train": {"bf16": "yes"}}, "'train.bf16' must be true or false"),
        ({"segment": {"aggregation": "max"}}, "'segment.aggregation' must be one of 'softmax', 'sum', 'mean'"),
        ({"engine": "vllm"}, "'engine' must be one of 'trl', 'openrlhf'"),
        ({"train": {"adam_betas": [0.9]}}, "'train.adam_betas' must have 2 items"),
        ({"segment": "x"}, "'segment' must be a mapping"),
    ],
)
def test_mistyped_values_are_named(data, message):
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_dict(SegmentRMRecipe, data)


def test_cross_field_validation_names_the_section():
    with pytest.raises(RecipeError, match=r"segment.entropy_cutoff must be a number >= 0 \(or inf\); got -1.0"):
        from_dict(SegmentRMRecipe, {"segment": {"entropy_cutoff": -1}})
    with pytest.raises(RecipeError, match=r"'train': batch_size \(10\) must be a multiple of micro_batch_size \(4\)"):
        from_dict(SegmentRMRecipe, {"train": {"batch_size": 10, "micro_batch_size": 4}})


def test_ints_are_accepted_for_floats_and_inf_parses():
    r = from_dict(SegmentRMRecipe, {"segment": {"entropy_cutoff": "inf", "tau": 1}, "train": {"learning_rate": 1}})
    assert math.isinf(r.segment.entropy_cutoff) and r.segment.tau == 1.0 and r.train.learning_rate == 1.0


def test_overrides_apply_nested_and_typed(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("segment:\n  tau: 0.5\n")
    recipe = load_recipe(SegmentRMRecipe, path, ["segment.tau=0.3", "train.num_train_epochs=2", "data.eval=null"])
    assert recipe.segment.tau == 0.3 and recipe.train.num_train_epochs == 2.0 and recipe.data.eval is None
    assert parse_override("model.sft_model=builtin:tiny") == (["model", "sft_model"], "builtin:tiny")
    with pytest.raises(RecipeError, match="must look like key.sub=value"):
        apply_overrides({}, ["segment.tau"])
    with pytest.raises(RecipeError, match="is a value, not a section"):
        apply_overrides({"engine": "trl"}, ["engine.x=1"])


def test_bad_yaml_and_missing_file_are_clear(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("segment: [unclosed\n")
    with pytest.raises(RecipeError, match="invalid YAML"):
        load_recipe(SegmentRMRecipe, bad)
    with pytest.raises(RecipeError, match="does not exist; `rlhf-ext recipe list`"):
        load_recipe(SegmentRMRecipe, tmp_path / "nope.yaml")
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(RecipeError, match="must be a mapping of sections"):
        load_recipe(SegmentRMRecipe, listy)


def test_every_packaged_segment_rm_recipe_loads():
    names = [n for n in recipe_names() if n.startswith("segment_rm")]
    assert {"segment_rm_tiny", "segment_rm_paper"} <= set(names)
    for name in names:
        load_recipe(SegmentRMRecipe, recipe_path(name))
    paper = load_recipe(SegmentRMRecipe, recipe_path("segment_rm_paper"))
    # Table 7 of paper 003
    assert (paper.segment.entropy_cutoff, paper.segment.tau, paper.train.learning_rate) == (2.0, 0.5, 1e-6)
    assert (paper.train.batch_size, paper.data.max_length, paper.train.zero_stage) == (128, 2048, 3)


@pytest.mark.parametrize(
    "recipe_cls, section",
    [
        ("rlhf_ext.pipelines.segment_rm:SegmentRMRecipe", "train"),
        ("rlhf_ext.pipelines.segment_ppo:SegmentPPORecipe", "train"),
        ("rlhf_ext.pipelines.iterative_dpo:OnlineDPORecipe", "train"),
        ("rlhf_ext.pipelines.continual_recipe:ContinualRecipe", "train"),
        ("rlhf_ext.pipelines.continual_recipe:ContinualRecipe", "reward_model.train"),
    ],
)
def test_every_train_section_validates_the_shared_optimisation_keys(recipe_cls, section):
    import importlib

    from rlhf_ext.config import RecipeError, TrainSection, load_recipe

    module, name = recipe_cls.split(":")
    cls = getattr(importlib.import_module(module), name)
    recipe = load_recipe(cls, None, [])
    train = recipe
    for part in section.split("."):
        train = getattr(train, part)
    assert isinstance(train, TrainSection)
    bad = {
        "micro_batch_size=3": r"batch_size \(16\) must be a multiple of micro_batch_size \(3\)",
        "learning_rate=0": "learning_rate must be a number > 0; got 0.0",
        "max_steps=0": "max_steps must be an integer >= 1, or null; got 0",
        "num_train_epochs=0": "num_train_epochs must be a number > 0; got 0.0",
        "logging_steps=0": "logging_steps must be an integer >= 1; got 0",
    }
    for override, message in bad.items():
        where = f"'{section}': " if "multiple" in message else f"{section}."  # a range names the dotted key
        with pytest.raises(RecipeError, match=f"{where}{message}"):
            load_recipe(cls, None, [f"{section}.{override}", f"{section}.batch_size=16"])


def test_trl_style_flat_yaml_and_flag_overrides_equal_the_nested_recipe(tmp_path):
    flat, nested = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text("entropy_cutoff: 1.5\ntau: 0.25\nsft_model: builtin:tiny\nengine: trl\n")
    nested.write_text("segment:\n  entropy_cutoff: 1.5\n  tau: 0.25\nmodel:\n  sft_model: builtin:tiny\nengine: trl\n")
    overrides = ["--aggregation", "mean", "--train.num_train_epochs=2", "--train.resume"]
    a = load_recipe(SegmentRMRecipe, flat, overrides)
    b = load_recipe(
        SegmentRMRecipe, nested, ["segment.aggregation=mean", "train.num_train_epochs=2", "train.resume=true"]
    )
    assert a == b and a.segment.aggregation == "mean" and a.train.resume is True and a.segment.tau == 0.25


def test_flat_keys_that_are_ambiguous_or_contradict_the_section_are_refused():
    with pytest.raises(RecipeError, match="'tau' is given twice, flat and as 'segment.tau'"):
        from_dict(SegmentRMRecipe, {"tau": 0.3, "segment": {"tau": 0.5}})
    with pytest.raises(RecipeError, match=r"key 'max_length' is ambiguous here; write one of data.max_length"):
        from_dict(_TwoSections, {"max_length": 3})


def test_a_renamed_key_names_its_new_name(monkeypatch):
    from rlhf_ext import config

    monkeypatch.setitem(config.RENAMED_KEYS, "segment.cutoff", "segment.entropy_cutoff")
    with pytest.raises(RecipeError, match="'segment.cutoff' was renamed to 'segment.entropy_cutoff'"):
        from_dict(SegmentRMRecipe, {"segment": {"cutoff": 1.0}})


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.ppo_steps=40", "'training.ppo_steps' was renamed to 'train.ppo.max_steps'"),
        ("training.seed=3", "'training.seed' was renamed to 'seed'"),
        ("model.sft_epochs=2", "'model.sft_epochs' was renamed to 'train.sft.num_train_epochs'"),
    ],
)
def test_the_demos_old_training_keys_name_their_train_section_keys(tmp_path, override, message):
    """The demo's ``training`` section (``rm_epochs``, ``ppo_steps`` ...) became one ``TrainSection`` per stage under
    ``train``; an old key, in a file or as an override, is one error naming the new key, even where its whole section
    is gone (``training``)."""
    from rlhf_ext.demo import DemoRecipe

    with pytest.raises(RecipeError, match=re.escape(message)):
        load_recipe(DemoRecipe, None, [override])
    key, value = override.split("=")
    section, leaf = key.split(".")
    path = tmp_path / "demo.yaml"
    path.write_text(f"{section}:\n  {leaf}: {value}\n")
    with pytest.raises(RecipeError, match=re.escape(message)):
        load_recipe(DemoRecipe, path)


@dataclasses.dataclass
class _Sized:
    max_length: int = 1


@dataclasses.dataclass
class _TwoSections:
    data: _Sized = dataclasses.field(default_factory=_Sized)
    model: _Sized = dataclasses.field(default_factory=_Sized)


def test_a_trl_users_flat_yaml_runs_as_a_recipe(tmp_path):
    """TrlParser style: TRL's own fields (flat) go to train.trl_args, the paper knobs to their section, overrides are
    TRL-style flags; the TRL config built from the recipe carries all of them."""
    from rlhf_ext.pipelines.segment_rm import trl_config

    path = tmp_path / "trl_style.yaml"
    path.write_text("per_device_train_batch_size: 4\nentropy_cutoff: 1.5\nlearning_rate: 1.0e-4\nbf16: false\n")
    recipe = load_recipe(SegmentRMRecipe, path, ["--gradient_accumulation_steps", "3", "--tau", "0.25"])
    assert recipe.train.trl_args == {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 3}
    assert (recipe.segment.entropy_cutoff, recipe.segment.tau, recipe.train.learning_rate) == (1.5, 0.25, 1e-4)
    args = trl_config(recipe)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 3)
    assert (args.entropy_cutoff, args.tau, args.learning_rate) == (1.5, 0.25, 1e-4)
    with pytest.raises(RecipeError, match="unknown key 'per_device_train_batchsize'"):
        load_recipe(SegmentRMRecipe, path, ["--per_device_train_batchsize", "4"])


def test_a_flat_override_replaces_the_recipe_files_nested_value():
    """`rlhf-ext train segment-rm --config segment_rm_tiny --entropy_cutoff 1.5` (found running the installed wheel)
    used to fail with "given twice ... with different values"; an override wins, flat or dotted."""
    flat = load_recipe(SegmentRMRecipe, recipe_path("segment_rm_tiny"), ["--entropy_cutoff", "1.5", "tau=0.25"])
    dotted = load_recipe(
        SegmentRMRecipe, recipe_path("segment_rm_tiny"), ["segment.entropy_cutoff=1.5", "segment.tau=0.25"]
    )
    assert flat == dotted and (flat.segment.entropy_cutoff, flat.segment.tau) == (1.5, 0.25)


def test_a_micro_batch_larger_than_the_batch_is_lowered_to_it():
    """``train: {batch_size: 8}`` against the default micro batch of 16 trains 8 per step without accumulation (before:
    an error, 'batch_size (8) must be a multiple of micro_batch_size (16)'); a micro batch that does not divide the
    batch is still one."""
    from rlhf_ext.config import TrainSection

    assert (TrainSection(batch_size=8).micro_batch_size, TrainSection(batch_size=32).micro_batch_size) == (8, 16)
    with pytest.raises(ValueError, match=r"batch_size \(24\) must be a multiple of micro_batch_size \(16\)"):
        TrainSection(batch_size=24)


def test_a_partial_section_keeps_its_recipes_defaults_for_the_keys_it_omits(tmp_path):
    """A section written in part starts from the recipe's own default for that section, not from the class's field
    defaults: the simulator's DPO trains 2 epochs at 5e-4 by default, so ``dpo: {train: {learning_rate: 1e-4}}``
    changes the learning rate alone (before: epochs fell back to TrainSection's 1.0 and warmup to its 0.03 — the
    override silently changed two other settings). Nested sections too, and a key given is still checked."""
    from rlhf_ext.config import load_recipe
    from rlhf_ext.sim.recipe import SimCompareRecipe

    default = load_recipe(SimCompareRecipe)
    path = tmp_path / "r.yaml"
    path.write_text("dpo: {train: {learning_rate: 1.0e-4}}\nonline_dpo: {train: {batch_size: 16}}\n")
    recipe = load_recipe(SimCompareRecipe, path)
    assert default.dpo.train.num_train_epochs == 2 and default.online_dpo.train.micro_batch_size == 8
    assert recipe.dpo.train == dataclasses.replace(default.dpo.train, learning_rate=1e-4)
    assert recipe.online_dpo.train == dataclasses.replace(default.online_dpo.train, batch_size=16)
    overridden = load_recipe(SimCompareRecipe, None, ["quark.train.num_train_epochs=3"])
    assert overridden.quark.train == dataclasses.replace(default.quark.train, num_train_epochs=3)
    # one of alternatives is replaced whole: naming the reward model drops the default reward function
    from rlhf_ext.pipelines.iterative_dpo import OnlineDPORecipe

    path.write_text("reward: {model: some/rm}\n")
    reward = load_recipe(OnlineDPORecipe, path).reward
    assert (reward.model, reward.function) == ("some/rm", None)
    assert load_recipe(OnlineDPORecipe).reward.function == "builtin:keyphrase-gold"
    path.write_text("dpo: {train: {learning_rate: -1}}\n")
    with pytest.raises(RecipeError, match=r"dpo\.train\.learning_rate"):
        load_recipe(SimCompareRecipe, path)


@pytest.mark.parametrize(
    "recipe, yaml_text, message",
    [
        ("segment_rm", "train: {epochs: 2}", "'train.epochs' was renamed to 'train.num_train_epochs' (TRL's name)"),
        (
            "segment_rm",
            "train: {lr_scheduler: linear}",
            "'train.lr_scheduler' was renamed to 'train.lr_scheduler_type'",
        ),
        ("segment_rm", "epochs: 2", "'epochs' was renamed to 'num_train_epochs' (TRL's name)"),
        ("sim", "dpo: {train: {epochs: 1}}", "'dpo.train.epochs' was renamed to 'dpo.train.num_train_epochs'"),
        (
            "sim",
            "reward_model: {epochs: 3}",
            "'reward_model.epochs' was renamed to 'reward_model.train.num_train_epochs'",
        ),
        ("demo", "train: {sft: {epochs: 3}}", "'train.sft.epochs' was renamed to 'train.sft.num_train_epochs'"),
        (
            "sim",
            "online_dpo_async: {updates: 5}",
            "'online_dpo_async.updates' was renamed to 'online_dpo_async.max_steps'",
        ),
        ("continual", "ppo: {steps_per_task: 3}", "'ppo.steps_per_task' was renamed to 'ppo.max_steps'"),
    ],
)
def test_the_train_sections_old_names_name_trls(tmp_path, recipe, yaml_text, message):
    """``epochs`` and ``lr_scheduler`` became TRL's ``num_train_epochs`` and ``lr_scheduler_type`` in every ``train``
    section, the simulator's reward-model keys moved into its ``train`` and its asynchronous online DPO's ``updates``
    became ``max_steps`` (the section is a train section itself), as did the continual PPO's ``steps_per_task``: an
    old key, in a file (nested or flat) or as a dotted override, is one error naming the new key."""
    from rlhf_ext.demo import DemoRecipe
    from rlhf_ext.pipelines.continual_recipe import ContinualRecipe
    from rlhf_ext.sim.recipe import SimCompareRecipe

    cls = {"segment_rm": SegmentRMRecipe, "sim": SimCompareRecipe, "demo": DemoRecipe, "continual": ContinualRecipe}
    cls = cls[recipe]
    path = tmp_path / "r.yaml"
    path.write_text(yaml_text + "\n")
    with pytest.raises(RecipeError, match=re.escape(message)):
        load_recipe(cls, path)
    if "{" in yaml_text:  # the same key as a dotted override
        import yaml

        def dotted(d, prefix=""):
            return [x for k, v in d.items() for x in (dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else
                                                       [f"{prefix}{k}={v}"])]  # fmt: skip

        with pytest.raises(RecipeError, match=re.escape(message)):
            load_recipe(cls, None, dotted(yaml.safe_load(yaml_text)))


def test_trl_args_cannot_shadow_a_key_of_its_own_train_section(tmp_path):
    """``train.trl_args`` is for TRL fields the section does not have; naming one it has (``num_train_epochs``,
    ``learning_rate``, ``seed`` ...) gave that knob two values and ``trl_args`` silently won (before: the recipe said 1
    epoch, TRL trained 5). Now one error naming the key to set instead; other TRL fields still pass through."""
    path = tmp_path / "rm.yaml"
    path.write_text("train: {num_train_epochs: 1, trl_args: {num_train_epochs: 5, seed: 3}}\n")
    message = "'train': trl_args sets num_train_epochs, seed: keys of this train section; set train.num_train_epochs,"
    with pytest.raises(RecipeError, match=re.escape(message)):
        load_recipe(SegmentRMRecipe, path)
    path.write_text("train: {trl_args: {per_device_train_batch_size: 4, report_to: none}}\n")
    assert load_recipe(SegmentRMRecipe, path).train.trl_args == {"per_device_train_batch_size": 4, "report_to": "none"}
