"""The segment reward-model recipe :class:`SegmentRMRecipe` (``recipes/segment_rm_*.yaml`` map onto it 1:1), shared
by both engines: :func:`run_segment_rm` dispatches to the TRL or OpenRLHF adapter.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from rlhf_ext.algos.knobs import check_knobs, knob, knob_like, seed_knob
from rlhf_ext.algos.segment_reward import SegmentRewardKnobs
from rlhf_ext.config import TrainSection

Engine = Literal["trl", "openrlhf"]


@dataclass
class ModelSection:
    """``sft_model``: the SFT checkpoint (path, hub id or ``builtin:tiny-sft``); the reward model is initialised from
    it and it segments the data. ``tokenizer``: defaults to the SFT model's."""

    sft_model: str = "builtin:tiny-sft"
    tokenizer: str | None = None


@dataclass
class PreferenceDataSection:
    """Where the preference pairs come from and how they are cut to length (prompt left, response right)."""

    train: str = "builtin:toy-keyphrase"
    train_split: str = "train"
    eval: str | None = None
    eval_split: str = "test"
    prompt_key: str | None = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    max_length: int = knob(512, ge=2)
    max_prompt_length: int | None = knob(None, ge=1)
    max_train_samples: int | None = knob(None, ge=1)
    max_eval_samples: int | None = knob(None, ge=1)

    def __post_init__(self):
        check_knobs(self)
        if self.max_prompt_length is not None and self.max_prompt_length >= self.max_length:
            raise ValueError(
                f"max_prompt_length ({self.max_prompt_length}) must be < max_length ({self.max_length}), or no "
                "tokens are left for the responses"
            )


@dataclass
class SegmentSection(SegmentRewardKnobs):
    """Paper 003's knobs (:class:`~rlhf_ext.algos.segment_reward.SegmentRewardKnobs`, same names and defaults as the
    TRL config and OpenRLHF's ``--ext.*``) plus the batch size of the one-time entropy pass."""

    entropy_batch_size: int = knob(8, ge=1)


@dataclass
class RMTrainSection(TrainSection):
    """Optimisation settings (:class:`~rlhf_ext.config.TrainSection`), the same keys on both engines. ``trl_args`` /
    ``openrlhf_args`` pass engine-native options through unchanged (``SegmentRewardConfig`` fields, or OpenRLHF flags
    without the leading dashes, e.g. ``{ds.adam_offload: true}``)."""

    output_dir: str = "runs/segment_rm"
    learning_rate: float = knob_like(TrainSection, "learning_rate", 1e-3)
    adam_betas: tuple[float, float] = knob((0.9, 0.95), ge=0, lt=1)
    seed: int = seed_knob(42)
    save_steps: int | None = knob(None, ge=1)
    resume: bool = True
    zero_stage: int = knob(2, ge=0, le=3)
    segment_cache_dir: str | None = None
    openrlhf_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class SegmentRMRecipe:
    """Segment-level reward model training (paper 003, section 2.2, Algorithm 1 first half)."""

    engine: Engine = "trl"
    model: ModelSection = field(default_factory=ModelSection)
    data: PreferenceDataSection = field(default_factory=PreferenceDataSection)
    segment: SegmentSection = field(default_factory=SegmentSection)
    train: RMTrainSection = field(default_factory=RMTrainSection)

    @classmethod
    def engine_config_fields(cls) -> set[str]:
        """Field names of the TRL config this recipe builds (flat TrlParser-style keys go to ``train.trl_args``)."""
        from rlhf_ext.trl.segment_reward import SegmentRewardConfig

        return {f.name for f in fields(SegmentRewardConfig)}


#: Why a segment reward-model run has no held-out accuracy, and the fix (the summary's ``eval_skipped``).
NO_EVAL_SPLIT = (
    "not measured: {source} has no '{split}' split, so the model was trained without evaluation; give a held-out "
    "set with data.eval (a file or dataset) or data.eval_split (a split of {source})"
)


