"""The segment-PPO recipe :class:`SegmentPPORecipe` (paper 003, section 2.3; Table 8 defaults; the
``recipes/segment_ppo_*.yaml``), shared by the TRL and OpenRLHF engines.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from rlhf_ext.algos.knobs import knob, knob_like, seed_knob
from rlhf_ext.algos.names import knob_values
from rlhf_ext.algos.ppo import PPOKnobs
from rlhf_ext.algos.segment_dense import DenseRewardKnobs, resolve_granularity
from rlhf_ext.algos.segment_reward import Aggregation, SegmentRewardKnobs
from rlhf_ext.config import TrainSection
from rlhf_ext.runtime.resources import Cluster, Plan

logger = logging.getLogger(__name__)
#: The models of OpenRLHF's PPO, by their flag prefix.
ROLES = ("actor", "ref", "critic", "reward")


@dataclass
class PPOModelSection:
    """``sft_model``: policy and reference initialisation; ``reward_model``: the segment RM (its
    ``segment_config.json`` supplies cutoff/aggregation/tau); ``critic_model``: default the reward model (the policy
    with a reward source); ``normalizer``: a saved LocationNormalizer (null = fit on ``data.calibration``).
    ``reward_source``: a dense reward source instead of ``reward_model`` (set that to null), answering with character
    spans that are mapped onto the policy's tokens (:func:`rlhf_ext.runtime.dense_sources.load_reward_source`):
    ``rules:FILE.yaml``, ``file.py:function``, ``module:function``, ``prm:MODEL`` (read at ``step_separator``),
    ``segment-rm:DIR`` (a segment RM on its own tokenizer) or ``http://HOST:PORT`` (``rlhf-ext serve rm``)."""

    sft_model: str = "builtin:tiny-sft"
    reward_model: str | None = "builtin:tiny-segment-rm"
    critic_model: str | None = None
    normalizer: str | None = None
    reward_source: str | None = None
    step_separator: str = "\n"

    def __post_init__(self) -> None:
        if self.reward_source and self.reward_model:
            raise ValueError("reward_model and reward_source are two rewards: set reward_model: null to train on the "
                             "reward source")  # fmt: skip
        if not self.reward_source and not self.reward_model:
            raise ValueError("no reward: set reward_model (a segment reward model) or reward_source")
        if not self.step_separator:
            raise ValueError("step_separator must be a non-empty string (the text that ends a step for prm:)")


@dataclass
class PPODataSection:
    prompts: str = "builtin:toy-keyphrase"
    prompt_split: str = "train"
    prompt_key: str = "prompt"
    max_prompts: int | None = knob(None, ge=1)
    calibration: str | None = "builtin:toy-keyphrase"
    calibration_split: str = "train"
    max_calibration_pairs: int = knob(512, ge=1)
    max_prompt_length: int = knob(1024, ge=1)
    max_completion_length: int = knob(1024, ge=1)


@dataclass
class PPOSegmentSection(DenseRewardKnobs):
    """Paper 003's Table 1-3 switches (:class:`~rlhf_ext.algos.segment_dense.DenseRewardKnobs`, the same names and
    defaults as ``DensePPOConfig``) plus the reward model's segmentation, ``entropy_cutoff`` / ``aggregation`` /
    ``tau`` (:class:`~rlhf_ext.algos.segment_reward.SegmentRewardKnobs`); null = the reward model's own."""

    entropy_cutoff: float | None = knob_like(SegmentRewardKnobs, "entropy_cutoff", None)
    aggregation: Aggregation | None = None
    tau: float | None = knob_like(SegmentRewardKnobs, "tau", None)


@dataclass
class PPOAlgoSection(PPOKnobs):
    """PPO settings: :class:`~rlhf_ext.algos.ppo.PPOKnobs` (paper 003 Table 8 / OpenRLHF defaults, the same names as
    ``DensePPOConfig``) plus the clip, sampling and rollout settings."""

    clip_eps: float = knob(0.2, gt=0, help="PPO ratio clip epsilon (paper 003 Appendix C: 0.2).")
    num_generations: int = knob(2, ge=1)
    temperature: float = knob(1.0, gt=0)
    top_p: float = knob(1.0, gt=0, le=1)
    async_generation: bool = False  # TRL engine: one-step off-policy rollouts (paper 001); OpenRLHF: train.async_enable


