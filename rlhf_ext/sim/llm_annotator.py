"""An LLM judge as a simulated annotator (paper 002, Appendix C.1): :class:`LLMAnnotator` asks a served model through
the dataset generator's backends (``openai``: any OpenAI-compatible server), with :class:`rlhf_ext.datagen.LLMJudge`'s
prompt, strict A/B parsing and randomised presentation order. An answer that is neither ``A`` nor ``B`` is
unparseable (``NaN``), which :class:`~rlhf_ext.sim.annotators.AnnotatorPool` counts and settles.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class JudgeTask:
    """What :func:`rlhf_ext.datagen.mappers.judge_prompt` needs of a task: its name and preference text."""

    name: str
    preference: str


class LLMAnnotator:
    """An LLM judge as an annotator: ``backend`` an unstarted :class:`rlhf_ext.datagen.Backend` (started and closed
    around each batch); ``preference`` the judge checks, one text or a mapping ``style -> text``; ``seed`` seeds
    presentation order and requests. ``probability`` is 1 / 0 for the judge's choice, ``NaN`` for neither."""

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
        return torch.tensor([math.nan if v.winner is None else float(v.winner == 0) for v in verdicts])


def _digest_int(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps(parts, default=str).encode()).digest()[:8], "big")
