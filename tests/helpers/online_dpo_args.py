"""The small iterative / online DPO configuration the TRL adapter tests share (tiny model, CPU, a few steps)."""

from __future__ import annotations

from pathlib import Path

from rlhf_ext.trl import IterativeDPOConfig
from rlhf_ext.trl.args import CPU_RUN


def make_args(out: Path, **kw) -> IterativeDPOConfig:
    """``IterativeDPOConfig`` for a tiny CPU run into ``out``; ``kw`` overrides any field."""
    base = dict(
        output_dir=str(out),
        num_iterations=2,
        prompts_per_iteration=8,
        num_generations=4,
        max_completion_length=64,
        learning_rate=1e-4,
        num_train_epochs=1,
        per_device_train_batch_size=4,
        beta=0.1,
        lr_scheduler_type="constant",
        **CPU_RUN,
        logging_steps=100,
        eval_num_prompts=4,
        eval_samples_per_prompt=1,
        eval_temperature=0.7,
        max_length=160,
        seed=0,
    )
    base.update(kw)
    return IterativeDPOConfig(**base)
