"""One mapping from a recipe's ``train`` section to TRL/transformers ``TrainingArguments`` keywords.

Every TRL adapter's ``recipe_to_config`` starts from :func:`training_kwargs`, adds its method's own fields, and builds
its config with :func:`make_config`, so the batch arithmetic, CPU defaults and error messages exist once.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from transformers import TrainerCallback

if TYPE_CHECKING:
    from rlhf_ext.config import TrainSection

T = TypeVar("T")
logger = logging.getLogger(__name__)


def activation_checkpointing(enabled: bool) -> dict[str, bool]:
    """The ``TrainingArguments`` keyword that turns activation (gradient) checkpointing on or off
    (``activation_checkpointing`` in transformers 5.2x, ``gradient_checkpointing`` in 5.15)."""
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    return {"activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing": enabled}


class HardwareBF16Default:
    """Mixin of the TRL configs: ``bf16`` left unset defaults to TRL's ``True`` where a GPU supports bf16 and to
    ``False`` elsewhere; an explicit ``bf16`` is kept. List it right before the TRL config class."""

    def __post_init__(self) -> None:
        from transformers.utils import is_torch_bf16_gpu_available

        if self.bf16 is None and not self.fp16 and not is_torch_bf16_gpu_available():
            self.bf16 = False
        super().__post_init__()


#: ``TrainingArguments`` keywords of a quiet single-process CPU run (the simulator, benchmarks, tests): float32, no
#: logging integrations, checkpoints, gradient checkpointing or progress bars.
CPU_RUN: dict[str, Any] = dict(
    bf16=False, use_cpu=True, report_to="none", save_strategy="no", **activation_checkpointing(False), disable_tqdm=True
)


def optimisation_kwargs(train: TrainSection) -> dict[str, Any]:
    """The optimisation keywords of ``TrainingArguments`` from a recipe's ``train`` section
    (:class:`~rlhf_ext.config.TrainSection`): ``batch_size`` (global, per optimizer step) and ``micro_batch_size``
    (per device, lowered to fit the world size) give the gradient accumulation; the rest map one to one."""
    from rlhf_ext.config import per_device_micro_batch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro = per_device_micro_batch(train.batch_size, train.micro_batch_size, world)
    kwargs: dict[str, Any] = dict(
        num_train_epochs=train.num_train_epochs,
        max_steps=train.max_steps if train.max_steps is not None else -1,
        per_device_train_batch_size=micro,
        per_device_eval_batch_size=micro,
        gradient_accumulation_steps=train.batch_size // (micro * world),
        learning_rate=train.learning_rate,
        lr_scheduler_type=train.lr_scheduler_type,
        warmup_steps=train.warmup_ratio,  # transformers 5: a float < 1 is a ratio of the total steps
        weight_decay=train.weight_decay,
        max_grad_norm=train.max_grad_norm,
        logging_steps=train.logging_steps,
    )
    if hasattr(train, "adam_betas"):
        kwargs["adam_beta1"], kwargs["adam_beta2"] = train.adam_betas
    return kwargs


def training_kwargs(train: TrainSection, output_dir: str | None = None, seed: int | None = None) -> dict[str, Any]:
    """``TrainingArguments`` keywords from a recipe ``train`` section: :func:`optimisation_kwargs`, then ``seed``
    (default ``train.seed``), ``bf16``, ``gradient_checkpointing`` and the optional ``save_steps``; CPU runs get
    ``use_cpu``."""
    seed = train.seed if seed is None else seed
    save_steps = getattr(train, "save_steps", None)
    return dict(
        optimisation_kwargs(train),
        output_dir=output_dir or train.output_dir,
        seed=seed,
        data_seed=seed,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        bf16=train.bf16,
        **activation_checkpointing(train.gradient_checkpointing),
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
    )


#: The ``report_to`` integrations of transformers checked before a trainer is built (each needs the module of its name).
REPORT_TO_MODULES = ("tensorboard", "wandb", "mlflow", "comet_ml", "clearml", "dvclive", "trackio", "swanlab")


def check_report_to(report_to: str | list[str] | None) -> None:
    """Raise :class:`rlhf_ext.config.MissingOptionalPackage` when an integration ``report_to`` names is not
    installed (``"all"`` reports to whatever is installed, so it is never an error)."""
    import importlib.util

    from rlhf_ext.config import MissingOptionalPackage, report_integrations

    for name in report_integrations(report_to):
        if name in REPORT_TO_MODULES and importlib.util.find_spec(name) is None:
            raise MissingOptionalPackage(name, f"report_to={name}")


def keep_tensorboard_logs(trainer, logging_dir: str | os.PathLike) -> None:
    """Write ``trainer``'s TensorBoard events to ``logging_dir`` (when it reports to TensorBoard) instead of
    ``output_dir/runs/<time>_<host>``: for stages whose ``output_dir`` is deleted after training."""
    from transformers.integrations import TensorBoardCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, TensorBoardCallback):
            callback.logging_dir = str(logging_dir)


def make_config(config_cls: type[T], kwargs: dict[str, Any], trl_args: dict[str, Any] | None = None) -> T:
    """``config_cls(**kwargs)`` with the recipe's ``train.trl_args`` applied last (``report_to`` among them); bad
    keys name the fix, a ``report_to`` integration that is not installed names its package."""
    from rlhf_ext.config import RecipeError

    kwargs = {**kwargs, **(trl_args or {})}
    check_report_to(kwargs.get("report_to"))
    try:
        return config_cls(**kwargs)
    except TypeError as e:
        raise RecipeError(f"train.trl_args: {e} (keys must be {config_cls.__name__} fields)") from e


#: The file transformers' ``Trainer`` writes last into a ``checkpoint-N`` directory (without it: an interrupted write).
TRAINER_STATE_FILE = "trainer_state.json"
#: rlhf-ext's record in a ``checkpoint-N`` it writes: created with the directory (a checkpoint without it is never
#: deleted), rewritten after the save with every file's size (``{"files": {relative path: bytes}}``).
CHECKPOINT_RECORD = "rlhf_ext_checkpoint.json"


class CheckpointError(ValueError):
    """An output directory holds a ``checkpoint-N`` that rlhf-ext did not write and cannot resume from."""


def _record(path: Path, name: str = CHECKPOINT_RECORD) -> dict[str, Any] | None:
    """The JSON object in file ``name`` of checkpoint ``path`` (by default rlhf-ext's record: ``{}`` while being
    written), or None when there is none."""
    try:
        record = json.loads(Path(path, name).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _sizes(path: Path) -> dict[str, int]:
    files = (f for f in sorted(path.rglob("*")) if f.is_file() and f.name != CHECKPOINT_RECORD)
    return {str(f.relative_to(path)): f.stat().st_size for f in files}


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why the ``checkpoint-N`` directory ``path`` cannot be resumed from, or None when it can: no complete
    ``trainer_state.json`` (written last: the write was interrupted), a file whose size differs from the one rlhf-ext
    recorded after the save, or (checkpoints without a record) a ``.safetensors`` file shorter than its header."""
    path = Path(path)
    if "global_step" not in (_record(path, TRAINER_STATE_FILE) or {}):
        return f"no complete {TRAINER_STATE_FILE}"
    from rlhf_ext.runtime.io import weights_problem

    recorded = (_record(path) or {}).get("files")
    if recorded is None:
        return weights_problem(path)
    sizes = _sizes(path)
    for name, size in recorded.items():
        if sizes.get(name) != size:
            return f"{name} has {sizes.get(name, 0)} of the {size} bytes written"
    return None


