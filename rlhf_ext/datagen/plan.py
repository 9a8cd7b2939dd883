"""The plan of a generation run, computed without calling a backend (``rlhf-ext data generate --dry-run`` prints it):
the tasks resolved against the phrase bank, the drift schedule's stages and one :class:`SampleJob` per sample."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_ext.config import RecipeError, to_dict
from rlhf_ext.datagen.drift import Stage, allocate_sources, build_schedule, derive_seed, drift_summary
from rlhf_ext.datagen.mappers import PromptMapper, ResponseMapper, sample_axes, sample_seed_words
from rlhf_ext.datagen.phrasebank import PhraseBank, load_phrase_bank
from rlhf_ext.datagen.schema import DatagenConfig, TaskSpec, load_task_config
from rlhf_ext.runtime.io import stable_hash

if TYPE_CHECKING:
    from rlhf_ext.datagen.cache import SampleCache

PROMPT_MAPPER = PromptMapper()
RESPONSE_MAPPER = ResponseMapper()


@dataclass(frozen=True)
class ResolvedTask:
    """A task with its phrase-bank style and objective kind resolved (explicit or inferred) and its fingerprint."""

    spec: TaskSpec
    style: str | None
    objective_kind: str | None
    fingerprint: str


@dataclass(frozen=True)
class SampleJob:
    """One sample to generate: stage, index within the stage, source task, seed and cache key."""

    stage: Stage
    index: int
    task: ResolvedTask
    seed: int
    key: str


@dataclass
class GenerationPlan:
    """Everything a run will do, computed without calling a backend (``rlhf-ext data generate --dry-run``). Sample
    jobs are made per stage on demand (:meth:`stage_jobs`), never held all at once."""

    config: DatagenConfig
    stages: list[Stage]
    tasks: dict[str, ResolvedTask]
    drift: dict[str, Any]
    generation_fingerprint: str

    @property
    def num_jobs(self) -> int:
        return sum(stage.num_samples for stage in self.stages)

    @property
    def jobs(self) -> list[SampleJob]:
        """Every job, in stage and index order (materialised: for small plans and tests)."""
        return [job for stage in self.stages for job in self.stage_jobs(stage)]

    def stage_keys(self, stage: Stage, sources: Sequence[str] | None = None) -> list[str]:
        """The cache key of each of ``stage``'s samples: ``stable_hash(generation fingerprint, task fingerprint,
        stage seed, index, length=20)``, hashing the shared prefix once per task."""
        sources = allocate_sources(stage) if sources is None else sources
        prefixes = {}
        for name, task in self.tasks.items():
            h = hashlib.sha256()
            for part in (self.generation_fingerprint, task.fingerprint, stage.seed):
                h.update(json.dumps(part, sort_keys=True, default=str).encode() + b"\0")
            prefixes[name] = h
        keys = []
        for j, name in enumerate(sources):
            h = prefixes[name].copy()
            h.update(b"%d\0" % j)
            keys.append(h.hexdigest()[:20])
        return keys

    def cached(self, cache: SampleCache) -> int:
        """How many of the plan's samples ``cache`` holds."""
        return sum(int((cache.locate(self.stage_keys(stage))[0] >= 0).sum()) for stage in self.stages)

    def stage_jobs(self, stage: Stage, positions: Iterable[int] | None = None) -> Iterator[SampleJob]:
        """The jobs of ``stage`` at ``positions`` (default: all), in that order."""
        sources = allocate_sources(stage)
        keys = self.stage_keys(stage, sources)
        for j in range(len(sources)) if positions is None else positions:
            j = int(j)
            seed = derive_seed("sample", stage.seed, j)
            yield SampleJob(stage=stage, index=j, task=self.tasks[sources[j]], seed=seed, key=keys[j])

    @property
    def requests_per_sample(self) -> int:
        """Backend requests per sample: prompt + pair, or prompt + 2 responses (+ 1 judge with an LLM judge)."""
        gen = self.config.generation
        if gen.response_mode == "pair":
            return 2
        return 3 + (gen.resolved_judge() == "llm")

    def example(self, job: SampleJob | None = None) -> dict[str, str]:
        """The rendered meta-prompt and response prompt(s) of ``job`` (default: the first), with a placeholder for
        the prompt the backend would generate."""
        job = job or next(self.stage_jobs(self.stages[0]))
        task = job.task.spec
        rng = random.Random(job.seed)
        words = sample_seed_words(task, rng)
        axes = sample_axes(task, rng)
        prompt = PROMPT_MAPPER.finalize(task, "<generated prompt>")
        out = {"meta_prompt": PROMPT_MAPPER.meta_prompt(task, words)}
        if self.config.generation.response_mode == "pair":
            out["pair_prompt"] = RESPONSE_MAPPER.pair_prompt(task, prompt, axes)
        else:
            first, second = RESPONSE_MAPPER.sample_stances(task, rng)
            out["response_prompt_1"] = RESPONSE_MAPPER.response_prompt(task, prompt, first, axes)
            out["response_prompt_2"] = RESPONSE_MAPPER.response_prompt(task, prompt, second, axes)
        return out

    def describe(self, cached: int = 0) -> str:
        """A human-readable summary of the plan."""
        gen = self.config.generation
        lines = [
            f"dataset {self.config.name!r}: {len(self.stages)} stages, {self.num_jobs} samples "
            f"({cached} already cached), {self.requests_per_sample} requests per sample",
            f"drift: {self.drift['type']} / mode {self.drift['mode']}"
            + (f" / {self.drift['cycles']} cycles" if self.drift["cycles"] > 1 else "")
            + (f" / C = {self.drift['lipschitz_constant']}" if self.drift["lipschitz_constant"] else ""),
            f"backend: {gen.backend}"
            + (f" ({gen.model})" if gen.model else "")
            + f", mode {gen.response_mode}"
            + (f", judge {gen.resolved_judge()}" if gen.response_mode == "judged" else ""),
        ]
        width = max(len(st.name) for st in self.stages)
        for st in self.stages:
            mix = ", ".join(f"{k} {w:.2f}" for k, w in sorted(st.weights.items()))
            line = f"  [{st.index:3d}] {st.name:{width}s}  n={st.num_samples:<6d} test={st.test_ratio:.2f}  {mix}"
            lines.append(line)
        return "\n".join(lines)


