"""One vocabulary: every paper knob is declared once (a dataclass in rlhf_ext.algos) and every engine config, recipe
section and command line that exposes it inherits the same name and the same default."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from rlhf_ext.algos.continual_kl import ContinualKnobs
from rlhf_ext.algos.pair_selection import OnlineDPOKnobs
from rlhf_ext.algos.ppo import PPOKnobs
from rlhf_ext.algos.segment_dense import DenseRewardKnobs
from rlhf_ext.algos.segment_reward import SegmentRewardKnobs

KNOBS = (SegmentRewardKnobs, DenseRewardKnobs, PPOKnobs, ContinualKnobs, OnlineDPOKnobs)


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _users():
    from rlhf_ext.pipelines.continual_recipe import ContinualSection
    from rlhf_ext.pipelines.continual_recipe import PPOSection as ContinualPPOSection
    from rlhf_ext.pipelines.iterative_dpo import OnlineSection
    from rlhf_ext.pipelines.segment_ppo import PPOAlgoSection, PPOSegmentSection
    from rlhf_ext.pipelines.segment_rm import SegmentSection
    from rlhf_ext.sim.recipe import OnlineDPOSection, PPOSection, RewardModelSection
    from rlhf_ext.trl import ContinualDPOConfig, IterativeDPOConfig, SegmentPPOConfig, SegmentRewardConfig

    return [
        (SegmentRewardKnobs, SegmentRewardConfig), (SegmentRewardKnobs, SegmentSection),
        (SegmentRewardKnobs, RewardModelSection), (DenseRewardKnobs, SegmentPPOConfig),
        (DenseRewardKnobs, PPOSegmentSection), (PPOKnobs, SegmentPPOConfig), (PPOKnobs, PPOAlgoSection),
        (PPOKnobs, PPOSection), (ContinualKnobs, ContinualDPOConfig), (ContinualKnobs, SegmentPPOConfig),
        (ContinualKnobs, ContinualSection), (OnlineDPOKnobs, IterativeDPOConfig), (OnlineDPOKnobs, OnlineSection),
        (OnlineDPOKnobs, OnlineDPOSection), (PPOKnobs, ContinualPPOSection),
    ]  # fmt: skip


def test_every_user_inherits_each_knob_with_its_one_default():
    for knobs, user in _users():
        assert issubclass(user, knobs), (user, knobs)
        fields = {f.name: f for f in dataclasses.fields(user)}
        for f in dataclasses.fields(knobs):
            assert _default(fields[f.name]) == _default(f), f"{user.__name__}.{f.name} has another default"


def test_knob_names_are_unique_across_methods_so_flat_keys_are_unambiguous():
    names = [(k.__name__, f.name) for k in KNOBS for f in dataclasses.fields(k)]
    for (ka, a), (kb, b) in itertools.combinations(names, 2):
        assert a != b, f"{ka}.{a} and {kb}.{b} share a name"


def test_every_trl_config_field_metadata_is_argparse_keywords():
    """transformers 5.24's ``HfArgumentParser`` hands ``dict(field.metadata)`` to ``add_argument`` (5.15 called
    ``.copy()``): a knob's range kept in the metadata made ``HfArgumentParser(SegmentPPOConfig)`` raise ``TypeError:
    ... unexpected keyword argument 'range'`` on the newest release (found by ``make test-newest``)."""
    import argparse

    from rlhf_ext.trl import (
        ContinualDPOConfig,
        DensePPOConfig,
        IterativeDPOConfig,
        KLSFTConfig,
        SegmentPPOConfig,
        SegmentRewardConfig,
    )

    for config in (ContinualDPOConfig, DensePPOConfig, IterativeDPOConfig, KLSFTConfig, SegmentPPOConfig,
                   SegmentRewardConfig):  # fmt: skip
        for f in dataclasses.fields(config):
            kwargs = dict(f.metadata)
            kwargs.pop("aliases", None)
            argparse.ArgumentParser().add_argument(f"--{f.name}", **kwargs)  # raises on a non-argparse key


def test_trl_command_line_takes_the_knob_names():
    from transformers import HfArgumentParser

    from rlhf_ext.trl import SegmentPPOConfig

    (args,) = HfArgumentParser(SegmentPPOConfig).parse_args_into_dataclasses(
        ["--output_dir", "/tmp/x", "--bf16", "false", "--continual_kl_coef", "0.5", "--granularity", "token",
         "--advantage_estimator", "reinforce", "--interpolation", "repeat"]
    )  # fmt: skip
    assert (args.continual_kl_coef, args.granularity, args.advantage_estimator, args.interpolation) == (
        0.5,
        "token",
        "reinforce",
        "repeat",
    )
    with pytest.raises(ValueError, match="granularity must be one of"):
        SegmentPPOConfig(output_dir="/tmp/x", bf16=False, granularity="segmnt")


def test_openrlhf_ext_flags_are_generated_from_the_knobs():
    from rlhf_ext.openrlhf import segment_rm, train_ppo_ray

    for f in dataclasses.fields(SegmentRewardKnobs):
        assert segment_rm.EXT_DEFAULTS[f.name] == _default(f)
        assert f.name in train_ppo_ray.EXT_DEFAULTS  # PPO: None = the reward model's recorded value
    for name in ("granularity", "interpolation"):
        assert train_ppo_ray.EXT_DEFAULTS[name] == _default(DenseRewardKnobs.__dataclass_fields__[name])
    for f in dataclasses.fields(ContinualKnobs):
        assert f.name in train_ppo_ray.EXT_DEFAULTS


def test_trl_configs_keep_output_dir_first_and_run_trl_and_knob_checks():
    """The knobs sit before TRL's class in the bases, so ``Config("out")`` is ``output_dir`` (TRL's convention) and
    both TRL's ``__post_init__`` and the knob checks run."""
    from rlhf_ext.trl import ContinualDPOConfig, DensePPOConfig, IterativeDPOConfig, SegmentRewardConfig

    for config in (DensePPOConfig, SegmentRewardConfig, ContinualDPOConfig, IterativeDPOConfig):
        args = config("/tmp/rlhf-ext-out", bf16=False)
        assert args.output_dir == "/tmp/rlhf-ext-out"
        assert type(args.lr_scheduler_type).__name__ == "SchedulerType"  # set by TrainingArguments.__post_init__
    with pytest.raises(ValueError, match="continual_kl_coef must be a number >= 0; got -1.0"):
        ContinualDPOConfig("/tmp/rlhf-ext-out", bf16=False, continual_kl_coef=-1.0)
    with pytest.raises(ValueError, match="tau must be a number > 0; got 0.0"):
        SegmentRewardConfig("/tmp/rlhf-ext-out", bf16=False, tau=0.0)


