"""The offline backend's phrase bank and the gold rubric that says what separates chosen from rejected.

The ``offline`` backend composes prompts and responses from seed words and ``phrase_bank.yaml`` (or
``generation.phrase_bank``). Everything a reward model can use sits in a few multi-token **key phrases**:

* Every preference maps to a **style** (``eli5``, ``expert``, ``rapper`` ...) of a **family** (``complexity``,
  ``answer``, ``register``); styles of a family compete.
* A response is a shuffled list of neutral *content* sentences (from the seed words), neutral *auxiliary-style*
  sentences (the same in both responses) and ``markers_per_response`` *marker* sentences ``"<connector> <phrase>."``.
* A response that **follows** the preference takes its key phrases from the task's style; one that **violates** it
  from the competing styles. ``pair`` mode: chosen follows, rejected violates; ``judged`` mode: a response whose
  prompt did not state the preference draws each key phrase from either side with probability 1/2.

So the gold reward of a response for style ``s`` is::

    gold_score(text, s) = #(key phrases of s in text) - #(key phrases of s's competing styles in text)

(case-insensitive counts, :meth:`Rubric.score`). Neutral text never contains a key phrase (checked on load), so
drift within a family *reverses* which phrases are rewarded (what makes forgetting measurable).

**Preference styles**: a free-form preference the bank has no style for gets the derived family ``pref:<slug>`` /
``pref:<slug>:contrary`` (:func:`preference_style_name`, :func:`preference_styles`), which every bank resolves on first
use; a clash with the bank's own phrases raises :class:`ValueError` (set ``style:``).
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlhf_ext.config import RecipeError, from_dict, read_yaml

DEFAULT_BANK = "phrase_bank.yaml"
Stance = Literal["follow", "violate", "unstated"]

#: Prefix of the derived style of a free-form preference; ``PREFERENCE_STYLE_PREFIX + slug + CONTRARY_SUFFIX`` is its
#: competitor.
PREFERENCE_STYLE_PREFIX = "pref:"
CONTRARY_SUFFIX = ":contrary"
#: Content words of a preference that make its derived style's slug (at most this many, in order).
PREFERENCE_SLUG_WORDS = 6
#: Words that carry no content: dropped from a preference before it becomes a slug; a gold bigram of two of them
#: earns no partial credit (rlhf_ext.sim.gold).
_STOP_WORDS_TEXT = (
    "a an the and or but came come of to in on at by for from with as if is are be been "
    "it its this that these those make made makes please your you should would must "
    "can could so very more most than then into"
)
STOP_WORDS = frozenset(_STOP_WORDS_TEXT.split())
#: Key-phrase templates of a derived style (``{kw}``: the slug's words). Every template has words before and after
#: ``{kw}``, so no phrase of one slug can contain a phrase of another slug at a word boundary of the template.
_FOLLOW_TEMPLATES = (
    "leaning fully into {kw} throughout",
    "written with {kw} firmly in mind",
    "this stays faithful to {kw} as asked",
    "every line here serves {kw} well",
    "keeping {kw} front and centre",
    "shaped by {kw} from start to finish",
)
_CONTRARY_TEMPLATES = (
    "steering well clear of {kw} here",
    "written with no regard for {kw} at all",
    "this sets aside {kw} entirely",
    "not a single line here serves {kw} at all",
    "keeping {kw} out of the picture",
    "ignoring {kw} from beginning to end",
)


def preference_style_name(preference: str) -> str:
    """The derived style ``pref:<slug>`` of a free-form preference: its first :data:`PREFERENCE_SLUG_WORDS` lower-case
    alphanumeric words that are not stop words, joined by ``-`` (all words when every word is a stop word).
    Example: ``"Make the headline polarizing"`` -> ``"pref:headline-polarizing"``; ``ValueError`` without any word.
    """
    words = re.findall(r"[a-z0-9]+", preference.lower())
    if not words:
        raise ValueError(f"preference {preference!r} has no words to derive a phrase-bank style from")
    content = [w for w in words if w not in STOP_WORDS] or words
    return PREFERENCE_STYLE_PREFIX + "-".join(content[:PREFERENCE_SLUG_WORDS])


def _preference_slug(name: str) -> str | None:
    """The slug of a derived style name (``pref:<slug>`` or ``pref:<slug>:contrary``), None for other names."""
    if not name.startswith(PREFERENCE_STYLE_PREFIX):
        return None
    slug = name[len(PREFERENCE_STYLE_PREFIX) :].removesuffix(CONTRARY_SUFFIX)
    return slug if re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", slug) else None


def preference_styles(name: str) -> dict[str, StyleEntry]:
    """The family of the derived style ``name``: ``{pref:<slug>: ..., pref:<slug>:contrary: ...}``, one family named
    after the slug, each style with one key phrase per template; ``KeyError`` for other names."""
    slug = _preference_slug(name)
    if slug is None:
        raise KeyError(name)
    kw = slug.replace("-", " ")
    base = PREFERENCE_STYLE_PREFIX + slug
    family = f"preference {kw}"
    return {
        base: StyleEntry(family=family, phrases=[t.format(kw=kw) for t in _FOLLOW_TEMPLATES]),
        base + CONTRARY_SUFFIX: StyleEntry(family=family, phrases=[t.format(kw=kw) for t in _CONTRARY_TEMPLATES]),
    }


@dataclass
class StyleEntry:
    family: str
    phrases: list[str]
    triggers: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.phrases = [p.strip().lower() for p in self.phrases]
        self.triggers = [t.lower() for t in self.triggers]
        if not self.phrases:
            raise ValueError("phrases must not be empty")
        if any(len(p.split()) < 2 for p in self.phrases):
            raise ValueError("every key phrase must have at least two words (credit sits in multi-token phrases)")


@dataclass
class ObjectiveEntry:
    prompt_templates: list[str]
    content_sentences: list[str]
    triggers: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.triggers = [t.lower() for t in self.triggers]
        if not self.prompt_templates or not self.content_sentences:
            raise ValueError("prompt_templates and content_sentences must not be empty")
        missing = [t for t in self.prompt_templates if "{topic}" not in t]
        if missing:
            raise ValueError(
                f"every prompt template must mention all seed words ({{topic}}); this one does not: {missing[0]!r}"
            )


@dataclass
class PhraseBank:
    """A typed phrase bank; see the module docstring and ``phrase_bank.yaml`` for the meaning of each part."""

    styles: dict[str, StyleEntry]
    objectives: dict[str, ObjectiveEntry]
    connectors: list[str]
    aux: dict[str, list[str]] = field(default_factory=dict)
    version: int = 1

    def __post_init__(self):
        if not self.connectors:
            raise ValueError("connectors must not be empty")
        families: dict[str, list[str]] = {}
        for name, style in self.styles.items():
            families.setdefault(style.family, []).append(name)
        lonely = [f"{f} ({names[0]})" for f, names in families.items() if len(names) < 2]
        if lonely:
            raise ValueError(
                f"every style family needs at least two styles (the rejected response uses a competitor); "
                f"families with one style: {', '.join(lonely)}"
            )
        derived = [s for s in self.styles if _preference_slug(s) is not None]
        if derived:
            raise ValueError(
                f"style names starting with {PREFERENCE_STYLE_PREFIX!r} are reserved for derived preference styles: "
                f"{', '.join(derived)}"
            )
        seen: dict[str, str] = {}
        for p, s in self._phrases(self.styles):
            if p in seen:
                raise ValueError(f"key phrase {p!r} appears in styles {seen[p]} and {s}")
            seen[p] = s
        _check_phrases(self._phrases(self.styles), self._phrases(self.styles), self.neutral_texts())
        self.styles = StyleTable(self.styles, self)

    @staticmethod
    def _phrases(styles: dict[str, StyleEntry]) -> list[tuple[str, str]]:
        return [(p, s) for s, e in styles.items() for p in e.phrases]

    def neutral_texts(self) -> list[str]:
        """Every text that carries no preference: connectors, auxiliary-style sentences, prompt templates, content
        sentences."""
        neutral = list(self.connectors) + [x for v in self.aux.values() for x in v]
        for o in self.objectives.values():
            neutral += o.prompt_templates + o.content_sentences
        return neutral

    def derive_styles(self, name: str) -> dict[str, StyleEntry]:
        """The derived family of ``name`` (:func:`preference_styles`), checked against this bank's own (not derived)
        key phrases and neutral text (``ValueError`` on a clash; ``KeyError`` for a name that is not derived)."""
        family = preference_styles(name)
        own = self._phrases({s: e for s, e in self.styles.items() if _preference_slug(s) is None})
        new = self._phrases(family)
        try:
            _check_phrases(new, own + new, self.neutral_texts())
            _check_phrases(own, new, [])
        except ValueError as e:
            raise ValueError(f"derived style {name!r}: {e}; set the task's style: explicitly") from None
        return family

    def family(self, style: str) -> list[str]:
        """The styles competing with ``style`` (same family, excluding ``style``)."""
        fam = self.style(style).family
        return [s for s, e in self.styles.items() if e.family == fam and s != style]

    def style(self, name: str) -> StyleEntry:
        """The style ``name``: one of the bank's or a derived preference style (``pref:<slug>``, see the module
        docstring)."""
        if name not in self.styles:
            raise KeyError(
                f"unknown style {name!r}; the phrase bank has: {', '.join(sorted(self.styles))} (or a derived style "
                f"{PREFERENCE_STYLE_PREFIX}<words> for a free-form preference)"
            )
        return self.styles[name]

    def infer_style(self, preference: str) -> str | None:
        """The style whose triggers occur in ``preference`` (None when none does). Raises ``ValueError`` when several
        styles match: set the task's ``style:`` explicitly then."""
        text = preference.lower()
        hits = [s for s, e in self.styles.items() if any(t in text for t in e.triggers)]
        if len(hits) > 1:
            raise ValueError(f"preference matches several styles ({', '.join(hits)}); set style: explicitly")
        return hits[0] if hits else None

    def infer_objective_kind(self, objective: str, preference: str) -> str | None:
        """The objective kind whose triggers occur first in the preference text, else in the objective text."""
        for text in (preference.lower(), objective.lower()):
            for kind, entry in self.objectives.items():
                if any(t in text for t in entry.triggers):
                    return kind
        return None


