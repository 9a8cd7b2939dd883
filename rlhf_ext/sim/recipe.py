"""The ``sim compare`` recipe: one typed config (``recipes/sim_compare.yaml`` maps onto it 1:1; paper 002, section 5).

Sections: the simulated task, the initial model and its SFT, the simulated feedback (AlpacaFarm's ``p_sim`` pool), the
surrogate reward models, sampling, the evaluation (win rate against the SFT model, judged by ``p_eval``), and one
section per method of :data:`METHODS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlhf_ext.algos.knobs import MAX_SEED, check_knobs, knob, knob_like, seed_knob
from rlhf_ext.algos.pair_selection import OnlineDPOKnobs
from rlhf_ext.algos.ppo import PPOKnobs
from rlhf_ext.algos.segment_reward import SegmentRewardKnobs
from rlhf_ext.config import RecipeError, TrainSection, load_recipe
from rlhf_ext.datagen.schema import MAX_TASK_SAMPLES
from rlhf_ext.sim.annotators import (
    DEFAULT_ANNOTATORS,
    TRAIN_FLIP_PROB,
    UNPARSEABLE_POLICIES,
    AnnotatorPool,
    AnnotatorSpec,
)
from rlhf_ext.sim.gold import GoldScorer

#: Methods in table order: AlpacaFarm's reference methods (section 3.4), then ours (papers 003, 004, 001).
METHODS: tuple[str, ...] = (
    "sft",
    "best_of_n",
    "expert_iteration",
    "feedme",
    "reward_conditioning",
    "quark",
    "dpo",
    "bandit_ppo",
    "segment_ppo",
    "chunk_ppo",
    "token_ppo",
    "rules_ppo",
    "online_dpo",
    "online_dpo_async",
    "online_dpo_sync",
)


@dataclass
class MethodTrainSection(TrainSection):
    """The ``train`` section of a simulated method's supervised or DPO run: every recipe's optimisation keys
    (:class:`~rlhf_ext.config.TrainSection`), at the tiny simulator models' ``learning_rate``."""

    learning_rate: float = knob_like(TrainSection, "learning_rate", 1e-3)


def _method_train(**values: Any):
    """A ``train`` field defaulting to ``MethodTrainSection(**values)`` (a fresh one per recipe)."""
    return field(default_factory=lambda: MethodTrainSection(**values))


@dataclass
class TaskSection:
    """The simulated task (:mod:`rlhf_ext.sim.task`): ``source`` a ``rlhf_ext.datagen`` config (packaged name or YAML
    path) generated with the offline backend, of which stage ``stage`` is used, or ``toy``; ``num_samples`` every
    datagen task's sample count, or the number of toy rows; ``prompt_suffix`` is appended to datagen prompts;
    ``phrase_credit`` the gold reward's (:class:`~rlhf_ext.sim.GoldScorer`)."""

    source: str = "continual-piecewise-preference"
    stage: int = knob(0, ge=0)
    num_samples: int = knob(800, ge=10, le=MAX_TASK_SAMPLES)
    overrides: list[str] = field(default_factory=lambda: ["drift.cycles=1"])
    sft_fraction: float = knob(0.35, gt=0, lt=1)
    pref_fraction: float = knob(0.35, gt=0, lt=1)
    max_eval_prompts: int = knob(64, ge=1)
    prompt_suffix: str = "\n"
    max_length: int = knob(256, ge=2)
    phrase_credit: Literal["partial", "exact"] = "partial"

    def __post_init__(self):
        check_knobs(self, "task.")
        if self.sft_fraction + self.pref_fraction >= 1:
            raise ValueError(
                "task.sft_fraction and task.pref_fraction must sum to < 1 (the rest are unlabeled prompts); got "
                f"{self.sft_fraction} and {self.pref_fraction}"
            )


@dataclass
class ModelSection:
    """``base``: the model SFT starts from. ``null`` builds a tiny Llama (2 layers, hidden 64) from config with a BPE
    tokenizer of ``tokenizer_vocab`` tokens trained on the task's texts; or a checkpoint path / ``builtin:`` name
    (``builtin:tiny`` for the toy task, ``builtin:smollm2`` for a real model)."""

    base: str | None = None
    tokenizer_vocab: int = knob(1024, ge=64)
    seed: int = seed_knob(0)


