"""A streaming ``trl.DPOTrainer`` for iterative best/worst-of-n online DPO (paper 004) and one-step asynchronous
online DPO (paper 001); every DPO run it makes is a plain ``trl.DPOTrainer`` on the pairs collected so far.

- ``online_mode="iterative"`` (paper 004 section 3.3, Algorithm 2): one DPO run per iteration ``t`` from ``pi_t`` on
  the stored (or latest) pairs against ``pi_0`` or ``pi_t``, saved as ``pi_{t+1}``
  (:func:`rlhf_ext.runtime.iterations.run_iterations` over ``trainer.iteration_steps``).
- ``online_mode="online"`` (paper 001 sections 3.5 and 4.2): one DPO run on a stream of pairs generated one step
  ahead (:mod:`rlhf_ext.trl.online_stream`).

Every step whose result exists in ``output_dir`` is skipped, so a killed run resumes and, with the same seed, ends
with the same pairs and weights as an uninterrupted one.

Example::

    trainer = IterativeDPOTrainer(
        "my-sft-checkpoint",
        reward_funcs="my-reward-model",            # or a callable (prompts, responses) -> one score per response
        args=IterativeDPOConfig(output_dir="runs/idpo", num_iterations=3, num_generations=8, beta=0.1),
        train_dataset=prompt_dataset,              # a "prompt" column (text or chat messages), or a list
    )
    out = trainer.train()      # TrainOutput: global_step = DPO optimizer steps run, training_loss, metrics
    trainer.summary            # pairs and evaluation of every iteration (also output_dir/summary.json)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import shutil
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_utils import TrainOutput
from trl import DPOConfig, DPOTrainer

from rlhf_ext.algos.knobs import check_knob, knob, knob_like
from rlhf_ext.algos.names import knob_values
from rlhf_ext.algos.pair_selection import OnlineDPOKnobs, OnlineSamplingKnobs
from rlhf_ext.runtime.async_runner import RunnerStats, torch_threads
from rlhf_ext.runtime.io import atomic_directory, commit_directory, temporary_sibling
from rlhf_ext.runtime.iterations import POLICIES_DIR, IterationRun, run_iterations
from rlhf_ext.runtime.rewards import RewardFn, SequenceClassifierReward, load_reward, segment_reward_as_e_phi
from rlhf_ext.runtime.sampling import is_conversation, split_temperatures
from rlhf_ext.trl.args import HardwareBF16Default
from rlhf_ext.trl.online_stream import StreamDPOTrainer, dpo_dataset, train_online
from rlhf_ext.trl.release import free_memory_without_collection, release_trainer_run

logger = logging.getLogger(__name__)


@dataclass
class IterativeDPOConfig(OnlineDPOKnobs, OnlineSamplingKnobs, HardwareBF16Default, DPOConfig):
    """``DPOConfig`` (the inner DPO runs) plus the knobs of papers 004 / 001
    (:class:`~rlhf_ext.algos.pair_selection.OnlineDPOKnobs`), the sampling settings
    (:class:`~rlhf_ext.algos.pair_selection.OnlineSamplingKnobs`) and:

    Args:
        reference: ``sft`` (the SFT model, as the paper's authors did) or ``previous`` (the iterate being trained).
        resume: continue a run found in ``output_dir`` (``False``: refuse to touch an existing run).
    """

    max_new_tokens: int | None = knob(None, ge=1, help="Deprecated: use max_completion_length.")
    num_samples: int | None = knob_like(OnlineDPOKnobs, "num_generations", None, help="Deprecated: num_generations.")
    reference: str = field(default="sft", metadata={"help": "sft | previous"})
    reward_batch_size: int = knob(32, ge=1, help="Sequences per reward-model forward.")
    eval_num_prompts: int | None = knob(64, ge=1, help="Evaluation prompts (None: all).")
    vllm_kwargs: dict[str, Any] | None = field(default=None, metadata={"help": "Extra vllm.LLM arguments."})
    resume: bool = field(default=True, metadata={"help": "Continue a run found in output_dir."})

    #: renamed settings -> their old names (the deprecated aliases, and the keys ``run.json`` records them under)
    recorded_names: ClassVar[dict[str, str]] = {
        "max_completion_length": "max_new_tokens",
        "num_generations": "num_samples",
    }

    def __post_init__(self):
        for new, old in self.recorded_names.items():
            if getattr(self, old) is not None:  # checked under its own name, then moved to TRL's name
                check_knob(type(self), old, getattr(self, old))
                warnings.warn(
                    f"IterativeDPOConfig({old}=...) is deprecated and will be removed in the next release; use {new}= "
                    "(TRL's name, as in GRPOConfig)",
                    DeprecationWarning,
                    stacklevel=3,
                )
                setattr(self, new, getattr(self, old))
        super().__post_init__()
        split_temperatures(self.num_generations, self.temperatures)
        if self.reference not in ("sft", "previous"):
            raise ValueError(f"reference must be one of sft, previous; got {self.reference!r}")

    def settings(self) -> dict[str, Any]:
        """What a run's pairs and weights depend on (a resumed run with any of them changed is refused)."""
        keys = [
            "max_completion_length", "max_prompt_length", "top_p", "top_k", "reference", "seed",
            # the inner DPO runs
            "beta", "loss_type", "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay",
            "num_train_epochs", "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
            "max_length", "max_grad_norm",
        ]  # fmt: skip
        out = {**knob_values(self, OnlineDPOKnobs), **{k: getattr(self, k) for k in keys}}
        for name, recorded in self.recorded_names.items():
            out[recorded] = out.pop(name)
        return json.loads(json.dumps(out, default=str))  # enums (lr_scheduler_type) as their strings


# ------------------------------------------------------------------------------------------------------ inputs
def _prompt_list(prompts, prompt_key: str, name: str = "train_dataset") -> list[Any]:
    if prompts is None:
        raise ValueError(f"`{name}` is required: a dataset with a {prompt_key!r} column, or a list of prompts")
    if hasattr(prompts, "column_names"):
        if prompt_key not in prompts.column_names:
            raise ValueError(
                f"the prompt dataset has no {prompt_key!r} column (columns: {', '.join(prompts.column_names)}); "
                "pass prompt_key="
            )
        prompts = prompts[prompt_key]
    prompts = list(prompts)
    if not prompts:
        raise ValueError(f"the prompt set ({name}) is empty")
    for i, p in enumerate(prompts):
        if not (isinstance(p, str) or is_conversation(p)):
            raise ValueError(f"prompt {i} is neither text nor a list of chat messages: {p!r}")
    return prompts


def _prompt_dataset(given, prompts: list[Any], prompt_key: str):
    """The prompts as the ``train_dataset`` the ``DPOTrainer`` base holds (its DPO runs get pair datasets)."""
    from datasets import Dataset

    if hasattr(given, "select_columns"):
        return given.select_columns([prompt_key])
    try:
        return Dataset.from_dict({prompt_key: prompts})
    except Exception:  # text and chat prompts mixed: Arrow wants one type per column
        return Dataset.from_dict({"prompt_index": list(range(len(prompts)))})


def _deprecated(old: str, value: Any, new: str, current: Any) -> Any:
    """The value of a renamed keyword: ``value`` (with a DeprecationWarning) or ``current``; both is an error."""
    if value is None:
        return current
    if current is not None:
        raise ValueError(f"pass {new}= only; {old}= is its deprecated name")
    msg = f"IterativeDPOTrainer({old}=...) is deprecated and will be removed in the next release; use {new}= instead"
    warnings.warn(msg, DeprecationWarning, stacklevel=4)
    return value


def _checked_arguments(reward_funcs, args, train_dataset, eval_dataset, optimizers, peft_config, *, prompts,
                       eval_prompts, reward_fn, reward_model) -> tuple[Any, IterativeDPOConfig, Any, Any]:  # fmt: skip
    """``(reward_funcs, args, train_dataset, eval_dataset)`` checked, with their deprecated names resolved."""
    if isinstance(reward_funcs, TrainingArguments):
        raise TypeError(
            "IterativeDPOTrainer takes TRL's argument order (model, reward_funcs, args, train_dataset, ...); "
            "pass the config as args="
        )
    train_dataset = _deprecated("prompts", prompts, "train_dataset", train_dataset)
    eval_dataset = _deprecated("eval_prompts", eval_prompts, "eval_dataset", eval_dataset)
    if reward_fn is not None and not callable(reward_fn):
        raise TypeError("reward_fn must be callable: (prompts, responses) -> one score per response")
    given = [r for r in (reward_funcs, reward_fn, reward_model) if r is not None]
    if len(given) != 1:
        raise ValueError(
            "pass exactly one reward: reward_funcs= (a callable (prompts, responses) -> scores, a reward-model "
            "path or hub id, or a loaded reward model)"
        )
    reward_funcs = _deprecated("reward_fn", reward_fn, "reward_funcs", reward_funcs)
    reward_funcs = _deprecated("reward_model", reward_model, "reward_funcs", reward_funcs)

    args = args if args is not None else IterativeDPOConfig(output_dir="iterative-dpo")
    if not isinstance(args, IterativeDPOConfig):
        raise TypeError(f"args must be an IterativeDPOConfig, got {type(args).__name__}")
    if tuple(optimizers) != (None, None):
        raise ValueError(
            "optimizers= is not supported: every DPO run loads its policy from disk and builds its optimizer "
            "from args (optim, learning_rate, lr_scheduler_type, ...)"
        )
    if peft_config is not None and args.online_mode == "online":
        raise ValueError("peft_config works with online_mode='iterative' only (per-batch mode publishes full weights)")
    return reward_funcs, args, train_dataset, eval_dataset


def _reward_function(reward_funcs, processing_class, batch_size: int) -> RewardFn:
    """One ``(prompts, responses) -> scores`` function from TRL-style ``reward_funcs`` (a callable, a reward-model
    path / hub id, a loaded sequence-classification model, or a list holding one of those)."""
    if isinstance(reward_funcs, list | tuple):
        if len(reward_funcs) != 1:
            raise ValueError(
                f"IterativeDPOTrainer ranks responses by one reward, got {len(reward_funcs)} in reward_funcs; "
                "combine them into one callable (prompts, responses) -> scores, e.g. their weighted sum"
            )
        reward_funcs = reward_funcs[0]
    if isinstance(reward_funcs, str | os.PathLike):
        return load_reward(str(reward_funcs), batch_size=batch_size)
    if isinstance(reward_funcs, torch.nn.Module):
        segment_reward_as_e_phi(reward_funcs, "reward_funcs")  # a loaded segment reward model is refused
        return SequenceClassifierReward(reward_funcs, tokenizer=processing_class, batch_size=batch_size)
    if callable(reward_funcs):
        return reward_funcs
    raise TypeError(
        "reward_funcs must be a callable (prompts, responses) -> one score per response, a reward-model path or "
        f"hub id, or a loaded reward model; got {type(reward_funcs).__name__}"
    )


# ------------------------------------------------------------------------------------------------------ trainer
class IterativeDPOTrainer(DPOTrainer):
    """``trl.DPOTrainer`` that trains on preference pairs as they are collected (see the module docstring).

    Args:
        model: the SFT checkpoint ``pi_0`` (path or hub id), or a causal LM (saved once; pass ``processing_class``).
        reward_funcs: a callable ``(prompts, responses) -> scores`` (one per response), a reward-model checkpoint
            or hub id (sequence classification or rlhf-ext segment RM), a loaded sequence-classification model, or a
            list holding one of those.
        train_dataset: the prompts: a ``datasets.Dataset`` with a ``prompt_key`` column or a list of prompts (text
            or chat messages).
        eval_dataset: held-out prompts for the evaluation of each policy (default: the training prompts).
        callbacks: ``transformers`` callbacks, added to every DPO run.
        optimizers: must stay ``(None, None)`` (each DPO run builds its optimizer from ``args``).
        peft_config: a ``peft.PeftConfig`` (per-iteration mode only): each ``pi_{t+1}`` is saved merged.
        ref_model: path of the SFT reference (default: ``model``), or a causal LM (saved once).
        gold_fn: an extra scorer reported at evaluation only (e.g. a gold reward).
        prompt_key: the prompt column of dataset inputs.
        prompts, eval_prompts, reward_fn, reward_model: deprecated names of ``train_dataset``, ``eval_dataset`` and
            ``reward_funcs``.

    Attributes:
        summary: after :meth:`train`: per-iteration pairs and evaluations (``iterations``, ``eval``,
            ``final_policy``, ``skipped_iterations``) or, per-batch, ``runner``, ``updates``, ``resumed_from_update``;
            also ``output_dir/summary.json``.
        model: the policy of the current (or last) DPO run; ``pi_0`` before :meth:`train`.
    """

    _tag_names = ["trl", "dpo", "online-dpo", "rlhf-ext"]
    _name = "Iterative DPO"

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: IterativeDPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config=None,
        *,
        ref_model=None,
        gold_fn: RewardFn | None = None,
        prompt_key: str = "prompt",
        prompts=None,
        eval_prompts=None,
        reward_fn: RewardFn | None = None,
        reward_model=None,
    ):
        from accelerate import PartialState
        from transformers import AutoTokenizer

        reward_funcs, args, train_dataset, eval_dataset = _checked_arguments(
            reward_funcs, args, train_dataset, eval_dataset, optimizers, peft_config,
            prompts=prompts, eval_prompts=eval_prompts, reward_fn=reward_fn, reward_model=reward_model,
        )  # fmt: skip
        self.args = args  # (Trainer sets it again; _load_model reads it before)
        self._dist = PartialState()
        self.root = Path(args.output_dir)
        self.prompts = _prompt_list(train_dataset, prompt_key)
        self.eval_prompts = (
            self.prompts if eval_dataset is None else _prompt_list(eval_dataset, prompt_key, "eval_dataset")
        )[: args.eval_num_prompts]
        if processing_class is None:
            if not isinstance(model, str | Path):
                raise ValueError("pass processing_class= (the tokenizer) when the model is already instantiated")
            processing_class = AutoTokenizer.from_pretrained(str(model))
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        # every DPO run and every sampler loads its policy from disk: instantiated models are saved once, atomically
        self.sft_path = self._as_path(model, "policy_000", processing_class)
        self.ref_path = self.sft_path if ref_model is None else self._as_path(ref_model, "reference", processing_class)
        self.reward_fn = _reward_function(reward_funcs, processing_class, args.reward_batch_size)
        self.iteration_steps = IterationRun(
            args, self.prompts, self.eval_prompts, self.sft_path, self.ref_path, processing_class, self.reward_fn,
            gold_fn, self._dist, engine=self,
        )  # fmt: skip
        self.summary: dict[str, Any] | None = None
        self.runner_stats: RunnerStats | None = None
        self._user_callbacks = list(callbacks or [])
        self._peft_config = peft_config
        self._dpo_run: DPOTrainer | None = None  # the current (or last) DPO run
        self._steps_run, self._loss_sum = 0, 0.0
        self._given_models = weakref.WeakSet([model] if isinstance(model, torch.nn.Module) else [])
        # (DPOTrainer would load the reference of an instantiated model from its config's name)
        base_ref = None if isinstance(model, str | Path) else self._load_model(self.ref_path)
        super().__init__(
            model=str(model) if isinstance(model, Path) else model,
            ref_model=base_ref,
            args=args,
            train_dataset=_prompt_dataset(train_dataset, self.prompts, prompt_key),
            processing_class=processing_class,
            callbacks=callbacks,
            peft_config=copy.deepcopy(peft_config),
        )

    def _as_path(self, model, name: str, processing_class) -> str:
        if isinstance(model, str | Path):
            return str(model)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"expected a checkpoint path or a causal LM, got {type(model).__name__}")
        path = self.root / POLICIES_DIR / name
        if not (path / "config.json").exists() and self._dist.is_main_process:
            with atomic_directory(path) as tmp:
                model.save_pretrained(tmp)
                processing_class.save_pretrained(tmp)
        self._dist.wait_for_everyone()
        return str(path)

    # ---------------------------------------------------------------------------------- DPOTrainer overrides
    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if "chosen" not in (dataset.column_names or []):
            return dataset  # the prompts: pairs are tokenised per DPO run, as they are collected
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def _precompute_ref_logps(self, dataset, name, batch_size):
        if "chosen" not in (dataset.column_names or []):
            return dataset
        return super()._precompute_ref_logps(dataset, name, batch_size)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs) -> TrainOutput:
        """Run (or resume, automatically: ``resume_from_checkpoint`` only ``None`` / ``True``) the schedule in
        ``args.online_mode``.

        Returns:
            ``TrainOutput``: ``global_step`` = DPO optimizer steps this call ran (steps restored from checkpoints are
            not counted), ``training_loss`` = their mean loss, ``metrics`` (also logged); details in :attr:`summary`.
        """
        if resume_from_checkpoint not in (None, True) or trial is not None or kwargs:
            raise ValueError(
                "IterativeDPOTrainer.train() resumes from args.output_dir on its own (args.resume); it takes no "
                f"resume_from_checkpoint path, trial or {', '.join(kwargs) or 'other'} arguments"
            )
        start = time.perf_counter()
        self._steps_run, self._loss_sum = 0, 0.0
        if self.args.online_mode == "online":
            self.iteration_steps.open_run()
            summary = train_online(self)
        else:
            summary = run_iterations(self.iteration_steps)  # paper 004's Algorithm 2, steps 1-7
        return self._train_output(summary, time.perf_counter() - start)

    # ------------------------------------------------------------------------------ the engine-free steps
    def open_run(self):
        """Check ``output_dir`` against this run's settings (:meth:`IterationRun.open_run`)."""
        return self.iteration_steps.open_run()

    def policy_path(self, t: int) -> str | None:
        """Checkpoint of ``pi_t`` (``pi_0`` = SFT), or None if it does not exist yet."""
        return self.iteration_steps.policy_path(t)

    def evaluate_policy(self, t: int) -> dict[str, Any]:
        """Step 7: the evaluation of ``pi_t`` (:meth:`IterationRun.evaluate_policy`)."""
        return self.iteration_steps.evaluate_policy(t)

    def _load_model(self, path: str):
        from trl.trainer.utils import create_model_from_path

        return create_model_from_path(path, **dict(self.args.model_init_kwargs or {}))

    def _release_dpo_run(self, keep_model: bool = False) -> None:
        """Drop the last DPO run's optimizer (and, unless ``keep_model``, its policy and reference; before the first
        run: this trainer's ``pi_0``) without a full garbage collection."""
        release_trainer_run(self._dpo_run or self, keep_model, self._given_models)
        if not keep_model:
            self.model = self.model_wrapped = self.ref_model = None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``Trainer.log`` through the last DPO run (its state, callbacks and console); this trainer's before it."""
        run = self._dpo_run
        return super().log(logs, start_time) if run is None else run.log(logs, start_time)

    def _run_dpo(self, model: str, ref_path: str, args: IterativeDPOConfig, train_dataset, stream=None,
                 setup: Callable[[DPOTrainer], None] | None = None) -> DPOTrainer:  # fmt: skip
        """One DPO run (a :class:`~rlhf_ext.trl.online_stream.StreamDPOTrainer` reading ``stream`` in per-batch mode)
        of ``model`` (a path) against ``ref_path`` with this trainer's callbacks and console (``setup(run)`` before
        training), from the last checkpoint in ``args.output_dir``; kept until the next run releases it."""
        from rlhf_ext.trl.args import CheckpointRecords, last_checkpoint
        from rlhf_ext.trl.console import console_callback_of, use_console_output

        console = console_callback_of(self._dpo_run or self)  # use_console_output(trainer) lasts over every run
        self._release_dpo_run()
        ref = self._load_model(ref_path)
        last = last_checkpoint(args.output_dir)
        run = (DPOTrainer if stream is None else StreamDPOTrainer)(
            model=model,
            ref_model=ref,
            args=args,
            train_dataset=train_dataset,
            processing_class=self.processing_class,
            callbacks=[*self._user_callbacks, CheckpointRecords()],  # rlhf-ext's record in every checkpoint
            peft_config=copy.deepcopy(self._peft_config),  # get_peft_model records the base model in it
        )
        self._dpo_run, self.model, self.model_wrapped = run, run.model, run.model_wrapped
        if console is not None:
            use_console_output(run, callback=console)
        if stream is not None:
            run.stream = stream
        if setup is not None:
            setup(run)
        with torch_threads(self.args.training_threads), free_memory_without_collection(run.accelerator):
            out = run.train(resume_from_checkpoint=last)
        self.model, self.model_wrapped = run.model, run.model_wrapped
        self.state = run.state  # trainer.state: the last run's steps and log_history, as a Trainer's after train()
        done_before = int(Path(last).name.split("-")[-1]) if last else 0
        self._steps_run += out.global_step - done_before
        self._loss_sum += out.training_loss * out.global_step  # this call's summed loss (Trainer divides by all)
        return run

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``; after :meth:`train` and without ``output_dir`` (as ``push_to_hub`` calls it): the
        run's final policy, copied into ``args.output_dir``."""
        final = (self.summary or {}).get("final_policy")
        if output_dir is not None or final is None:
            return super().save_model(output_dir, _internal_call)
        if self._dist.is_main_process:
            for file in Path(final).iterdir():
                if file.is_file():
                    shutil.copy2(file, self.root / file.name)
        self._dist.wait_for_everyone()

    def _save_policy(self, dest: Path) -> None:
        """Save the policy just trained to ``dest`` atomically (all ranks take part), a PEFT adapter merged first."""
        partial = temporary_sibling(dest, "partial")  # one name every rank agrees on
        if self._dist.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        self._dist.wait_for_everyone()
        run = self._dpo_run
        unwrapped = run.accelerator.unwrap_model(run.model)
        if hasattr(unwrapped, "merge_and_unload") and hasattr(unwrapped, "peft_config"):  # a PEFT model
            if self._dist.is_main_process:
                unwrapped.merge_and_unload().save_pretrained(str(partial))
        else:
            run.save_model(str(partial))
        if self._dist.is_main_process:
            self.processing_class.save_pretrained(str(partial))
            commit_directory(partial, dest)
        self._dist.wait_for_everyone()

    def train_policy(self, start: str, ref_path: str, rows: list[dict[str, Any]], work: Path, seed: int,
                     dest: Path) -> None:  # fmt: skip
        """Step 6's DPO run: from ``start`` on ``rows`` against ``ref_path``, in ``work``, saved to ``dest``."""
        args = dataclasses.replace(self.args, output_dir=str(work), seed=seed)
        self._run_dpo(start, ref_path, args, dpo_dataset(rows))
        self._save_policy(dest)
        self._release_dpo_run(keep_model=True)

    def _train_output(self, summary: dict[str, Any], runtime: float) -> TrainOutput:
        steps = self._steps_run
        loss = self._loss_sum / steps if steps else 0.0
        metrics: dict[str, float] = {"train_runtime": round(runtime, 4), "train_loss": loss, "dpo_steps": steps}
        final = summary["eval"][-1]
        metrics.update({f"final_{k}": final[k] for k in ("mean_reward", "mean_gold") if k in final})
        metrics["initial_mean_reward"] = summary["eval"][0]["mean_reward"]
        if summary["mode"] == "iterative":
            metrics["iterations"] = len(summary["iterations"])
            metrics["skipped_iterations"] = len(summary["skipped_iterations"])
            metrics["num_pairs"] = sum(it["pairs"]["num_pairs"] for it in summary["iterations"])
        else:
            metrics["updates"] = summary["updates"]
            metrics["resumed_from_update"] = summary["resumed_from_update"]
        self.summary = summary
        self.log(dict(metrics))
        return TrainOutput(steps, loss, metrics)
