"""Prompt mapper, response mapper and judge templates (paper 5.2, Figure 4, Appendix E) with strict output parsers
(``CHOSEN:`` / ``REJECTED:`` sections; a judge answers exactly ``A`` or ``B``, whitespace, quotes, asterisks or a final
period tolerated). All sampling takes an explicit ``random.Random`` so a sample's inputs depend only on its seed.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

from rlhf_ext.datagen.schema import TaskSpec

#: Appendix E.1 (the prompt mapper's meta-prompt).
META_PROMPT_TEMPLATE = """Generate a text that fulfills the objective below.
Do exactly what the objective says: {objective}
The description must include the following seed words: {seed_words}.
Do not include any meta commentary, instructions, or extra text (e.g., avoid phrases like "User asks" or additional \
context).
The output should be clear and self-contained.
You don't need to start by saying "prompt:".
Ensure that the generated response adheres to ethical practices, avoids biases, and respects the target audience's \
needs."""

#: Appendix E.2 (the response mapper's one-call pair prompt) plus the strict output format.
PAIR_PROMPT_TEMPLATE = """Generate a 'chosen' and 'rejected' response pair to the following prompt: {prompt}
The 'chosen' response should respond to the prompt according to the following preference: {preference}
The 'rejected' response should still respond to the prompt according to the preference but negligibly worse in its \
quality, however still close to the chosen response so it confuses the reader which one is actually better.
Consider exactly the same style and lengths for the chosen and rejected please.
You don't need to start your response by saying "here is the response" nor to give any meta-explanation. Just \
provide the response.{axes}
Format your answer exactly as follows, with nothing before or after:
CHOSEN:
<the chosen response>
REJECTED:
<the rejected response>"""

RESPONSE_PROMPT_TEMPLATE = """Generate a response to the following prompt: {prompt}
{instruction}{axes}
You don't need to start your response by saying "here is the response" nor to give any meta-explanation. Just \
provide the response."""

FOLLOW_INSTRUCTION = "Your response must follow this preference overall: {preference}\n"
VIOLATE_INSTRUCTION = "Your response must not respect this preference overall: {preference}\n"

JUDGE_PROMPT_TEMPLATE = """You compare two responses to the same prompt against a stated preference.
PROMPT:
{prompt}
PREFERENCE:
{preference}
RESPONSE A:
{a}
RESPONSE B:
{b}
Which response follows the preference better? Answer with exactly one letter, A or B, and nothing else."""

AXIS_LINE = "On a scale of 1 to 5 where 1 is {low} and 5 is {high}, the response should be: {score}"

_HEADER = r"[ \t]*\**[ \t]*{name}[ \t]*\**[ \t]*:[ \t]*\**"
_PAIR_RE = re.compile(
    rf"^\s*{_HEADER.format(name='CHOSEN')}(?P<chosen>.*?)\n{_HEADER.format(name='REJECTED')}(?P<rejected>.*?)\s*$",
    re.DOTALL | re.IGNORECASE,
)
_ANY_HEADER_RE = re.compile(r"^" + _HEADER.format(name="(?:CHOSEN|REJECTED)"), re.MULTILINE | re.IGNORECASE)
_JUDGE_RE = re.compile(r"^[\s\"'*`(\[]*([AB])[\s\"'*`)\].]*$")


class UnparseableOutput(ValueError):
    """A model answer does not follow the required format (the sample is skipped and counted)."""


def parse_pair(text: str) -> tuple[str, str]:
    """``(chosen, rejected)`` from a ``CHOSEN: ... REJECTED: ...`` answer; raises :class:`UnparseableOutput`."""
    m = _PAIR_RE.match(text)
    if m is None:
        raise UnparseableOutput("pair answer lacks the CHOSEN:/REJECTED: sections")
    chosen, rejected = m.group("chosen").strip(), m.group("rejected").strip()
    if not chosen or not rejected:
        raise UnparseableOutput("pair answer has an empty section")
    if _ANY_HEADER_RE.search(chosen + "\n" + rejected):
        raise UnparseableOutput("pair answer repeats a section header")
    if chosen == rejected:
        raise UnparseableOutput("chosen and rejected are identical")
    return chosen, rejected


def parse_judge(text: str) -> int:
    """0 for ``A``, 1 for ``B``; raises :class:`UnparseableOutput` for anything else (strict format)."""
    m = _JUDGE_RE.match(text)
    if m is None:
        raise UnparseableOutput(f"judge answer is not exactly 'A' or 'B': {text[:40]!r}")
    return 0 if m.group(1) == "A" else 1


