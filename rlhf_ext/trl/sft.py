"""The package's one supervised fine-tuning routine (the demo's SFT stage, the simulator's SFT-based methods and the
test fixtures' ``builtin:tiny-sft`` all call it): TRL's ``SFTTrainer`` on ``prompt``/``completion`` rows with the loss
on completions only, or :class:`~rlhf_ext.trl.KLRegularizedSFTTrainer` when ``kl_coef > 0``, saved atomically."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from rlhf_ext.config import TrainSection


def fine_tune(
    model: Any, rows: list[dict[str, str]], out: str | Path, train: TrainSection, *, seed: int,
    max_length: int = 1024, tokenizer: Any = None, kl_coef: float = 0.0, ref_model: Any = None,
    disable_tqdm: bool = False, report_to: str | list[str] = "none",
) -> str:  # fmt: skip
    """Fine-tune ``model`` (a checkpoint path or a loaded model) on ``rows`` and write model + tokenizer to ``out``.

    Args:
        model: path of the initial checkpoint, or a ``PreTrainedModel`` (then ``tokenizer`` is required).
        rows: ``[{"prompt": ..., "completion": ...}]``; must not be empty.
        out: destination directory, written atomically; ``str(out)`` is returned.
        train: the optimisation settings (:class:`~rlhf_ext.config.TrainSection`); ``max_steps`` 0 saves the initial
            model unchanged.
        kl_coef, ref_model: Quark's KL penalty to ``ref_model`` (a path or a model) per completion token.
        report_to: TRL's logging integrations; TensorBoard events are saved in ``out/runs``.
    """
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    from rlhf_ext.runtime.io import atomic_directory
    from rlhf_ext.trl.args import CPU_RUN, check_report_to, keep_tensorboard_logs, training_kwargs
    from rlhf_ext.trl.console import use_console_output
    from rlhf_ext.trl.kl_sft import KLRegularizedSFTTrainer, KLSFTConfig

    out = Path(out)
    if not rows:
        raise ValueError(f"no training rows for {out.name}; check the data splits and sample counts")
    if isinstance(model, (str, Path)):
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(model)
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if tokenizer is None:
        raise ValueError("fine_tune: pass tokenizer= with a loaded model")
    check_report_to(report_to)
    with atomic_directory(out) as tmp:
        if train.max_steps != 0:
            fields = {**training_kwargs(train, str(tmp / "trainer"), seed), **CPU_RUN, **train.trl_args}
            fields.update(disable_tqdm=disable_tqdm, report_to=report_to)
            args = KLSFTConfig(**fields, kl_coef=kl_coef, max_length=max_length, completion_only_loss=True)
            common = dict(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
            if kl_coef > 0:
                if ref_model is None:
                    raise ValueError("fine_tune: kl_coef > 0 needs ref_model=")
                if isinstance(ref_model, (str, Path)):
                    ref_model = AutoModelForCausalLM.from_pretrained(ref_model, dtype=torch.float32)
                trainer = KLRegularizedSFTTrainer(**common, ref_model=ref_model)
            else:
                trainer = SFTTrainer(**common)
            keep_tensorboard_logs(trainer, tmp / "runs" / "sft")  # the trainer's output_dir is deleted below
            use_console_output(trainer)
            trainer.train()
            shutil.rmtree(tmp / "trainer", ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return str(out)
