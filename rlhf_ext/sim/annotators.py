"""Simulated pairwise preferences ``p_sim`` (paper 002, sections 3.2-3.3 and Appendix C.1).

Each pair is labelled by one annotator drawn from a **pool** (inter-annotator variability); *training* labels are also
flipped with probability 0.25 (intra-annotator noise), *evaluation* labels (``p_eval``) are not. An :class:`Annotator`
returns ``P(a preferred over b)``: a :class:`BTAnnotator` (gold-scorer variants or reward models), an LLM judge or
AlpacaFarm's own annotators (the :class:`AnnotatorPool` builders).

**Draws** (identical responses, never sent to an annotator, or an annotator's draw answer) are 1/2 in
:meth:`AnnotatorPool.outcome`; binary labels settle them with the pair's fair coin. **Unparseable answers** (``NaN``)
are counted per annotator, warned about above :data:`UNPARSEABLE_WARN_RATE`, and settled by that coin
(``unparseable="coin"``) or dropped from :meth:`AnnotatorPool.relabel`'s training labels (``"drop"``, AlpacaEval).

Randomness is a deterministic function of ``(seed, prompt, {a, b})`` (SHA-256 gives three uniforms per pair: annotator,
Bernoulli draw, training flip): labels do not depend on batch order, ``prefer(b, a) == not prefer(a, b)`` for ``a !=
b``, and a training label is its evaluation label with the flip applied.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from rlhf_ext.sim.gold import GoldScorer, PhraseCredit, StyleSpec
from rlhf_ext.sim.llm_annotator import LLMAnnotator

UtilityFn = Callable[[list[Any], list[str], list[str | None]], Tensor]
Styles = Sequence[str | None] | str | None
Texts = Sequence[str]
#: AlpacaFarm's intra-annotator noise for training labels (section 3.2, Appendix C.1).
TRAIN_FLIP_PROB = 0.25
#: An annotator whose share of unparseable answers in a batch exceeds this is named in a warning.
UNPARSEABLE_WARN_RATE = 0.05
UNPARSEABLE_POLICIES = ("coin", "drop")
logger = logging.getLogger(__name__)


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
    """Bradley-Terry chooser ``name``: ``P(a > b) = sigmoid((u(a) - u(b)) / temperature)`` with ``utility(prompts,
    responses, styles) -> [N]``; temperature 0 is the deterministic argmax (equal utilities: 1/2)."""

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
    """A gold-scorer variant annotator (:class:`BTAnnotator` on :class:`~rlhf_ext.sim.GoldScorer` with these weights;
    ``length_weight``: utility per 100 characters, > 0 prefers long responses; ``temperature`` 0 = deterministic)."""

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


def reward_model_annotator(name: str, reward_fn, temperature: float = 1.0) -> BTAnnotator:
    """A :class:`BTAnnotator` whose utility is a reward function ``(prompts, responses) -> [N]`` (styles ignored)."""
    return BTAnnotator(name, lambda prompts, responses, styles: reward_fn(prompts, responses), temperature)


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
        tie: ``[N]`` bool, a draw: identical responses, or an answered draw the training noise (a fair coin with
            probability ``2 * flip_prob``, AlpacaFarm) did not replace; ``prefer_a`` holds the pair's coin there.
        unparseable: ``[N]`` bool, the answer named no response (``probability`` 1/2, ``prefer_a`` the pair's coin).
    """

    prefer_a: Tensor
    annotator: Tensor
    probability: Tensor
    flipped: Tensor
    tie: Tensor
    unparseable: Tensor

    @property
    def outcome(self) -> Tensor:
        """``[N]`` float: 1 where ``a`` wins, 0 where ``b`` wins, 1/2 for a draw (AlpacaEval's ``preference - 1``
        mirrored: a draw counts half a win)."""
        return torch.where(self.tie, 0.5, self.prefer_a.float())