def format_pair(chosen: str, rejected: str) -> str:
    """The answer format :func:`parse_pair` reads (used by model-free backends)."""
    return f"CHOSEN:\n{chosen}\nREJECTED:\n{rejected}"


def sample_seed_words(task: TaskSpec, rng: random.Random) -> list[str]:
    """``seed_words_per_prompt`` distinct seed words across the domain's components, without replacement.

    A word's probability is ``weight_c / sum(weights) / len(vocab_c)`` (uniform within a component). Weighted
    sampling without replacement uses exponential keys (Efraimidis-Spirakis): keep the k largest ``u ** (1 / p)``.
    Words listed in several components count once.
    """
    total = sum(c.weight for c in task.domain.values())
    probs: dict[str, float] = {}
    for name in sorted(task.domain):
        comp = task.domain[name]
        for w in comp.seed_words:
            probs[w] = probs.get(w, 0.0) + comp.weight / total / len(comp.seed_words)
    words = list(probs)
    keys = [math.log(rng.random() or 1e-300) / probs[w] for w in words]
    k = min(task.metadata.seed_words_per_prompt, len(words))
    top = sorted(range(len(words)), key=lambda i: keys[i], reverse=True)[:k]
    return [words[i] for i in top]


def sample_axes(task: TaskSpec, rng: random.Random) -> list[tuple[str, str, int]]:
    """``styles_per_response`` auxiliary style axes with 1-5 scores, shared by both responses of a sample."""
    axes = task.metadata.axes()
    chosen = rng.sample(range(len(axes)), task.metadata.styles_per_response)
    return [(axes[i][0], axes[i][1], rng.randint(1, 5)) for i in sorted(chosen)]


def _axes_text(axes: list[tuple[str, str, int]], lead: str) -> str:
    if not axes:
        return ""
    lines = [AXIS_LINE.format(low=lo, high=hi, score=s) for lo, hi, s in axes]
    return "\n" + lead + "\n" + "\n".join(lines)


@dataclass(frozen=True)
class PromptMapper:
    """Renders the meta-prompt (Appendix E.1) and wraps the generated prompt in the task's prefix/suffix."""

    def meta_prompt(self, task: TaskSpec, seed_words: list[str]) -> str:
        return META_PROMPT_TEMPLATE.format(objective=task.objective.strip(), seed_words=", ".join(seed_words))

    def finalize(self, task: TaskSpec, generated: str) -> str:
        return f"{task.metadata.prompt_prefix}{generated.strip()}{task.metadata.prompt_suffix}"


@dataclass(frozen=True)
class ResponseMapper:
    """Renders response-generation prompts (Appendix E.2 and the two-response variant of Figure 4b)."""

    def pair_prompt(self, task: TaskSpec, prompt: str, axes: list[tuple[str, str, int]]) -> str:
        axes_text = _axes_text(axes, "Both responses should match these style scores:")
        return PAIR_PROMPT_TEMPLATE.format(prompt=prompt, preference=task.preference.strip(), axes=axes_text)

    def sample_stances(self, task: TaskSpec, rng: random.Random) -> tuple[str, str]:
        """Whether the preference is stated to each response: ``follow``/``unstated`` for the first,
        ``violate``/``unstated`` for the second (each stated with probability ``preference_inclusion_prob``)."""
        p = task.metadata.preference_inclusion_prob
        first = "follow" if rng.random() < p else "unstated"
        second = "violate" if rng.random() < p else "unstated"
        return first, second

    def response_prompt(self, task: TaskSpec, prompt: str, stance: str, axes: list[tuple[str, str, int]]) -> str:
        instruction = {"follow": FOLLOW_INSTRUCTION, "violate": VIOLATE_INSTRUCTION, "unstated": ""}[stance]
        instruction = instruction.format(preference=task.preference.strip())
        return RESPONSE_PROMPT_TEMPLATE.format(
            prompt=prompt, instruction=instruction, axes=_axes_text(axes, "Match these style scores:")
        )


def judge_prompt(task: TaskSpec, prompt: str, a: str, b: str) -> str:
    """tau_judge of Algorithm 2: which of two responses follows the task preference better (answer ``A``/``B``)."""
    return JUDGE_PROMPT_TEMPLATE.format(prompt=prompt, preference=task.preference.strip(), a=a, b=b)
