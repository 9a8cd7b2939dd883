"""The segment-PPO recipe (paper 003, section 2.3; Table 8 defaults), shared by the TRL and OpenRLHF engines.

``recipes/segment_ppo_tiny.yaml`` (CPU, a few steps), ``segment_ppo_paper.yaml`` (Table 8) and
``segment_ppo_openrlhf.yaml`` (OpenRLHF Ray, one-step async) are instances of :class:`SegmentPPORecipe`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rlhf_ext.config import TrainSection
from rlhf_ext.segment.core import check_cutoff, check_tau


@dataclass
class PPOModelSection:
    """``sft_model``: policy and reference initialisation; ``reward_model``: the segment RM (its
    ``segment_config.json`` supplies cutoff/aggregation/tau); ``critic_model``: default the reward model;
    ``normalizer``: a saved LocationNormalizer (null = fit on ``data.calibration``)."""

    sft_model: str = "builtin:tiny-sft"
    reward_model: str = "builtin:tiny-segment-rm"
    critic_model: str | None = None
    normalizer: str | None = None


@dataclass
class PPODataSection:
    prompts: str = "builtin:toy-keyphrase"
    prompt_split: str = "train"
    prompt_key: str = "prompt"
    max_prompts: int | None = None
    calibration: str | None = "builtin:toy-keyphrase"
    calibration_split: str = "train"
    max_calibration_pairs: int = 512
    max_prompt_length: int = 1024
    max_completion_length: int = 1024


@dataclass
class PPOSegmentSection:
    """Table 1-3 switches. ``entropy_cutoff``/``aggregation``/``tau`` null = the reward model's recorded values."""

    granularity: Literal["segment", "token", "bandit", "bandit_as_segment", "segment_as_bandit"] = "segment"
    interpolation: Literal["even_split", "repeat", "segment_end"] = "even_split"
    normalizer_kind: Literal["none", "global", "last", "regression"] = "regression"
    normalizer_basis: Literal["linear", "log"] = "linear"
    entropy_cutoff: float | None = None
    aggregation: Literal["softmax", "sum", "mean"] | None = None
    tau: float | None = None

    def __post_init__(self):
        if self.entropy_cutoff is not None:
            check_cutoff(self.entropy_cutoff)
        if self.tau is not None:
            check_tau(self.tau)


@dataclass
class PPOAlgoSection:
    """PPO settings (Table 8 / OpenRLHF defaults)."""

    kl_coef: float = 0.01
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    advantage_estimator: Literal["gae", "reinforce", "reinforce_baseline"] = "gae"
    gamma: float = 1.0
    lam: float = 0.95
    clip_eps: float = 0.2
    value_clip: float | None = 0.25
    num_generations: int = 2
    temperature: float = 1.0
    top_p: float = 1.0
    whiten_advantages: bool = True
    async_generation: bool = False  # TRL engine: one-step off-policy rollouts (paper 001); OpenRLHF: train.async_enable

    def __post_init__(self):
        if self.kl_coef < 0:
            raise ValueError(f"ppo.kl_coef must be >= 0, got {self.kl_coef}")
        if self.num_generations < 1:
            raise ValueError(f"ppo.num_generations must be >= 1, got {self.num_generations}")


@dataclass
class PPOTrainSection(TrainSection):
    """:class:`~rlhf_ext.config.TrainSection` with ``batch_size`` = rollouts per optimizer step (global),
    ``micro_batch_size`` per device, and the critic's own learning rate."""

    output_dir: str = "runs/segment_ppo"
    batch_size: int = 128
    learning_rate: float = 5e-7
    critic_learning_rate: float = 9e-6
    logging_steps: int = 1
    seed: int = 42
    save_steps: int | None = None
    resume: bool = True
    zero_stage: int = 2
    openrlhf_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class SegmentPPORecipe:
    """Segment-level PPO (paper 003, Algorithm 1 second half)."""

    engine: Literal["trl", "openrlhf"] = "trl"
    model: PPOModelSection = field(default_factory=PPOModelSection)
    data: PPODataSection = field(default_factory=PPODataSection)
    segment: PPOSegmentSection = field(default_factory=PPOSegmentSection)
    ppo: PPOAlgoSection = field(default_factory=PPOAlgoSection)
    train: PPOTrainSection = field(default_factory=PPOTrainSection)


def run_segment_ppo(recipe: SegmentPPORecipe) -> dict[str, Any]:
    """Train with the recipe's engine; returns a summary (paths, reward/KL curve)."""
    if recipe.engine == "trl":
        from rlhf_ext.trl.segment_ppo import train_segment_ppo

        return train_segment_ppo(recipe)
    from rlhf_ext.openrlhf.segment_ppo import train_segment_ppo

    return train_segment_ppo(recipe)