def load_preference_splits(data: PreferenceDataSection):
    """(train, eval-or-None) ``datasets.Dataset`` for a recipe's data section, with columns checked up front."""
    from rlhf_ext.runtime.segment_data import check_preference_columns
    from rlhf_ext.zoo.builtins import resolve_dataset

    def pick(source: str, split: str, limit: int | None, what: str):
        dd = resolve_dataset(source)
        if split not in dd:
            raise ValueError(f"data.{what}: {source!r} has no split {split!r} (splits: {', '.join(dd)})")
        ds = dd[split]
        check_preference_columns(ds.column_names, data.chosen_key, data.rejected_key, f"data.{what} ({source})")
        if data.prompt_key not in (None, "prompt") and data.prompt_key not in ds.column_names:
            raise ValueError(
                f"data.{what} ({source}) has no prompt column {data.prompt_key!r}; "
                f"columns: {', '.join(ds.column_names)}"
            )
        if limit is not None:
            ds = ds.select(range(min(limit, len(ds))))
        if len(ds) == 0:
            raise ValueError(f"data.{what} ({source}, split {split!r}) is empty")
        return ds

    train = pick(data.train, data.train_split, data.max_train_samples, "train")
    eval_source = data.eval or data.train
    try:
        eval_ds = pick(eval_source, data.eval_split, data.max_eval_samples, "eval")
    except ValueError:
        if data.eval is not None:
            raise
        eval_ds = None  # the training source has no eval split and none was configured
    return train, eval_ds


def write_segment_report(model_dir: str, eval_rows, data: PreferenceDataSection, out_dir: str, n: int = 4):
    """Score ``n`` held-out pairs with the trained reward model; write ``segment_report.html`` and ``.txt``."""
    from rlhf_ext.runtime.io import atomic_write_text
    from rlhf_ext.runtime.token_scores import SegmentScorer, render_html

    scorer = SegmentScorer(model_dir)
    views, lines = [], []
    for row in eval_rows.select(range(min(n, len(eval_rows)))):
        prompt = row.get(data.prompt_key) if data.prompt_key else None
        for side, key in (("chosen", data.chosen_key), ("rejected", data.rejected_key)):
            view = scorer.score(prompt, row[key])
            views.append(view)
            lines.append(f"[{side}] {view.prompt!r}\n{view.as_text()}\n")
    out = Path(out_dir)
    html_path, txt_path = out / "segment_report.html", out / "segment_report.txt"
    atomic_write_text(html_path, render_html(views, "Segment rewards on held-out pairs (chosen, then rejected)"))
    atomic_write_text(txt_path, "\n".join(lines))
    return {"html": str(html_path), "text": str(txt_path)}


def run_segment_rm(recipe: SegmentRMRecipe) -> dict[str, Any]:
    """Train a segment reward model with the recipe's engine in its locked output directory
    (:func:`~rlhf_ext.runtime.rundir.claim_output_dir`), after its pre-flight plan on this launch's GPUs
    (:func:`rlhf_ext.pipelines.plan.segment_rm_plan`); returns a summary (paths, final metrics)."""
    from rlhf_ext.pipelines.plan import local_cluster, segment_rm_plan
    from rlhf_ext.runtime.rundir import claim_output_dir

    segment_rm_plan(recipe, local_cluster()).refuse_if_unrunnable()
    m, d = recipe.model, recipe.data
    inputs = {
        "model.sft_model": m.sft_model,
        "model.tokenizer": m.tokenizer,
        "data.train": d.train,
        "data.eval": d.eval,
    }
    with claim_output_dir(recipe.train.output_dir, inputs, "train.output_dir"):
        return train_with_trl(recipe) if recipe.engine == "trl" else train_with_openrlhf(recipe)


def trl_config(recipe):
    """Map a :class:`~rlhf_ext.pipelines.segment_rm.SegmentRMRecipe` onto TRL's config (``train.trl_args`` last)."""
    from rlhf_ext.trl.args import make_config, training_kwargs
    from rlhf_ext.trl.segment_reward import SegmentRewardConfig

    kwargs = training_kwargs(recipe.train)
    seg = recipe.segment
    kwargs.update(
        eval_strategy="epoch",
        max_length=recipe.data.max_length,
        entropy_cutoff=seg.entropy_cutoff,
        aggregation=seg.aggregation,
        tau=seg.tau,
        entropy_batch_size=seg.entropy_batch_size,
        segment_cache_dir=recipe.train.segment_cache_dir,
    )
    return make_config(SegmentRewardConfig, kwargs, recipe.train.trl_args)


