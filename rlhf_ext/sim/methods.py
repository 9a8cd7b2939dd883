"""The reference methods of ``sim compare``: AlpacaFarm's (paper 002, section 3.4 and Appendix A) and ours.

Each method ``method(run, seed) -> PolicySpec`` trains (or, for best-of-n, wraps) a policy from the run's SFT model
with the package's real trainers (TRL's ``SFTTrainer`` and ``DPOTrainer``, the ``rlhf_ext.trl`` trainers for Quark, PPO
and online DPO); ``run`` (:class:`rlhf_ext.sim.compare.SimRun`) owns the shared artefacts, reused on rerun.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rlhf_ext.algos.names import knob_values
from rlhf_ext.algos.pair_selection import OnlineDPOKnobs
from rlhf_ext.algos.ppo import PPOKnobs
from rlhf_ext.config import TrainSection
from rlhf_ext.runtime.io import atomic_directory, stable_hash
from rlhf_ext.sim.recipe import METHODS, DPOSection, OnlineDPOAsyncSection, OnlineDPOSection

if TYPE_CHECKING:
    from rlhf_ext.sim.compare import SimRun


@dataclass
class PolicySpec:
    """What to evaluate: the checkpoint at ``path`` sampled after ``prompt_prefix`` (with ``best_of_n``: best of that
    many under the bandit surrogate RM); ``info``: method statistics; budget beyond the SFT model: ``labels``
    (simulated preference labels used) and ``samples`` (responses generated while training)."""

    path: str
    prompt_prefix: str = ""
    best_of_n: int | None = None
    info: dict[str, Any] = field(default_factory=dict)
    labels: int = 0
    samples: int = 0


def _seed(*parts: Any) -> int:
    return int(stable_hash(*parts), 16) % (2**31 - 1)


def fine_tune(
    run: SimRun,
    init: str,
    rows: list[dict[str, str]],
    train: TrainSection,
    out: Path,
    seed: int,
    *,
    kl_coef: float = 0.0,
    ref: str | None = None,
) -> str:
    """:func:`rlhf_ext.trl.sft.fine_tune` of ``init`` on ``rows`` with a recipe's ``train`` section into ``out``
    (reused when it exists). ``kl_coef > 0`` adds Quark's KL to ``ref`` (default ``init``)."""
    if (out / "config.json").exists():
        return str(out)
    from rlhf_ext.pipelines.trl_runs import fine_tune as sft_fine_tune

    return sft_fine_tune(
        init, rows, out, train, seed=seed, max_length=run.recipe.task.max_length, kl_coef=kl_coef,
        ref_model=ref or init, disable_tqdm=True,
    )  # fmt: skip


def train_args(train: TrainSection, out: Path, seed: int, **extra: Any) -> dict[str, Any]:
    """The ``train`` knobs (``extra`` replacing some) of a pipeline run into ``out``: no progress bars, no resume."""
    run = {"output_dir": str(out), "seed": seed, "resume": False}
    return knob_values(train, TrainSection) | extra | {"trl_args": {**train.trl_args, "disable_tqdm": True}} | run


def _num_labels(run: SimRun, seed: int) -> int:
    """The simulated preference labels of ``seed`` (every surrogate reward model is trained on all of them)."""
    return len(run.feedback(seed)["train"])


def _pairs(run: SimRun, seed: int) -> list[dict[str, Any]]:
    return run.feedback(seed)["train"].select_columns(["prompt", "chosen", "rejected"]).to_list()


# ---------------------------------------------------------------------------------------------------- methods
def sft(run: SimRun, seed: int) -> PolicySpec:
    """SFT (AlpacaFarm 3.4, "SFT 10k"): supervised fine-tuning on the SFT split; every other method starts here and
    the win rates are measured against it, so its own row checks the evaluation (0.5 up to noise, KL 0)."""
    return PolicySpec(run.sft_model())


def best_of_n(run: SimRun, seed: int) -> PolicySpec:
    """Best-of-n sampling (AlpacaFarm 3.4, App. A.2): at inference, draw n i.i.d. responses from the SFT model and
    return the one with the highest surrogate reward (AlpacaFarm: n = 1024)."""
    run.reward_model(seed, "bandit")
    return PolicySpec(run.sft_model(), best_of_n=run.recipe.best_of_n.n, labels=_num_labels(run, seed))


