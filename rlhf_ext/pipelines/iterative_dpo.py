"""The online-DPO recipe (papers 004 and 001): :class:`OnlineDPORecipe`, which ``recipes/online_dpo_*.yaml`` map
onto 1:1, run on TRL by :func:`run_online_dpo` (OpenRLHF has no iterative or online DPO).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

from rlhf_ext.algos.knobs import check_knobs, knob, knob_like, seed_knob
from rlhf_ext.algos.names import knob_values
from rlhf_ext.algos.pair_selection import OnlineDPOKnobs, OnlineSamplingKnobs
from rlhf_ext.config import TrainSection


@dataclass
class PolicySection:
    """``sft_model``: the SFT checkpoint = ``pi_0`` (path, hub id or ``builtin:tiny-sft``). ``reference``: ``sft``
    (the paper's authors) or ``previous`` (the iterate being trained, as some public scripts do)."""

    sft_model: str = "builtin:tiny-sft"
    tokenizer: str | None = None
    reference: Literal["sft", "previous"] = "sft"


@dataclass
class RewardSection:
    """Exactly one of ``model`` (a sequence-classification or rlhf-ext segment RM checkpoint; ``kind: auto`` tells
    them apart) or ``function`` (``builtin:keyphrase-gold`` or ``package.module:callable`` scoring
    ``(prompts, responses)``). ``gold``: an optional second scorer reported at evaluation only. A recipe's ``reward``
    replaces the default section whole (naming ``model`` drops the default ``function``)."""

    replaced_whole: ClassVar[bool] = True
    model: str | None = None
    kind: Literal["auto", "segment", "sequence_classification"] = "auto"
    function: str | None = None
    gold: str | None = None
    batch_size: int = knob(32, ge=1)

    def __post_init__(self):
        check_knobs(self)
        if (self.model is None) == (self.function is None):
            raise ValueError("set exactly one of reward.model (a checkpoint) or reward.function (a callable)")


@dataclass
class PromptSection:
    """Where prompts come from (any dataset with a prompt column). ``eval`` defaults to ``train`` (its ``eval_split``)
    when that split exists, else the evaluation uses the first training prompts (not held out). ``as_chat``: wrap
    plain-text prompts as a user message, so they go through the chat template (message lists are kept as they are)."""

    train: str = "builtin:toy-keyphrase"
    train_split: str = "train"
    eval: str | None = None
    eval_split: str = "test"
    prompt_key: str = "prompt"
    as_chat: bool = False
    max_train_prompts: int | None = knob(None, ge=1)
    max_eval_prompts: int | None = knob(64, ge=1)


@dataclass
class OnlineSection(OnlineDPOKnobs, OnlineSamplingKnobs):
    """Papers 004 / 001 knobs (:class:`~rlhf_ext.algos.pair_selection.OnlineDPOKnobs`, as in ``IterativeDPOConfig``:
    ``online_mode: iterative`` is Algorithm 2, ``online`` one DPO update per generated batch, paper 001) plus the
    sampling and process settings (:class:`~rlhf_ext.algos.pair_selection.OnlineSamplingKnobs`)."""


@dataclass
class DPOTrainSection(TrainSection):
    """The inner DPO runs (paper 004: lr 5e-7, 2 epochs, cosine, warm-up 0.03, global batch 128, beta 0.1).
    ``batch_size`` is the global batch in pairs. ``max_steps``: online mode's number of updates (default: one pass
    over the prompts). ``save_steps`` writes resumable ``DPOTrainer`` checkpoints. ``trl_args``: extra
    ``DPOConfig`` fields passed through unchanged (e.g. ``{label_smoothing: 0.1}``)."""

    output_dir: str = "runs/online_dpo"
    num_train_epochs: float = knob_like(TrainSection, "num_train_epochs", 2.0)
    batch_size: int = knob_like(TrainSection, "batch_size", 128)
    micro_batch_size: int = knob_like(TrainSection, "micro_batch_size", 8)
    learning_rate: float = knob_like(TrainSection, "learning_rate", 5e-7)
    beta: float = knob(0.1, gt=0, help="The DPO KL coefficient (paper 004: 0.1).")
    loss_type: str = "sigmoid"
    max_length: int | None = knob(2048, ge=2)
    seed: int = seed_knob(42)
    save_steps: int | None = knob(None, ge=1)
    resume: bool = True


@dataclass
class OnlineDPORecipe:
    """Iterative best/worst-of-n online DPO (paper 004, Algorithm 2) or per-batch async online DPO (paper 001)."""

    policy: PolicySection = field(default_factory=PolicySection)
    reward: RewardSection = field(default_factory=lambda: RewardSection(function="builtin:keyphrase-gold"))
    data: PromptSection = field(default_factory=PromptSection)
    online: OnlineSection = field(default_factory=OnlineSection)
    train: DPOTrainSection = field(default_factory=DPOTrainSection)

    @classmethod
    def engine_config_fields(cls) -> set[str]:
        """Field names of the TRL config this recipe builds (flat TrlParser-style keys go to ``train.trl_args``)."""
        from rlhf_ext.trl.online_dpo import IterativeDPOConfig

        return {f.name for f in fields(IterativeDPOConfig)}


def run_online_dpo(recipe: OnlineDPORecipe) -> dict[str, Any]:
    """Run an :class:`OnlineDPORecipe` with TRL in its locked output directory
    (:func:`~rlhf_ext.runtime.rundir.claim_output_dir`); returns the run's summary (also in ``summary.json``)."""
    from rlhf_ext.runtime.rundir import claim_output_dir

    p, d = recipe.policy, recipe.data
    inputs = {"policy.sft_model": p.sft_model, "policy.tokenizer": p.tokenizer, "reward.model": recipe.reward.model,
              "data.train": d.train, "data.eval": d.eval}  # fmt: skip
    with claim_output_dir(recipe.train.output_dir, inputs, "train.output_dir"):
        return train_with_trl(recipe)


def trl_config(recipe):
    """Map an :class:`OnlineDPORecipe` onto :class:`~rlhf_ext.trl.IterativeDPOConfig` (``trl_args`` last)."""
    from rlhf_ext.trl.args import make_config, training_kwargs
    from rlhf_ext.trl.online_dpo import IterativeDPOConfig

    t, o = recipe.train, recipe.online
    kwargs = training_kwargs(t)
    kwargs.update(
        beta=t.beta,
        loss_type=t.loss_type,
        max_length=t.max_length,
        resume=t.resume,
        reference=recipe.policy.reference,
        **knob_values(o, OnlineDPOKnobs),
        **knob_values(o, OnlineSamplingKnobs),
        reward_batch_size=recipe.reward.batch_size,
        eval_num_prompts=recipe.data.max_eval_prompts,
    )
    return make_config(IterativeDPOConfig, kwargs, t.trl_args)


def load_prompt_splits(data) -> tuple[list[Any], list[Any] | None]:
    """(train prompts, eval prompts or None) for a recipe's ``data`` section, columns and prompts checked up front
    (a missing split or column, or empty prompts, is a :class:`DatasetFormatError` naming the fix)."""
    from rlhf_ext.runtime.segment_data import DatasetFormatError
    from rlhf_ext.zoo.builtins import resolve_dataset

    def pick(dd, source: str, split: str, limit: int | None, what: str):
        if split not in dd:
            raise DatasetFormatError(f"data.{what}: {source!r} has no split {split!r} (splits: {', '.join(dd)})")
        ds = dd[split]
        if data.prompt_key not in ds.column_names:
            raise DatasetFormatError(
                f"data.{what} ({source}) has no prompt column {data.prompt_key!r}; "
                f"columns: {', '.join(ds.column_names)}"
            )
        prompts = ds[data.prompt_key]
        prompts = prompts[:limit] if limit is not None else prompts
        empty = [i for i, p in enumerate(prompts) if isinstance(p, str) and not p.strip()]
        if empty:  # generation from zero prompt tokens fails deep inside transformers (IndexError)
            raise DatasetFormatError(
                f"data.{what} ({source}, split {split!r}): {len(empty)} of {len(prompts)} prompts are empty (rows "
                f"{', '.join(map(str, empty[:5]))}{', ...' if len(empty) > 5 else ''}); drop those rows or fill "
                f"their {data.prompt_key!r} column"
            )
        if data.as_chat:
            prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
        return prompts

    train_data = resolve_dataset(data.train)
    train = pick(train_data, data.train, data.train_split, data.max_train_prompts, "train")
    eval_data = train_data if data.eval is None else resolve_dataset(data.eval)
    if data.eval is None and data.eval_split not in eval_data:
        return train, None  # the training source has no eval split and none was configured
    return train, pick(eval_data, data.eval or data.train, data.eval_split, data.max_eval_prompts, "eval")


def train_with_trl(recipe) -> dict[str, Any]:
    """Run an :class:`~rlhf_ext.pipelines.iterative_dpo.OnlineDPORecipe`; returns the run's summary."""
    from transformers import AutoTokenizer

    from rlhf_ext.pipelines.builtins import resolve_model
    from rlhf_ext.zoo.builtins import resolve_reward as load_reward

    args = trl_config(recipe)
    sft = resolve_model(recipe.policy.sft_model)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(recipe.policy.tokenizer or sft))
    train_prompts, eval_prompts = load_prompt_splits(recipe.data)
    r = recipe.reward
    if r.function is not None:
        reward = load_reward(r.function)
    else:
        reward = load_reward(resolve_model(r.model), kind=r.kind, batch_size=r.batch_size, sft_model=sft)
    gold = load_reward(r.gold) if r.gold else None
    return train_online(
        sft,
        reward,
        args=args,
        train_dataset=train_prompts,
        eval_dataset=eval_prompts,
        processing_class=tokenizer,
        gold_fn=gold,
    )


def train_online(policy: Any, reward: Any, **kwargs: Any) -> dict[str, Any]:
    """Train :class:`~rlhf_ext.trl.IterativeDPOTrainer` ``(policy, reward, **kwargs)`` with console step lines;
    returns the run's summary."""
    from rlhf_ext.trl.console import use_console_output
    from rlhf_ext.trl.online_dpo import IterativeDPOTrainer

    trainer = IterativeDPOTrainer(policy, reward, **kwargs)
    use_console_output(trainer)
    trainer.train()  # Algorithm 2 (rlhf_ext.runtime.iterations.run_iterations) or per-batch online DPO
    return trainer.summary


def cpu_config(train: TrainSection | None = None, **kwargs: Any):
    """:class:`~rlhf_ext.trl.IterativeDPOConfig` of ``kwargs`` for a CPU run (:data:`rlhf_ext.trl.args.CPU_RUN`),
    with the optimisation settings of the ``train`` section of a recipe when given."""
    from rlhf_ext.trl.args import CPU_RUN, optimisation_kwargs
    from rlhf_ext.trl.online_dpo import IterativeDPOConfig

    return IterativeDPOConfig(**kwargs, **(optimisation_kwargs(train) if train else {}), **CPU_RUN)