def train_with_trl(recipe) -> dict[str, Any]:
    """Run a :class:`~rlhf_ext.pipelines.segment_rm.SegmentRMRecipe` with TRL; returns paths and final eval metrics."""
    from transformers import AutoTokenizer
    from transformers.trainer_utils import IntervalStrategy

    from rlhf_ext.pipelines.builtins import resolve_model
    from rlhf_ext.runtime.io import atomic_write_json
    from rlhf_ext.runtime.segment_data import prepare_segment_dataset
    from rlhf_ext.trl.segment_reward import SegmentRewardTrainer

    args = trl_config(recipe)
    sft_path = resolve_model(recipe.model.sft_model)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(recipe.model.tokenizer or sft_path))
    train_ds, eval_ds = load_preference_splits(recipe.data)
    if recipe.data.prompt_key and recipe.data.prompt_key not in train_ds.column_names:
        recipe.data.prompt_key = None
    prepare = _prepare_kwargs(recipe, tokenizer, sft_path, recipe.data.prompt_key)
    train_prepared = prepare_segment_dataset(train_ds, **prepare)
    eval_prepared = prepare_segment_dataset(eval_ds, **prepare) if eval_ds is not None else None
    if eval_prepared is None:  # no held-out split (e.g. one .jsonl file): train without evaluation and say so in
        args.eval_strategy = IntervalStrategy.NO  # the summary, with the fix (data.eval / data.eval_split)
    args.sft_model_name_or_path = sft_path
    trainer = SegmentRewardTrainer(
        model=sft_path, args=args, train_dataset=train_prepared, eval_dataset=eval_prepared, processing_class=tokenizer
    )
    train_and_save(trainer, args.output_dir, recipe.train.resume)
    metrics = (final_evaluation(trainer) or trainer.evaluate()) if eval_prepared is not None else {}
    summary: dict[str, Any] = {"engine": "trl", "model_dir": args.output_dir, "eval": metrics}
    if eval_prepared is None:
        summary["eval_skipped"] = NO_EVAL_SPLIT.format(source=recipe.data.train, split=recipe.data.eval_split)
    if trainer.accelerator.is_main_process:
        if eval_ds is not None:
            summary["report"] = write_segment_report(args.output_dir, eval_ds, recipe.data, args.output_dir)
        atomic_write_json(os.path.join(args.output_dir, "metrics.json"), summary)
    return summary


def train_and_save(trainer, output_dir: str, resume: bool) -> None:
    """Train (one terminal line per logging step; from the last checkpoint in ``output_dir`` when ``resume``), then
    save the model to ``output_dir``."""
    from rlhf_ext.trl.args import last_checkpoint
    from rlhf_ext.trl.console import use_console_output

    use_console_output(trainer)
    trainer.train(resume_from_checkpoint=last_checkpoint(output_dir, resume))
    trainer.save_model(output_dir)


def _prepare_kwargs(recipe, tokenizer, sft_path: str, prompt_key: str | None) -> dict[str, Any]:
    """The recipe's ``prepare_segment_dataset`` settings (tokenisation, SFT entropies), the same on both engines."""
    d = recipe.data
    return dict(
        tokenizer=tokenizer,
        sft_model_name_or_path=sft_path,
        max_length=d.max_length,
        max_prompt_length=d.max_prompt_length,
        prompt_key=prompt_key,
        chosen_key=d.chosen_key,
        rejected_key=d.rejected_key,
        entropy_batch_size=recipe.segment.entropy_batch_size,
        cache_dir=recipe.train.segment_cache_dir,
    )


def final_evaluation(trainer) -> dict[str, float] | None:
    """The evaluation the trainer already logged at its last step (``eval_strategy`` epoch or steps), as
    ``trainer.evaluate()`` returns it, so the held-out set is not scored twice; ``None`` when there is none."""
    state = trainer.state
    for entry in reversed(state.log_history):
        if "eval_loss" in entry:
            return {k: v for k, v in entry.items() if k != "step"} if entry.get("step") == state.global_step else None
    return None


