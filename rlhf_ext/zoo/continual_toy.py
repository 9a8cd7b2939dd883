"""Short continual task sequences built from the toy key-phrase task (:mod:`rlhf_ext.zoo.toy`), offline.

Each task is a ``DatasetDict`` with ``train`` / ``test`` splits of ``prompt`` / ``chosen`` / ``rejected`` — the format
``rlhf_ext.datagen.load_continual_dataset`` returns for generated sequences. Two kinds of non-stationarity
(paper 000, section 4) are available:

* ``preference_shift`` (piecewise *preference* drift, fixed prompt distribution): the 20 toy phrases are split into
  groups ``G_0 .. G_{K}`` and task ``t`` prefers a response with a phrase from ``G_t`` over one with a phrase from
  ``G_{t+1}``. Task ``t + 1`` then promotes exactly the group task ``t`` demoted, a partial conflict: a sequential
  learner forgets task ``t`` without the tasks being plain opposites.
* ``domains`` (piecewise *prompt* drift, fixed preference): task ``t`` asks about its own disjoint subset of topics
  and always prefers the key phrases (a subset per task) over the weak ones.

Deterministic for a given seed; train and test rows of a task come from disjoint seeds.
"""

from __future__ import annotations

import random
from typing import Literal

from rlhf_ext.zoo.toy import KEY_PHRASES, TOPICS, WEAK_PHRASES, preference_rows

SequenceKind = Literal["preference_shift", "domains"]
SEQUENCE_KINDS: tuple[str, ...] = ("preference_shift", "domains")
BUILTIN_PREFIX = "builtin:toy-continual-"


def _split(items: list[str], parts: int) -> list[list[str]]:
    size = len(items) // parts
    return [items[i * size : (i + 1) * size] for i in range(parts)]


def toy_task_sequence(
    kind: SequenceKind = "preference_shift", num_tasks: int = 3, n_train: int = 256, n_test: int = 64, seed: int = 0
):
    """A list of ``num_tasks`` ``DatasetDict`` (``train``/``test``) forming a toy continual sequence (module doc)."""
    from datasets import Dataset, DatasetDict

    if kind not in SEQUENCE_KINDS:
        raise ValueError(f"toy sequence kind must be one of {', '.join(SEQUENCE_KINDS)}; got {kind!r}")
    # preference_shift needs K + 1 non-empty phrase groups, domains one topic per task
    most = len(KEY_PHRASES) + len(WEAK_PHRASES) - 1 if kind == "preference_shift" else len(TOPICS)
    if not 1 <= num_tasks <= most:
        raise ValueError(
            f"num_tasks is {num_tasks}, but the toy {kind} sequence has 1 to {most} tasks; use fewer tasks"
        )
    if kind == "preference_shift":
        phrases = list(KEY_PHRASES) + list(WEAK_PHRASES)
        random.Random(seed).shuffle(phrases)
        groups = _split(phrases, num_tasks + 1)
        plan = [(list(TOPICS), groups[t], groups[t + 1]) for t in range(num_tasks)]
    else:
        topics = _split(list(TOPICS), num_tasks)
        keys = _split(list(KEY_PHRASES), min(num_tasks, len(KEY_PHRASES)))
        plan = [(topics[t], keys[t % len(keys)], list(WEAK_PHRASES)) for t in range(num_tasks)]

    def rows(n: int, t: int, offset: int):  # task t's (topics, chosen phrases, rejected phrases)
        return Dataset.from_list(preference_rows(n, seed * 1_000 + t * 10 + offset, *plan[t]))

    return [DatasetDict(train=rows(n_train, t, 1), test=rows(n_test, t, 2)) for t in range(num_tasks)]


def is_builtin_sequence(spec: str) -> bool:
    return isinstance(spec, str) and spec.startswith(BUILTIN_PREFIX)


def builtin_sequence(spec: str, **kwargs):
    """``builtin:toy-continual-preference-shift`` or ``builtin:toy-continual-domains`` (kwargs: see
    :func:`toy_task_sequence`)."""
    kind = spec[len(BUILTIN_PREFIX) :].replace("-", "_")
    if kind not in SEQUENCE_KINDS:
        names = ", ".join(BUILTIN_PREFIX + k.replace("_", "-") for k in SEQUENCE_KINDS)
        raise ValueError(f"unknown builtin task sequence {spec!r}; choose one of {names}")
    return toy_task_sequence(kind, **kwargs)