def expert_iteration(run: SimRun, seed: int) -> PolicySpec:
    """Expert iteration (AlpacaFarm 3.4, App. A.2): best-of-n on new (unlabeled) instructions with the surrogate
    reward model, then supervised fine-tuning of the SFT model on those best outputs; a single round."""
    from rlhf_ext.sim.evaluate import BestOfNPolicy

    cfg = run.recipe.expert_iteration
    out = run.seed_dir(seed) / "expert_iteration"
    prompts = run.splits()["unlabeled"]["prompt"][: cfg.max_prompts]
    if not (out / "config.json").exists():
        bon = BestOfNPolicy(run.policy(run.sft_model()), run.reward_fn(seed), cfg.n)
        best = bon.sample(prompts, 1, seed=_seed("expert_iteration", seed)).flat()
        rows = [{"prompt": p, "completion": y} for p, y in zip(prompts, best)]
        fine_tune(run, run.sft_model(), rows, cfg.train, out, seed)
    info = {"n": cfg.n, "prompts": len(prompts)}
    return PolicySpec(str(out), info=info, labels=_num_labels(run, seed), samples=cfg.n * len(prompts))


def feedme(run: SimRun, seed: int) -> PolicySpec:
    """Binary FeedME (AlpacaFarm 3.4, App. A.1): continue supervised fine-tuning of the SFT model on the preferred
    response of each simulated pairwise comparison."""
    rows = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in _pairs(run, seed)]
    path = fine_tune(run, run.sft_model(), rows, run.recipe.feedme.train, run.seed_dir(seed) / "feedme", seed)
    return PolicySpec(path, labels=len(rows))