def openrlhf_logger_flags(report_to: str | list[str] | None, output_dir: str) -> list[str]:
    """OpenRLHF 0.11.2's logger flags for TRL's ``report_to`` (from ``train.trl_args``, where a flat ``--report_to``
    puts it): ``tensorboard`` -> ``--logger.tensorboard_dir OUTPUT_DIR/runs``; ``wandb`` -> ``--logger.wandb.key``
    with a placeholder (OpenRLHF logs to wandb when that flag is set and logs in only when wandb has no key yet, so
    wandb reads the real key from ``WANDB_API_KEY`` or ``wandb login``, never the logged config) and
    ``--logger.wandb.project`` from ``WANDB_PROJECT``. With both, OpenRLHF logs to wandb only."""
    from rlhf_ext.config import RecipeError, report_integrations
    from rlhf_ext.trl.args import check_report_to

    names = report_integrations(report_to)
    if "all" in names:
        names = ["tensorboard", "wandb"]
    unsupported = sorted(set(names) - {"tensorboard", "wandb"})
    if unsupported:
        raise RecipeError(
            f"report_to: the OpenRLHF engine logs to tensorboard or wandb only, not {', '.join(unsupported)}; "
            "use engine: trl for other integrations"
        )
    check_report_to(names)
    flags: list[str] = []
    if "tensorboard" in names:
        flags += ["--logger.tensorboard_dir", os.path.join(output_dir, "runs")]
    if "wandb" in names:
        flags += ["--logger.wandb.key", OPENRLHF_WANDB_KEY_PLACEHOLDER]
        if os.environ.get("WANDB_PROJECT"):
            flags += ["--logger.wandb.project", os.environ["WANDB_PROJECT"]]
    return flags


def openrlhf_optimisation_flags(train, prefix: str = "") -> list[str]:
    """The ``train`` section's optimisation keys as OpenRLHF flags (``prefix``: ``actor.`` / ``critic.`` in
    ``train_ppo_ray``, none in ``train_rm``): weight decay, scheduler (``cosine`` is OpenRLHF's
    ``cosine_with_min_lr``), warm-up ratio and gradient clip."""
    scheduler = "cosine_with_min_lr" if train.lr_scheduler_type == "cosine" else train.lr_scheduler_type
    return [
        f"--{prefix}adam.weight_decay", repr(train.weight_decay),
        f"--{prefix}lr_scheduler", scheduler,
        f"--{prefix}lr_warmup_ratio", repr(train.warmup_ratio),
        f"--{prefix}max_norm", repr(train.max_grad_norm),
    ]  # fmt: skip


#: The value of OpenRLHF's ``--logger.wandb.key`` (its on-switch for wandb): wandb itself reads the real key.
OPENRLHF_WANDB_KEY_PLACEHOLDER = "from-wandb-login-or-WANDB_API_KEY"


