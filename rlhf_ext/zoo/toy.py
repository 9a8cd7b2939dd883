"""A learnable toy preference task: the chosen response contains a key multi-token phrase the rejected one lacks.

Every response is four short sentences: three filler sentences (a subject and a predicate, each drawn from ten
options) and, at a random position, the sentence ``"The facts about {topic} are {phrase}."``. In the chosen response
the phrase is a *key phrase* ("backed by peer-reviewed evidence", ...); in the rejected one it is a *weak phrase* of
the same length ("mostly rumours passed around online", ...). Everything else is drawn from the same distribution,
so a reward model can only separate the two by reading a few multi-token segments — the situation paper 003's
Figure 2 describes.

Deterministic for a given seed. Columns: ``prompt``, ``chosen``, ``rejected`` (TRL/OpenRLHF "standard" format with an
explicit prompt).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

TOPICS = [
    "volcanoes",
    "honeybees",
    "ocean tides",
    "black holes",
    "sourdough bread",
    "glaciers",
    "solar panels",
    "octopuses",
    "the printing press",
    "vaccines",
    "coral reefs",
    "earthquakes",
    "wind turbines",
    "penguins",
    "the immune system",
    "rainbows",
    "electric cars",
    "tea plants",
    "lightning",
    "migratory birds",
    "desert plants",
    "the moon",
    "composting",
    "jazz music",
]
SUBJECTS = [
    "Many people",
    "Most readers",
    "Some experts",
    "A few teachers",
    "Curious students",
    "Young children",
    "Local guides",
    "Old textbooks",
    "Travel writers",
    "Science museums",
]
PREDICATES = [
    "wonder about this",
    "ask this question often",
    "find it surprising",
    "enjoy the details",
    "disagree on small points",
    "mention it in passing",
    "get the basics wrong",
    "love a good example",
    "keep notes on it",
    "talk about it every year",
]
KEY_PHRASES = [
    "backed by peer-reviewed evidence",
    "confirmed by careful measurements",
    "explained step by step by experts",
    "supported by decades of field research",
    "verified by independent laboratories",
    "documented in primary historical sources",
    "measured with calibrated instruments",
    "reproduced in controlled experiments",
    "summarised in official encyclopedias",
    "checked against satellite observations",
]
WEAK_PHRASES = [
    "mostly rumours passed around online",
    "hard to pin down for anyone at all",
    "a matter of guesswork and hearsay",
    "whatever people happen to believe today",
    "based on a story a friend once told",
    "impossible to check in any useful way",
    "anyone's guess without more information",
    "something I vaguely remember reading",
    "open to every possible interpretation",
    "too fuzzy to say anything definite about",
]


def response_with_phrase(rng: random.Random, topic: str, phrases: list[str]) -> str:
    """Three filler sentences plus ``"The facts about {topic} are {phrase}."`` at a random position, with the phrase
    drawn from ``phrases`` (the building block of every toy response)."""
    sentences = [f"{rng.choice(SUBJECTS)} {rng.choice(PREDICATES)}." for _ in range(3)]
    phrase = rng.choice(phrases)
    sentences.insert(rng.randrange(len(sentences) + 1), f"The facts about {topic} are {phrase}.")
    return " " + " ".join(sentences)


def preference_rows(n: int, seed: int, topics: list[str], chosen: list[str], rejected: list[str]) -> list[dict]:
    """``n`` rows (prompt / chosen / rejected) about ``topics``, the chosen response with a phrase of ``chosen``, the
    rejected one with a phrase of ``rejected``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        topic = rng.choice(topics)
        prompt = f"Question: What should I know about {topic}?\nAnswer:"
        chosen_text = response_with_phrase(rng, topic, chosen)
        rows.append({"prompt": prompt, "chosen": chosen_text, "rejected": response_with_phrase(rng, topic, rejected)})
    return rows


def toy_preference_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` preference rows (prompt / chosen / rejected) of the key-phrase task."""
    return preference_rows(n, seed, TOPICS, KEY_PHRASES, WEAK_PHRASES)


def toy_preference_dataset(n_train: int = 512, n_test: int = 128, seed: int = 0):
    """A ``DatasetDict`` with ``train`` and ``test`` splits of the key-phrase task (disjoint seeds)."""
    from datasets import Dataset, DatasetDict

    return DatasetDict(
        train=Dataset.from_list(toy_preference_rows(n_train, seed)),
        test=Dataset.from_list(toy_preference_rows(n_test, seed + 10_000)),
    )


def has_key_phrase(text: str) -> bool:
    """The toy task's gold label: does the response contain a key phrase?"""
    return any(k in text for k in KEY_PHRASES)


def keyphrase_spans(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[list[tuple[int, int, float]]]:
    """The toy task's gold reward as spans (a :class:`~rlhf_ext.runtime.spans.DenseRewardFunc`, the callable of
    ``recipes/segment_ppo_callable_tiny.yaml``): +1 on the characters of the first key phrase, -1 on those of the first
    weak phrase, per completion (a chat completion: its last message's text)."""
    spans = []
    for c in completions:
        text = c[-1]["content"] if isinstance(c, list) else c
        row = []
        for phrases, reward in ((KEY_PHRASES, 1.0), (WEAK_PHRASES, -1.0)):
            found = [(text.find(p), p) for p in phrases if p in text]
            if found:
                start, phrase = min(found)
                row.append((start, start + len(phrase), reward))
        spans.append(sorted(row))
    return spans


def keyphrase_gold_reward(prompts: list[Any], responses: list[str]) -> torch.Tensor:
    """The toy task's gold reward (``builtin:keyphrase-gold``): 1 if the response contains a key phrase, else 0."""
    import torch

    return torch.tensor([float(has_key_phrase(r)) for r in responses])