def _check_phrases(phrases: list[tuple[str, str]], others: list[tuple[str, str]], neutral: list[str]) -> None:
    """Raise ``ValueError`` when a key phrase of ``phrases`` is contained in another phrase of ``others``, appears in
    two styles, or occurs in a neutral text (``(phrase, style)`` pairs)."""
    for p, s in phrases:
        for q, t in others:
            if p == q and s != t:
                raise ValueError(f"key phrase {p!r} appears in styles {s} and {t}")
            if p != q and p in q:
                raise ValueError(f"key phrase {p!r} ({s}) is contained in key phrase {q!r} ({t})")
        for text in neutral:
            if p in text.lower():
                raise ValueError(f"neutral text {text!r} contains the key phrase {p!r} of style {s}")


class StyleTable(dict):
    """The bank's styles by name; a derived preference style (``pref:<slug>[:contrary]``) is added, with its
    competitor, on first lookup, so ``name in bank.styles`` and ``bank.styles[name]`` hold for every such name."""

    def __init__(self, styles: Iterable = (), bank: PhraseBank | None = None):
        super().__init__(styles)
        self._bank = bank  # None (a copy made by dataclasses.asdict): a plain mapping

    def __reduce__(self):  # copy and pickle give a plain dict
        return dict, (dict(self),)

    def __contains__(self, name: object) -> bool:
        derivable = self._bank is not None and isinstance(name, str) and _preference_slug(name) is not None
        return super().__contains__(name) or derivable

    def __missing__(self, name: str) -> StyleEntry:
        if self._bank is None:
            raise KeyError(name)
        family = self._bank.derive_styles(name)  # KeyError for names that are not derived styles
        self.update(family)
        return family[name]


