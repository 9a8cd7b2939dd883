"""Judges that order two responses (tau_judge of Algorithm 2, paper Appendix A.1); both return a :class:`Verdict`
(``winner`` None with ``reason`` ``judge_tie`` / ``judge_unparseable``: the sample is skipped)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlhf_ext.datagen.chat import Backend, ChatRequest
from rlhf_ext.datagen.mappers import UnparseableOutput, judge_prompt, parse_judge
from rlhf_ext.datagen.phrasebank import PhraseBank, rubric_for
from rlhf_ext.datagen.schema import TaskSpec


@dataclass(frozen=True)
class Verdict:
    """``winner``: 0 (first response), 1 (second) or None; ``reason`` says why there is no winner."""

    winner: int | None
    reason: str | None = None
    raw: str | None = None


class RuleJudge:
    """Orders responses by the gold rubric of the task's style (:func:`~rlhf_ext.datagen.phrasebank.rubric_for`; needs
    a style in the phrase bank); ties are reported, not guessed."""

    kind = "rule"

    def __init__(self, bank: PhraseBank):
        self.bank = bank

    async def judge(self, task: TaskSpec, style: str | None, prompt: str, first: str, second: str, seed: int):
        if not style:
            raise ValueError(
                f"the rule judge needs task {task.name!r} to have a phrase-bank style; set style: or use judge: llm"
            )
        rubric = rubric_for(style, self.bank)
        a, b = rubric.score(first), rubric.score(second)
        if a == b:
            return Verdict(None, "judge_tie", raw=f"{a}={b}")
        return Verdict(0 if a > b else 1, raw=f"{a}:{b}")


class LLMJudge:
    """Asks ``backend`` which response follows the preference (:func:`~rlhf_ext.datagen.mappers.judge_prompt`,
    temperature 0), the two in a seeded random order (position-bias control); strict ``A``/``B`` answers only."""

    kind = "llm"

    def __init__(self, backend: Backend, max_tokens: int = 128):
        self.backend = backend
        self.max_tokens = max_tokens

    async def judge(self, task: TaskSpec, style: str | None, prompt: str, first: str, second: str, seed: int):
        flip = random.Random(seed).random() < 0.5
        a, b = (second, first) if flip else (first, second)
        messages = [{"role": "user", "content": judge_prompt(task, prompt, a, b)}]
        request = ChatRequest("judge", messages, seed, self.max_tokens, 0.0, {"style": style, "a": a, "b": b})
        completion = await self.backend.complete(request)
        try:
            letter = parse_judge(completion.text)
        except UnparseableOutput:
            return Verdict(None, "judge_unparseable", raw=completion.text[:200])
        return Verdict(letter ^ int(flip), raw=completion.text.strip())


def make_judge(kind: str, backend: Backend, bank: PhraseBank, max_tokens: int = 128):
    """``rule`` -> :class:`RuleJudge`; ``llm`` -> :class:`LLMJudge` through ``backend``."""
    if kind == "rule":
        return RuleJudge(bank)
    if kind == "llm":
        return LLMJudge(backend, max_tokens=max_tokens)
    raise ValueError(f"unknown judge {kind!r}; choose rule or llm")