def openrlhf_argv(recipe, dataset_dir: str, eval_dir: str | None) -> list[str]:
    """Translate a :class:`~rlhf_ext.pipelines.segment_rm.SegmentRMRecipe` into ``train_rm`` flags (+ ``--ext.*``)."""
    import torch

    from rlhf_ext.config import per_device_micro_batch
    from rlhf_ext.openrlhf.cli_runner import flags_from_mapping

    t = recipe.train
    cpu = not torch.cuda.is_available()
    micro = per_device_micro_batch(t.batch_size, t.micro_batch_size, int(os.environ.get("WORLD_SIZE", "1")))
    argv = [
        "--model.model_name_or_path", recipe.model.sft_model,
        "--data.dataset", dataset_dir,
        "--data.dataset_split", "train",
        "--data.max_len", str(recipe.data.max_length),
        "--ckpt.output_dir", t.output_dir,
        "--ckpt.path", os.path.join(t.output_dir, "checkpoints"),
        "--ckpt.save_steps", str(t.save_steps or -1),
        "--train.max_epochs", str(max(1, math.ceil(t.num_train_epochs))),
        "--train.batch_size", str(t.batch_size),
        "--train.micro_batch_size", str(micro),
        "--train.seed", str(t.seed),
        "--adam.lr", repr(t.learning_rate),
        "--adam.betas", repr(t.adam_betas[0]), repr(t.adam_betas[1]),
        *openrlhf_optimisation_flags(t),
        "--logger.logging_steps", str(t.logging_steps),
        "--ds.zero_stage", str(t.zero_stage),
        "--ds.param_dtype", "bf16",
        "--ds.attn_implementation", "sdpa" if cpu else "flash_attention_2",
        "--ext.entropy_cutoff", repr(recipe.segment.entropy_cutoff),
        "--ext.aggregation", recipe.segment.aggregation,
        "--ext.tau", repr(recipe.segment.tau),
        "--ext.sft_model", recipe.model.sft_model,
    ]  # fmt: skip
    if recipe.data.max_prompt_length is not None:
        argv += ["--ext.max_prompt_length", str(recipe.data.max_prompt_length)]
    if eval_dir is not None:
        argv += ["--eval.dataset", eval_dir, "--eval.split", "train"]
    if t.resume:
        argv += ["--ckpt.load_enable"]
    if t.gradient_checkpointing:
        argv += ["--model.gradient_checkpointing_enable"]
    argv += openrlhf_logger_flags(t.trl_args.get("report_to"), t.output_dir)
    return argv + flags_from_mapping(t.openrlhf_args)


def train_with_openrlhf(recipe) -> dict[str, Any]:
    """Run a :class:`SegmentRMRecipe` with OpenRLHF's ``train_rm`` (in this process), on data prepared once and saved
    next to the output, so every rank of a ``deepspeed`` launch reads the same prepared rows."""
    from rlhf_ext.openrlhf.segment_rm import run_train_rm
    from rlhf_ext.pipelines.builtins import resolve_model
    from rlhf_ext.runtime.io import atomic_directory, atomic_write_json, build_once
    from rlhf_ext.runtime.segment_data import prepare_segment_dataset

    if recipe.train.num_train_epochs != math.ceil(recipe.train.num_train_epochs):
        raise ValueError("the OpenRLHF engine trains whole epochs: set train.num_train_epochs to an integer")
    if recipe.train.max_steps is not None:  # train_rm has no step limit: the key would be ignored
        raise ValueError(
            "the OpenRLHF engine trains whole epochs (train_rm has no step limit): remove train.max_steps and set "
            "train.num_train_epochs, or use --engine trl"
        )
    recipe.model.sft_model = resolve_model(recipe.model.sft_model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(recipe.model.tokenizer or recipe.model.sft_model))
    data_root = os.path.join(recipe.train.output_dir, "prepared_data")
    train_ds, eval_ds = load_preference_splits(recipe.data)
    prompt_key = recipe.data.prompt_key if recipe.data.prompt_key in train_ds.column_names else None

    def prepare(ds, path: Path) -> None:
        prepared = prepare_segment_dataset(ds, **_prepare_kwargs(recipe, tokenizer, recipe.model.sft_model, prompt_key))
        with atomic_directory(path) as tmp:
            prepared.save_to_disk(str(tmp))

    dirs = {
        name: str(build_once(Path(data_root, name), functools.partial(prepare, ds), "dataset_info.json"))
        for name, ds in (("train", train_ds), ("eval", eval_ds))
        if ds is not None
    }
    run_train_rm(openrlhf_argv(recipe, dirs["train"], dirs.get("eval")))
    summary: dict[str, Any] = {"engine": "openrlhf", "model_dir": recipe.train.output_dir, "eval": {}}
    if int(os.environ.get("RANK", "0")) == 0:
        if eval_ds is not None:
            from datasets import load_from_disk

            from rlhf_ext.runtime.token_scores import preference_accuracy

            seg = recipe.segment
            out = recipe.train.output_dir
            eval_prepared = load_from_disk(dirs["eval"])
            summary["eval"] = preference_accuracy(out, eval_prepared, seg.entropy_cutoff, seg.aggregation, seg.tau)
            summary["report"] = write_segment_report(out, eval_ds, recipe.data, out)
        atomic_write_json(os.path.join(recipe.train.output_dir, "metrics.json"), summary)
    return summary