@dataclass
class SFTSection(TrainSection):
    """Supervised fine-tuning on the SFT split (trained once, shared by all seeds, with ``seed``): the optimisation
    keys of every recipe's ``train`` section (:class:`~rlhf_ext.config.TrainSection`) and ``responses``: ``both``
    (chosen and rejected: a policy of mixed quality, room for LPF methods) or ``chosen``."""

    responses: Literal["both", "chosen"] = "both"
    seed: int = seed_knob(0)
    max_steps: int | None = knob(200, ge=0, help="0: no training (the base model is saved as the SFT model).")
    batch_size: int = knob_like(TrainSection, "batch_size", 32)
    micro_batch_size: int = knob_like(TrainSection, "micro_batch_size", 32)
    learning_rate: float = knob_like(TrainSection, "learning_rate", 3e-3)


@dataclass
class PoolConfig:
    """A pool in a recipe: ``backend: gold`` (gold-scorer variants; ``annotators`` empty = the default six),
    ``reward_model`` (``reward_models`` paths, ``temperatures``), ``llm`` (``api_base``/``models`` of an
    OpenAI-compatible server, ``preference`` text) or ``alpaca_farm`` (:meth:`AnnotatorPool.from_alpaca_farm`:
    ``alpaca_farm_pool`` run against ``api_base`` with ``models``). ``unparseable``: ``coin`` or ``drop``
    (:class:`AnnotatorPool`)."""

    backend: str = "gold"
    flip_prob: float = knob(TRAIN_FLIP_PROB, ge=0, le=0.5)
    annotators: list[AnnotatorSpec] = field(default_factory=list)
    reward_models: list[str] = field(default_factory=list)
    temperatures: list[float] = knob(default_factory=list, gt=0)
    api_base: str = "http://localhost:8000/v1"
    models: list[str] = field(default_factory=list)
    api_key_env: str = "OPENAI_API_KEY"
    preference: str = "The response follows the requested style."
    alpaca_farm_pool: str = "annotator_pool_v0"
    unparseable: str = "coin"

    def __post_init__(self):
        if self.unparseable not in UNPARSEABLE_POLICIES:
            raise ValueError(f"pool.unparseable must be coin or drop; got {self.unparseable!r}")
        if self.backend not in ("gold", "reward_model", "llm", "alpaca_farm"):
            raise ValueError(f"pool.backend must be gold, reward_model, llm or alpaca_farm; got {self.backend!r}")
        check_knobs(self, "pool.")
        if self.backend == "reward_model" and not self.reward_models:
            raise ValueError("pool.backend reward_model needs pool.reward_models (checkpoint paths)")
        if self.backend == "llm" and not self.models:
            raise ValueError("pool.backend llm needs pool.models (served model names, one annotator each)")

    def build(self, gold: GoldScorer | None = None, seed: int = 0, sft_model: str | None = None) -> AnnotatorPool:
        """The :class:`AnnotatorPool` this config describes; ``gold`` (default ``GoldScorer()``) reports agreement, and
        the ``gold`` backend's annotators are variants of it (its style and phrase credit, the specs' weights)."""
        gold = gold if gold is not None else GoldScorer()
        if self.backend == "gold":
            pool = AnnotatorPool.default(
                gold.style,
                flip_prob=self.flip_prob,
                seed=seed,
                bank=gold.bank,
                specs=self.annotators or DEFAULT_ANNOTATORS,
                phrase_credit=gold.phrase_credit,
            )
        elif self.backend == "reward_model":
            temps = self.temperatures or 1.0
            pool = AnnotatorPool.from_reward_models(
                self.reward_models, temps, flip_prob=self.flip_prob, seed=seed, gold=gold, sft_model=sft_model
            )
        elif self.backend == "alpaca_farm":
            pool = AnnotatorPool.from_alpaca_farm(
                self.alpaca_farm_pool,
                api_base=self.api_base,
                models=self.models,
                api_key_env=self.api_key_env,
                flip_prob=self.flip_prob,
                seed=seed,
                gold=gold,
            )
        else:
            from rlhf_ext.datagen.openai_backend import OpenAIBackend

            backends = [OpenAIBackend(self.api_base, model=m, api_key_env=self.api_key_env) for m in self.models]
            pool = AnnotatorPool.from_llm(backends, self.preference, flip_prob=self.flip_prob, seed=seed, gold=gold)
        pool.unparseable = self.unparseable
        return pool


