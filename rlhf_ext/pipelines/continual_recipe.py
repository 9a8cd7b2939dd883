"""The continual-RLHF recipe :class:`ContinualRecipe`, which ``recipes/continual_*.yaml`` map onto 1:1; run by
:func:`rlhf_ext.pipelines.continual.run_continual` (DPO or PPO, on TRL).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlhf_ext.algos.continual_kl import ContinualKnobs
from rlhf_ext.algos.knobs import check_knobs, knob, knob_like, seed_knob
from rlhf_ext.algos.ppo import PPOKnobs
from rlhf_ext.config import TrainSection


@dataclass
class ContinualModelSection:
    """``sft_model``: the SFT checkpoint every task's policy descends from (path, hub id or ``builtin:tiny-sft``).
    It is also the DPO reference model (paper 000 Eq. 6) and the initialisation of per-task reward models."""

    sft_model: str = "builtin:tiny-sft"
    tokenizer: str | None = None


@dataclass
class TaskSequenceSection:
    """Where the task sequence comes from. ``tasks``: ``builtin:toy-continual-preference-shift`` /
    ``builtin:toy-continual-domains`` (:mod:`rlhf_ext.zoo.continual_toy`), or what
    ``rlhf_ext.datagen.load_continual_dataset`` reads (a dataset-generator directory or ``builtin:continual-*``).
    ``num_tasks``: the number of builtin toy tasks, or the first tasks kept of a generated sequence. ``max_length``:
    prompt + response tokens (paper 000: responses of up to 256 tokens). ``max_train_samples`` /
    ``max_test_samples`` cut every task's splits (builtin toy splits: 256 / 64 by default); ``seed``: the toy data's."""

    tasks: str = "builtin:toy-continual-preference-shift"
    num_tasks: int | None = knob(None, ge=1)
    max_length: int = knob(512, ge=2)
    max_train_samples: int | None = knob(None, ge=1)
    max_test_samples: int | None = knob(None, ge=1)
    seed: int = seed_knob(0)

    def __post_init__(self):
        check_knobs(self)


@dataclass
class ContinualSection(ContinualKnobs):
    """The KL to the previous task's policy (paper 000 Eq. 7): :class:`~rlhf_ext.algos.continual_kl.ContinualKnobs`
    plus ``continual_kl_coef_schedule``: optional weights ``[c_1, ..., c_{K-1}]``, ``c_t`` used while training task
    ``t`` against the snapshot of task ``t - 1`` (section 4: a sharp preference shift can get 0)."""

    continual_kl_coef_schedule: list[float] | None = knob_like(ContinualKnobs, "continual_kl_coef", None)

    def coef_for_task(self, index: int, num_tasks: int) -> float:
        """The KL weight used while training task ``index`` (0 for the first task, which has no predecessor)."""
        schedule = self.continual_kl_coef_schedule
        if schedule is not None and len(schedule) != num_tasks - 1:
            raise ValueError(
                f"continual.continual_kl_coef_schedule has {len(schedule)} entries but the sequence has "
                f"{num_tasks} tasks, i.e. {num_tasks - 1} transitions; give one weight per transition "
                "(into task 1 .. K-1), or remove it to use continual.continual_kl_coef everywhere"
            )
        if index == 0:
            return 0.0
        return self.continual_kl_coef if schedule is None else schedule[index - 1]


@dataclass
class DPOSection:
    """DPO settings (paper 000 Eq. 6). ``beta``: TRL's default 0.1 (paper 000 does not report it)."""

    beta: float = knob(0.1, gt=0)
    loss_type: str = "sigmoid"

    def __post_init__(self):
        check_knobs(self)