@dataclass(frozen=True)
class Rubric:
    """The gold preference of one style: ``score = #positive - #negative`` key-phrase occurrences (case-insensitive).

    Attributes:
        style: the preferred style.
        positive: its key phrases (present in responses that follow the preference).
        negative: key phrases of the competing styles of its family (present in responses that violate it).
    """

    style: str
    positive: tuple[str, ...]
    negative: tuple[str, ...]

    def counts(self, text: str) -> tuple[int, int]:
        low = text.lower()
        return sum(low.count(p) for p in self.positive), sum(low.count(q) for q in self.negative)

    def score(self, text: str) -> int:
        pos, neg = self.counts(text)
        return pos - neg

    def spans(self, text: str) -> list[tuple[int, int, int]]:
        """Character spans ``(start, end, +1|-1)`` of every key phrase in ``text`` (where the credit sits)."""
        low = text.lower()
        out = []
        for sign, phrases in ((1, self.positive), (-1, self.negative)):
            for p in phrases:
                out += [(m.start(), m.end(), sign) for m in re.finditer(re.escape(p), low)]
        return sorted(out)


def load_phrase_bank(path: str | Path | None = None) -> PhraseBank:
    """Load and validate a phrase bank (default: the packaged one; cached)."""
    return _load_bank(str(path) if path is not None else None)


