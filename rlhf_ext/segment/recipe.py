"""The segment reward-model recipe: one typed config that YAML files map onto 1:1, shared by both engines.

``recipes/segment_rm_tiny.yaml`` (CPU, seconds) and ``recipes/segment_rm_paper.yaml`` (Table 7) are instances of
:class:`SegmentRMRecipe`. :func:`run_segment_rm` dispatches to the TRL or OpenRLHF adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rlhf_ext.config import TrainSection
from rlhf_ext.segment.core import (
    DEFAULT_ENTROPY_CUTOFF,
    DEFAULT_TAU,
    check_aggregation,
    check_cutoff,
    check_tau,
)

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
    max_length: int = 512
    max_prompt_length: int | None = None
    max_train_samples: int | None = None
    max_eval_samples: int | None = None

    def __post_init__(self):
        if self.max_length < 2:
            raise ValueError(f"data.max_length must be >= 2, got {self.max_length}")


@dataclass
class SegmentSection:
    """Paper 003 segment settings (Table 7 defaults). ``entropy_cutoff: inf`` is the bandit model, ``0`` the token
    model."""

    entropy_cutoff: float = DEFAULT_ENTROPY_CUTOFF
    aggregation: Literal["softmax", "sum", "mean"] = "softmax"
    tau: float = DEFAULT_TAU
    entropy_batch_size: int = 8

    def __post_init__(self):
        check_cutoff(self.entropy_cutoff)
        check_tau(self.tau)
        check_aggregation(self.aggregation)


@dataclass
class RMTrainSection(TrainSection):
    """Optimisation settings (:class:`~rlhf_ext.config.TrainSection`); both engines read the same keys.

    ``save_steps`` writes resumable checkpoints; with ``resume: true`` a rerun continues from the last one.
    ``trl_args`` / ``openrlhf_args`` pass engine-native options through unchanged (``SegmentRewardConfig`` fields,
    or OpenRLHF flags without the leading dashes, e.g. ``{ds.adam_offload: true}``).
    """

    output_dir: str = "runs/segment_rm"
    learning_rate: float = 1e-3
    adam_betas: tuple[float, float] = (0.9, 0.95)
    seed: int = 42
    save_steps: int | None = None
    resume: bool = True
    zero_stage: int = 2
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


def load_preference_splits(data: PreferenceDataSection, **builtin_kwargs: Any):
    """(train, eval-or-None) ``datasets.Dataset`` for a recipe's data section, with columns checked up front."""
    from rlhf_ext.resources import resolve_dataset
    from rlhf_ext.segment.data import check_preference_columns

    def pick(source: str, split: str, limit: int | None, what: str):
        dd = resolve_dataset(source, **builtin_kwargs) if source.startswith("builtin:") else resolve_dataset(source)
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
    from pathlib import Path

    from rlhf_ext.segment.scoring import SegmentScorer, render_html
    from rlhf_ext.utils import atomic_write_text

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
    """Train a segment reward model with the recipe's engine; returns a summary (paths, final metrics)."""
    if recipe.engine == "trl":
        from rlhf_ext.trl.segment_reward import train_segment_rm

        return train_segment_rm(recipe)
    from rlhf_ext.openrlhf.segment_rm import train_segment_rm

    return train_segment_rm(recipe)
