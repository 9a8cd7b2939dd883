"""The simulated task of ``sim compare``: AlpacaFarm-like splits (section 3.1) of one stage of an offline-generated
:mod:`rlhf_ext.datagen` dataset (one style) or of the toy task, columns ``prompt``, ``chosen``, ``rejected``, ``style``:

* ``sft`` / ``pref`` / ``unlabeled``: disjoint parts of the stage's train split (``task.sft_fraction`` /
  ``task.pref_fraction`` / the rest), in a fixed shuffled order;
* ``eval``: the first ``task.max_eval_prompts`` rows of the stage's test split (prompts for the win rate);
* ``rm_eval``: the whole test split, gold-ordered pairs (held-out reward-model accuracy).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rlhf_ext.sim.recipe import TaskSection

COLUMNS = ("prompt", "chosen", "rejected", "style")


def _toy_rows(n: int, seed: int) -> list[dict[str, Any]]:
    from rlhf_ext.zoo.toy import toy_preference_rows

    return [{**r, "style": "toy"} for r in toy_preference_rows(n, seed)]


def _datagen_stage(task: TaskSection, workdir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from rlhf_ext.datagen import generate_dataset, load_continual_dataset

    out = workdir / "datagen"
    if not (out / "continual_dataset.json").exists():
        generate_dataset(task.source, out, overrides=task.overrides, num_samples=task.num_samples, progress=False)
    stages = load_continual_dataset(out)
    if not 0 <= task.stage < len(stages):
        raise ValueError(f"task.stage {task.stage} does not exist: {task.source} has {len(stages)} stage(s)")
    dd = stages[task.stage]
    for split in ("train", "test"):
        if split not in dd:
            raise ValueError(f"stage {task.stage} of {task.source} has no {split!r} split; set the task's test_ratio")
    if "style" not in dd["train"].column_names or any(s is None for s in dd["train"]["style"]):
        raise ValueError(
            f"stage {task.stage} of {task.source} has rows without a phrase-bank style; the gold scorer needs one "
            "(set style: in the task config)"
        )

    def rows(split):
        return [{k: r[k] + task.prompt_suffix if k == "prompt" else r[k] for k in COLUMNS} for r in dd[split].to_list()]

    return rows("train"), rows("test")


def build_task_splits(task: TaskSection, workdir: str | Path, seed: int = 0):
    """The ``DatasetDict`` of the task (see the module docstring); deterministic for a given task section."""
    from datasets import Dataset, DatasetDict

    workdir = Path(workdir)
    if task.source == "toy":
        n_test = max(task.max_eval_prompts, task.num_samples // 8)
        train, test = _toy_rows(task.num_samples, seed), _toy_rows(n_test, seed + 10_000)
    else:
        train, test = _datagen_stage(task, workdir)
    random.Random(seed).shuffle(train)
    n_sft = round(task.sft_fraction * len(train))
    n_pref = round(task.pref_fraction * len(train))
    parts = {
        "sft": train[:n_sft],
        "pref": train[n_sft : n_sft + n_pref],
        "unlabeled": train[n_sft + n_pref :],
        "eval": test[: task.max_eval_prompts],
        "rm_eval": test,
    }
    empty = [k for k, v in parts.items() if not v]
    if empty:
        raise ValueError(
            f"task split(s) {', '.join(empty)} are empty ({len(train)} train / {len(test)} test rows); raise "
            "task.num_samples"
        )
    return DatasetDict({k: Dataset.from_list(v) for k, v in parts.items()})


def task_texts(splits) -> list[str]:
    """All prompt and response texts of the SFT and PREF splits (what a task tokenizer is trained on)."""
    return [r[k] for name in ("sft", "pref") for r in splits[name] for k in ("prompt", "chosen", "rejected")]


def build_base_model(dest: str | Path, texts: list[str], vocab_size: int, seed: int) -> str:
    """A tiny Llama (2 layers, hidden 64) with a byte-level BPE tokenizer trained on ``texts``, saved at ``dest``."""
    from rlhf_ext.zoo.models import save_tiny_checkpoint, tiny_causal_lm
    from rlhf_ext.zoo.tokenizer import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(texts, vocab_size)
    save_tiny_checkpoint(dest, model=tiny_causal_lm(tokenizer, seed=seed), tokenizer=tokenizer)
    return str(dest)