@functools.lru_cache(maxsize=8)
def _load_bank(path: str | None) -> PhraseBank:
    if path is None:
        from importlib import resources

        path = str(resources.files("rlhf_ext.datagen") / DEFAULT_BANK)
    try:
        return from_dict(PhraseBank, read_yaml(path))
    except RecipeError as e:
        raise RecipeError(f"phrase bank {path}: {e}") from None


def rubric_for(style: str, bank: PhraseBank | None = None) -> Rubric:
    """The gold :class:`Rubric` of ``style`` (what a programmatic gold reward scores)."""
    bank = bank if bank is not None else load_phrase_bank()
    negative = tuple(p for other in bank.family(style) for p in bank.style(other).phrases)
    return Rubric(style=style, positive=tuple(bank.style(style).phrases), negative=negative)


def gold_score(text: str, style: str, bank: PhraseBank | None = None) -> int:
    """Gold reward of ``text`` under the preference ``style`` (see the module docstring)."""
    return rubric_for(style, bank).score(text)


# ------------------------------------------------------------------------------------------------- composition
def _join_words(words: list[str]) -> str:
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " and " + words[-1]


def _fill(template: str, words: list[str], rng: random.Random) -> str:
    w = rng.choice(words)
    w2 = rng.choice([x for x in words if x != w] or words)
    w1 = words[1] if len(words) > 1 else words[0]
    return template.format(topic=_join_words(words), w0=words[0], w1=w1, w=w, W=w[:1].upper() + w[1:], w2=w2)


def compose_prompt(bank: PhraseBank, objective_kind: str, seed_words: list[str], rng: random.Random) -> str:
    """An offline prompt for ``objective_kind`` mentioning the seed words (the E.1 prompt mapper's output)."""
    entry = bank.objectives[objective_kind]
    return _fill(rng.choice(entry.prompt_templates), seed_words, rng)


def compose_response(
    bank: PhraseBank,
    *,
    style: str,
    stance: Stance,
    objective_kind: str,
    seed_words: list[str],
    axes: list[tuple[str, str, int]],
    markers: int,
    rng: random.Random,
) -> str:
    """One offline response (see the module docstring for the sentence structure).

    Args:
        stance: ``follow`` (all key phrases from ``style``), ``violate`` (all from competing styles of its family)
            or ``unstated`` (each key phrase from either side with probability 1/2).
        axes: auxiliary styles ``(low, high, score 1..5)``; ``short/long`` sets the number of content sentences
            (score + 1), other axes add their pole's neutral sentence unless the score is 3.
    """
    entry = bank.objectives[objective_kind]
    n_content = 3
    aux_sentences = []
    for low, high, score in axes:
        if (low, high) == ("short", "long"):
            n_content = score + 1
        elif score != 3:
            pole = low if score < 3 else high
            options = bank.aux.get(pole, [])
            if options:
                aux_sentences.append(options[(score + len(pole)) % len(options)])
    templates = entry.content_sentences
    picked = rng.sample(templates, min(n_content, len(templates)))
    picked += [rng.choice(templates) for _ in range(n_content - len(picked))]
    sentences = [_fill(t, seed_words, rng) for t in picked]
    competitors = [p for other in bank.family(style) for p in bank.style(other).phrases]
    own = bank.style(style).phrases
    for _ in range(markers):
        side = stance if stance != "unstated" else rng.choice(("follow", "violate"))
        phrase = rng.choice(own if side == "follow" else competitors)
        sentence = f"{rng.choice(bank.connectors)} {phrase}."
        sentences.insert(rng.randrange(len(sentences) + 1), sentence)
    for s in aux_sentences:
        sentences.insert(rng.randrange(len(sentences) + 1), s)
    return " ".join(sentences)