@dataclass
class AgreementReport:
    """Agreement between the pool's annotators and with the gold scorer on a set of pairs (Appendix C.2, Fig. 8):
    *expected* rates from the annotators' probabilities (labels with ``P(a) = p`` and ``q`` agree with probability
    ``p q + (1 - p)(1 - q)``).

    Attributes:
        names: annotator names (rows/columns of ``matrix``).
        matrix: ``[K][K]`` agreement between annotators' evaluation labels (diagonal: with an independent redraw).
        with_gold / with_gold_train: each annotator's agreement with gold on pairs gold does not tie (eval / train).
        pool_eval_with_gold / pool_train_with_gold: the pool (annotator drawn per pair) in eval / train mode.
        pool_eval_self / pool_train_self: the pool's agreement with an independent re-annotation (fresh annotator
            and coin; AlpacaFarm's humans agree with each other ~66%).
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

        def row(*cells: str) -> str:
            return "| " + " | ".join(cells) + " |"

        rows = [
            row(n, *(f"{v:.3f}" for v in [self.with_gold[n], self.with_gold_train[n], *self.matrix[i]]))
            for i, n in enumerate(self.names)
        ]
        pool = row(
            "**pool**", f"{self.pool_eval_with_gold:.3f}", f"{self.pool_train_with_gold:.3f}", *[""] * len(self.names)
        )
        notes = (
            f"\n{self.num_pairs} pairs; gold ties {self.gold_tie_fraction:.1%} (excluded from the gold columns); "
            f"training flip probability {self.flip_prob}; pool self-agreement eval {self.pool_eval_self:.3f}, "
            f"train {self.pool_train_self:.3f}."
        )
        head = row("annotator", "gold (eval)", "gold (train)", *self.names)
        return "\n".join([head, "|" + "---|" * (3 + len(self.names)), *rows, pool]) + notes


class AnnotatorPool:
    """A pool of simulated annotators with AlpacaFarm's noise model (see the module docstring).

    Args:
        annotators: the pool (each pair is labelled by one, drawn uniformly per pair).
        flip_prob: probability that a *training* label is flipped (AlpacaFarm: 0.25); ``seed`` seeds every draw.
        gold: the gold scorer used by :meth:`agreement` (default: ``GoldScorer()`` with the pool's default style).
        assign: ``assign(prompts, a, b) -> [N]`` long annotator indices (default: uniform from the pair's digest).
        unparseable: ``coin`` (settled by the pair's fair coin) or ``drop`` (AlpacaEval: :meth:`relabel` drops it).

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
        unparseable: str = "coin",
    ):
        annotators = list(annotators)
        if unparseable not in UNPARSEABLE_POLICIES:
            raise ValueError(f"unparseable must be coin or drop; got {unparseable!r}")
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
        self.unparseable = unparseable
        self._counts = {name: [0, 0] for name in names}  # annotator -> [answers asked for, unparseable]

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.annotators]

    def label_counts(self, since: Mapping[str, Mapping[str, int]] | None = None) -> dict[str, dict[str, Any]]:
        """Per annotator: ``labels`` (answers asked of it by :meth:`decide`), ``unparseable`` and their ``rate``;
        counted from ``since`` (an earlier result of this method) when given."""
        out = {}
        for name, (asked, bad) in self._counts.items():
            if since is not None and name in since:
                asked, bad = asked - since[name]["labels"], bad - since[name]["unparseable"]
            out[name] = {"labels": asked, "unparseable": bad, "rate": bad / asked if asked else 0.0}
        return out

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
        """The gold-scorer pool (:data:`DEFAULT_ANNOTATORS`, or ``specs``): :class:`BTAnnotator` s on variants of the
        gold scorer, all with the gold's ``phrase_credit`` and each with its spec's weights and temperature."""
        gold = GoldScorer(style, bank=bank, phrase_credit=phrase_credit)
        annotators = []
        for s in specs:
            weights = {w: getattr(s, w) for w in ("positive_weight", "negative_weight", "length_weight")}
            scorer = GoldScorer(style, bank=bank, phrase_credit=phrase_credit, **weights)
            annotators.append(BTAnnotator(s.name, scorer.score, s.temperature))
        return cls(annotators, flip_prob, seed, gold=gold)

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
        """AlpacaFarm's annotator pool as shipped (:func:`~rlhf_ext.sim.alpaca_farm_pool.resolve_pool` names ``pool``)
        run against ``api_base`` (``models``: :func:`~rlhf_ext.sim.alpaca_farm_pool.model_for`); ``flip_prob`` is
        AlpacaFarm's ``p_label_flip``."""
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

    def _annotator_probabilities(
        self, index: Tensor, prompts, a, b, styles, asked: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Per pair, of annotator ``index[i]``: ``[N]`` P(a > b) (1/2 where unparseable or not ``asked``), ``[N]`` bool
        it answered a draw, ``[N]`` bool its answer was unparseable (counted and warned about: module docstring)."""
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
                bad = int(prob.isnan().sum())
                self._counts[annotator.name][0] += len(rows)
                self._counts[annotator.name][1] += bad
                if bad > UNPARSEABLE_WARN_RATE * len(rows):
                    logger.warning(
                        "annotator %s: %d of %d answers unparseable (%.0f%%), %s", annotator.name, bad, len(rows),
                        100 * bad / len(rows), "settled by a coin (pool.unparseable: drop drops them, as AlpacaEval)"
                        if self.unparseable == "coin" else "dropped from training labels",
                    )  # fmt: skip
        return p.nan_to_num(0.5), tie, p.isnan()

    def decide(
        self, prompts: Sequence[Any], responses_a: Texts, responses_b: Texts, styles: Styles = None, *, train: bool
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
        prob, answered_tie, unparseable = self._annotator_probabilities(index, prompts, a, b, styles, ~identical)
        p_canonical = torch.where(a_first, prob, 1.0 - prob)  # P(canonical first response wins)
        first_wins = u[:, 1] < p_canonical
        prefer_a = torch.where(a_first, first_wins, ~first_wins)
        flipped = (u[:, 2] < self.flip_prob) if train else torch.zeros_like(prefer_a)
        noised = (u[:, 2] < 2 * self.flip_prob) if train else torch.zeros_like(prefer_a)
        tie = identical | (answered_tie & ~noised)
        return Decisions(prefer_a ^ flipped, index, prob.float(), flipped, tie, unparseable)

    def prefer(
        self, prompts: Sequence[Any], responses_a: Texts, responses_b: Texts, styles: Styles = None, *, train: bool
    ) -> Tensor:
        """``[N]`` bool: True where response ``a`` is preferred. ``train=True`` adds the training flips."""
        return self.decide(prompts, responses_a, responses_b, styles, train=train).prefer_a

    def outcome(
        self, prompts: Sequence[Any], responses_a: Texts, responses_b: Texts, styles: Styles = None, *, train: bool
    ) -> Tensor:
        """``[N]`` float: 1 where ``a`` wins, 0 where ``b`` wins, 1/2 for a draw (see :class:`Decisions`)."""
        return self.decide(prompts, responses_a, responses_b, styles, train=train).outcome

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

        ``chosen``/``rejected`` are exchanged where the pool prefers the rejected one; added: ``sim_annotator`` and
        ``sim_swapped``. Styles come from ``style_key`` if present. With ``unparseable="drop"`` unparseable rows go.
        """
        cols = dataset.column_names
        missing = [k for k in (prompt_key, chosen_key, rejected_key) if k not in cols]
        if missing:
            raise ValueError(
                f"relabel needs columns {prompt_key!r}, {chosen_key!r}, {rejected_key!r}; missing {missing} "
                f"(columns: {', '.join(cols)}). Pass prompt_key=/chosen_key=/rejected_key="
            )
        # relabelling a relabelled dataset starts from its current label
        dataset = dataset.remove_columns([name for name in ("sim_annotator", "sim_swapped") if name in cols])
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
        out = out.add_column("sim_swapped", swap).select_columns([*cols, "sim_annotator", "sim_swapped"])
        if self.unparseable == "drop" and bool(dec.unparseable.any()):
            out = out.select((~dec.unparseable).nonzero().flatten().tolist())
        return out

    # ---------------------------------------------------------------------------------------------- agreement
    def agreement(
        self, prompts: Sequence[Any], responses_a: Texts, responses_b: Texts, styles: Styles = None
    ) -> AgreementReport:
        """Expected agreement between annotators and with the gold scorer on these pairs (see
        :class:`AgreementReport`)."""
        prompts, a, b, styles = self._check(prompts, responses_a, responses_b, styles)
        if not a:
            raise ValueError("agreement needs at least one pair")
        probs = [ann.probability(prompts, a, b, styles).double().cpu().flatten() for ann in self.annotators]
        p = torch.stack(probs).nan_to_num(0.5)  # [K, N] every annotator's P(a > b); an unparseable answer: 1/2
        gold = self.gold.score(prompts + prompts, a + b, styles + styles).double()
        g = torch.sign(gold[: len(a)] - gold[len(a) :])  # +1 a, -1 b, 0 tie
        decided = g != 0
        target = (g > 0).double()

        def agree(x: Tensor, y: Tensor) -> Tensor:  # [..., N] probabilities -> [...] mean agreement
            return (x * y + (1 - x) * (1 - y)).mean(-1)

        matrix = agree(p.unsqueeze(1), p.unsqueeze(0))  # [K, K]
        noisy = self.flip_prob + (1.0 - 2.0 * self.flip_prob) * p
        names = self.names
        # gold columns over the pairs gold decides (NaN, a mean over none, when it decides none); the pool draws its
        # annotator uniformly per pair, and two independent pool annotations draw annotators i, j and their coins
        return AgreementReport(
            names=names,
            matrix=matrix.tolist(),
            with_gold=dict(zip(names, agree(p[:, decided], target[decided]).tolist())),
            with_gold_train=dict(zip(names, agree(noisy[:, decided], target[decided]).tolist())),
            pool_eval_with_gold=float(agree(p.mean(0)[decided], target[decided])),
            pool_train_with_gold=float(agree(noisy.mean(0)[decided], target[decided])),
            pool_eval_self=float(matrix.mean()),
            pool_train_self=float(agree(noisy.unsqueeze(1), noisy.unsqueeze(0)).mean()),
            gold_tie_fraction=float((~decided).double().mean()),
            num_pairs=len(a),
            flip_prob=self.flip_prob,
        )