@dataclass
class PPOTrainSection(TrainSection):
    """:class:`~rlhf_ext.config.TrainSection` with ``batch_size`` = rollouts per optimizer step (global),
    ``micro_batch_size`` per device, and the critic's own learning rate."""

    output_dir: str = "runs/segment_ppo"
    batch_size: int = knob_like(TrainSection, "batch_size", 128)
    learning_rate: float = knob_like(TrainSection, "learning_rate", 5e-7)
    critic_learning_rate: float = knob(9e-6, gt=0)
    logging_steps: int = knob_like(TrainSection, "logging_steps", 1)
    seed: int = seed_knob(42)
    save_steps: int | None = knob(None, ge=1)
    resume: bool = True
    zero_stage: int = knob(2, ge=0, le=3)
    openrlhf_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class SegmentPPORecipe:
    """Segment-level PPO (paper 003, Algorithm 1 second half)."""

    engine: Literal["trl", "openrlhf"] = "trl"
    model: PPOModelSection = field(default_factory=PPOModelSection)
    data: PPODataSection = field(default_factory=PPODataSection)
    segment: PPOSegmentSection = field(default_factory=PPOSegmentSection)
    ppo: PPOAlgoSection = field(default_factory=PPOAlgoSection)
    train: PPOTrainSection = field(default_factory=PPOTrainSection)

    def __post_init__(self) -> None:  # an unset granularity: the reward source's default (chunk on a reward model)
        self.segment.granularity = resolve_granularity(self.segment.granularity, self.model.reward_source is not None)

    @classmethod
    def engine_config_fields(cls) -> set[str]:
        """Field names of the TRL config this recipe builds (flat TrlParser-style keys go to ``train.trl_args``)."""
        from rlhf_ext.trl.segment_ppo import DensePPOConfig

        return {f.name for f in fields(DensePPOConfig)}


#: What the summary's PPO curve records per logging step (response length in tokens).
CURVE_KEYS = (
    "step",
    "reward",
    "segment/kl",
    "segment/score",
    "segment/raw_last_score",
    "segment/response_length",
    "segment/segments_per_response",
)


def run_segment_ppo(recipe: SegmentPPORecipe) -> dict[str, Any]:
    """Train with the recipe's engine in its locked output directory (:func:`~rlhf_ext.runtime.rundir.claim_output_dir`;
    a given normalizer file is validated before any model loads); returns a summary (paths, reward/KL curve)."""
    from rlhf_ext.runtime.calibration import load_normalizer
    from rlhf_ext.runtime.dense_sources import check_reward_source
    from rlhf_ext.runtime.rundir import claim_output_dir

    m, d = recipe.model, recipe.data
    keys = ("sft_model", "reward_model", "reward_source", "critic_model", "normalizer")
    inputs = {f"model.{k}": getattr(m, k) for k in keys}
    inputs.update({"data.prompts": d.prompts, "data.calibration": d.calibration})
    with claim_output_dir(recipe.train.output_dir, inputs, "train.output_dir"):
        if m.normalizer is not None:
            load_normalizer(m.normalizer)
        if m.reward_source is not None:
            check_reward_source(m.reward_source)
        return train_with_trl(recipe) if recipe.engine == "trl" else train_with_openrlhf(recipe)


def trl_config(recipe):
    """Map a :class:`~rlhf_ext.pipelines.segment_ppo.SegmentPPORecipe` onto TRL's config (``train.trl_args`` last)."""
    from rlhf_ext.config import RecipeError
    from rlhf_ext.trl.args import make_config, training_kwargs
    from rlhf_ext.trl.segment_ppo import SegmentPPOConfig

    t, ppo, seg = recipe.train, recipe.ppo, recipe.segment
    if ppo.num_generations < 2:
        raise RecipeError("the TRL engine samples at least 2 responses per prompt: set ppo.num_generations >= 2")
    kwargs = training_kwargs(t)
    kwargs.update(
        disable_tqdm=False,
        num_generations=ppo.num_generations,
        max_completion_length=recipe.data.max_completion_length,
        temperature=ppo.temperature,
        top_p=ppo.top_p,
        epsilon=ppo.clip_eps,
        reward_model_path=recipe.model.reward_model,
        critic_model_path=recipe.model.critic_model,
        normalizer_path=recipe.model.normalizer,
        entropy_cutoff=seg.entropy_cutoff,
        aggregation=seg.aggregation,
        tau=seg.tau,
        calibration_max_pairs=recipe.data.max_calibration_pairs,
        critic_learning_rate=t.critic_learning_rate,
        async_generation=ppo.async_generation,
        **knob_values(seg, DenseRewardKnobs),
        **knob_values(ppo, PPOKnobs),
    )
    return make_config(SegmentPPOConfig, kwargs, t.trl_args)


