"""The small TRL runs of the simulator (:mod:`rlhf_ext.sim`) and the demo, which reach an engine only through this
package: supervised fine-tuning and offline DPO (online DPO: :func:`~rlhf_ext.pipelines.iterative_dpo.train_online`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_ext.runtime.io import atomic_directory

if TYPE_CHECKING:
    from rlhf_ext.config import TrainSection


def fine_tune(*args: Any, **kwargs: Any) -> str:
    """:func:`rlhf_ext.trl.sft.fine_tune` (TRL's ``SFTTrainer``); returns the output directory."""
    from rlhf_ext.trl.sft import fine_tune

    return fine_tune(*args, **kwargs)


def train_dpo(
    model: str, rows: list[dict[str, Any]], out: Path, train: TrainSection, *, seed: int, **config: Any
) -> None:
    """TRL's ``DPOTrainer`` on CPU from ``model`` (its float32 copy the reference) on the preference ``rows``, the
    model and tokenizer saved into ``out`` atomically; ``train``: a recipe's optimisation settings, ``config``: the
    other :class:`trl.DPOConfig` fields (``beta``, ``max_length``)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from rlhf_ext.trl.args import CPU_RUN, optimisation_kwargs
    from rlhf_ext.trl.console import use_console_output

    tokenizer = AutoTokenizer.from_pretrained(model)
    with atomic_directory(out) as tmp:
        args = DPOConfig(output_dir=str(tmp / "trainer"), seed=seed, **optimisation_kwargs(train), **config, **CPU_RUN)
        ref_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        trainer = DPOTrainer(
            model=model,
            ref_model=ref_model,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
        )
        use_console_output(trainer)
        trainer.train()
        trainer.save_model(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        shutil.rmtree(tmp / "trainer", ignore_errors=True)