def resolve_tasks(config: DatagenConfig, bank: PhraseBank) -> dict[str, ResolvedTask]:
    """Resolve each task's style and objective kind (the offline backend needs both, the rule judge the style;
    ``RecipeError`` naming ``tasks[i].style`` / ``tasks[i].objective_kind`` when they cannot be resolved)."""
    gen = config.generation
    offline = gen.backend == "offline"
    rule = gen.response_mode == "judged" and gen.resolved_judge() == "rule"
    out = {}
    choices = ", ".join(sorted(bank.styles))
    for i, t in enumerate(config.tasks):
        style = t.style
        if style is None:
            try:
                style = bank.infer_style(t.preference)
            except ValueError as e:
                raise RecipeError(f"tasks[{i}].style ({t.name}): {e}") from None
        if offline or rule:
            if style is None:
                raise RecipeError(
                    f"tasks[{i}].style ({t.name}): cannot tell which phrase-bank style the preference "
                    f"{t.preference!r} asks for; the offline backend and the rule judge need style: one of {choices}"
                )
            if style not in bank.styles:
                raise RecipeError(f"tasks[{i}].style ({t.name}): unknown style {style!r}; choose one of {choices}")
        kind = t.objective_kind or bank.infer_objective_kind(t.objective, t.preference)
        if offline and kind not in bank.objectives:
            raise RecipeError(
                f"tasks[{i}].objective_kind ({t.name}): cannot infer it from the objective and preference text; "
                f"set it to one of: {', '.join(bank.objectives)}"
            )
        content = to_dict(t)
        for key in ("num_samples", "test_ratio"):  # changing the sample count must not invalidate the cache
            content.pop(key)
        fp = stable_hash(content, style, kind)
        out[t.name] = ResolvedTask(spec=t, style=style, objective_kind=kind, fingerprint=fp)
    return out


def plan_generation(
    config: DatagenConfig | str | Path,
    overrides: Iterable[str] = (),
    num_samples: int | None = None,
    bank: PhraseBank | None = None,
) -> GenerationPlan:
    """Validate ``config`` (plus overrides; ``num_samples`` replaces every task's count) and compute its stages and
    sample jobs. No backend is contacted."""
    config = load_task_config(config, overrides)
    if num_samples is not None:
        config = config.with_num_samples(num_samples)
    bank = bank if bank is not None else load_phrase_bank(config.generation.phrase_bank)
    tasks = resolve_tasks(config, bank)
    gen_fp = stable_hash(config.generation.content_fingerprint())
    return GenerationPlan(config, build_schedule(config), tasks, drift_summary(config), gen_fp)
