"""The default granularity is the reward source's (issue 30): ``chunk`` on a reward model's token scores, the mode
that beat paper 003's ``segment`` under the simulator's fair protocol; ``segment`` on span rewards, whose spans are
the segments (``chunk`` is not defined there). Every entry point resolves an unset granularity the same way: the
knobs, TRL's ``DensePPOConfig`` (on the command line too), the recipes, OpenRLHF's ``--ext`` flags and its
experience maker; an explicit setting is kept."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlhf_ext.algos.segment_dense import DenseRewardKnobs, Granularity, resolve_granularity


def test_unset_is_chunk_on_a_reward_model_and_segment_on_spans_and_an_explicit_value_is_kept():
    assert DenseRewardKnobs().granularity is None
    assert resolve_granularity(None, spans=False) == "chunk"
    assert resolve_granularity(None, spans=True) == "segment"
    for value in Granularity.values():
        assert resolve_granularity(value, spans=False) == value and type(resolve_granularity(value, False)) is str
        assert resolve_granularity(Granularity(value), spans=True) == value
    with pytest.raises(ValueError, match="granularity must be one of"):
        DenseRewardKnobs(granularity="chunks")


def test_trl_resolves_it_from_the_reward_it_gets():
    from rlhf_ext.runtime.rewards import reward_sources

    def spans(prompts, completions, **kwargs):
        return [[(0, 1, 1.0)] for _ in completions]

    on_model = SimpleNamespace(granularity=None, reward_model_path="/models/segment-rm")
    assert reward_sources(on_model, None, None, None) == (None, False)
    assert on_model.granularity == "chunk"
    on_spans = SimpleNamespace(granularity=None, reward_model_path=None)
    assert reward_sources(on_spans, spans, None, None)[1] is True
    assert on_spans.granularity == "segment"
    paper = SimpleNamespace(granularity="segment", reward_model_path="/models/segment-rm")
    reward_sources(paper, None, None, None)
    assert paper.granularity == "segment"


def test_trl_command_line_leaves_it_unset_and_lists_the_choices():
    from transformers import HfArgumentParser

    from rlhf_ext.trl import DensePPOConfig

    parser = HfArgumentParser(DensePPOConfig)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", "/tmp/x", "--bf16", "false"])
    assert args.granularity is None
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", "/tmp/x", "--bf16", "false", "--granularity", "segment"]
    )
    assert args.granularity == "segment"
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--output_dir", "/tmp/x", "--granularity", "chunks"])


def test_recipes_resolve_it_and_the_packaged_ones_say_which():
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe
    from rlhf_ext.recipes import recipe_path

    assert SegmentPPORecipe().segment.granularity == "chunk"
    on_spans = load_recipe(
        SegmentPPORecipe, None, ["model.reward_model=null", "model.reward_source=rules:builtin:toy-keyphrase"]
    )
    assert on_spans.segment.granularity == "segment"
    expected = {"segment_ppo_tiny": "chunk", "segment_ppo_openrlhf": "chunk", "segment_ppo_openrlhf_2x8": "chunk",
                "segment_ppo_paper": "segment", "segment_ppo_rules_tiny": "segment"}  # fmt: skip
    for name, granularity in expected.items():
        assert load_recipe(SegmentPPORecipe, recipe_path(name), []).segment.granularity == granularity, name
    from rlhf_ext.demo import DemoRecipe  # the demo learns from a segment reward model

    assert load_recipe(DemoRecipe, recipe_path("demo"), []).dense.granularity == "chunk"
    assert load_recipe(DemoRecipe, recipe_path("demo"), ["dense.granularity=segment"]).dense.granularity == "segment"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], "chunk"),
        (["--ext.reward_source", "rules:builtin:toy-keyphrase"], "segment"),
        (["--reward.remote_url", "http://127.0.0.1:5000/get_reward"], "segment"),
        (["--ext.granularity", "segment"], "segment"),
        (["--ext.granularity", "bandit"], "bandit"),
    ],
)
def test_openrlhf_resolves_it_in_the_driver_from_the_reward_flags(flags, expected):
    from rlhf_ext.openrlhf.train_ppo_ray import for_cluster, parse_ext_args
    from rlhf_ext.runtime.resources import Cluster

    _, ext = for_cluster(*parse_ext_args(["--actor.model_name_or_path", "/m/sft", *flags]), Cluster((0,)))
    assert ext["granularity"] == expected
