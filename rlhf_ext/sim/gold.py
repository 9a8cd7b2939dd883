"""Gold rewards of the simulator: what a response *should* be rewarded for (paper 002 2.2; paper 003 Fig. 2-3).

:class:`GoldScorer` scores the ``offline`` dataset generator's tasks (``style`` = a phrase-bank style: positive phrases
its key phrases, negative those of the competing styles, :func:`rlhf_ext.datagen.phrasebank.rubric_for`) and the toy
task (``style`` ``None`` or ``"toy"``: :data:`rlhf_ext.zoo.toy.KEY_PHRASES` positive, ``WEAK_PHRASES`` negative).
Credit sits in a few multi-token **key phrases** and nowhere else::

    gold(y, s) = w_pos * P(y, s) - w_neg * N(y, s) + w_len * len(y) / 100
    P(y, s) = sum_{q positive} credit(q, y),   N(y, s) = sum_{q negative} credit(q, y)

with ``len`` in characters and defaults ``w_pos = w_neg = 1``, ``w_len = 0``. ``phrase_credit`` sets ``credit(q, y)``:

* ``"partial"`` (default): the fraction of ``q``'s *distinctive* word bigrams found in ``y`` (within a clause;
  distinctive = in no other key phrase of the bank, in none of its neutral texts, and not two stop words), so two
  samples of one SFT model rarely tie (AlpacaFarm compares exactly such pairs, paper 002 section 3.2).
* ``"exact"``: 1 if ``q`` occurs verbatim (case-insensitive), else 0; ``P`` / ``N`` count **distinct** phrases.

Both give a whole key phrase exactly 1; **repeating a key phrase earns nothing more** (paper 003, Figure 3), unlike
:func:`rlhf_ext.datagen.phrasebank.gold_score`, which counts occurrences of the same rubric.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

TOY_STYLE = "toy"
StyleSpec = str | None | Mapping[str, str]


def toy_rubric():
    """The toy task's :class:`~rlhf_ext.datagen.phrasebank.Rubric`: key phrases positive, weak phrases negative."""
    from rlhf_ext.datagen.phrasebank import Rubric
    from rlhf_ext.zoo.toy import KEY_PHRASES, WEAK_PHRASES

    positive, negative = (tuple(p.lower() for p in phrases) for phrases in (KEY_PHRASES, WEAK_PHRASES))
    return Rubric(style=TOY_STYLE, positive=positive, negative=negative)


_WORD = re.compile(r"[a-z0-9']+")
_CLAUSE = re.compile(r"[.!?;:,\n]+")
PhraseCredit = Literal["partial", "exact"]


def word_bigrams(text: str) -> set[tuple[str, str]]:
    """The word bigrams of ``text`` (lower-cased, within clauses: no bigram spans punctuation)."""
    out: set[tuple[str, str]] = set()
    for clause in _CLAUSE.split(text.lower()):
        words = _WORD.findall(clause)
        out.update(zip(words, words[1:]))
    return out


class _Matcher:
    """Per response: the summed credit of the positive and the negative key phrases (see the module docstring);
    ``neutral`` texts and every key phrase of the bank (``all_phrases``) decide which bigrams are distinctive."""

    def __init__(self, rubric, credit: PhraseCredit, neutral: Sequence[str] = (), all_phrases: Sequence[str] = ()):
        self.rubric = rubric
        self.credit = credit
        self.positive = frozenset(rubric.positive)
        self.negative = frozenset(rubric.negative)
        phrases = sorted(self.positive | self.negative, key=len, reverse=True)  # longest first: no partial matches
        self.regex = re.compile("|".join(re.escape(p) for p in phrases))
        shared = Counter(b for p in set(all_phrases) | self.positive | self.negative for b in word_bigrams(p))
        from rlhf_ext.datagen.phrasebank import STOP_WORDS

        common = set().union(*(word_bigrams(t) for t in neutral)) if neutral else set()

        def distinctive(b: tuple[str, str]) -> bool:
            return shared[b] == 1 and b not in common and not (b[0] in STOP_WORDS and b[1] in STOP_WORDS)

        #: phrase -> its distinctive bigrams (empty: the phrase is credited by exact match only)
        self.bigrams = {p: {b for b in word_bigrams(p) if distinctive(b)} for p in phrases}

    def credits(self, text: str) -> tuple[float, float]:
        low = text.lower()
        if self.credit == "exact":
            found = set(self.regex.findall(low))
            return float(len(found & self.positive)), float(len(found & self.negative))
        bigrams = word_bigrams(low)

        def credit(phrase: str) -> float:  # a phrase present verbatim has all its bigrams: credit 1
            own = self.bigrams[phrase]
            return len(own & bigrams) / len(own) if own else float(phrase in low)

        return sum(credit(p) for p in self.positive), sum(credit(p) for p in self.negative)


