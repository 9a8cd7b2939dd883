"""One mapping from a recipe's ``train`` section to TRL/transformers ``TrainingArguments`` keywords.

Every TRL adapter's ``recipe_to_config`` starts from :func:`training_kwargs`, adds its method's own fields, and builds
its config with :func:`make_config`, so the batch arithmetic, CPU defaults and error messages exist once.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

import torch

T = TypeVar("T")

#: ``TrainingArguments`` keywords of a quiet single-process CPU run (the simulator, benchmarks, tests): float32 on the
#: CPU, no logging integrations, no checkpoints, no gradient checkpointing, no progress bars. Recipes go through
#: :func:`training_kwargs` instead.
CPU_RUN: dict[str, Any] = dict(
    bf16=False,
    use_cpu=True,
    report_to="none",
    save_strategy="no",
    gradient_checkpointing=False,
    disable_tqdm=True,
)


def training_kwargs(train: Any, output_dir: str | None = None, seed: int | None = None) -> dict[str, Any]:
    """``TrainingArguments`` keywords from a recipe ``train`` section.

    Reads ``batch_size`` (global, per optimizer step) and ``micro_batch_size`` (per device) and derives the gradient
    accumulation from the world size; ``epochs``, ``max_steps``, ``learning_rate``, ``lr_scheduler``, ``warmup_ratio``,
    ``max_grad_norm``, ``seed``, ``logging_steps``, ``bf16`` and ``gradient_checkpointing`` map one to one, and the
    optional ``weight_decay``, ``adam_betas`` and ``save_steps`` when the section has them. CPU runs get ``use_cpu``.
    """
    from rlhf_ext.config import RecipeError

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if train.batch_size % (train.micro_batch_size * world):
        raise RecipeError(
            f"train.batch_size ({train.batch_size}) must be a multiple of micro_batch_size x processes "
            f"({train.micro_batch_size} x {world})"
        )
    seed = train.seed if seed is None else seed
    save_steps = getattr(train, "save_steps", None)
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir or train.output_dir,
        num_train_epochs=train.epochs,
        max_steps=train.max_steps if train.max_steps is not None else -1,
        per_device_train_batch_size=train.micro_batch_size,
        per_device_eval_batch_size=train.micro_batch_size,
        gradient_accumulation_steps=train.batch_size // (train.micro_batch_size * world),
        learning_rate=train.learning_rate,
        lr_scheduler_type=train.lr_scheduler,
        warmup_steps=train.warmup_ratio,  # transformers 5: a float < 1 is a ratio of the total steps
        max_grad_norm=train.max_grad_norm,
        seed=seed,
        data_seed=seed,
        logging_steps=train.logging_steps,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        bf16=train.bf16,
        gradient_checkpointing=train.gradient_checkpointing,
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
    )
    if hasattr(train, "weight_decay"):
        kwargs["weight_decay"] = train.weight_decay
    if hasattr(train, "adam_betas"):
        kwargs["adam_beta1"], kwargs["adam_beta2"] = train.adam_betas
    return kwargs


def make_config(config_cls: type[T], kwargs: dict[str, Any], trl_args: dict[str, Any] | None = None) -> T:
    """``config_cls(**kwargs)`` with the recipe's ``train.trl_args`` applied last; bad keys name the fix."""
    from rlhf_ext.config import RecipeError

    kwargs = {**kwargs, **(trl_args or {})}
    try:
        return config_cls(**kwargs)
    except TypeError as e:
        raise RecipeError(f"train.trl_args: {e} (keys must be {config_cls.__name__} fields)") from e


def last_checkpoint(output_dir: str | os.PathLike, resume: bool = True) -> str | None:
    """The newest ``checkpoint-*`` directory under ``output_dir`` to resume from (``None``: start fresh)."""
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(str(output_dir)) if resume and os.path.isdir(output_dir) else None
