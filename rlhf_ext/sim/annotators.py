"""Simulated pairwise preferences ``p_sim`` (paper 002, sections 3.2-3.3 and Appendix C.1).

AlpacaFarm replaces human annotators with a **pool** of simulated annotators: each example is labelled by one
annotator drawn from the pool (inter-annotator variability), and *training* labels are additionally flipped with
probability 0.25 (intra-annotator noise; the paper mixes ``p_eval`` with an independent fair coin at weight 1/2,
which is the same thing). *Evaluation* labels (``p_eval``) are not flipped.

Here an annotator is anything that returns ``P(a preferred over b)`` for a batch of pairs (:class:`Annotator`):

* :class:`BTAnnotator` — a Bradley-Terry / logistic chooser on a utility ``u``:
  ``P(a > b) = sigmoid((u(a) - u(b)) / temperature)``; temperature 0 is the deterministic argmax (ties 1/2).
  The default pool (:data:`DEFAULT_ANNOTATORS`) uses variants of the gold scorer (:class:`~rlhf_ext.sim.GoldScorer`
  with other phrase weights, a length preference like AlpacaFarm's "prefers long / short" GPT-4 annotators, and
  different temperatures). Any reward model is a utility too (:meth:`AnnotatorPool.from_reward_models`, through
  :func:`rlhf_ext.runtime.rewards.load_reward`: a sequence-classification RM or an rlhf-ext segment RM; temperature
  1 is the reward model's own Bradley-Terry probability).
* :class:`LLMAnnotator` — an LLM judge through the dataset generator's backends (``openai``: any OpenAI-compatible
  server), with :class:`rlhf_ext.datagen.LLMJudge`'s prompt, strict A/B parsing and randomised presentation order
  (Appendix C.1); an unparseable answer counts as a tie (1/2).
* :class:`~rlhf_ext.sim.alpaca_farm_pool.AlpacaFarmAnnotator` — AlpacaFarm's own annotators, loaded as shipped from a
  pool's ``configs.yaml`` and templates (:meth:`AnnotatorPool.from_alpaca_farm`; ``annotator_pool_v0`` has 13), with
  AlpacaFarm's per-example annotator choice.

**Draws.** Identical responses are a draw without asking any annotator (as AlpacaEval scores them 1.5), and an
annotator may answer a draw (:meth:`AnnotatorPool.outcome` gives 1/2 for both; an annotator says which of its 1/2
probabilities are draws with an optional ``probability_with_ties`` method — a deterministic :class:`BTAnnotator` on
equal utilities, an AlpacaFarm annotator's explicit tie answer). Binary labels (:meth:`AnnotatorPool.prefer`,
``relabel``) still settle a draw with the pair's fair coin.

Randomness is a deterministic function of ``(seed, prompt, {a, b})`` (a SHA-256 digest gives three uniforms per
pair: which annotator, the Bernoulli draw, the training flip), so labels are reproducible regardless of batch order,
``prefer(b, a) == not prefer(a, b)`` for ``a != b``, and the training label of a pair is its evaluation label with
the flip applied — which is what makes the measured flip rate exactly the injected noise.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from rlhf_ext.algos.knobs import check_knobs, knob
from rlhf_ext.sim.gold import GoldScorer, PhraseCredit, StyleSpec

UtilityFn = Callable[[list[Any], list[str], list[str | None]], Tensor]
#: AlpacaFarm's intra-annotator noise for training labels (section 3.2, Appendix C.1).
TRAIN_FLIP_PROB = 0.25


@runtime_checkable
class Annotator(Protocol):
    """A simulated annotator: ``probability(prompts, a, b, styles) -> [N]`` = ``P(a preferred over b)``.

    Optionally ``probability_with_ties(prompts, a, b, styles) -> ([N] probability, [N] bool)`` also says where the
    annotator answered a draw (its probability there is 1/2); without it an annotator never answers a draw.
    """

    name: str

    def probability(
        self, prompts: list[Any], a: list[str], b: list[str], styles: list[str | None]
    ) -> Tensor:  # pragma: no cover - protocol
        ...


class BTAnnotator:
    """Bradley-Terry chooser: ``P(a > b) = sigmoid((u(a) - u(b)) / temperature)``.

    Args:
        name: annotator id (recorded with every label it gives).
        utility: ``(prompts, responses, styles) -> [N]`` scores (a gold-scorer variant or a reward model).
        temperature: > 0 for a stochastic chooser; 0 for the deterministic argmax (equal utilities: 1/2).
    """

    def __init__(self, name: str, utility: UtilityFn, temperature: float = 0.5):
        if not (temperature >= 0 and math.isfinite(temperature)):
            raise ValueError(f"annotator {name!r}: temperature must be a finite number >= 0, got {temperature}")
        self.name = name
        self.utility = utility
        self.temperature = float(temperature)

    def __repr__(self) -> str:
        return f"BTAnnotator({self.name!r}, temperature={self.temperature})"

    def probability(self, prompts: list[Any], a: list[str], b: list[str], styles: list[str | None]) -> Tensor:
        n = len(a)
        u = torch.as_tensor(self.utility(prompts + prompts, a + b, styles + styles), dtype=torch.float32).flatten()
        if u.numel() != 2 * n or not torch.isfinite(u).all():
            raise ValueError(f"annotator {self.name!r}: the utility must return one finite score per response")
        diff = u[:n] - u[n:]
        if self.temperature == 0:
            return torch.where(diff > 0, 1.0, torch.where(diff < 0, 0.0, 0.5))
        return torch.sigmoid(diff / self.temperature)

    def probability_with_ties(
        self, prompts: list[Any], a: list[str], b: list[str], styles: list[str | None]
    ) -> tuple[Tensor, Tensor]:
        """:meth:`probability` and ``[N]`` bool draws: a deterministic chooser (temperature 0) answers a draw on equal
        utilities; a stochastic one never does (its 1/2 is a coin)."""
        p = self.probability(prompts, a, b, styles)
        return p, (p == 0.5) if self.temperature == 0 else torch.zeros(p.shape, dtype=torch.bool)


@dataclass(frozen=True)
class AnnotatorSpec:
    """A gold-scorer variant annotator (:class:`BTAnnotator` on :class:`~rlhf_ext.sim.GoldScorer` with these weights).

    Attributes:
        name: annotator id.
        positive_weight / negative_weight: weights of the distinct preferred / competing key phrases.
        length_weight: utility per 100 characters (> 0 prefers long responses, < 0 short ones).
        temperature: Bradley-Terry temperature (0 = deterministic).
    """

    name: str
    positive_weight: float = 1.0
    negative_weight: float = 1.0
    length_weight: float = 0.0
    temperature: float = 0.5


#: The default pool: six gold-scorer variants (AlpacaFarm used 13 API annotators that differ in model, prompt,
#: in-context examples and two that are told to prefer long / short outputs; Appendix C.1). The variants differ in
#: how much they weigh the preferred style against violations, in length preference, and in decisiveness.
DEFAULT_ANNOTATORS: tuple[AnnotatorSpec, ...] = (
    AnnotatorSpec("balanced", 1.0, 1.0, 0.0, 0.5),
    AnnotatorSpec("style_seeker", 1.5, 0.5, 0.0, 0.5),
    AnnotatorSpec("violation_averse", 0.5, 1.5, 0.0, 0.5),
    AnnotatorSpec("prefers_long", 1.0, 1.0, 0.5, 0.7),
    AnnotatorSpec("prefers_short", 1.0, 1.0, -0.5, 0.7),
    AnnotatorSpec("decisive", 1.0, 1.0, 0.0, 0.1),
)


def gold_annotator(
    spec: AnnotatorSpec, style: StyleSpec = None, bank=None, phrase_credit: PhraseCredit = "partial"
) -> BTAnnotator:
    """The :class:`BTAnnotator` of a gold-scorer variant (the gold's ``phrase_credit``, the spec's weights)."""
    scorer = GoldScorer(
        style,
        bank=bank,
        positive_weight=spec.positive_weight,
        negative_weight=spec.negative_weight,
        length_weight=spec.length_weight,
        phrase_credit=phrase_credit,
    )
    return BTAnnotator(spec.name, scorer.score, spec.temperature)


def reward_model_annotator(name: str, reward_fn, temperature: float = 1.0) -> BTAnnotator:
    """A :class:`BTAnnotator` whose utility is a reward function ``(prompts, responses) -> [N]`` (styles ignored)."""
    return BTAnnotator(name, lambda prompts, responses, styles: reward_fn(prompts, responses), temperature)


@dataclass(frozen=True)
class JudgeTask:
    """What :func:`rlhf_ext.datagen.mappers.judge_prompt` needs of a task: its name and preference text."""

    name: str
    preference: str


class LLMAnnotator:
    """An LLM judge (through a :mod:`rlhf_ext.datagen` backend, e.g. ``OpenAIBackend``) as an annotator.

    Args:
        name: annotator id.
        backend: an unstarted :class:`rlhf_ext.datagen.Backend`; started and closed around each batch.
        preference: the preference the judge checks: one text for all rows, or a mapping ``style -> text``.
        max_tokens: judge answer budget.
        seed: seeds the judge's presentation order and requests.

    ``probability`` is 1 / 0 for the judge's choice and 1/2 when it answered neither ``A`` nor ``B``.
    """

    def __init__(self, name: str, backend, preference: str | Mapping[str, str], max_tokens: int = 128, seed: int = 0):
        self.name = name
        self.backend = backend
        self.preference = preference
        self.max_tokens = max_tokens
        self.seed = seed
        self.stats = {"requests": 0, "unparseable": 0}

    def task(self, style: str | None) -> JudgeTask:
        if isinstance(self.preference, str):
            return JudgeTask(self.name, self.preference)
        if style not in self.preference:
            raise ValueError(
                f"LLM annotator {self.name!r} has no preference text for style {style!r}; "
                f"known styles: {', '.join(map(str, self.preference))}"
            )
        return JudgeTask(f"{self.name}:{style}", self.preference[style])

    def probability(self, prompts: list[Any], a: list[str], b: list[str], styles: list[str | None]) -> Tensor:
        from rlhf_ext.datagen.judge import LLMJudge

        judge = LLMJudge(self.backend, max_tokens=self.max_tokens)

        async def run() -> list:
            async with self.backend:
                jobs = [
                    judge.judge(self.task(s), s, p, x, y, seed=_digest_int(self.seed, p, x, y) % (2**31))
                    for p, x, y, s in zip(prompts, a, b, styles)
                ]
                return await asyncio.gather(*jobs)

        verdicts = asyncio.run(run())
        self.stats["requests"] += len(verdicts)
        self.stats["unparseable"] += sum(v.winner is None for v in verdicts)
        return torch.tensor([0.5 if v.winner is None else float(v.winner == 0) for v in verdicts])


def _digest_int(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps(parts, default=str).encode()).digest()[:8], "big")


def pair_uniforms(seed: int, prompts: Sequence[Any], a: Sequence[str], b: Sequence[str]) -> tuple[Tensor, Tensor]:
    """Per pair: ``[N, 3]`` float64 uniforms in [0, 1) from SHA-256 of ``(seed, prompt, sorted(a, b))`` and ``[N]``
    bool ``a`` is the canonical first response (``a <= b``). Symmetric in ``a``/``b`` by construction."""
    rows, first = [], []
    for p, x, y in zip(prompts, a, b):
        lo, hi = (x, y) if x <= y else (y, x)
        d = hashlib.sha256(json.dumps([seed, p, lo, hi], default=str).encode()).digest()
        rows.append([int.from_bytes(d[8 * k : 8 * k + 8], "big") >> 11 for k in range(3)])  # 53-bit integers
        first.append(x <= y)
    u = torch.tensor(rows, dtype=torch.float64).view(-1, 3) / float(1 << 53)
    return u, torch.tensor(first, dtype=torch.bool)


@dataclass
class Decisions:
    """What the pool decided for ``N`` pairs (``prefer_a`` is the label; the rest explains it).

    Attributes:
        prefer_a: ``[N]`` bool, True = response ``a`` preferred.
        annotator: ``[N]`` long, index of the annotator that labelled each pair (``pool.names[i]``).
        probability: ``[N]`` float, that annotator's ``P(a > b)`` before any training flip.
        flipped: ``[N]`` bool, the training noise flipped the annotator's choice (always False with ``train=False``).
        tie: ``[N]`` bool, the pair is a draw: identical responses (no annotator asked), or the annotator answered a
            draw and (``train=True``) the training noise did not replace that answer (AlpacaFarm replaces a label by
            a fair coin with probability ``2 * flip_prob``). ``prefer_a`` holds the pair's coin there.
    """

    prefer_a: Tensor
    annotator: Tensor
    probability: Tensor
    flipped: Tensor
    tie: Tensor

    @property
    def outcome(self) -> Tensor:
        """``[N]`` float: 1 where ``a`` wins, 0 where ``b`` wins, 1/2 for a draw (AlpacaEval's ``preference - 1``
        mirrored: a draw counts half a win)."""
        return torch.where(self.tie, 0.5, self.prefer_a.float())


@dataclass
class AgreementReport:
    """Agreement between the pool's annotators and with the gold scorer on a set of pairs (Appendix C.2, Fig. 8).

    All numbers are *expected* agreement rates computed from the annotators' probabilities (no sampling noise):
    two labels with ``P(a) = p`` and ``q`` agree with probability ``p q + (1 - p)(1 - q)``.

    Attributes:
        names: annotator names (rows/columns of ``matrix``).
        matrix: ``[K][K]`` agreement between annotators' evaluation labels; the diagonal is an annotator's agreement
            with itself on a second independent draw (1 for deterministic annotators).
        with_gold: each annotator's agreement with the gold scorer, on pairs where gold is not tied.
        with_gold_train: the same with the training flips.
        pool_eval_with_gold / pool_train_with_gold: the pool (annotator drawn per pair) in eval / train mode.
        pool_eval_self / pool_train_self: the pool's agreement with an independent re-annotation of the same pairs
            (a fresh annotator draw and coin; AlpacaFarm's "variance" side: humans agree with each other ~66%).
        gold_tie_fraction: share of pairs the gold scorer ties (excluded from the gold columns).
        num_pairs: pairs evaluated.
    """

    names: list[str]
    matrix: list[list[float]]
    with_gold: dict[str, float]
    with_gold_train: dict[str, float]
    pool_eval_with_gold: float
    pool_train_with_gold: float
    pool_eval_self: float
    pool_train_self: float
    gold_tie_fraction: float
    num_pairs: int
    flip_prob: float = TRAIN_FLIP_PROB

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def as_markdown(self) -> str:
        """A Markdown table: each annotator's agreement with gold and with every other annotator."""
        head = "| annotator | gold (eval) | gold (train) | " + " | ".join(self.names) + " |"
        sep = "|" + "---|" * (3 + len(self.names))
        rows = [
            f"| {n} | {self.with_gold[n]:.3f} | {self.with_gold_train[n]:.3f} | "
            + " | ".join(f"{v:.3f}" for v in self.matrix[i])
            + " |"
            for i, n in enumerate(self.names)
        ]
        pool = (
            f"| **pool** | {self.pool_eval_with_gold:.3f} | {self.pool_train_with_gold:.3f} | "
            + " | ".join("" for _ in self.names)
            + " |"
        )
        notes = (
            f"\n{self.num_pairs} pairs; gold ties {self.gold_tie_fraction:.1%} (excluded from the gold columns); "
            f"training flip probability {self.flip_prob}; pool self-agreement eval {self.pool_eval_self:.3f}, "
            f"train {self.pool_train_self:.3f}."
        )
        return "\n".join([head, sep, *rows, pool]) + notes


class AnnotatorPool:
    """A pool of simulated annotators with AlpacaFarm's noise model (see the module docstring).

    Args:
        annotators: the pool (each pair is labelled by one, drawn uniformly per pair).
        flip_prob: probability that a *training* label is flipped (AlpacaFarm: 0.25); evaluation labels never are.
        seed: seeds every draw (annotator choice, Bernoulli draw, flip).
        gold: the gold scorer used by :meth:`agreement` (default: ``GoldScorer()`` with the pool's default style).
        assign: which annotator labels each pair, ``assign(prompts, a, b) -> [N]`` long indices (default: uniform,
            from the pair's digest; AlpacaFarm's pools choose per instruction, see
            :class:`~rlhf_ext.sim.alpaca_farm_pool.AlpacaFarmAssignment`).

    Example::

        pool = AnnotatorPool.default(seed=0)
        labels = pool.prefer(prompts, a, b, styles=styles, train=True)   # bool [N], True = a preferred
        relabelled = pool.relabel(dataset)                               # p_sim: re-decide chosen / rejected
        print(pool.agreement(prompts, a, b, styles).as_markdown())
    """

    def __init__(
        self,
        annotators: Sequence[Annotator],
        flip_prob: float = TRAIN_FLIP_PROB,
        seed: int = 0,
        gold: GoldScorer | None = None,
        assign: Callable[[list[Any], list[str], list[str]], Tensor] | None = None,
    ):
        annotators = list(annotators)
        if not annotators:
            raise ValueError("an annotator pool needs at least one annotator")
        names = [a.name for a in annotators]
        if len(set(names)) != len(names):
            raise ValueError(f"annotator names must be unique; got {names}")
        if not 0.0 <= flip_prob <= 0.5:
            raise ValueError(
                f"flip_prob must be in [0, 0.5] (AlpacaFarm uses 0.25; above 0.5 labels are mostly inverted), "
                f"got {flip_prob}"
            )
        self.annotators = annotators
        self.flip_prob = float(flip_prob)
        self.seed = int(seed)
        self.gold = gold if gold is not None else GoldScorer()
        self.assign = assign

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.annotators]

    def __repr__(self) -> str:
        return f"AnnotatorPool({self.names}, flip_prob={self.flip_prob}, seed={self.seed})"

    # ------------------------------------------------------------------------------------------------ builders
    @classmethod
    def default(
        cls,
        style: StyleSpec = None,
        *,
        flip_prob: float = TRAIN_FLIP_PROB,
        seed: int = 0,
        bank=None,
        specs: Sequence[AnnotatorSpec] = DEFAULT_ANNOTATORS,
        phrase_credit: PhraseCredit = "partial",
    ) -> AnnotatorPool:
        """The gold-scorer pool (:data:`DEFAULT_ANNOTATORS`, or ``specs``), all with the gold's ``phrase_credit``."""
        gold = GoldScorer(style, bank=bank, phrase_credit=phrase_credit)
        return cls([gold_annotator(s, style, bank, phrase_credit) for s in specs], flip_prob, seed, gold=gold)

    @classmethod
    def gold_only(cls, style: StyleSpec = None, *, flip_prob: float = 0.0, seed: int = 0, bank=None) -> AnnotatorPool:
        """One deterministic annotator that *is* the gold scorer (noise 0 unless ``flip_prob`` is given)."""
        return cls.default(style, flip_prob=flip_prob, seed=seed, bank=bank, specs=[AnnotatorSpec("gold", 1, 1, 0, 0)])

    @classmethod
    def from_reward_models(
        cls,
        models: Sequence[Any],
        temperatures: float | Sequence[float] = 1.0,
        *,
        flip_prob: float = TRAIN_FLIP_PROB,
        seed: int = 0,
        gold: GoldScorer | None = None,
        sft_model: str | None = None,
        batch_size: int = 32,
    ) -> AnnotatorPool:
        """Annotators backed by reward models: checkpoint paths (sequence-classification or rlhf-ext segment RMs,
        loaded with :func:`~rlhf_ext.runtime.rewards.load_reward`) or reward functions ``(prompts, responses)``."""
        from rlhf_ext.runtime.rewards import load_reward

        temps = [temperatures] * len(models) if isinstance(temperatures, int | float) else list(temperatures)
        if len(temps) != len(models):
            raise ValueError(f"got {len(temps)} temperatures for {len(models)} reward models")
        annotators = []
        for i, (m, t) in enumerate(zip(models, temps)):
            fn = m if callable(m) else load_reward(str(m), batch_size=batch_size, sft_model=sft_model)
            annotators.append(reward_model_annotator(f"rm{i}:{m if isinstance(m, str) else type(m).__name__}", fn, t))
        return cls(annotators, flip_prob, seed, gold)

    @classmethod
    def from_llm(
        cls,
        backends: Sequence[Any],
        preference: str | Mapping[str, str],
        *,
        flip_prob: float = TRAIN_FLIP_PROB,
        seed: int = 0,
        gold: GoldScorer | None = None,
        max_tokens: int = 128,
    ) -> AnnotatorPool:
        """LLM-judge annotators, one per backend (e.g. ``OpenAIBackend`` instances for different served models)."""
        annotators = [
            LLMAnnotator(f"llm{i}:{getattr(b, 'model', None) or b.name}", b, preference, max_tokens, seed + i)
            for i, b in enumerate(backends)
        ]
        return cls(annotators, flip_prob, seed, gold)

    @classmethod
    def from_alpaca_farm(
        cls,
        pool: str = "annotator_pool_v0",
        *,
        api_base: str = "http://localhost:8000/v1",
        models: Sequence[str] = (),
        api_key_env: str = "OPENAI_API_KEY",
        flip_prob: float = TRAIN_FLIP_PROB,
        seed: int = 0,
        gold: GoldScorer | None = None,
        backend_factory: Callable[[str], Any] | None = None,
    ) -> AnnotatorPool:
        """AlpacaFarm's annotator pool as shipped (:mod:`rlhf_ext.sim.alpaca_farm_pool`): ``pool`` is a pool name of
        the installed ``alpaca_farm`` (``annotator_pool_v0``), ``alpaca_eval:<evaluator>``, or a directory holding a
        ``configs.yaml`` of that shape; every annotator talks to the OpenAI-compatible server at ``api_base``
        (``models``: one served model for all, or ``config_model=served`` pairs; empty: the configs' model names).
        ``flip_prob`` is AlpacaFarm's ``p_label_flip`` (0.25 for training labels)."""
        from rlhf_ext.sim.alpaca_farm_pool import AlpacaFarmAssignment, alpaca_farm_annotators

        annotators = alpaca_farm_annotators(
            pool, backend_factory, models=models, seed=seed, api_base=api_base, api_key_env=api_key_env
        )
        assign = AlpacaFarmAssignment([a.name for a in annotators], seed)
        return cls(annotators, flip_prob, seed, gold, assign=assign)

    # ---------------------------------------------------------------------------------------------- decisions
    def _check(self, prompts, a, b, styles) -> tuple[list, list, list, list]:
        prompts, a, b = list(prompts), list(a), list(b)
        if not (len(prompts) == len(a) == len(b)):
            raise ValueError(f"got {len(prompts)} prompts, {len(a)} responses a and {len(b)} responses b; must match")
        return prompts, a, b, self.gold.resolve_styles(prompts, styles)

    def _annotator_probabilities(self, index: Tensor, prompts, a, b, styles, asked: Tensor) -> tuple[Tensor, Tensor]:
        """``[N]`` P(a > b) of the annotator ``index[i]`` for each pair and ``[N]`` bool: it answered a draw. Each
        annotator sees only its pairs, and only those where ``asked`` (elsewhere: 1/2, no draw)."""
        p = torch.full((len(a),), 0.5, dtype=torch.float64)
        tie = torch.zeros(len(a), dtype=torch.bool)
        for k, annotator in enumerate(self.annotators):
            rows = ((index == k) & asked).nonzero().flatten().tolist()
            if rows:
                sub = [[xs[i] for i in rows] for xs in (prompts, a, b, styles)]
                if hasattr(annotator, "probability_with_ties"):
                    prob, draws = annotator.probability_with_ties(*sub)
                    tie[rows] = torch.as_tensor(draws, dtype=torch.bool).cpu()
                else:
                    prob = annotator.probability(*sub)
                p[rows] = prob.double().cpu()
        return p, tie

    def decide(
        self,
        prompts: Sequence[Any],
        responses_a: Sequence[str],
        responses_b: Sequence[str],
        styles: Sequence[str | None] | str | None = None,
        *,
        train: bool,
    ) -> Decisions:
        """Label ``N`` pairs and say who labelled them, whether the training noise flipped them and which are draws
        (identical responses are never sent to an annotator)."""
        prompts, a, b, styles = self._check(prompts, responses_a, responses_b, styles)
        u, a_first = pair_uniforms(self.seed, prompts, a, b)
        if self.assign is not None:
            index = torch.as_tensor(self.assign(prompts, a, b), dtype=torch.long).flatten()
        else:
            index = (u[:, 0] * len(self.annotators)).long().clamp_max(len(self.annotators) - 1)
        identical = torch.tensor([x == y for x, y in zip(a, b)], dtype=torch.bool)
        prob, answered_tie = self._annotator_probabilities(index, prompts, a, b, styles, asked=~identical)
        p_canonical = torch.where(a_first, prob, 1.0 - prob)  # P(canonical first response wins)
        first_wins = u[:, 1] < p_canonical
        prefer_a = torch.where(a_first, first_wins, ~first_wins)
        flipped = (u[:, 2] < self.flip_prob) if train else torch.zeros_like(prefer_a)
        noised = (u[:, 2] < 2 * self.flip_prob) if train else torch.zeros_like(prefer_a)
        tie = identical | (answered_tie & ~noised)
        return Decisions(prefer_a ^ flipped, index, prob.float(), flipped, tie)

    def prefer(
        self,
        prompts: Sequence[Any],
        responses_a: Sequence[str],
        responses_b: Sequence[str],
        styles: Sequence[str | None] | str | None = None,
        *,
        train: bool,
    ) -> Tensor:
        """``[N]`` bool: True where response ``a`` is preferred. ``train=True`` adds the training flips."""
        return self.decide(prompts, responses_a, responses_b, styles, train=train).prefer_a

    def outcome(
        self,
        prompts: Sequence[Any],
        responses_a: Sequence[str],
        responses_b: Sequence[str],
        styles: Sequence[str | None] | str | None = None,
        *,
        train: bool,
    ) -> Tensor:
        """``[N]`` float: 1 where ``a`` wins, 0 where ``b`` wins, 1/2 for a draw (see :class:`Decisions`)."""
        return self.decide(prompts, responses_a, responses_b, styles, train=train).outcome

    def probability(
        self,
        prompts: Sequence[Any],
        responses_a: Sequence[str],
        responses_b: Sequence[str],
        styles: Sequence[str | None] | str | None = None,
        *,
        train: bool,
    ) -> Tensor:
        """``[N]`` P(a preferred) averaged over the pool's annotators (and the training flips when ``train``)."""
        prompts, a, b, styles = self._check(prompts, responses_a, responses_b, styles)
        p = self._all_probabilities(prompts, a, b, styles).mean(0)
        return (self._noisy(p) if train else p).float()

    def _noisy(self, p: Tensor) -> Tensor:
        return self.flip_prob + (1.0 - 2.0 * self.flip_prob) * p

    def _all_probabilities(self, prompts, a, b, styles) -> Tensor:
        """``[K, N]`` float64: every annotator's P(a > b) on every pair."""
        return torch.stack([ann.probability(prompts, a, b, styles).double().cpu().flatten() for ann in self.annotators])

    # --------------------------------------------------------------------------------------------------- p_sim
    def relabel(
        self,
        dataset,
        train: bool = True,
        *,
        prompt_key: str = "prompt",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        style_key: str | None = "style",
    ):
        """AlpacaFarm's ``p_sim``: re-decide which response of every pair is chosen (a new ``datasets.Dataset``).

        All columns are kept; ``chosen``/``rejected`` are exchanged where the pool prefers the rejected one. Added
        columns: ``sim_annotator`` (name of the annotator that labelled the row) and ``sim_swapped`` (True where the
        pool's label differs from the input's). Styles come from ``style_key`` when the dataset has that column,
        otherwise from the pool's gold scorer's default style.
        """
        cols = dataset.column_names
        missing = [k for k in (prompt_key, chosen_key, rejected_key) if k not in cols]
        if missing:
            raise ValueError(
                f"relabel needs columns {prompt_key!r}, {chosen_key!r}, {rejected_key!r}; missing {missing} "
                f"(columns: {', '.join(cols)}). Pass prompt_key=/chosen_key=/rejected_key="
            )
        for name in ("sim_annotator", "sim_swapped"):
            if name in cols:
                dataset = dataset.remove_columns(name)  # relabelling a relabelled dataset starts from its current label
        styles = dataset[style_key] if style_key and style_key in cols else None
        chosen, rejected = dataset[chosen_key], dataset[rejected_key]
        dec = self.decide(dataset[prompt_key], chosen, rejected, styles, train=train)
        swap = (~dec.prefer_a).tolist()
        names = self.names
        new_chosen = [r if s else c for c, r, s in zip(chosen, rejected, swap)]
        new_rejected = [c if s else r for c, r, s in zip(chosen, rejected, swap)]
        out = dataset.remove_columns([chosen_key, rejected_key])
        out = out.add_column(chosen_key, new_chosen).add_column(rejected_key, new_rejected)
        out = out.add_column("sim_annotator", [names[i] for i in dec.annotator.tolist()])
        out = out.add_column("sim_swapped", swap)
        return out.select_columns([*cols, "sim_annotator", "sim_swapped"])

    # ---------------------------------------------------------------------------------------------- agreement
    def agreement(
        self,
        prompts: Sequence[Any],
        responses_a: Sequence[str],
        responses_b: Sequence[str],
        styles: Sequence[str | None] | str | None = None,
    ) -> AgreementReport:
        """Expected agreement between annotators and with the gold scorer on these pairs (see
        :class:`AgreementReport`)."""
        prompts, a, b, styles = self._check(prompts, responses_a, responses_b, styles)
        if not a:
            raise ValueError("agreement needs at least one pair")
        p = self._all_probabilities(prompts, a, b, styles)  # [K, N]
        gold = self.gold.score(prompts + prompts, a + b, styles + styles).double()
        g = torch.sign(gold[: len(a)] - gold[len(a) :])  # +1 a, -1 b, 0 tie
        decided = g != 0
        target = (g > 0).double()

        def agree(x: Tensor, y: Tensor) -> Tensor:  # [..., N] probabilities -> [...] mean agreement
            return (x * y + (1 - x) * (1 - y)).mean(-1)

        matrix = agree(p.unsqueeze(1), p.unsqueeze(0))  # [K, K]
        noisy = self._noisy(p)
        if decided.any():
            with_gold = agree(p[:, decided], target[decided])
            with_gold_train = agree(noisy[:, decided], target[decided])
        else:
            with_gold = with_gold_train = torch.full((len(self.annotators),), float("nan"), dtype=torch.float64)
        pool_p, pool_noisy = p.mean(0), noisy.mean(0)  # uniform annotator draw per pair
        names = self.names

        def pool_gold(x: Tensor) -> float:
            return float(agree(x[decided], target[decided])) if decided.any() else float("nan")

        # two independent pool annotations of one pair: annotators i, j drawn independently, then their coins
        pool_self = float(matrix.mean())
        pool_self_train = float(agree(noisy.unsqueeze(1), noisy.unsqueeze(0)).mean())
        return AgreementReport(
            names=names,
            matrix=matrix.tolist(),
            with_gold=dict(zip(names, with_gold.tolist())),
            with_gold_train=dict(zip(names, with_gold_train.tolist())),
            pool_eval_with_gold=pool_gold(pool_p),
            pool_train_with_gold=pool_gold(pool_noisy),
            pool_eval_self=pool_self,
            pool_train_self=pool_self_train,
            gold_tie_fraction=float((~decided).double().mean()),
            num_pairs=len(a),
            flip_prob=self.flip_prob,
        )