def reward_conditioning(run: SimRun, seed: int) -> PolicySpec:
    """Binary reward conditioning (AlpacaFarm 3.4, App. A.1): fine-tune on [positive token, x, y_chosen] and
    [negative token, x, y_rejected] (twice the pairs); sample conditioned on the positive token."""
    cfg = run.recipe.reward_conditioning
    rows = []
    for r in _pairs(run, seed):
        rows.append({"prompt": cfg.good_token + r["prompt"], "completion": r["chosen"]})
        rows.append({"prompt": cfg.bad_token + r["prompt"], "completion": r["rejected"]})
    path = fine_tune(run, run.sft_model(), rows, cfg.train, run.seed_dir(seed) / "reward_conditioning", seed)
    return PolicySpec(path, prompt_prefix=cfg.good_token, info={"examples": len(rows)}, labels=len(rows) // 2)


def quark(run: SimRun, seed: int) -> PolicySpec:
    """Quark, top-quantile variant (AlpacaFarm 3.4, App. A.2 / B.2): each round keeps the best reward quantile of the
    current policy's samples under the surrogate RM and fine-tunes on it with a KL penalty to the SFT model (no
    entropy bonus; with one bin, Quark's reward token is a constant, so it is omitted)."""
    from rlhf_ext.runtime.rewards import score

    cfg = run.recipe.quark
    unlabeled = run.splits()["unlabeled"]["prompt"]
    policy, stats = run.sft_model(), []
    for r in range(cfg.rounds):
        out = run.seed_dir(seed) / "quark" / f"round-{r}"
        if not (out / "config.json").exists():
            start = (r * cfg.prompts_per_round) % len(unlabeled)
            prompts = [unlabeled[(start + i) % len(unlabeled)] for i in range(cfg.prompts_per_round)]
            samples = run.policy(policy).sample(prompts, cfg.num_generations, seed=_seed("quark", seed, r))
            flat_prompts = [p for p in prompts for _ in range(cfg.num_generations)]
            texts = samples.flat()
            rewards = score(run.reward_fn(seed), flat_prompts, texts)
            keep = rewards.topk(max(1, math.ceil(cfg.top_fraction * rewards.numel()))).indices.tolist()
            rows = [{"prompt": flat_prompts[i], "completion": texts[i]} for i in keep]
            fine_tune(run, policy, rows, cfg.train, out, seed, kl_coef=cfg.kl_coef, ref=run.sft_model())
            stats.append({"round": r, "mean_reward": float(rewards.mean()), "top_mean": float(rewards[keep].mean())})
        policy = str(out)
    samples = cfg.rounds * cfg.prompts_per_round * cfg.num_generations
    return PolicySpec(policy, info={"rounds": stats}, labels=_num_labels(run, seed), samples=samples)


def dpo(run: SimRun, seed: int, *, cfg: DPOSection | None = None, name: str = "dpo") -> PolicySpec:
    """DPO (AlpacaFarm 3.4, App. A.1 Eq. 1 / B.3): TRL's DPOTrainer on the simulated pairs with the SFT model as the
    reference (beta 0.1). ``cfg`` (default: the recipe's ``dpo`` section) and ``name`` (the output directory under
    the seed's) let a benchmark train variants, e.g. with a smaller label budget (``max_pairs``)."""
    from rlhf_ext.pipelines.trl_runs import train_dpo

    cfg, out = cfg or run.recipe.dpo, run.seed_dir(seed) / name
    if not (out / "config.json").exists():
        rows = _pairs(run, seed)
        if cfg.max_pairs is not None:
            if cfg.max_pairs > len(rows):
                raise ValueError(f"dpo.max_pairs={cfg.max_pairs} but the simulated feedback has only {len(rows)} pairs")
            rows = rows[: cfg.max_pairs]
        max_length = run.recipe.task.max_length
        train_dpo(run.sft_model(), rows, out, cfg.train, seed=seed, beta=cfg.beta, max_length=max_length)
    return PolicySpec(str(out), labels=cfg.max_pairs or _num_labels(run, seed))


def _ppo(run: SimRun, seed: int, granularity: str, reward_model: str | None = None,
         reward_source: Callable[[], str] | None = None, name: str | None = None) -> PolicySpec:  # fmt: skip
    """PPO from the SFT model at ``granularity`` on the surrogate reward model ``run.reward_model(seed, reward_model)``
    (default: the one named like the granularity), or on the dense reward source ``reward_source()`` makes (a
    ``model.reward_source`` spec), with the recipe's one ``ppo`` section, into ``<name or granularity>_ppo``."""
    from rlhf_ext.pipelines import segment_ppo as sp
    from rlhf_ext.runtime.io import atomic_write_json

    cfg, out = run.recipe.ppo, run.seed_dir(seed) / f"{name or granularity}_ppo"
    summary_file = out / "ppo_metrics.json"
    if not summary_file.exists():
        source = reward_source() if reward_source else None
        rm = None if source else run.reward_model(seed, reward_model or granularity)
        feedback = str(run.feedback_dir(seed))
        with atomic_directory(out) as tmp:
            recipe = sp.SegmentPPORecipe(
                engine="trl",
                model=sp.PPOModelSection(
                    sft_model=run.sft_model(),
                    reward_model=rm,
                    reward_source=source,
                    critic_model=run.sft_model() if cfg.critic_init == "sft" or source else rm,
                ),
                data=sp.PPODataSection(
                    prompts=str(run.data_dir),
                    prompt_split="unlabeled",
                    calibration=feedback,
                    calibration_split="train",
                    max_calibration_pairs=256,
                    max_prompt_length=run.recipe.task.max_length // 2,
                    max_completion_length=cfg.max_completion_length,
                ),
                segment=sp.PPOSegmentSection(granularity=granularity, chunk_size=cfg.chunk_size),
                ppo=sp.PPOAlgoSection(
                    **knob_values(cfg, PPOKnobs),
                    num_generations=cfg.num_generations,
                    temperature=run.recipe.generation.temperature,
                ),
                train=sp.PPOTrainSection(
                    **train_args(cfg, tmp, seed, logging_steps=cfg.logging_steps or max(1, cfg.max_steps // 6)),
                    critic_learning_rate=cfg.critic_learning_rate,
                ),
            )
            summary = sp.run_segment_ppo(recipe)
            atomic_write_json(tmp / "ppo_metrics.json", {**summary, "model_dir": str(out)})
    info = {"curve": json.loads(summary_file.read_text()).get("curve", [])}
    return PolicySpec(str(out), info=info, labels=_num_labels(run, seed), samples=cfg.max_steps * cfg.batch_size)


def bandit_ppo(run: SimRun, seed: int) -> PolicySpec:
    """PPO (AlpacaFarm 3.4, App. A.2 Eq. 3 / B.1): maximise the surrogate (bandit) reward with a KL penalty to the SFT
    model, value model initialised from the reward model. :class:`~rlhf_ext.trl.DensePPOTrainer` with
    ``granularity: bandit`` and a reward model trained at ``entropy_cutoff: inf``."""
    return _ppo(run, seed, "bandit")


def segment_ppo(run: SimRun, seed: int) -> PolicySpec:
    """Segment-level PPO (paper 003): dense rewards from a segment reward model (entropy cutoff 2.0), normalised by
    location and spread evenly over each segment's tokens; otherwise as bandit PPO."""
    return _ppo(run, seed, "segment")


def chunk_ppo(run: SimRun, seed: int) -> PolicySpec:
    """Segment-level PPO with fixed-length segments (``granularity: chunk``): the segment reward model read every
    ``ppo.chunk_size`` tokens instead of at the SFT model's entropy boundaries, so the policy cannot buy reward by
    moving or multiplying boundaries; normalised by location and spread evenly, as ``segment_ppo``."""
    return _ppo(run, seed, "chunk", reward_model="segment")


def token_ppo(run: SimRun, seed: int) -> PolicySpec:
    """Token-level PPO (paper 003's token-level baseline, Table 1): the reward model at entropy cutoff 0 makes every
    token its own segment, each token's reward normalised by location; otherwise as segment PPO."""
    return _ppo(run, seed, "token")


def rules_ppo(run: SimRun, seed: int) -> PolicySpec:
    """Segment-level PPO on rules instead of a reward model: keyword credit learned from the same simulated labels
    (:meth:`~rlhf_ext.runtime.dense_sources.KeywordCredit.learn`), each matched phrase rewarded where it occurs; same
    labels and PPO budget as ``segment_ppo``: the effect of dense credit without a learned reward model."""

    def learned_rules() -> str:
        from rlhf_ext.runtime.dense_sources import KeywordCredit

        path = run.seed_dir(seed) / "rules.yaml"
        if not path.exists():
            pairs = run.feedback(seed)["train"]
            KeywordCredit.learn(pairs["chosen"], pairs["rejected"]).save(path)
        return f"rules:{path}"

    return _ppo(run, seed, "segment", reward_source=learned_rules, name="rules")


def sim_online_dpo(
    run: SimRun,
    seed: int,
    mode: Literal["iterative", "async", "sync"],
    *,
    cfg: OnlineDPOSection | OnlineDPOAsyncSection | None = None,
    name: str | None = None,
) -> PolicySpec:
    """Online DPO from the SFT model with the bandit surrogate RM as the online reward (:class:`IterativeDPOTrainer`).

    ``mode``: ``iterative`` (paper 004's Algorithm 2, section ``online_dpo``; ``info["policies"]``: the checkpoint
    after each iteration, 0 = SFT), ``async`` (one-step off-policy, paper 001) or ``sync`` (on-policy; both section
    ``online_dpo_async``). ``cfg``/``name`` override the section and the output directory.
    """
    from transformers import AutoTokenizer

    from rlhf_ext.pipelines.iterative_dpo import cpu_config, train_online

    name = name or {"iterative": "online_dpo", "async": "online_dpo_async", "sync": "online_dpo_sync"}[mode]
    out = run.seed_dir(seed) / name
    r = run.recipe
    common: dict[str, Any] = dict(
        output_dir=str(out),
        max_completion_length=r.generation.max_new_tokens,
        generation_backend="hf",
        generation_batch_size=r.generation.batch_size,
        max_length=r.task.max_length,
        eval_num_prompts=8,
        eval_samples_per_prompt=1,
        generation_threads=r.threads,
        training_threads=r.threads,
        seed=seed,
    )
    if mode != "iterative":
        c = cfg or r.online_dpo_async
        args = cpu_config(
            **common,
            online_mode="online",
            async_generation=mode == "async",
            num_generations=c.num_generations,
            temperatures=[r.generation.temperature],
            beta=c.beta,
            train=c,
        )
    else:
        c = cfg or r.online_dpo
        args = cpu_config(**common, **knob_values(c, OnlineDPOKnobs), beta=c.beta, train=c.train)
    splits = run.splits()
    summary = train_online(
        run.sft_model(),
        run.reward_model(seed, "bandit"),
        args=args,
        train_dataset=list(splits["unlabeled"]["prompt"]),
        processing_class=AutoTokenizer.from_pretrained(run.sft_model()),
        gold_fn=run.gold,
    )
    info: dict[str, Any] = {"online_eval": summary["eval"][-1]}
    if mode == "iterative":
        info["policies"] = [e["path"] for e in summary["eval"]]
        samples = c.num_iterations * c.prompts_per_iteration * c.num_generations
    else:
        samples = c.max_steps * c.batch_size * c.num_generations
    return PolicySpec(summary["final_policy"], info=info, labels=_num_labels(run, seed), samples=samples)


def online_dpo(run: SimRun, seed: int) -> PolicySpec:
    """Iterative best/worst-of-n online DPO (paper 004, Algorithm 2) with the surrogate RM as the online reward:
    each iteration samples n responses per prompt from the current policy, trains DPO on best vs worst."""
    return sim_online_dpo(run, seed, "iterative")


def online_dpo_async(run: SimRun, seed: int) -> PolicySpec:
    """One-step asynchronous online DPO (paper 001): one DPO update per generated batch, the batch generated by the
    previous policy version while the learner trains (best vs worst of K responses)."""
    return sim_online_dpo(run, seed, "async")


def online_dpo_sync(run: SimRun, seed: int) -> PolicySpec:
    """The on-policy baseline of ``online_dpo_async``: the same per-batch loop and settings, but each batch is
    generated by the current policy after the previous update (paper 001's synchronous RLHF)."""
    return sim_online_dpo(run, seed, "sync")


METHOD_FUNCTIONS: dict[str, Callable[[SimRun, int], PolicySpec]] = {name: globals()[name] for name in METHODS}
