"""The online-DPO recipe (papers 004 and 001).

``recipes/online_dpo_tiny.yaml`` (CPU, seconds) and ``recipes/online_dpo_paper.yaml`` (paper 004's settings) are
instances of :class:`OnlineDPORecipe`, one typed config that YAML files map onto 1:1. :func:`run_online_dpo` runs one
with the TRL adapter, :class:`rlhf_ext.trl.IterativeDPOTrainer` (a streaming ``trl.DPOTrainer``), whose ``train()``
runs per-iteration mode through :func:`rlhf_ext.runtime.iterations.run_iterations` (paper 004's Algorithm 2, step by
step, written once) and per-batch mode (paper 001) as one streaming DPO run. OpenRLHF has no iterative or online DPO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from rlhf_ext.algos.pair_selection import check_num_samples
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
    """Run an :class:`OnlineDPORecipe` with TRL; returns the run's summary (also ``output_dir/summary.json``)."""
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
        online_mode=o.mode,
        async_generation=o.async_generation,
        generator_process=o.generator_process,
        num_iterations=o.iterations,
        prompts_per_iteration=o.prompts_per_iteration,
        num_samples=o.num_samples,
        temperatures=list(o.temperatures),
        max_new_tokens=o.max_new_tokens,
        max_prompt_length=o.max_prompt_length,
        top_p=o.top_p,
        top_k=o.top_k,
        selection_rule=o.selection,
        length_penalty=o.length_penalty,
        length_unit=o.length_unit,
        tie_tolerance=o.tie_tolerance,
        pair_data=o.pair_data,
        generation_backend=o.generation_backend,
        generation_batch_size=o.generation_batch_size,
        reward_batch_size=recipe.reward.batch_size,
        eval_num_prompts=recipe.data.max_eval_prompts,
        eval_samples_per_prompt=o.eval_samples_per_prompt,
        eval_temperature=o.eval_temperature,
        max_fill_rounds=o.max_fill_rounds,
        generation_threads=o.generation_threads,
        training_threads=o.training_threads,
        vllm_gpu_memory_utilization=o.vllm_gpu_memory_utilization,
    )
    return make_config(IterativeDPOConfig, kwargs, t.trl_args)


def load_prompt_splits(data) -> tuple[list[Any], list[Any] | None]:
    """(train prompts, eval prompts or None) for a recipe's ``data`` section, columns checked up front."""
    from rlhf_ext.zoo.builtins import resolve_dataset

    def pick(source: str, split: str, limit: int | None, what: str):
        dd = resolve_dataset(source)
        if split not in dd:
            raise ValueError(f"data.{what}: {source!r} has no split {split!r} (splits: {', '.join(dd)})")
        ds = dd[split]
        if data.prompt_key not in ds.column_names:
            raise ValueError(
                f"data.{what} ({source}) has no prompt column {data.prompt_key!r}; "
                f"columns: {', '.join(ds.column_names)}"
            )
        prompts = ds[data.prompt_key]
        prompts = prompts[:limit] if limit is not None else prompts
        if data.as_chat:
            prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
        return prompts

    train = pick(data.train, data.train_split, data.max_train_prompts, "train")
    try:
        evals = pick(data.eval or data.train, data.eval_split, data.max_eval_prompts, "eval")
    except ValueError:
        if data.eval is not None:
            raise
        evals = None  # the training source has no eval split and none was configured
    return train, evals


def train_with_trl(recipe) -> dict[str, Any]:
    """Run an :class:`~rlhf_ext.pipelines.iterative_dpo.OnlineDPORecipe`; returns the run's summary."""
    from transformers import AutoTokenizer

    from rlhf_ext.pipelines.builtins import resolve_model
    from rlhf_ext.trl.online_dpo import IterativeDPOTrainer
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
    trainer = IterativeDPOTrainer(
        sft,
        reward,
        args=args,
        train_dataset=train_prompts,
        eval_dataset=eval_prompts,
        processing_class=tokenizer,
        gold_fn=load_reward(r.gold) if r.gold else None,
    )
    trainer.train()  # Algorithm 2 (rlhf_ext.runtime.iterations.run_iterations) or per-batch online DPO
    return trainer.summary