@dataclass
class PoolConfig:
    """A pool in a recipe: ``backend: gold`` (gold-scorer variants; ``annotators`` empty = the default six),
    ``reward_model`` (``reward_models`` paths, ``temperatures``), ``llm`` (``api_base``/``models`` of an
    OpenAI-compatible server and the ``preference`` text) or ``alpaca_farm`` (AlpacaFarm's annotators as shipped:
    ``alpaca_farm_pool`` = ``annotator_pool_v0``, ``alpaca_eval:<evaluator>`` or a directory with a ``configs.yaml``,
    run against ``api_base``; ``models``: one served model for all annotators, ``config_model=served`` pairs, or
    empty for the configs' own model names)."""

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

    def __post_init__(self):
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
            return AnnotatorPool.default(
                gold.style,
                flip_prob=self.flip_prob,
                seed=seed,
                bank=gold.bank,
                specs=self.annotators or DEFAULT_ANNOTATORS,
                phrase_credit=gold.phrase_credit,
            )
        if self.backend == "reward_model":
            temps = self.temperatures or 1.0
            return AnnotatorPool.from_reward_models(
                self.reward_models, temps, flip_prob=self.flip_prob, seed=seed, gold=gold, sft_model=sft_model
            )
        if self.backend == "alpaca_farm":
            return AnnotatorPool.from_alpaca_farm(
                self.alpaca_farm_pool,
                api_base=self.api_base,
                models=self.models,
                api_key_env=self.api_key_env,
                flip_prob=self.flip_prob,
                seed=seed,
                gold=gold,
            )
        from rlhf_ext.datagen.backends import OpenAIBackend

        backends = [OpenAIBackend(self.api_base, model=m, api_key_env=self.api_key_env) for m in self.models]
        return AnnotatorPool.from_llm(backends, self.preference, flip_prob=self.flip_prob, seed=seed, gold=gold)