def load_prompts(data, tokenizer):
    """The recipe's prompt split as a ``prompt`` column, prompts longer than ``max_prompt_length`` cut on the left."""
    from rlhf_ext.zoo.builtins import resolve_dataset

    dd = resolve_dataset(data.prompts)
    if data.prompt_split not in dd:
        raise ValueError(f"data.prompts: {data.prompts!r} has no split {data.prompt_split!r} (splits: {', '.join(dd)})")
    ds = dd[data.prompt_split]
    if data.prompt_key not in ds.column_names:
        raise ValueError(
            f"data.prompts ({data.prompts}) has no column {data.prompt_key!r}; columns: {', '.join(ds.column_names)}. "
            "Set data.prompt_key"
        )
    if data.max_prompts is not None:
        ds = ds.select(range(min(data.max_prompts, len(ds))))
    ds = ds.select_columns([data.prompt_key])
    if data.prompt_key != "prompt":
        ds = ds.rename_column(data.prompt_key, "prompt")

    def cut(row):
        if isinstance(row["prompt"], str):
            ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
            if len(ids) > data.max_prompt_length:
                return {"prompt": tokenizer.decode(ids[-data.max_prompt_length :])}
        return row

    return ds.map(cut, desc="Truncating prompts")


def train_with_trl(recipe) -> dict[str, Any]:
    """Run a :class:`SegmentPPORecipe` with TRL; returns paths and the reward/KL curve."""
    from transformers import AutoTokenizer

    from rlhf_ext.pipelines.plan import local_cluster
    from rlhf_ext.pipelines.segment_rm import train_and_save
    from rlhf_ext.runtime.io import atomic_write_json
    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer
    from rlhf_ext.zoo.builtins import resolve_dataset

    plan = plan_segment_ppo(recipe, local_cluster())  # before any model loads
    if os.environ.get("RANK", "0") == "0":
        logger.debug("%s", plan.table())
    plan.refuse_if_unrunnable()
    resolve_recipe_models(recipe.model)
    args = trl_config(recipe)
    tokenizer = AutoTokenizer.from_pretrained(recipe.model.sft_model)
    prompts = load_prompts(recipe.data, tokenizer)
    calibration = None
    if recipe.model.normalizer is None and recipe.data.calibration is not None:
        calibration = resolve_dataset(recipe.data.calibration)[recipe.data.calibration_split]
    reward_funcs = [recipe_reward_source(recipe.model)] if recipe.model.reward_source else None
    trainer = SegmentPPOTrainer(
        model=recipe.model.sft_model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=prompts,
        processing_class=tokenizer,
        calibration_dataset=calibration,
    )
    train_and_save(trainer, args.output_dir, recipe.train.resume)
    curve = [{k: h[k] for k in CURVE_KEYS if k in h} for h in trainer.state.log_history if "reward" in h]
    summary = {"engine": "trl", "model_dir": args.output_dir, "curve": curve}
    if trainer.accelerator.is_main_process:
        atomic_write_json(os.path.join(args.output_dir, "ppo_metrics.json"), summary)
    return summary


def resolve_recipe_models(model: PPOModelSection) -> None:
    """Replace ``builtin:`` names in the model section (of the SFT model, the reward model or the models a reward
    source names) by their paths, building trained builtins first."""
    from rlhf_ext.pipelines.builtins import resolve_model, resolve_reward_source_spec

    model.sft_model = resolve_model(model.sft_model)
    if model.reward_model is not None:
        model.reward_model = resolve_model(model.reward_model)
    if model.reward_source is not None:
        model.reward_source = resolve_reward_source_spec(model.reward_source)


def recipe_reward_source(model: PPOModelSection):
    """The recipe's ``model.reward_source`` loaded (``builtin:`` model names resolved)."""
    from rlhf_ext.zoo.builtins import resolve_reward_source

    return resolve_reward_source(model.reward_source, step_separator=model.step_separator)