@dataclass
class FeedbackSection:
    """Simulated human feedback on the PREF split: ``pairs: sft_samples`` draws two SFT responses per PREF prompt and
    lets the pool choose (AlpacaFarm); ``dataset`` relabels the dataset's own pairs. The annotators: ``pool``
    (:class:`PoolConfig`)."""

    pairs: Literal["sft_samples", "dataset"] = "sft_samples"
    pool: PoolConfig = field(default_factory=PoolConfig)


@dataclass
class RewardModelSection(SegmentRewardKnobs):
    """Surrogate reward models (paper 002 Eq. 2), trained from the SFT model with :class:`SegmentRewardTrainer` with
    one ``train`` setting: the bandit model at ``entropy_cutoff: inf`` and the segment model with paper 003's knobs
    (:class:`~rlhf_ext.algos.segment_reward.SegmentRewardKnobs`) for segment PPO."""

    train: MethodTrainSection = _method_train(num_train_epochs=2, batch_size=16, micro_batch_size=16)


@dataclass
class GenerationSection:
    """Sampling inside methods (best-of-n, expert iteration, Quark, online DPO) and for feedback pairs."""

    max_new_tokens: int = knob(128, ge=1)
    temperature: float = knob(1.0, gt=0)
    batch_size: int = knob(64, ge=1)


@dataclass
class EvalSection:
    """Win rate against the SFT model on the held-out prompts (section 3.3), judged by ``pool`` (``p_eval``: the
    feedback pool without flips) or ``gold``; draws count 1/2. ``temperature`` 1.0 keeps the KL estimate of the
    policy itself (AlpacaFarm sampled at 0.7)."""

    samples_per_prompt: int = knob(2, ge=1)
    temperature: float = knob(1.0, gt=0)
    judge: Literal["pool", "gold"] = "pool"
    #: ``eval``: the held-out evaluation prompts; ``validation``: the next ``task.max_eval_prompts`` test prompts,
    #: which ``sim tune`` picks settings on (never the prompts the results are reported on)
    split: Literal["eval", "validation"] = "eval"


@dataclass
class BestOfNSection:
    """Inference-time best-of-n with the bandit surrogate RM (AlpacaFarm: n = 1024; 16 here)."""

    n: int = knob(16, ge=1)


@dataclass
class ExpertIterationSection:
    """One round (AlpacaFarm, Appendix A.2): best-of-``n`` on ``max_prompts`` unlabeled prompts, then SFT on them."""

    n: int = knob(8, ge=1)
    max_prompts: int = knob(128, ge=1)
    train: MethodTrainSection = _method_train(num_train_epochs=2)


@dataclass
class FeedMESection:
    train: MethodTrainSection = _method_train(num_train_epochs=2)


@dataclass
class RewardConditioningSection:
    """Control tokens put before the prompt (the positive one at inference)."""

    good_token: str = "<|good|> "
    bad_token: str = "<|bad|> "
    train: MethodTrainSection = _method_train(num_train_epochs=2)


@dataclass
class QuarkSection:
    """Top-quantile Quark (Appendix B.2): per round, sample ``num_generations`` responses for
    ``prompts_per_round`` unlabeled prompts from the current policy, keep the top ``top_fraction`` by surrogate
    reward (the rollout pool is reset every round), fine-tune with ``kl_coef`` x KL to the SFT model."""

    rounds: int = knob(3, ge=1)
    prompts_per_round: int = knob(64, ge=1)
    num_generations: int = knob(4, ge=1)
    top_fraction: float = knob(0.25, gt=0, le=1)
    kl_coef: float = knob(0.05, ge=0)
    train: MethodTrainSection = _method_train(num_train_epochs=1, learning_rate=5e-4, warmup_ratio=0)