@dataclass
class PPOSection(PPOKnobs, TrainSection):
    """The ``ppo`` algorithm (CPPO-style continual PPO, paper 000 Eq. 7): each task trains the policy with
    ``DensePPOTrainer`` (bandit granularity, rewards normalized by the last-token statistics of the task's pairs)
    against that task's reward model (``reward_model.enabled``), with a KL penalty ``kl_coef`` to the SFT model in the
    reward and ``continual.continual_kl_coef`` x KL to the previous task's policy in the loss. Flat, as TRL's
    ``PPOConfig``: the :class:`~rlhf_ext.algos.ppo.PPOKnobs`, the policy's training keys in place of the DPO stage's
    ``train`` (:class:`~rlhf_ext.config.TrainSection`: ``max_steps`` per task, ``batch_size`` rollouts per step ...)
    and ``eval_prompts``."""

    max_steps: int = knob(16, ge=1)
    batch_size: int = knob_like(TrainSection, "batch_size", 16)
    micro_batch_size: int = knob_like(TrainSection, "micro_batch_size", 16)
    learning_rate: float = knob_like(TrainSection, "learning_rate", 3e-4)
    lr_scheduler_type: str = "linear"
    warmup_ratio: float = knob_like(TrainSection, "warmup_ratio", 0.0)
    logging_steps: int = knob_like(TrainSection, "logging_steps", 1)
    num_generations: int = knob(2, ge=2, help="Responses per prompt (the TRL engine samples at least 2).")
    max_completion_length: int = knob(64, ge=1)
    eval_prompts: int = knob(32, ge=1)


@dataclass
class StageTrainSection(TrainSection):
    """Optimisation settings of one per-task training stage (:class:`~rlhf_ext.config.TrainSection`).
    ``batch_size`` is the global batch (pairs); every task is trained for ``num_train_epochs`` (or ``max_steps``).
    Defaults are paper 000's DPO settings (Table 5: learning rate 5e-6, 4 epochs, batch 8)."""

    num_train_epochs: float = knob_like(TrainSection, "num_train_epochs", 4.0)
    batch_size: int = knob_like(TrainSection, "batch_size", 8)
    micro_batch_size: int = knob_like(TrainSection, "micro_batch_size", 8)
    learning_rate: float = knob_like(TrainSection, "learning_rate", 5e-6)
    lr_scheduler_type: str = "linear"
    warmup_ratio: float = knob_like(TrainSection, "warmup_ratio", 0.0)


def _rm_defaults() -> StageTrainSection:
    """Paper 000, Table 3: learning rate 1e-5, 3 epochs, batch 8, weight decay 0.01, warmup ratio 0.1."""
    return StageTrainSection(num_train_epochs=3.0, learning_rate=1e-5, weight_decay=0.01, warmup_ratio=0.1)


@dataclass
class RewardModelSection:
    """Optional per-task reward model (Appendix C): a Bradley-Terry model initialised from the SFT model, trained on
    the task's pairs and scored on every task's test split; the PPO policy stage trains against it."""

    enabled: bool = False
    train: StageTrainSection = field(default_factory=_rm_defaults)


@dataclass
class ContinualRecipe:
    """Continual RLHF over a task sequence (paper 000, section 4, Algorithm 1; :mod:`rlhf_ext.pipelines.continual`).
    ``output_dir`` holds everything; with ``resume: true`` a rerun continues after the last finished task."""

    engine: Literal["trl"] = "trl"
    algorithm: Literal["dpo", "ppo"] = "dpo"
    output_dir: str = "runs/continual"
    resume: bool = True
    seed: int = seed_knob(42)
    plots: bool = True
    model: ContinualModelSection = field(default_factory=ContinualModelSection)
    data: TaskSequenceSection = field(default_factory=TaskSequenceSection)
    continual: ContinualSection = field(default_factory=ContinualSection)
    dpo: DPOSection = field(default_factory=DPOSection)
    ppo: PPOSection = field(default_factory=lambda: PPOSection(advantage_estimator="reinforce_baseline"))
    train: StageTrainSection = field(default_factory=StageTrainSection)
    reward_model: RewardModelSection = field(default_factory=RewardModelSection)
