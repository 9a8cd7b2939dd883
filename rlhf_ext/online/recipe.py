"""The online-DPO recipe: one typed config that YAML files map onto 1:1 (papers 004 and 001).

``recipes/online_dpo_tiny.yaml`` (CPU, seconds) and ``recipes/online_dpo_paper.yaml`` (paper 004's settings) are
instances of :class:`OnlineDPORecipe`. :func:`run_online_dpo` runs one with the TRL adapter
(:class:`rlhf_ext.trl.IterativeDPOTrainer`); OpenRLHF has no iterative or online DPO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from rlhf_ext.config import TrainSection
from rlhf_ext.online.selection import check_num_samples


@dataclass
class PolicySection:
    """``sft_model``: the SFT checkpoint = ``pi_0`` (path, hub id or ``builtin:tiny-sft``). ``reference``: ``sft``
    (the paper's authors) or ``previous`` (the iterate being trained, as some public scripts do)."""

    sft_model: str = "builtin:tiny-sft"
    tokenizer: str | None = None
    reference: Literal["sft", "previous"] = "sft"


@dataclass
class RewardSection:
    """Exactly one of ``model`` (a reward-model checkpoint: sequence classification or an rlhf-ext segment RM,
    ``kind: auto`` tells them apart) or ``function`` (``builtin:keyphrase-gold`` or ``package.module:callable``
    taking ``(prompts, responses)`` and returning one score per response — the simulator's annotators plug in
    here). ``gold``: an optional second scorer reported at evaluation only."""

    model: str | None = None
    kind: Literal["auto", "segment", "sequence_classification"] = "auto"
    function: str | None = None
    gold: str | None = None
    batch_size: int = 32

    def __post_init__(self):
        if (self.model is None) == (self.function is None):
            raise ValueError("set exactly one of reward.model (a checkpoint) or reward.function (a callable)")


@dataclass
class PromptSection:
    """Where prompts come from (any dataset with a prompt column; preference datasets work, their responses are
    ignored). ``eval`` defaults to ``train`` (its ``eval_split``) when that split exists, else the evaluation uses
    the first training prompts (not held out). ``as_chat``: wrap plain-text
    prompts as a user message so they go through the chat template (for chat / instruct models); prompts that are
    already message lists are used as they are."""

    train: str = "builtin:toy-keyphrase"
    train_split: str = "train"
    eval: str | None = None
    eval_split: str = "test"
    prompt_key: str = "prompt"
    as_chat: bool = False
    max_train_prompts: int | None = None
    max_eval_prompts: int | None = 64


@dataclass
class OnlineSection:
    """Papers 004 / 001 knobs (defaults: the papers'). ``mode: iterative`` is Algorithm 2; ``mode: online`` is one
    DPO update per generated batch with ``async_generation`` one step off-policy (paper 001) or synchronous;
    ``generator_process`` runs the generator in its own process instead of a thread (no interpreter-lock
    contention; HF generation, picklable reward)."""

    mode: Literal["iterative", "online"] = "iterative"
    async_generation: bool = True
    generator_process: bool = False
    iterations: int = 3
    prompts_per_iteration: int | None = None
    num_samples: int = 8
    temperatures: list[float] = field(default_factory=lambda: [0.7, 1.0])
    max_new_tokens: int = 256
    max_prompt_length: int | None = None
    top_p: float = 1.0
    top_k: int = 0
    selection: Literal["max_min", "max_random", "random"] = "max_min"
    length_penalty: float = 0.0
    length_unit: Literal["chars", "tokens"] = "chars"
    tie_tolerance: float = 0.0
    pair_data: Literal["accumulate", "latest"] = "accumulate"
    generation_backend: Literal["auto", "hf", "vllm"] = "auto"
    generation_batch_size: int = 64
    eval_samples_per_prompt: int = 2
    eval_temperature: float = 1.0
    max_fill_rounds: int = 4
    generation_threads: int | None = None
    training_threads: int | None = None
    vllm_gpu_memory_utilization: float = 0.3

    def __post_init__(self):
        check_num_samples(self.num_samples, "online.num_samples")
        if self.iterations < 1:
            raise ValueError(f"online.iterations must be >= 1, got {self.iterations}")
        if self.length_penalty < 0 or not math.isfinite(self.length_penalty):
            raise ValueError(f"online.length_penalty must be >= 0, got {self.length_penalty}")
        if not self.temperatures or any(t <= 0 for t in self.temperatures):
            raise ValueError(f"online.temperatures must be positive numbers, got {self.temperatures}")


@dataclass
class DPOTrainSection(TrainSection):
    """The inner DPO runs (paper 004: lr 5e-7, 2 epochs, cosine, warm-up 0.03, global batch 128, beta 0.1).
    ``batch_size`` is the global batch in pairs. ``max_steps``: online mode's number of updates (default: one pass
    over the prompts). ``save_steps`` writes resumable ``DPOTrainer`` checkpoints. ``trl_args``: extra
    ``DPOConfig`` fields passed through unchanged (e.g. ``{label_smoothing: 0.1}``)."""

    output_dir: str = "runs/online_dpo"
    epochs: float = 2.0
    batch_size: int = 128
    micro_batch_size: int = 8
    learning_rate: float = 5e-7
    beta: float = 0.1
    loss_type: str = "sigmoid"
    max_length: int | None = 2048
    seed: int = 42
    save_steps: int | None = None
    resume: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.beta <= 0:
            raise ValueError(f"beta (the DPO KL coefficient) must be > 0, got {self.beta}")


@dataclass
class OnlineDPORecipe:
    """Iterative best/worst-of-n online DPO (paper 004, Algorithm 2) or per-batch async online DPO (paper 001)."""

    policy: PolicySection = field(default_factory=PolicySection)
    reward: RewardSection = field(default_factory=lambda: RewardSection(function="builtin:keyphrase-gold"))
    data: PromptSection = field(default_factory=PromptSection)
    online: OnlineSection = field(default_factory=OnlineSection)
    train: DPOTrainSection = field(default_factory=DPOTrainSection)


def run_online_dpo(recipe: OnlineDPORecipe) -> dict[str, Any]:
    """Run an :class:`OnlineDPORecipe` with TRL; returns the trainer's summary."""
    from rlhf_ext.trl.online_dpo import train_online_dpo

    return train_online_dpo(recipe)