def openrlhf_layout(recipe, cluster: Cluster) -> list[str]:
    """``train_ppo_ray``'s placement flags for ``cluster`` (its nodes' GPUs, not the driver's):

    * no GPUs (or logical ones): one (logical) GPU per role, no colocation, the HF rollout engine;
    * on-policy: every role on every GPU of every node (``--train.colocate_all``) with one vLLM engine per GPU sharing
      it (OpenRLHF's hybrid engine);
    * one-step async (``ppo.async_generation``): OpenRLHF 0.11.2 colocates only the DeepSpeed models then, so half of
      each node's GPUs go to the models (colocated) and half to vLLM engines of their own;

    with ``--X.num_nodes`` when the cluster has more than one node. ``train.openrlhf_args`` come later and win."""
    from rlhf_ext.config import RecipeError

    nodes, gpus = cluster.num_nodes, cluster.gpus_per_node
    if gpus == 0:
        return [flag for role in ROLES for flag in (f"--{role}.num_gpus_per_node", "1")]
    asynchronous = recipe.ppo.async_generation or bool(recipe.train.openrlhf_args.get("train.async_enable"))
    if asynchronous and gpus < 2:
        raise RecipeError(
            f"one-step async on OpenRLHF gives vLLM GPUs of its own: it needs at least 2 GPUs per node, the cluster "
            f"has {gpus}; set ppo.async_generation: false"
        )
    models = gpus // 2 if asynchronous else gpus
    argv = [flag for role in ROLES for flag in (f"--{role}.num_gpus_per_node", str(models))]
    if nodes > 1:
        argv += [flag for role in ROLES for flag in (f"--{role}.num_nodes", str(nodes))]
    return argv + ["--train.colocate_all", "--vllm.num_engines", str(nodes * (gpus - models if asynchronous else gpus))]