class CheckpointRecords(TrainerCallback):
    """Writes :data:`CHECKPOINT_RECORD` into every ``checkpoint-N`` the trainer saves: an empty record with the
    directory (one rename) before the Trainer writes into it, the files' sizes after the save (``on_save``)."""

    def _folder(self, args, state) -> Path:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        return Path(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")

    def _begin(self, args, state, control, **kwargs) -> None:
        if not (control.should_save and args.should_save):
            return
        from rlhf_ext.runtime.io import atomic_write_json, temporary_sibling

        folder = self._folder(args, state)
        if folder.exists():  # a damaged checkpoint written again
            atomic_write_json(folder / CHECKPOINT_RECORD, {})
            return
        ready = temporary_sibling(folder, f"new-{os.getpid()}")
        shutil.rmtree(ready, ignore_errors=True)
        ready.mkdir(parents=True)
        atomic_write_json(ready / CHECKPOINT_RECORD, {})
        os.replace(ready, folder)

    on_step_end = on_epoch_end = _begin

    def on_save(self, args, state, control, **kwargs) -> None:
        if args.should_save:
            from rlhf_ext.runtime.io import atomic_write_json

            folder = self._folder(args, state)
            atomic_write_json(folder / CHECKPOINT_RECORD, {"files": _sizes(folder)})


def last_checkpoint(output_dir: str | os.PathLike, resume: bool = True) -> str | None:
    """The newest ``checkpoint-N`` directory under ``output_dir`` that can be resumed from (``None``: start fresh).

    Checkpoints with a :func:`checkpoint_problem` are skipped (logged). Newer ones that rlhf-ext wrote and never
    finished are removed; damaged ones are kept; an incomplete one without rlhf-ext's record raises
    :class:`CheckpointError`. ``resume=False`` returns ``None`` and touches nothing.
    """
    if not resume or not os.path.isdir(output_dir):
        return None
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    from rlhf_ext.runtime.io import temporary_sibling

    pattern = re.compile(rf"{re.escape(PREFIX_CHECKPOINT_DIR)}-(\d+)")
    matches = ((pattern.fullmatch(entry.name), entry) for entry in os.scandir(output_dir))
    found = {int(match[1]): Path(entry.path) for match, entry in matches if match and entry.is_dir()}
    problems = {step: checkpoint_problem(path) for step, path in found.items()}
    usable = max((step for step, problem in problems.items() if problem is None), default=-1)
    for step, path in sorted(found.items(), reverse=True):
        if step <= usable:
            break
        record = _record(path)
        foreign = record is None and any(path.iterdir())  # not rlhf-ext's: never deleted
        if foreign and problems[step] == f"no complete {TRAINER_STATE_FILE}":
            raise CheckpointError(
                f"{path} holds no complete checkpoint (no {TRAINER_STATE_FILE}) and was not written by rlhf-ext "
                f"(no {CHECKPOINT_RECORD}); rlhf-ext deletes only what it wrote: move it out of {output_dir} or "
                "choose another output directory"
            )
        if foreign or (record is not None and "files" in record):  # or finished, then damaged: kept
            logger.warning("%s cannot be resumed from (%s); it is kept", path, problems[step])
            continue
        # rlhf-ext's write that a kill interrupted (or an empty directory): renamed aside (one rank takes it), deleted
        aside = temporary_sibling(path, f"partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            os.replace(path, aside)
        except FileNotFoundError:  # another rank took it
            continue
        logger.warning("removed %s: rlhf-ext's write of it was interrupted (no complete %s)", path, TRAINER_STATE_FILE)
        shutil.rmtree(aside, ignore_errors=True)
    if usable < 0:
        return None
    if any(step > usable for step in found):
        logger.warning("resuming from %s, the newest checkpoint that loads", found[usable])
    return str(found[usable])