@dataclass
class DPOSection:
    """DPO on the simulated pairs (Appendix B.3: beta 0.1, 1 epoch); reference = the SFT model."""

    beta: float = knob(0.1, gt=0)
    max_pairs: int | None = knob(None, ge=1, help="Use only the first N simulated pairs (None: all).")
    train: MethodTrainSection = _method_train(num_train_epochs=2, learning_rate=5e-4)


@dataclass
class PPOSection(PPOKnobs, TrainSection):
    """The PPO runs (:class:`~rlhf_ext.trl.DensePPOTrainer`): one setting for every PPO method, compared under the same
    budget. Flat, as TRL's ``PPOConfig``: the PPO knobs, every recipe's training keys (``max_steps`` PPO steps of
    ``batch_size`` rollouts = prompts x ``num_generations``; ``logging_steps`` null: six points per run) and
    ``critic_learning_rate``."""

    max_steps: int = knob(96, ge=1)
    batch_size: int = knob(16, ge=2)
    micro_batch_size: int = knob_like(TrainSection, "micro_batch_size", 16)
    learning_rate: float = knob_like(TrainSection, "learning_rate", 1e-4)
    logging_steps: int | None = knob(None, ge=1)
    critic_learning_rate: float = knob(1e-4, gt=0)
    num_generations: int = knob(2, ge=2)
    max_completion_length: int = knob(128, ge=1)
    chunk_size: int = knob(4, ge=1)
    #: the GAE critic's initialisation: ``sft`` (the SFT model with a fresh value head, as paper 003's public code
    #: does) or ``reward_model`` (the surrogate reward model, as AlpacaFarm does)
    critic_init: Literal["sft", "reward_model"] = "sft"


@dataclass
class OnlineDPOSection(OnlineDPOKnobs):
    """Iterative best/worst-of-n online DPO (paper 004) with the bandit surrogate RM as the online reward: the knobs
    of :class:`~rlhf_ext.algos.pair_selection.OnlineDPOKnobs` (the same names as ``IterativeDPOConfig``) plus the DPO
    ``beta`` and the inner DPO runs' ``train`` settings."""

    beta: float = knob(0.1, gt=0)
    train: MethodTrainSection = _method_train(num_train_epochs=2, batch_size=8, micro_batch_size=8, learning_rate=5e-4)


@dataclass
class OnlineDPOAsyncSection(TrainSection):
    """One-step asynchronous online DPO (paper 001): ``max_steps`` DPO updates of ``batch_size`` pairs, each the best
    and worst of ``num_generations`` responses generated one policy version behind (``online_dpo_sync``: the same
    on-policy). Flat, as TRL's ``OnlineDPOConfig``: every recipe's training keys
    (:class:`~rlhf_ext.config.TrainSection`, constant learning rate, no warm-up), ``num_generations`` and ``beta``."""

    max_steps: int = knob(12, ge=1)
    batch_size: int = knob_like(TrainSection, "batch_size", 8)
    micro_batch_size: int = knob_like(TrainSection, "micro_batch_size", 8)
    learning_rate: float = knob_like(TrainSection, "learning_rate", 5e-4)
    lr_scheduler_type: str = "constant"
    warmup_ratio: float = knob_like(TrainSection, "warmup_ratio", 0.0)
    num_generations: int = knob_like(OnlineDPOKnobs, "num_generations", 4)
    beta: float = knob(0.1, gt=0)


@dataclass
class TuningSection:
    """``rlhf-ext sim tune`` (:mod:`rlhf_ext.sim.tune`): every method of ``methods`` gets the same ``grid`` (dotted
    recipe keys -> values; the product is tried) or its own in ``method_grids`` (DPO has no ``ppo.*`` keys), trained
    on ``seeds`` and picked by the mean length-controlled win rate on the validation prompts (paper 002, section 4)."""

    seeds: list[int] = knob(default_factory=lambda: [0], ge=0, le=MAX_SEED)
    methods: list[str] = field(default_factory=list)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    method_grids: dict[str, dict[str, list[Any]]] = field(default_factory=dict)

    def __post_init__(self):
        unknown = [m for m in [*self.methods, *self.method_grids] if m not in METHODS]
        if unknown:
            raise ValueError(f"tuning.methods / tuning.method_grids: unknown method(s) {', '.join(unknown)}")
        grids = {"grid": self.grid, **{f"method_grids.{m}": g for m, g in self.method_grids.items()}}
        empty = [f"tuning.{name}.{key}" for name, grid in grids.items() for key, values in grid.items() if not values]
        if empty:  # the recipe loader has checked the types: every value is a list
            raise ValueError(f"{empty[0]} must be a non-empty list of values")

    def grid_of(self, method: str) -> dict[str, list[Any]]:
        """The grid ``method`` is tuned on: its own in ``method_grids``, else the shared ``grid``."""
        return self.method_grids.get(method) or self.grid