def openrlhf_argv(recipe, prompts_file: str, normalizer_path: str | None, cluster: Cluster) -> list[str]:
    """Translate a :class:`SegmentPPORecipe` into ``train_ppo_ray`` flags (+ ``--ext``) for ``cluster``
    (:func:`openrlhf_layout`)."""
    from rlhf_ext.config import per_device_micro_batch
    from rlhf_ext.openrlhf.cli_runner import flag_value, flags_from_mapping
    from rlhf_ext.pipelines.segment_rm import openrlhf_logger_flags, openrlhf_optimisation_flags

    t, ppo, seg, data = recipe.train, recipe.ppo, recipe.segment, recipe.data
    if t.num_train_epochs != math.ceil(t.num_train_epochs):  # --train.num_episodes is an integer
        raise ValueError("the OpenRLHF engine runs whole passes over the prompts: set train.num_train_epochs to an "
                         "integer, or train.max_steps")  # fmt: skip
    layout = openrlhf_layout(recipe, cluster)
    overrides = flags_from_mapping(t.openrlhf_args)

    def actor(flag: str) -> int:  # the actor's shape: train.openrlhf_args, else the layout, else OpenRLHF's 1
        return int(flag_value(overrides, flag, flag_value(layout, flag, 1)))

    ranks = actor("--actor.num_gpus_per_node") * actor("--actor.num_nodes")
    micro = per_device_micro_batch(t.batch_size, t.micro_batch_size, ranks)
    # OpenRLHF needs a rollout micro batch for every actor rank: batch x samples / micro >= ranks
    rollout_micro = max(1, min(t.micro_batch_size, t.batch_size * ppo.num_generations // ranks))
    dtype = t.openrlhf_args.get("ds.param_dtype") or ("bf16" if t.bf16 else None)
    if dtype is None:
        raise ValueError(
            "OpenRLHF trains in bf16 or fp16 only (--ds.param_dtype): set train.bf16: true, or "
            "train.openrlhf_args: {ds.param_dtype: fp16}"
        )
    argv = [
        "--actor.model_name_or_path", recipe.model.sft_model,
        *reward_flags(recipe.model),
        "--data.prompt_dataset", prompts_file,
        "--data.input_key", "prompt",
        "--data.max_len", str(data.max_prompt_length + data.max_completion_length),
        "--rollout.max_new_tokens", str(data.max_completion_length),
        "--rollout.batch_size", str(t.batch_size),
        "--rollout.micro_batch_size", str(rollout_micro),
        "--rollout.n_samples_per_prompt", str(ppo.num_generations),
        "--rollout.temperature", repr(ppo.temperature),
        "--rollout.top_p", repr(ppo.top_p),
        "--train.batch_size", str(t.batch_size),
        "--train.micro_batch_size", str(micro),
        "--train.max_epochs", "1",
        "--train.num_episodes", str(max(1, math.ceil(t.num_train_epochs))),
        "--train.seed", str(t.seed),
        "--actor.adam.lr", repr(t.learning_rate),
        *openrlhf_optimisation_flags(t, "actor."),
        "--critic.adam.lr", repr(t.critic_learning_rate),
        "--critic.max_norm", repr(t.max_grad_norm),  # the TRL engine clips the critic with the same norm
        "--actor.eps_clip", repr(ppo.clip_eps),
        "--algo.kl.init_coef", repr(ppo.kl_coef),
        "--algo.kl.estimator", ppo.kl_estimator,
        *(["--reward.clip_range", *map(repr, ppo.reward_clip_range)] if ppo.reward_clip_range else []),
        "--algo.advantage.estimator", ppo.advantage_estimator,
        "--algo.advantage.gamma", repr(ppo.gamma),
        "--algo.advantage.lambd", repr(ppo.lam),
        "--ds.zero_stage", str(t.zero_stage),
        "--ds.param_dtype", dtype,
        "--ckpt.output_dir", t.output_dir,
        "--ckpt.path", os.path.join(t.output_dir, "checkpoints"),
        "--logger.logging_steps", str(t.logging_steps),
        *layout,
        "--ext.granularity", seg.granularity,
        "--ext.interpolation", seg.interpolation,
        "--ext.chunk_size", str(seg.chunk_size),
    ]  # fmt: skip
    if not cluster.total_gpus or cluster.logical:  # the HF rollout engine on CPUs, no flash-attention
        argv += ["--ds.attn_implementation", "sdpa", "--ext.rollout_engine", "hf"]
    if t.max_steps is not None:  # OpenRLHF has no step limit: one PPO step consumes rollout.batch_size prompts
        argv += ["--data.max_samples", str(t.max_steps * t.batch_size)]
    if ppo.advantage_estimator == "gae":
        m = recipe.model
        argv += ["--critic.model_name_or_path", m.critic_model or m.reward_model or m.sft_model]
        if ppo.value_clip is not None:
            argv += ["--critic.value_clip", repr(ppo.value_clip)]
    for key in ("entropy_cutoff", "aggregation", "tau"):
        value = getattr(seg, key)
        if value is not None:
            argv += [f"--ext.{key}", str(value)]
    if normalizer_path is not None:
        argv += ["--ext.normalizer", normalizer_path]
    if t.save_steps:
        argv += ["--ckpt.save_steps", str(t.save_steps)]
    if t.resume:
        argv += ["--ckpt.load_enable"]
    if t.gradient_checkpointing:
        argv += ["--actor.gradient_checkpointing_enable"]
    if ppo.async_generation:
        argv += ["--train.async_enable", "--train.async_queue_size", "1"]
    argv += openrlhf_logger_flags(t.trl_args.get("report_to"), t.output_dir)
    return argv + overrides


def reward_flags(model: PPOModelSection) -> list[str]:
    """``train_ppo_ray``'s reward: the segment reward model (with its id, which a fitted normalizer must match), or
    ``--ext.reward_source`` scored in the experience maker."""
    from rlhf_ext.runtime.calibration import model_id

    if model.reward_source:
        return ["--ext.reward_source", model.reward_source, "--ext.step_separator", model.step_separator]
    return ["--reward.model_name_or_path", model.reward_model, "--ext.reward_model_id", model_id(model.reward_model)]


def plan_segment_ppo(recipe, cluster: Cluster) -> Plan:
    """The pre-flight plan of the recipe on ``cluster`` (:mod:`rlhf_ext.pipelines.plan`): for OpenRLHF, the exact
    ``train_ppo_ray`` command line the launch would run there, checked as the launch checks it."""
    from rlhf_ext.openrlhf.train_ppo_ray import plan_for_argv
    from rlhf_ext.pipelines.plan import size_of, trl_segment_ppo_plan

    if recipe.engine == "trl":
        return trl_segment_ppo_plan(recipe, cluster)
    argv = openrlhf_argv(recipe, os.path.join(recipe.train.output_dir, "prompts.jsonl"), None, cluster)
    plan = plan_for_argv(argv, cluster, lookup=size_of)
    plan.title = f"segment PPO (OpenRLHF train_ppo_ray, {recipe.model.sft_model})"
    return plan


def prepare_openrlhf_run(recipe, cluster: Cluster) -> tuple[list[str], dict[str, Any]]:
    """Resolve models, check the run's plan on ``cluster`` (before any model loads), write the prompt file, fit the
    normalizer if needed; returns (argv, paths)."""
    import json

    from transformers import AutoTokenizer

    from rlhf_ext.runtime.calibration import save_normalizer
    from rlhf_ext.runtime.io import atomic_write_text

    plan_segment_ppo(recipe, cluster).refuse_if_unrunnable()
    m, seg = recipe.model, recipe.segment
    resolve_recipe_models(m)
    out = recipe.train.output_dir
    prompts_file = os.path.join(out, "prompts.jsonl")
    os.makedirs(out, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(m.sft_model)
    prompts = load_prompts(recipe.data, tokenizer)
    atomic_write_text(prompts_file, "".join(json.dumps({"prompt": p}) + "\n" for p in prompts["prompt"]))
    normalizer_path = m.normalizer
    if normalizer_path is None and seg.granularity != "bandit" and seg.normalizer_kind != "none":
        normalizer_path = os.path.join(out, "normalizer.json")
        save_normalizer(fit_recipe_normalizer(recipe, tokenizer), normalizer_path)
    paths = {"prompts": prompts_file, "normalizer": normalizer_path}
    return openrlhf_argv(recipe, prompts_file, normalizer_path, cluster), paths


def fit_recipe_normalizer(recipe, tokenizer):
    """The location normalizer (paper 003 Eq. 6) of an OpenRLHF run, fitted in the driver on ``data.calibration``
    exactly as :class:`~rlhf_ext.trl.segment_ppo.DensePPOTrainer` fits it: on the reward source's spans, or on the
    segment reward model's segments (segmented by the SFT model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf_ext.runtime.calibration import fit_normalizer, model_id
    from rlhf_ext.runtime.segment_data import resolve_segment_settings
    from rlhf_ext.runtime.spans import fit_span_normalizer
    from rlhf_ext.zoo.builtins import resolve_dataset

    m, seg, data = recipe.model, recipe.segment, recipe.data
    if data.calibration is None:
        raise ValueError("set model.normalizer or data.calibration: segment rewards need a normalizer (Table 2)")
    calibration = resolve_dataset(data.calibration)[data.calibration_split]
    cutoff, aggregation, tau = resolve_segment_settings(m.reward_model, seg.entropy_cutoff, seg.aggregation, seg.tau,
                                                        warn_unrecorded=True)  # fmt: skip
    common = {"kind": seg.normalizer_kind, "basis": seg.normalizer_basis, "granularity": seg.granularity,
              "aggregation": aggregation, "tau": tau, "max_pairs": data.max_calibration_pairs}  # fmt: skip
    if m.reward_source:
        return fit_span_normalizer([recipe_reward_source(m)], tokenizer, calibration, **common)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reward_model = AutoModelForSequenceClassification.from_pretrained(m.reward_model, num_labels=1).to(device)
    return fit_normalizer(
        reward_model,
        AutoModelForCausalLM.from_pretrained(m.sft_model).to(device),
        tokenizer,
        calibration,
        entropy_cutoff=cutoff,
        chunk_size=seg.chunk_size,
        reward_model_id=model_id(m.reward_model),
        **common,
    )


def train_with_openrlhf(recipe) -> dict[str, Any]:
    """Run a :class:`~rlhf_ext.pipelines.segment_ppo.SegmentPPORecipe` with OpenRLHF's Ray PPO on the cluster the run
    gets (vLLM rollouts on GPUs, the HF rollout engine without them)."""
    from rlhf_ext.openrlhf.plan import detect_cluster
    from rlhf_ext.openrlhf.train_ppo_ray import main as train_ppo_ray

    cluster = detect_cluster()
    argv, paths = prepare_openrlhf_run(recipe, cluster)
    train_ppo_ray(argv, cluster=cluster)
    return {"engine": "openrlhf", "model_dir": recipe.train.output_dir, **paths}
