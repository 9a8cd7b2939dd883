"""Best-of-n / worst-of-n preference-pair selection (paper 004 Algorithm 2 step 5, section 3.3, paper 004 Eq. 9).

For every prompt the policy samples ``n`` responses; a reward model scores them and one preference pair per prompt
is formed. The ranking score is the length-penalised reward of paper 004 Eq. 9,

    r_e(x, a) = r(x, a) - lambda * |a|,

where ``|a|`` is the response length (characters in the paper). ``max_min`` (default) pairs the best-ranked response
(chosen) with the worst-ranked (rejected); ``max_random`` the best with a uniformly drawn other; ``random`` two
distinct uniform draws (the better chosen). A prompt whose picked responses tie (within ``tie_tolerance``) or have
identical text is dropped and counted. Vectorised over the ``[P, n]`` reward matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlhf_ext.algos.knobs import check_knob, check_knobs, knob
from rlhf_ext.algos.names import StrEnum, post_init_next


class SelectionRule(StrEnum):
    """How :func:`select_pairs` picks the two responses of a prompt (see the module docstring)."""

    MAX_MIN = "max_min"
    MAX_RANDOM = "max_random"
    RANDOM = "random"


SELECTION_RULES: tuple[str, ...] = SelectionRule.values()


@dataclass(frozen=True)
class PairSelection:
    """The pairs kept by :func:`select_pairs`, in prompt order: ``[K]`` ``prompt_index`` (row), ``chosen`` and
    ``rejected`` (columns), ``margin`` ``r_e(chosen) - r_e(rejected)`` (paper 004 Eq. 9) and ``reward_margin`` (without
    the length penalty); ``dropped``: prompts dropped as ties (score or text)."""

    prompt_index: Tensor
    chosen: Tensor
    rejected: Tensor
    margin: Tensor
    reward_margin: Tensor
    dropped: int

    def __len__(self) -> int:
        return int(self.prompt_index.numel())


def text_ids(texts: Sequence[Sequence[str]]) -> Tensor:
    """``[P, n]`` long ids, equal exactly where two responses have identical text (for :func:`select_pairs`'s
    ``texts=``)."""
    rows = [list(r) for r in texts]
    if not rows:
        return torch.zeros(0, 0, dtype=torch.long)
    n = len(rows[0])
    if any(len(r) != n for r in rows):
        raise ValueError("texts must have the same number of responses for every prompt")
    vocab: dict[str, int] = {}
    flat = [vocab.setdefault(t, len(vocab)) for r in rows for t in r]
    return torch.tensor(flat, dtype=torch.long).view(len(rows), n)


def _check_rewards(rewards: Tensor) -> Tensor:
    if not isinstance(rewards, Tensor):
        rewards = torch.as_tensor(rewards)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be a [P, n] matrix (prompts x responses); got shape {tuple(rewards.shape)}")
    check_knob(OnlineDPOKnobs, "num_generations", int(rewards.shape[1]), "responses per prompt (rewards.shape[1])")
    rewards = rewards.float() if not rewards.is_floating_point() else rewards
    if not torch.isfinite(rewards).all():
        bad = (~torch.isfinite(rewards)).nonzero()[0].tolist()
        raise ValueError(
            f"rewards contain NaN/inf (first at prompt {bad[0]}, response {bad[1]}); check the reward model or "
            "reward function"
        )
    return rewards


def select_pairs(
    rewards: Tensor,
    lengths: Tensor | None = None,
    rule: SelectionRule | str = "max_min",
    length_penalty: float = 0.0,
    texts: Tensor | Sequence[Sequence[str]] | None = None,
    tie_tolerance: float = 0.0,
    generator: torch.Generator | None = None,
) -> PairSelection:
    """Pick one (chosen, rejected) pair per prompt from ``n`` scored responses (paper 004 Eq. 9; Alg. 2 step 5).

    Args:
        rewards: ``[P, n]`` reward of each of the ``n >= 2`` responses of ``P`` prompts.
        lengths: ``[P, n]`` response lengths ``|a|``; required when ``length_penalty`` is not 0.
        rule: see the module docstring (ties among maxima/minima pick the lowest index).
        length_penalty: ``lambda >= 0`` of paper 004 Eq. 9.
        texts: optional ``[P, n]`` text ids (:func:`text_ids`) or the response strings themselves.
        tie_tolerance: pairs whose ranking scores differ by at most this much are dropped.
        generator: random generator for the ``max_random`` / ``random`` rules.
    """
    rewards = _check_rewards(rewards)
    p, n = rewards.shape
    if rule not in SELECTION_RULES:
        raise ValueError(f"unknown selection rule {rule!r}; choose one of {', '.join(SELECTION_RULES)}")
    check_knob(OnlineDPOKnobs, "length_penalty", length_penalty)
    check_knob(OnlineDPOKnobs, "tie_tolerance", tie_tolerance)
    scores = rewards
    if length_penalty != 0.0:
        if lengths is None:
            raise ValueError("length_penalty is set but no lengths were given; pass lengths=[P, n] response lengths")
        lengths = torch.as_tensor(lengths, device=rewards.device)
        if lengths.shape != rewards.shape:
            raise ValueError(
                f"lengths has shape {tuple(lengths.shape)}, rewards {tuple(rewards.shape)}; they must match"
            )
        scores = rewards - length_penalty * lengths.to(rewards.dtype)

    if rule == SelectionRule.RANDOM:
        first = torch.randint(0, n, (p,), generator=generator).to(rewards.device)
    else:
        first = scores.argmax(dim=1)
    if rule == SelectionRule.MAX_MIN:
        second = scores.argmin(dim=1)
    else:  # a uniform draw among the n - 1 other responses: draw in [0, n-1) and skip over `first`
        other = torch.randint(0, n - 1, (p,), generator=generator).to(rewards.device)
        second = other + (other >= first).long()
    rows = torch.arange(p, device=rewards.device)
    first_wins = scores[rows, first] >= scores[rows, second]
    chosen = torch.where(first_wins, first, second)
    rejected = torch.where(first_wins, second, first)
    margin = scores[rows, chosen] - scores[rows, rejected]
    keep = margin > tie_tolerance
    if texts is not None:
        ids = (texts if isinstance(texts, Tensor) else text_ids(texts)).to(rewards.device)
        if ids.shape != rewards.shape:
            raise ValueError(f"texts has shape {tuple(ids.shape)}, rewards {tuple(rewards.shape)}; they must match")
        keep &= ids[rows, chosen] != ids[rows, rejected]
    idx = keep.nonzero().flatten()
    return PairSelection(
        prompt_index=idx,
        chosen=chosen[idx],
        rejected=rejected[idx],
        margin=margin[idx],
        reward_margin=rewards[idx, chosen[idx]] - rewards[idx, rejected[idx]],
        dropped=int(p - idx.numel()),
    )


@dataclass
class OnlineDPOKnobs:
    """The knobs of iterative best/worst-of-n online DPO (paper 004, Algorithm 2 and Eq. 9) and of its one-step
    asynchronous per-batch variant (paper 001), declared once: ``IterativeDPOConfig``, the online-DPO recipe's
    ``online:`` section and the simulator use these names and defaults.

    Args:
        online_mode: ``iterative`` (paper 004's Algorithm 2) or ``online`` (one DPO update per batch, paper 001).
        async_generation: ``online`` mode: generate batch ``t+1`` with ``theta_t`` while training on batch ``t``
            (paper 001's one-step off-policy), or wait for each update.
        prompts_per_iteration: ``None`` = all prompts split evenly.
        temperatures: ``n`` is split evenly across these (paper 004: 0.7 and 1.0).
        pair_data: ``accumulate`` (all pairs so far, paper 004's "historical + new") or ``latest``.
    """

    online_mode: str = field(default="iterative", metadata={"help": "iterative (paper 004) | online (paper 001)"})
    async_generation: bool = field(default=True, metadata={"help": "Online mode: one-step async (paper 001)."})
    num_iterations: int = knob(3, ge=1, help="Iterations of Algorithm 2 (3).")
    prompts_per_iteration: int | None = knob(None, ge=1, help="Prompts per iteration.")
    num_generations: int = knob(8, ge=2, help="Responses sampled per prompt (n = 8; a pair needs 2).")
    temperatures: list[float] = knob(default_factory=lambda: [0.7, 1.0], gt=0, help="Sampling temps.")
    selection_rule: SelectionRule = field(default=SelectionRule.MAX_MIN.value, metadata={"help": "max_min (paper)"})
    length_penalty: float = knob(0.0, ge=0, help="lambda of paper 004 Eq. 9.")
    length_unit: str = field(default="chars", metadata={"help": "chars | tokens"})
    tie_tolerance: float = knob(0.0, ge=0, help="Score gap at or below which a pair is a tie.")
    pair_data: str = field(default="accumulate", metadata={"help": "accumulate | latest"})

    def __post_init__(self) -> None:
        post_init_next(self, __class__)  # a config that lists the knobs before TRL's class runs TRL's checks too
        self.check_online_dpo_knobs()

    def check_online_dpo_knobs(self, prefix: str = "") -> None:
        """Validate the knobs (called by every config that embeds them; ``prefix`` names its section in errors)."""
        check_knobs(self, prefix)
        if not self.temperatures:
            raise ValueError(f"{prefix}temperatures must list at least one temperature")
        for name, allowed in (
            ("online_mode", ("iterative", "online")),
            ("selection_rule", SELECTION_RULES),
            ("length_unit", ("chars", "tokens")),
            ("pair_data", ("accumulate", "latest")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")


@dataclass
class OnlineSamplingKnobs:
    """How online DPO samples and evaluates (papers 004 / 001 use no top-p / top-k), declared once:
    ``IterativeDPOConfig`` and the online-DPO recipe's ``online:`` section embed these fields.

    Args:
        generation_backend: ``auto`` (vLLM on a CUDA machine when installed, else HF), ``hf`` or ``vllm``.
        generator_process: online mode: run the generator in a spawned process instead of a thread (HF only; the
            reward function must be picklable); ``None``: where it pays
            (:func:`~rlhf_ext.runtime.pair_collection.wants_generator_process`).
        generation_threads / training_threads: torch intra-op threads of each role (CPU); ``None``: unchanged.
    """

    max_completion_length: int = knob(256, ge=1, help="Maximum response length in tokens.")
    max_prompt_length: int | None = knob(None, ge=1, help="Prompts are cut from the left.")
    top_p: float = knob(1.0, gt=0, le=1, help="Nucleus sampling (1.0 = off).")
    top_k: int = knob(0, ge=0, help="Top-k sampling (0 = off).")
    generation_backend: str = field(default="auto", metadata={"help": "auto | hf | vllm"})
    generation_batch_size: int = knob(64, ge=1, help="Sequences per generate call.")
    eval_samples_per_prompt: int = knob(2, ge=1, help="Samples per evaluation prompt.")
    eval_temperature: float = knob(1.0, gt=0, help="Evaluation sampling temperature.")
    generator_process: bool | None = field(
        default=None, metadata={"help": "Online mode: generate in a separate process (default: when async on a CPU)."}
    )
    max_fill_rounds: int = knob(4, ge=0, help="Online mode: rounds to replace tied prompts.")
    generation_threads: int | None = knob(None, ge=1, help="CPU threads for generation.")
    training_threads: int | None = knob(None, ge=1, help="CPU threads for training.")
    vllm_gpu_memory_utilization: float = knob(0.3, gt=0, le=1, help="vLLM's share of GPU memory.")

    def __post_init__(self) -> None:
        post_init_next(self, __class__)  # a config that lists the knobs before TRL's class runs TRL's checks too
        check_knobs(self)
        if self.generation_backend not in ("auto", "hf", "vllm"):
            raise ValueError(f"generation_backend must be one of auto, hf, vllm; got {self.generation_backend!r}")
