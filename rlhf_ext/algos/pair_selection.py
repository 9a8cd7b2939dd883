"""Best-of-n / worst-of-n preference-pair selection (paper 004 Algorithm 2 step 5, section 3.3, paper 004 Eq. 9).

For every prompt the policy samples ``n`` responses; a reward model scores them and one preference pair per prompt
is formed. The ranking score is the length-penalised reward of paper 004 Eq. 9,

    r_e(x, a) = r(x, a) - lambda * |a|,

where ``|a|`` is the response length (characters in the paper). The default rule ``max_min`` pairs the best-ranked
response (chosen) with the worst-ranked one (rejected) — the "best-of-n as main agent, worst-of-n as enhancer" pair
that maximises their difference. ``max_random`` pairs the best with a uniformly drawn other response, ``random``
pairs two distinct uniformly drawn responses (the better one is chosen). A prompt whose two picked responses tie
(equal ranking score, within ``tie_tolerance``) or have identical text is dropped and counted: it carries no
preference signal (the paper drops pairs with identical responses).

Everything is vectorised over the ``[P, n]`` reward matrix; there is no per-prompt Python loop.
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
    """The pairs kept by :func:`select_pairs`, one entry per kept prompt, in prompt order.

    Attributes:
        prompt_index: ``[K]`` long — row of the reward matrix (prompt) each pair comes from, increasing.
        chosen: ``[K]`` long — column (response index in ``0..n-1``) of the chosen response.
        rejected: ``[K]`` long — column of the rejected response.
        margin: ``[K]`` float — ranking-score difference ``r_e(chosen) - r_e(rejected) > tie_tolerance``
            (paper 004 Eq. 9; the plain reward margin when ``length_penalty == 0``).
        reward_margin: ``[K]`` float — the raw reward difference ``r(chosen) - r(rejected)`` (no length penalty).
        dropped: number of prompts dropped because the picked responses tied (score or text).
    """

    prompt_index: Tensor
    chosen: Tensor
    rejected: Tensor
    margin: Tensor
    reward_margin: Tensor
    dropped: int

    def __len__(self) -> int:
        return int(self.prompt_index.numel())


def text_ids(texts: Sequence[Sequence[str]]) -> Tensor:
    """``[P, n]`` long ids with equal ids exactly where two responses of the *same prompt* have identical text.

    Use it to pass response texts to :func:`select_pairs` (``texts=``); ids are only compared within a row.
    """
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
        lengths: ``[P, n]`` response lengths ``|a|`` (characters in the paper); required when ``length_penalty``
            is not 0.
        rule: ``max_min`` (best vs worst, default), ``max_random`` (best vs a uniformly drawn other response) or
            ``random`` (two distinct uniformly drawn responses, the higher-scored one chosen).
        length_penalty: ``lambda >= 0`` of paper 004 Eq. 9; responses are ranked by ``r - lambda * |a|``.
        texts: optional ``[P, n]`` text ids (see :func:`text_ids`) or the response strings themselves; a pair whose
            two responses have identical text is dropped.
        tie_tolerance: pairs whose ranking scores differ by at most this much are dropped (default: exact ties).
        generator: random generator for the ``max_random`` / ``random`` rules.

    Returns:
        A :class:`PairSelection`. Among equal maxima (minima) the lowest index is picked, so ``max_min`` is
        deterministic.
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

    if rule == SelectionRule.MAX_MIN:
        first = scores.argmax(dim=1)
        second = scores.argmin(dim=1)
    else:
        if rule == SelectionRule.MAX_RANDOM:
            first = scores.argmax(dim=1)
        else:
            first = torch.randint(0, n, (p,), generator=generator).to(rewards.device)
        # a uniform draw among the n - 1 other responses: draw in [0, n-1) and skip over `first`
        other = torch.randint(0, n - 1, (p,), generator=generator).to(rewards.device)
        second = other + (other >= first).long()
    rows = torch.arange(p, device=rewards.device)
    s_first, s_second = scores[rows, first], scores[rows, second]
    first_wins = s_first >= s_second
    chosen = torch.where(first_wins, first, second)
    rejected = torch.where(first_wins, second, first)
    margin = scores[rows, chosen] - scores[rows, rejected]
    keep = margin > tie_tolerance
    if texts is not None:
        ids = texts if isinstance(texts, Tensor) else text_ids(texts)
        ids = ids.to(rewards.device)
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
        online_mode: ``iterative`` (paper 004's Algorithm 2: collect an iteration's pairs, then train on them) or
            ``online`` (one DPO update per generated batch, paper 001).
        async_generation: ``online`` mode: generate batch ``t+1`` with ``theta_t`` while training on batch ``t``
            (paper 001's one-step off-policy; queue size 1), or wait for each update (on-policy).
        num_iterations: iterations of Algorithm 2 (paper 004: 3).
        prompts_per_iteration: prompts per iteration (paper 004: 20k); ``None`` = all prompts split evenly.
        num_generations: ``n`` responses per prompt (>= 2; paper 004: 8 or 16; paper 001: 2, or K = 4).
        temperatures: ``n`` is split evenly across these (paper 004: 0.7 and 1.0).
        selection_rule: ``max_min`` (best vs worst, paper 004), ``max_random`` or ``random`` (:class:`SelectionRule`).
        length_penalty: ``lambda`` of paper 004 Eq. 9, ``r(x, a) - lambda * |a|`` (the concise variant: 0.001).
        length_unit: ``chars`` (paper 004) or ``tokens`` for ``|a|``.
        tie_tolerance: pairs whose scores differ by at most this are dropped.
        pair_data: ``accumulate`` (train on all pairs so far, paper 004's "historical + new") or ``latest``.
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
        max_completion_length, max_prompt_length, top_p, top_k: sampling limits (prompts are cut from the left).
        generation_backend: ``auto`` (vLLM on a CUDA machine when installed, else HF), ``hf`` or ``vllm``.
        generation_batch_size: sequences per HF ``generate`` call.
        eval_samples_per_prompt / eval_temperature: the evaluation after each iteration.
        generator_process: online mode: run the generator (sampling + scoring) in a spawned process instead of a
            thread, so the two roles do not contend for Python's interpreter lock (HF generation only; the reward
            function must be picklable). ``None`` (default): a process where it can run and pays -- asynchronous
            generation with HF on a machine without CUDA and a picklable reward -- else a thread
            (:func:`~rlhf_ext.runtime.pair_collection.wants_generator_process`).
        max_fill_rounds: online mode: extra sampling rounds to replace tied prompts before giving up.
        generation_threads / training_threads: torch intra-op threads of each role (CPU); ``None``: unchanged.
        vllm_gpu_memory_utilization: vLLM's share of GPU memory.
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
