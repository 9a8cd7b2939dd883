"""Pair collection for online DPO (paper 004, Algorithm 2 steps 4-6): score ``[P][n]`` sampled responses and form one
pair per prompt (:func:`score_and_select`); :class:`OnlinePairGenerator` is the generator side of per-batch online DPO.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_ext.algos.pair_selection import OnlineDPOKnobs, select_pairs
from rlhf_ext.runtime.rewards import RewardFn, score
from rlhf_ext.runtime.sampling import make_sampler, sampling_seed


def wants_generator_process(requested: bool | None, async_generation: bool, backend: str, reward_fn: RewardFn) -> bool:
    """Where online mode's generator runs: ``requested`` when given; by default a spawned process with asynchronous
    generation on CPUs (no interpreter lock to share: 103% of the ideal speedup vs a thread's 77%,
    ``benchmarks/async.py``), HF generation and a reward function that pickles; else a thread."""
    if requested is not None:
        return requested
    if not async_generation or backend == "vllm" or torch.cuda.is_available():
        return False
    try:
        pickle.dumps(reward_fn)
    except Exception:
        return False
    return True


def score_and_select(
    prompts: list[Any],
    ids: list[int],
    samples,
    reward_fn: RewardFn,
    settings: OnlineDPOKnobs,
    generator: torch.Generator,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Score ``samples`` (``[P][n]`` responses of ``prompts``) and pick one pair per prompt (paper 004 Eq. 9) with
    the selection knobs of ``settings`` (``selection_rule``, ``length_penalty``, ``length_unit``, ``tie_tolerance``:
    an :class:`~rlhf_ext.algos.pair_selection.OnlineDPOKnobs`, or a config that embeds it). Returns the pair rows
    (one dict per kept prompt, in prompt order) and statistics of the scored samples."""
    n = len(samples.temperatures)
    flat_prompts = [p for p in prompts for _ in range(n)]
    rewards = score(reward_fn, flat_prompts, samples.flat()).view(len(prompts), n)
    lengths = samples.num_chars() if settings.length_unit == "chars" else samples.num_tokens.float()
    sel = select_pairs(
        rewards,
        lengths=lengths,
        rule=settings.selection_rule,
        length_penalty=settings.length_penalty,
        texts=samples.texts,
        tie_tolerance=settings.tie_tolerance,
        generator=generator,
    )
    rows = [
        {
            "prompt": prompts[i],
            "chosen": samples.texts[i][c],
            "rejected": samples.texts[i][r],
            "chosen_reward": float(rewards[i, c]),
            "rejected_reward": float(rewards[i, r]),
            "margin": float(sel.margin[j]),
            "reward_margin": float(sel.reward_margin[j]),
            "prompt_id": ids[i],
            "chosen_index": c,
            "rejected_index": r,
            "chosen_temperature": samples.temperatures[c],
            "rejected_temperature": samples.temperatures[r],
        }
        for j, (i, c, r) in enumerate(zip(sel.prompt_index.tolist(), sel.chosen.tolist(), sel.rejected.tolist()))
    ]
    stats = {
        "num_prompts": len(prompts),
        "num_generations": n,
        "dropped": sel.dropped,
        "mean_reward": float(rewards.mean()),
        "mean_reward_by_temperature": {
            str(t): float(rewards[:, [j for j, tt in enumerate(samples.temperatures) if tt == t]].mean())
            for t in dict.fromkeys(samples.temperatures)
        },
        "mean_margin": float(sel.reward_margin.mean()) if len(sel) else 0.0,
        "mean_max_min_gap": float((rewards.max(1).values - rewards.min(1).values).mean()),
        "mean_length_chars": float(samples.num_chars().mean()),
        "truncated_fraction": float(samples.truncated.float().mean()),
    }
    return rows, stats


@dataclass(frozen=True)
class OnlineBatchPairs:
    """One per-batch online DPO batch: its pair rows and the generator's prompt cursor after it (where a resumed run
    continues)."""

    rows: list[dict[str, Any]]
    cursor: int


class OnlinePairGenerator:
    """The generator side of online DPO (paper 001): for each batch, sample ``num_generations`` responses for as many
    prompts as pairs are still needed, score them, select pairs; prompts whose responses tie are replaced by the
    next prompts, at most ``max_fill_rounds`` times. Runs in the runner's thread or, pickled, in its process.

    Prompts are taken in a fixed shuffled order (``seed``), wrapping around, from position ``cursor`` on. Each
    sampling round draws with :func:`~rlhf_ext.runtime.sampling.sampling_seed` ``(seed, "online", update, round)``
    (``update`` = ``first_index`` + the batch index), so a run repeats exactly, and a resumed run given its
    ``first_index`` and stored :attr:`OnlineBatchPairs.cursor` makes the uninterrupted run's batches.
    """

    def __init__(
        self,
        prompts: list[Any],
        pairs_per_update: int,
        max_fill_rounds: int,
        selection: OnlineDPOKnobs,
        reward_fn: RewardFn,
        sampler_spec: dict[str, Any],
        seed: int,
        sampler=None,
        first_index: int = 0,
        cursor: int = 0,
    ):
        self.prompts, self.pairs_per_update, self.max_fill_rounds = prompts, pairs_per_update, max_fill_rounds
        self.selection, self.reward_fn, self.sampler_spec, self.seed = selection, reward_fn, sampler_spec, seed
        self.order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed))
        self.first_index, self.cursor, self._sampler = first_index, cursor, sampler
        if sampler is not None:
            sampler.load_policy(sampler_spec["policy"])
        else:
            if sampler_spec["backend"] == "vllm":
                raise ValueError("generator_process needs generation_backend='hf' (vLLM runs its own engine process)")
            try:
                pickle.dumps(reward_fn)
            except Exception as e:
                raise ValueError(
                    f"generator_process pickles the reward function to the generator process, but {reward_fn!r} "
                    f"cannot be pickled ({e}); use a module-level function or a reward-model object"
                ) from e

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_sampler": None}

    @property
    def sampler(self):
        if self._sampler is None:
            self._sampler = make_sampler(**self.sampler_spec)
        return self._sampler

    def generate(self, index: int, version: int) -> OnlineBatchPairs:
        """The pairs of the runner's batch ``index`` (update ``first_index + index``), sampled with the weights
        loaded last (policy ``version``), and the prompt cursor after them."""
        update = self.first_index + index
        rows: list[dict[str, Any]] = []
        for fill_round in range(self.max_fill_rounds + 1):
            m = self.pairs_per_update - len(rows)
            ids = self.order[(self.cursor + torch.arange(m)) % len(self.prompts)].tolist()
            prompts, self.cursor = [self.prompts[i] for i in ids], self.cursor + m
            seed = sampling_seed(self.seed, "online", update, fill_round)
            samples = self.sampler.sample(prompts, self.selection.num_generations, seed=seed)
            rows += score_and_select(
                prompts, ids, samples, self.reward_fn, self.selection, torch.Generator().manual_seed(update)
            )[0]
            if len(rows) == self.pairs_per_update:
                return OnlineBatchPairs(rows, self.cursor)
        raise RuntimeError(
            f"online batch {update}: only {len(rows)} of {self.pairs_per_update} prompts gave a preference pair after "
            f"{self.max_fill_rounds + 1} sampling rounds (the others' {self.selection.num_generations} responses "
            "tied). Use a reward with finer resolution, more samples per prompt (num_generations), or a larger "
            "max_fill_rounds."
        )

    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.sampler.load_weights(weights)
