"""Gold rewards of the simulator: what a response *should* be rewarded for (paper 002 2.2; paper 003 Fig. 2-3).

:class:`GoldScorer` scores how well a response satisfies a task's preference, for the tasks of the ``offline`` dataset
generator (:mod:`rlhf_ext.datagen`) and for the toy key-phrase task (:mod:`rlhf_ext.zoo.toy`). Credit sits in a
few multi-token **key phrases** and nowhere else:

* **Offline generator tasks** (``style`` = a phrase-bank style such as ``rapper`` or ``eli5``): the positive phrases are
  the style's key phrases, the negative phrases those of the competing styles of its family
  (:func:`rlhf_ext.datagen.phrasebank.rubric_for`).
* **Toy task** (``style`` = ``None`` or ``"toy"``): the positive phrases are :data:`rlhf_ext.zoo.toy.KEY_PHRASES`
  ("backed by peer-reviewed evidence", ...), the negative phrases :data:`~rlhf_ext.zoo.toy.WEAK_PHRASES`
  ("mostly rumours passed around online", ...).

The gold reward of response ``y`` under style ``s`` is::

    gold(y, s) = w_pos * P(y, s) - w_neg * N(y, s) + w_len * len(y) / 100

where ``P`` / ``N`` count the **distinct** positive / negative key phrases that occur in ``y`` (case-insensitive
substring match), ``len`` is in characters, and the defaults are ``w_pos = w_neg = 1``, ``w_len = 0``. Content
sentences, connectors, fillers and the prompt earn nothing; **repeating a key phrase earns nothing more** (paper 003,
Figure 3 bottom: a reward model that pays for repetition is being hacked, so the gold reward must not). This differs
on purpose from :func:`rlhf_ext.datagen.phrasebank.gold_score` / :meth:`Rubric.score`, which count *occurrences*
(they describe how the generator built a pair, where repetition is incidental); the rubric — which phrases are
positive and negative — is the same. For the toy task, ``P >= 1`` is exactly
:func:`rlhf_ext.zoo.toy.has_key_phrase` up to letter case.

The annotator variants of :class:`rlhf_ext.sim.AnnotatorPool` are gold scorers with other weights.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

TOY_STYLE = "toy"
StyleSpec = str | None | Mapping[str, str]


def toy_rubric():
    """The toy task's :class:`~rlhf_ext.datagen.phrasebank.Rubric`: key phrases positive, weak phrases negative."""
    from rlhf_ext.datagen.phrasebank import Rubric
    from rlhf_ext.zoo.toy import KEY_PHRASES, WEAK_PHRASES

    return Rubric(
        style=TOY_STYLE,
        positive=tuple(p.lower() for p in KEY_PHRASES),
        negative=tuple(p.lower() for p in WEAK_PHRASES),
    )


class _Matcher:
    """One regex pass per response: the set of distinct positive and negative phrases it contains."""

    def __init__(self, rubric):
        self.rubric = rubric
        self.positive = frozenset(rubric.positive)
        self.negative = frozenset(rubric.negative)
        phrases = sorted(self.positive | self.negative, key=len, reverse=True)  # longest first: no partial matches
        self.regex = re.compile("|".join(re.escape(p) for p in phrases))

    def distinct(self, text: str) -> tuple[int, int]:
        found = set(self.regex.findall(text.lower()))
        return len(found & self.positive), len(found & self.negative)


class GoldScorer:
    """The programmatic gold reward (see the module docstring for exactly what it rewards).

    Args:
        style: the default style when :meth:`score` gets no ``styles``: a phrase-bank style, ``None``/``"toy"`` for
            the toy task, or a mapping ``prompt -> style`` (multi-style data; every scored prompt must be in it).
        bank: the phrase bank (default: the packaged one); use the bank the dataset was generated with.
        positive_weight / negative_weight: ``w_pos`` / ``w_neg`` (>= 0).
        length_weight: ``w_len``, utility per 100 characters (0 for the gold reward; annotator variants use it).

    Callable as a reward function ``scorer(prompts, responses) -> tensor[N]`` (with the default ``style``), so it
    plugs into :class:`~rlhf_ext.trl.IterativeDPOTrainer` (``reward_funcs=`` / ``gold_fn=``) and
    :func:`rlhf_ext.sim.best_of_n`.
    """

    def __init__(
        self,
        style: StyleSpec = None,
        *,
        bank=None,
        positive_weight: float = 1.0,
        negative_weight: float = 1.0,
        length_weight: float = 0.0,
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
        self._matchers: dict[str, _Matcher] = {}
        if isinstance(style, str):
            self.matcher(style)  # fail early on an unknown style

    def __repr__(self) -> str:
        return (
            f"GoldScorer(style={self.style!r}, positive_weight={self.positive_weight}, "
            f"negative_weight={self.negative_weight}, length_weight={self.length_weight})"
        )

    def matcher(self, style: str | None) -> _Matcher:
        key = TOY_STYLE if style in (None, TOY_STYLE) else style
        if key not in self._matchers:
            if key == TOY_STYLE:
                rubric = toy_rubric()
            else:
                from rlhf_ext.datagen.phrasebank import rubric_for

                try:
                    rubric = rubric_for(key, self.bank)
                except KeyError as e:
                    raise ValueError(
                        f"{e.args[0]}; the gold scorer needs a phrase-bank style (the dataset's 'style' column) or "
                        f"None/'{TOY_STYLE}' for the toy task"
                    ) from None
            self._matchers[key] = _Matcher(rubric)
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
        """``([N], [N])`` long: distinct positive and negative key phrases in each response."""
        if len(styles) != len(responses):
            raise ValueError(f"got {len(styles)} styles for {len(responses)} responses")
        pairs = [self.matcher(s).distinct(_text(r)) for r, s in zip(responses, styles)]
        t = torch.tensor(pairs, dtype=torch.long).view(-1, 2)
        return t[:, 0], t[:, 1]

    def score(
        self,
        prompts: Sequence[Any],
        responses: Sequence[str],
        styles: Sequence[str | None] | str | None = None,
    ) -> Tensor:
        """``[N]`` float32 gold rewards of ``responses`` (prompt ``i`` is the prompt of response ``i``).

        Args:
            prompts: ``N`` prompts (text or chat messages; used only to look up styles in a prompt mapping).
            responses: ``N`` responses (text, or chat messages whose last message is the response).
            styles: one style per row, one style for all rows, or ``None`` for the scorer's default ``style``.
        """
        if len(prompts) != len(responses):
            raise ValueError(f"got {len(prompts)} prompts for {len(responses)} responses; pass one prompt per response")
        pos, neg = self.counts(responses, self.resolve_styles(prompts, styles))
        out = self.positive_weight * pos.float() - self.negative_weight * neg.float()
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