@dataclass
class SimCompareRecipe:
    """``rlhf-ext sim compare``: train and evaluate ``methods`` for every seed in ``seeds`` (see the module doc)."""

    output_dir: str = "runs/sim_compare"
    seeds: list[int] = knob(default_factory=lambda: [0, 1, 2], ge=0, le=MAX_SEED)
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    threads: int | None = knob(1, ge=1)
    workers: int = knob(1, ge=1, help="Processes running seeds at once.")
    task: TaskSection = field(default_factory=TaskSection)
    model: ModelSection = field(default_factory=ModelSection)
    sft: SFTSection = field(default_factory=SFTSection)
    feedback: FeedbackSection = field(default_factory=FeedbackSection)
    reward_model: RewardModelSection = field(default_factory=RewardModelSection)
    generation: GenerationSection = field(default_factory=GenerationSection)
    eval: EvalSection = field(default_factory=EvalSection)
    best_of_n: BestOfNSection = field(default_factory=BestOfNSection)
    expert_iteration: ExpertIterationSection = field(default_factory=ExpertIterationSection)
    feedme: FeedMESection = field(default_factory=FeedMESection)
    reward_conditioning: RewardConditioningSection = field(default_factory=RewardConditioningSection)
    quark: QuarkSection = field(default_factory=QuarkSection)
    dpo: DPOSection = field(default_factory=DPOSection)
    ppo: PPOSection = field(default_factory=PPOSection)
    online_dpo: OnlineDPOSection = field(
        default_factory=lambda: OnlineDPOSection(num_iterations=2, prompts_per_iteration=64, num_generations=4)
    )
    online_dpo_async: OnlineDPOAsyncSection = field(default_factory=OnlineDPOAsyncSection)
    #: per-method ``key=value`` overrides applied when that method runs (e.g. the settings ``sim tune`` picked)
    method_overrides: dict[str, list[str]] = field(default_factory=dict)
    tuning: TuningSection = field(default_factory=TuningSection)
    #: named budgets: ``--budget NAME`` applies ``budgets[NAME]`` (a list of ``key=value`` overrides) over the file
    budgets: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        check_knobs(self)
        for name, items in self.budgets.items():
            if not isinstance(items, list) or not all(isinstance(i, str) and "=" in i for i in items):
                raise ValueError(f"budgets.{name} must be a list of key=value overrides, got {items!r}")
        unknown = [m for m in [*self.methods, *self.method_overrides] if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
        for name, items in self.method_overrides.items():
            if not isinstance(items, list) or not all(isinstance(i, str) and "=" in i for i in items):
                raise ValueError(f"method_overrides.{name} must be a list of key=value overrides, got {items!r}")
        if not self.methods:
            raise ValueError("methods must list at least one method")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be a non-empty list of distinct integers, got {self.seeds}")


def load_compare_recipe(
    path: str | Path | None, overrides: list[str] = (), budget: str | None = None
) -> SimCompareRecipe:
    """The recipe at ``path`` with ``overrides``; with ``budget``, the recipe's ``budgets[budget]`` overrides are
    applied first (``overrides`` still win), e.g. ``budget="full"`` for the night-long setting."""
    recipe = load_recipe(SimCompareRecipe, path, overrides)
    if budget is None:
        return recipe
    if budget not in recipe.budgets:
        known = ", ".join(sorted(recipe.budgets)) or "none"
        raise RecipeError(f"unknown budget {budget!r}; the recipe defines: {known} (its budgets: section)")
    return load_recipe(SimCompareRecipe, path, [*recipe.budgets[budget], *overrides])