class GoldScorer:
    """The programmatic gold reward (see the module docstring for exactly what it rewards).

    Args:
        style: the default style: a phrase-bank style, ``None``/``"toy"`` for the toy task, or a mapping ``prompt ->
            style`` (every scored prompt must be in it).
        bank: the phrase bank the dataset was generated with (default: the packaged one).
        positive_weight / negative_weight / length_weight: ``w_pos`` / ``w_neg`` (>= 0) / ``w_len``.
        phrase_credit: ``"partial"`` (default, graded) or ``"exact"`` (verbatim phrases only).

    Callable as a reward function ``scorer(prompts, responses) -> tensor[N]`` (default ``style``).
    """

    def __init__(
        self,
        style: StyleSpec = None,
        *,
        bank=None,
        positive_weight: float = 1.0,
        negative_weight: float = 1.0,
        length_weight: float = 0.0,
        phrase_credit: PhraseCredit = "partial",
    ):
        if positive_weight < 0 or negative_weight < 0:
            raise ValueError(
                f"gold weights must be >= 0 (got positive {positive_weight}, negative {negative_weight}); a negative "
                "weight would reward the competing style"
            )
        self.style = style
        self.bank = bank
        self.positive_weight = float(positive_weight)
        self.negative_weight = float(negative_weight)
        self.length_weight = float(length_weight)
        if phrase_credit not in ("partial", "exact"):
            raise ValueError(f"phrase_credit must be 'partial' or 'exact', got {phrase_credit!r}")
        self.phrase_credit = phrase_credit
        self._matchers: dict[str, _Matcher] = {}
        if isinstance(style, str):
            self.matcher(style)  # fail early on an unknown style

    def __repr__(self) -> str:
        return (
            f"GoldScorer(style={self.style!r}, positive_weight={self.positive_weight}, "
            f"negative_weight={self.negative_weight}, length_weight={self.length_weight}, "
            f"phrase_credit={self.phrase_credit!r})"
        )

    def matcher(self, style: str | None) -> _Matcher:
        key = TOY_STYLE if style in (None, TOY_STYLE) else style
        if key not in self._matchers:
            if key == TOY_STYLE:  # neutral: filler subjects and predicates and the phrase's frame
                from rlhf_ext.zoo.toy import PREDICATES, SUBJECTS, TOPICS

                rubric, all_phrases = toy_rubric(), ()
                neutral = [*SUBJECTS, *PREDICATES, *TOPICS, "The facts about are"]
            else:
                from rlhf_ext.datagen.phrasebank import load_phrase_bank, rubric_for

                bank = self.bank if self.bank is not None else load_phrase_bank()
                try:
                    rubric = rubric_for(key, bank)
                except KeyError as e:
                    raise ValueError(
                        f"{e.args[0]}; the gold scorer needs a phrase-bank style (the dataset's 'style' column) or "
                        f"None/'{TOY_STYLE}' for the toy task"
                    ) from None
                neutral = bank.neutral_texts()
                all_phrases = [p for s in bank.styles for p in bank.style(s).phrases]
            self._matchers[key] = _Matcher(rubric, self.phrase_credit, neutral, all_phrases)
        return self._matchers[key]

    def rubric(self, style: str | None):
        """The :class:`~rlhf_ext.datagen.phrasebank.Rubric` (positive / negative key phrases) of ``style``."""
        return self.matcher(style).rubric

    def resolve_styles(self, prompts: Sequence[Any], styles: Sequence[str | None] | str | None = None) -> list:
        """One style per row: ``styles`` if given (a sequence or one style for all), else the default ``style``."""
        n = len(prompts)
        if styles is None:
            styles = self.style
            if isinstance(styles, Mapping):
                missing = [p for p in prompts if _key(p) not in styles]
                if missing:
                    raise ValueError(
                        f"{len(missing)} prompt(s) have no style in the scorer's prompt -> style mapping, e.g. "
                        f"{str(missing[0])[:80]!r}; pass styles= explicitly"
                    )
                return [styles[_key(p)] for p in prompts]
        if styles is None or isinstance(styles, str):
            return [styles] * n
        styles = list(styles)
        if len(styles) != n:
            raise ValueError(f"got {len(styles)} styles for {n} responses; pass one style per row (or one for all)")
        return styles

    def counts(self, responses: Sequence[str], styles: Sequence[str | None]) -> tuple[Tensor, Tensor]:
        """``([N], [N])`` float: the summed credit of the positive and of the negative key phrases in each response
        (with ``phrase_credit="exact"``: the number of distinct positive / negative key phrases)."""
        if len(styles) != len(responses):
            raise ValueError(f"got {len(styles)} styles for {len(responses)} responses")
        pairs = [self.matcher(s).credits(_text(r)) for r, s in zip(responses, styles)]
        t = torch.tensor(pairs, dtype=torch.float32).view(-1, 2)
        return t[:, 0], t[:, 1]

    def score(
        self, prompts: Sequence[Any], responses: Sequence[str], styles: Sequence[str | None] | str | None = None
    ) -> Tensor:
        """``[N]`` float32 gold rewards of ``responses`` (text, or chat messages ending in the response) to ``prompts``
        (used only to look up styles in a prompt mapping); ``styles``: one per row, one for all, or ``None`` (the
        scorer's default ``style``)."""
        if len(prompts) != len(responses):
            raise ValueError(f"got {len(prompts)} prompts for {len(responses)} responses; pass one prompt per response")
        pos, neg = self.counts(responses, self.resolve_styles(prompts, styles))
        out = self.positive_weight * pos - self.negative_weight * neg
        if self.length_weight:
            lengths = torch.tensor([len(_text(r)) for r in responses], dtype=torch.float32)
            out = out + self.length_weight * lengths / 100.0
        return out

    def __call__(self, prompts: Sequence[Any], responses: Sequence[str]) -> Tensor:
        return self.score(prompts, responses)


def _key(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else repr(prompt)


def _text(response: Any) -> str:
    """Response text: a string, or the content of the last message of a chat response."""
    if isinstance(response, str):
        return response
    if isinstance(response, list) and response and isinstance(response[-1], dict):
        return str(response[-1].get("content", ""))
    raise TypeError(f"a response must be text or a list of chat messages, got {type(response).__name__}")
