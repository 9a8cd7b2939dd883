"""Building the trained ``builtin:`` models (``tiny-sft``, ``tiny-segment-rm``): :mod:`rlhf_ext.zoo` never trains;
the pipelines call :func:`resolve_model` here, which builds what is missing first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlhf_ext.runtime.io import atomic_directory, build_once
from rlhf_ext.zoo import builtins as zoo
from rlhf_ext.zoo.toy import toy_preference_rows


def train_tiny_sft(dest: Path, base: str | Path, steps: int = 300, seed: int = 0) -> None:
    """Supervised fine-tuning of ``base`` on the toy task's chosen *and* rejected responses with TRL's SFTTrainer:
    segmentation needs low entropy inside a phrase and high entropy where the next phrase is chosen."""
    from rlhf_ext.config import TrainSection
    from rlhf_ext.trl.sft import fine_tune

    rows = toy_preference_rows(zoo.TOY_CORPUS_ROWS, seed=12345)
    demos = [{"prompt": r["prompt"], "completion": r[k]} for r in rows for k in ("chosen", "rejected")]
    train = TrainSection(max_steps=steps, batch_size=32, micro_batch_size=32, learning_rate=3e-3,
                         warmup_ratio=10 / steps, logging_steps=50)  # 10 warmup steps  # fmt: skip
    fine_tune(base, demos, dest, train, seed=seed, disable_tqdm=True)


_DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "CROSS_RANK", "CROSS_SIZE")  # fmt: skip


def build_model(name: str, cache_dir: str | Path | None = None) -> str:
    """Build ``builtin:<name>`` into the cache once (:func:`~rlhf_ext.runtime.io.build_once`) if it is missing; returns
    its directory. Inside a ``torchrun``/``deepspeed`` launch the build runs in a plain subprocess (training there
    would join the launch's process group while the other ranks wait for the lock: a deadlock)."""
    spec = zoo.PREFIX + name
    if name not in zoo.TRAINED_MODELS:
        return zoo.resolve_model(spec, cache_dir)
    dest = zoo.builtin_model_dir(name, cache_dir)
    if (dest / "config.json").exists():
        return str(dest)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_ENV}
        code = f"from rlhf_ext.pipelines.builtins import build_model; build_model({name!r}, {str(dest.parents[1])!r})"
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        return str(dest)

    def build(path: Path) -> None:
        if name == "tiny-sft":
            return train_tiny_sft(path, zoo.resolve_model(zoo.PREFIX + "tiny", cache_dir))
        # tiny-segment-rm: recipes/segment_rm_tiny.yaml trained from tiny-sft
        from rlhf_ext.config import load_recipe
        from rlhf_ext.pipelines.segment_rm import SegmentRMRecipe, run_segment_rm  # noqa: I001

        sft = build_model("tiny-sft", cache_dir)
        recipe_file = Path(__file__).parents[1] / "recipes" / "segment_rm_tiny.yaml"
        with atomic_directory(path) as tmp:
            recipe = load_recipe(SegmentRMRecipe, recipe_file, [f"train.output_dir={tmp}", f"model.sft_model={sft}"])
            run_segment_rm(recipe)

    return str(build_once(dest, build, "config.json"))


def resolve_model(spec: str, cache_dir: str | Path | None = None) -> str:
    """:func:`rlhf_ext.zoo.resolve_model`, building a trained ``builtin:`` model first when it is missing."""
    if zoo.is_builtin(spec) and spec[len(zoo.PREFIX) :] in zoo.TRAINED_MODELS:
        return build_model(spec[len(zoo.PREFIX) :], cache_dir)
    return zoo.resolve_model(spec, cache_dir)


def resolve_reward_source_spec(spec: str) -> str:
    """:func:`rlhf_ext.zoo.resolve_reward_source_spec`, building a trained ``builtin:`` model it names first."""
    kind, _, rest = spec.partition(":")
    model = rest if kind in ("prm", "segment-rm") else spec
    if zoo.is_builtin(model) and model[len(zoo.PREFIX) :] in zoo.BUILTIN_MODELS:
        resolve_model(model)
    return zoo.resolve_reward_source_spec(spec)


def load_tokenizer(spec: str, flag: str):
    """The tokenizer of ``spec`` (a model or tokenizer directory, a hub id or a ``builtin:`` model); one that none
    loads from raises a one-line :class:`FileNotFoundError` naming the option ``flag`` it came from."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(resolve_model(spec))
    except (OSError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FileNotFoundError(
            f"{flag} {spec!r}: no tokenizer loads from it ({reason}); give a model or tokenizer directory, a hub id "
            "or a builtin: model"
        ) from None