def test_trainers_take_their_trl_parents_positional_order():
    """Positional arguments mean what they mean for the TRL parent (our extras are keyword-only)."""
    import inspect

    from trl import DPOTrainer, GRPOTrainer, RewardTrainer

    from rlhf_ext.trl import ContinualDPOTrainer, DensePPOTrainer, IterativeDPOTrainer, SegmentRewardTrainer

    def positional(cls, n):
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD,)
        return [p.name for p in inspect.signature(cls.__init__).parameters.values() if p.kind in kinds][1 : n + 1]

    assert positional(SegmentRewardTrainer, 6) == positional(RewardTrainer, 6)
    assert positional(ContinualDPOTrainer, 3) == positional(DPOTrainer, 3)
    assert positional(DensePPOTrainer, 10) == positional(GRPOTrainer, 10)
    assert positional(IterativeDPOTrainer, 2) == ["model", "reward_funcs"]


def test_no_literal_choice_tuples_or_knob_defaults_outside_algos():
    """Outside ``rlhf_ext/algos`` no tuple, list or set of a choice knob's strings (granularity, interpolation,
    aggregation: the enums carry their properties, e.g. ``Granularity.needs_entropy``) and no function default or
    keyword argument for a paper knob written as a literal (``tau: float = 0.5``): each is the knob's one ``DEFAULT_*``
    or enum member, so a changed default cannot leave a stale copy behind."""
    import ast
    from pathlib import Path

    from rlhf_ext.algos.segment_dense import GRANULARITIES, INTERPOLATIONS
    from rlhf_ext.algos.segment_reward import AGGREGATIONS

    choices = [set(GRANULARITIES), set(INTERPOLATIONS), set(AGGREGATIONS)]
    knobs = {"entropy_cutoff", "tau", "aggregation", "granularity", "interpolation"}
    package = Path(__file__).resolve().parents[2] / "rlhf_ext"
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] == "algos":
            continue
        where = path.relative_to(package.parent)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple | ast.List | ast.Set) and len(node.elts) >= 2:
                values = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                if len(values) == len(node.elts) and any(values <= c for c in choices):
                    found.append(f"{where}:{node.lineno} {sorted(values)}")
            pairs = []
            if isinstance(node, ast.keyword):
                pairs = [(node.arg, node.value)]
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                positional = node.args.posonlyargs + node.args.args
                pairs = list(zip((a.arg for a in positional[len(positional) - len(node.args.defaults) :]),
                                 node.args.defaults))  # fmt: skip
                pairs += [(a.arg, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
            for name, value in pairs:
                if name in knobs and isinstance(value, ast.Constant) and value.value is not None:
                    found.append(f"{where}:{value.lineno} {name}={value.value!r}")
    assert not found, "literal knob values outside rlhf_ext/algos:\n" + "\n".join(found)


def _sections(cls: type) -> set[type]:
    """``cls`` and every dataclass section below it (nested recipe sections, list items)."""
    from typing import get_args, get_type_hints

    found, todo = set(), [cls]
    while todo:
        current = todo.pop()
        if current in found:
            continue
        found.add(current)
        for hint in get_type_hints(current).values():
            todo += [t for t in (hint, *get_args(hint)) if dataclasses.is_dataclass(t) and isinstance(t, type)]
    return found


def test_one_training_vocabulary_in_every_recipe():
    """Every recipe section that sets optimisation (learning rate, epochs or steps, batch sizes, schedule) is a
    :class:`~rlhf_ext.config.TrainSection`, so one set of names reaches TRL through one mapping
    (``rlhf_ext.trl.args.training_kwargs``). Before: the simulator's ``TrainSettings`` (no ``micro_batch_size``,
    ``weight_decay``, ``max_grad_norm``) and the demo's ``training`` section (``rm_epochs``, ``ppo_steps``,
    ``ppo_batch_size`` ...) were second vocabularies, and so were the simulator's ``reward_model`` (``epochs``,
    ``batch_size``, ``learning_rate``; now its ``train``) and ``ppo`` (its own ``max_steps``, ``batch_size``,
    ``learning_rate``; now a ``TrainSection`` itself, flat as TRL's ``PPOConfig``, so the tuning grid's
    ``ppo.learning_rate`` keeps its name)."""
    import re

    from rlhf_ext.config import TrainSection
    from rlhf_ext.demo import DemoRecipe
    from rlhf_ext.pipelines.continual_recipe import ContinualRecipe
    from rlhf_ext.pipelines.iterative_dpo import OnlineDPORecipe
    from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe
    from rlhf_ext.pipelines.segment_rm import SegmentRMRecipe
    from rlhf_ext.sim.recipe import SimCompareRecipe

    vocabulary = {
        "epochs",
        "num_train_epochs",
        "max_steps",
        "batch_size",
        "micro_batch_size",
        "learning_rate",
        "lr_scheduler",
        "lr_scheduler_type",
        "warmup_ratio",
    }
    recipes = (DemoRecipe, ContinualRecipe, OnlineDPORecipe, SegmentPPORecipe, SegmentRMRecipe, SimCompareRecipe)
    sections = set().union(*map(_sections, recipes))
    second = sorted(
        s.__qualname__
        for s in sections
        if len(vocabulary & {f.name for f in dataclasses.fields(s)}) >= 3 and not issubclass(s, TrainSection)
    )
    assert not second, f"sections with their own training vocabulary: {second}"
    stage_prefixed = sorted(
        f"{s.__qualname__}.{f.name}"
        for s in sections
        for f in dataclasses.fields(s)
        if re.fullmatch(r"(sft|rm|ppo|dpo)_(epochs|steps|learning_rate|batch_size)", f.name)
    )
    assert not stage_prefixed, f"stage-prefixed training names (use the stage's train section): {stage_prefixed}"
    trained = {s.__qualname__ for s in sections if issubclass(s, TrainSection)}  # the walk reaches them
    assert {"SFTSection", "MethodTrainSection", "DemoPPOTrain", "PPOTrainSection", "RMTrainSection"} <= trained


def test_the_train_sections_keys_are_trls_field_names():
    """The keys every ``train`` section shares are ``TrainingArguments``' own field names (``num_train_epochs``,
    ``lr_scheduler_type`` ...; before: ``epochs`` and ``lr_scheduler``), so a TRL user's key works as written. The
    exceptions are the engine-neutral global batch (``batch_size``, and ``micro_batch_size`` per device: TRL has only
    the per-device batch, OpenRLHF's argv names them ``train_batch_size`` / ``micro_train_batch_size``),
    ``warmup_ratio`` (transformers 5 folded it into ``warmup_steps``; OpenRLHF's ``lr_warmup_ratio``) and the
    pass-through ``trl_args``; each maps to TRL's fields in ``optimisation_kwargs``."""
    from transformers import TrainingArguments

    from rlhf_ext.config import TrainSection
    from rlhf_ext.trl.args import optimisation_kwargs

    trl_fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    keys = {f.name for f in dataclasses.fields(TrainSection)}
    assert sorted(keys - trl_fields) == ["batch_size", "micro_batch_size", "trl_args", "warmup_ratio"]
    section = TrainSection(
        num_train_epochs=3, max_steps=7, learning_rate=2e-4, lr_scheduler_type="linear", weight_decay=0.1,
        max_grad_norm=0.5, logging_steps=3, warmup_ratio=0.1,
    )  # fmt: skip
    mapped = optimisation_kwargs(section)
    same = sorted(k for k in mapped if k in keys)  # every shared key passes through under its own name, unchanged
    assert same == ["learning_rate", "logging_steps", "lr_scheduler_type", "max_grad_norm", "max_steps",
                    "num_train_epochs", "weight_decay"]  # fmt: skip
    assert all(mapped[k] == getattr(section, k) for k in same)


def test_num_samples_is_dataset_rows_and_num_generations_is_responses_per_prompt():
    """Issue 26: ``num_samples`` meant two things, rows of a generated dataset (``task.num_samples``,
    ``data.num_samples``) and responses per prompt (online DPO's ``n``); the simulator's Quark called the latter
    ``samples_per_prompt``. Responses per prompt is now TRL's ``num_generations`` in every training section and config
    (``num_samples`` stays on ``IterativeDPOConfig`` only as a deprecated alias)."""
    from rlhf_ext.demo import DemoRecipe
    from rlhf_ext.pipelines.continual_recipe import ContinualRecipe
    from rlhf_ext.pipelines.iterative_dpo import OnlineDPORecipe
    from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe
    from rlhf_ext.pipelines.segment_rm import SegmentRMRecipe
    from rlhf_ext.sim.recipe import SimCompareRecipe

    recipes = (DemoRecipe, ContinualRecipe, OnlineDPORecipe, SegmentPPORecipe, SegmentRMRecipe, SimCompareRecipe)
    sections = set().union(*map(_sections, recipes))

    def having(name: str) -> list[str]:
        return sorted(s.__qualname__ for s in sections if name in {f.name for f in dataclasses.fields(s)})

    assert having("num_samples") == ["DemoData", "TaskSection"]  # the generated datasets' sizes
    assert having("samples_per_prompt") == ["EvalSection"]  # the evaluation's sample size, not a training knob
    assert having("num_generations") == [
        "OnlineDPOAsyncSection", "OnlineDPOSection", "OnlineSection", "PPOAlgoSection", "PPOSection", "PPOSection",
        "QuarkSection",
    ]  # fmt: skip
    assert "num_samples" not in {f.name for f in dataclasses.fields(OnlineDPOKnobs)}
