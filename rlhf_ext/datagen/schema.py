"""The task YAML schema: a sequence of alignment tasks plus drift, generation and output settings (paper 000, 5.1).

A config file maps 1:1 onto :class:`DatagenConfig` through :mod:`rlhf_ext.config` (errors name the key path).
Example (the structure of every packaged config under ``rlhf_ext/datagen/configs``)::

    name: my-continual-dataset
    seed: 0
    drift:
      type: piecewise          # piecewise | lipschitz
      cycles: 1                # repeat the task sequence (piecewise preference: 3 cycles)
      lipschitz_constant: null # lipschitz only: max change of a task's mixture weight per step
    generation:
      backend: offline         # offline | hf | openai
      response_mode: pair      # pair (one call, E.2) | judged (two responses + judge, Algorithm 2)
    output:
      format: plain            # plain | conversational
    tasks:
      - name: eli5
        objective: "Ask a non-trivial physics question ..."
        preference: "Explain the answer ... understood by a five year old."
        style: eli5            # offline phrase-bank style (inferred from the preference when omitted)
        domain:
          physics: {seed_words: [entropy, momentum, ...], weight: 1.0}
        num_samples: 1000
        test_ratio: 0.15
        metadata:
          seed_words_per_prompt: 2
          preference_inclusion_prob: 0.4

AIF-Gen's task configs (``task_specs``) load as they are, mapped by
:func:`rlhf_ext.datagen.aif_gen_config.config_to_rlhf_ext`.

Defaults are the paper's (section 6.1 and Appendix D).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from rlhf_ext.algos.knobs import check_knob, check_knobs, knob, seed_knob
from rlhf_ext.config import RecipeError, apply_overrides, from_dict, read_yaml, to_dict

Backend = Literal["offline", "hf", "openai"]
ObjectiveKind = Literal["qa", "summary", "generation"]
DriftType = Literal["piecewise", "lipschitz"]
ResponseMode = Literal["pair", "judged"]
JudgeKind = Literal["auto", "rule", "llm"]
OutputFormat = Literal["plain", "conversational"]

#: Auxiliary style axes of the response mapper (paper Figure 4b, "preference axes"); each is (low pole, high pole)
#: on a 1-5 scale. Both responses of a pair share the sampled axes and scores, so they are nuisance variation.
DEFAULT_STYLE_AXES: tuple[tuple[str, str], ...] = (
    ("short", "long"),
    ("serious", "humorous"),
    ("optimistic", "pessimistic"),
    ("friendly", "distant"),
    ("authoritative", "tentative"),
    ("concrete", "abstract"),
)


#: The most samples one task may plan (every sample is a job held in memory while the run plans and resumes).
MAX_TASK_SAMPLES = 10_000_000


@dataclass
class DomainComponent:
    """One named part of a domain (e.g. ``physics`` in *education*): a seed-word vocabulary and a sampling weight.

    Seed words are drawn without replacement across all components of the domain; a word's probability is its
    component's normalised weight divided by the component's vocabulary size (paper 5.2, Figure 4a).
    """

    seed_words: list[str]
    weight: float = knob(1.0, gt=0)

    def __post_init__(self):
        check_knobs(self)
        words = [w for w in self.seed_words if w.strip()]
        if not words:
            raise ValueError("seed_words must contain at least one non-empty word")
        if len(set(words)) != len(words):
            dup = sorted({w for w in words if words.count(w) > 1})
            raise ValueError(f"seed_words contains duplicates: {', '.join(dup)}")
        self.seed_words = words


@dataclass
class TaskMetadata:
    """Per-task knobs of the prompt and response mappers (paper Figure 4).

    Args:
        prompt_prefix / prompt_suffix: text put before / after every generated prompt (part of the ``prompt`` column).
        seed_words_per_prompt: seed words sampled per prompt (paper: 2).
        preference_inclusion_prob: ``judged`` mode: the probability that the preference is stated in each response's
            generation prompt (positively for the first, negatively for the second; paper 6.1: 0.4).
        styles_per_response: auxiliary style axes sampled per sample (paper 6.1: 3; 0 disables them).
        style_axes: the axes to sample from (default :data:`DEFAULT_STYLE_AXES`).
    """

    prompt_prefix: str = ""
    prompt_suffix: str = ""
    seed_words_per_prompt: int = knob(2, ge=1)
    preference_inclusion_prob: float = knob(0.4, ge=0, le=1)
    styles_per_response: int = knob(3, ge=0)
    style_axes: list[tuple[str, str]] | None = None

    def __post_init__(self):
        check_knobs(self)
        axes = self.axes()
        if self.styles_per_response > len(axes):
            raise ValueError(f"styles_per_response must be between 0 and {len(axes)} (the number of style_axes)")

    def axes(self) -> list[tuple[str, str]]:
        return [tuple(a) for a in (self.style_axes if self.style_axes is not None else DEFAULT_STYLE_AXES)]


@dataclass
class TaskSpec:
    """One alignment task = objective x domain x preference (paper 5.1).

    Args:
        name: unique identifier (stage names, the ``source_task`` column, cache keys).
        objective: what the generated prompt should be; preference: the style the chosen response follows.
        domain: named components with seed-word vocabularies and weights.
        num_samples: pairs to generate (train + test); test_ratio: fraction held out in ``test``.
        style: the offline phrase bank's style for the preference (inferred when omitted; needed offline and by the
            rule judge). objective_kind: ``qa`` | ``summary`` | ``generation`` (inferred when omitted).
        metadata: :class:`TaskMetadata`.
    """

    name: str
    objective: str
    preference: str
    domain: dict[str, DomainComponent]
    num_samples: int = knob(ge=1, le=MAX_TASK_SAMPLES, help="Pairs generated for the task (train + test).")
    test_ratio: float = knob(0.15, ge=0, lt=1)
    style: str | None = None
    objective_kind: ObjectiveKind | None = None
    metadata: TaskMetadata = field(default_factory=TaskMetadata)

    def __post_init__(self):
        for key in ("name", "objective", "preference"):
            if not getattr(self, key).strip():
                raise ValueError(f"{key} must not be empty")
        if not self.domain:
            raise ValueError("domain needs at least one component (name: {seed_words: [...], weight: 1.0})")
        check_knobs(self)

    def prompt_fingerprint(self) -> dict[str, Any]:
        """What determines the prompt distribution p_t(x): objective, domain and prompt metadata."""
        m = self.metadata
        return {
            "objective": self.objective,
            "objective_kind": self.objective_kind,
            "domain": {k: to_dict(v) for k, v in sorted(self.domain.items())},
            "prompt_prefix": m.prompt_prefix,
            "prompt_suffix": m.prompt_suffix,
            "seed_words_per_prompt": m.seed_words_per_prompt,
        }

    def preference_fingerprint(self) -> dict[str, Any]:
        """What determines the reward r_t(y, x): the preference (and its offline style)."""
        return {"preference": self.preference, "style": self.style}


@dataclass
class DriftSpec:
    """How the task sequence turns into time steps (paper section 4, Figure 2d-e).

    ``piecewise``: one step per task, in order, the whole sequence repeated ``cycles`` times (sudden switches).
    ``lipschitz``: consecutive tasks are blended: between two tasks the mixture weight of each sample's source task
    moves by at most ``lipschitz_constant`` per step, i.e. ``ceil(1 / C)`` steps per transition.
    """

    type: DriftType = "piecewise"
    cycles: int = knob(1, ge=1)
    lipschitz_constant: float | None = knob(None, gt=0, le=1)

    def __post_init__(self):
        check_knobs(self)
        if self.type == "lipschitz":
            if self.lipschitz_constant is None:
                raise ValueError("lipschitz drift needs lipschitz_constant (0 < C <= 1), e.g. 0.25")
        elif self.lipschitz_constant is not None:
            raise ValueError("lipschitz_constant only applies to type: lipschitz")


@dataclass
class GenerationSpec:
    """Backend and sampling settings (paper Appendix D defaults).

    Args:
        backend: ``offline`` (deterministic, model-free), ``hf`` (local transformers model) or ``openai`` (any
            OpenAI-compatible chat-completions server). model: hf: a path, hub id or ``builtin:smollm2``; openai: the
            served model name (default: the only one the server lists).
        api_base / api_key_env: openai: base URL up to ``/v1``; the environment variable holding the API key.
        response_mode: ``pair``: one call returns a chosen/rejected pair (Appendix E.2); ``judged``: two responses
            ordered by a judge (Algorithm 2). judge: ``rule``, ``llm`` or ``auto`` (rule for offline, else llm).
        preference_swap: probability of swapping chosen and rejected (annotation noise).
        max_concurrency / request_timeout / max_retries: openai: requests in flight, seconds per attempt, retries.
        markers_per_response / phrase_bank: offline: key phrases per response; a custom phrase-bank YAML.
    """

    backend: Backend = "offline"
    model: str | None = None
    api_base: str = "http://localhost:8000/v1"
    api_key_env: str = "OPENAI_API_KEY"
    temperature: float = knob(0.99, ge=0, help="0: greedy.")
    max_tokens_prompt: int = knob(1024, ge=1)
    max_tokens_response: int = knob(2048, ge=1)
    max_tokens_judge: int = knob(128, ge=1)
    response_mode: ResponseMode = "pair"
    judge: JudgeKind = "auto"
    preference_swap: float = knob(0.0, ge=0, le=1)
    max_concurrency: int = knob(256, ge=1)
    request_timeout: float = knob(120.0, gt=0, help="Seconds per request attempt.")
    max_retries: int = knob(5, ge=0)
    markers_per_response: int = knob(2, ge=1)
    phrase_bank: str | None = None

    def __post_init__(self):
        check_knobs(self)
        if self.backend == "hf" and not self.model:
            raise ValueError("backend hf needs model (a checkpoint path, hub id, or builtin:smollm2)")
        if "://" not in self.api_base:
            raise ValueError(f"api_base must be a URL like http://localhost:8000/v1, got {self.api_base!r}")

    def resolved_judge(self) -> Literal["rule", "llm"]:
        if self.judge == "auto":
            return "rule" if self.backend == "offline" else "llm"
        return self.judge

    def content_fingerprint(self) -> dict[str, Any]:
        """Settings that change what a sample's text is (part of every cache key; not the server address, concurrency,
        timeouts, retries, swap probability or output format)."""
        keys = "backend model temperature max_tokens_prompt max_tokens_response max_tokens_judge response_mode"
        keys += " markers_per_response phrase_bank"
        fp = {k: getattr(self, k) for k in keys.split()}
        fp["judge"] = self.resolved_judge() if self.response_mode == "judged" else None
        return fp


@dataclass
class OutputSpec:
    """``format``: ``plain`` strings or ``conversational`` message lists (both load as-is in TRL and OpenRLHF)."""

    format: OutputFormat = "plain"


@dataclass
class DatagenConfig:
    """A continual preference-dataset recipe: the task sequence and how to turn it into data."""

    name: str
    tasks: list[TaskSpec]
    seed: int = seed_knob(0)
    drift: DriftSpec = field(default_factory=DriftSpec)
    generation: GenerationSpec = field(default_factory=GenerationSpec)
    output: OutputSpec = field(default_factory=OutputSpec)

    def __post_init__(self):
        if not self.tasks:
            raise ValueError("tasks must list at least one alignment task")
        names = [t.name for t in self.tasks]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"task names must be unique; repeated: {', '.join(dup)}")

    def task(self, name: str) -> TaskSpec:
        for t in self.tasks:
            if t.name == name:
                return t
        raise KeyError(f"no task named {name!r}; tasks: {', '.join(t.name for t in self.tasks)}")

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def with_num_samples(self, num_samples: int) -> DatagenConfig:
        """A copy in which every task has ``num_samples`` samples (``--num-samples``: run a config small)."""
        try:
            check_knob(TaskSpec, "num_samples", num_samples)
        except ValueError as e:
            raise RecipeError(str(e)) from None
        return replace(self, tasks=[replace(t, num_samples=num_samples) for t in self.tasks])


def config_names() -> list[str]:
    """Names of the packaged configs (``rlhf-ext data configs``)."""
    from importlib import resources

    root = resources.files("rlhf_ext.datagen") / "configs"
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def config_path(name_or_path: str | Path) -> Path:
    """A config file: an existing path, or the name of a packaged config (with or without ``.yaml``)."""
    from importlib import resources

    p = Path(name_or_path)
    if p.exists():
        return p
    name = str(name_or_path).removesuffix(".yaml")
    packaged = resources.files("rlhf_ext.datagen") / "configs" / f"{name}.yaml"
    if packaged.is_file():
        return Path(str(packaged))
    raise RecipeError(
        f"config {str(name_or_path)!r} is neither a file nor a packaged config; packaged configs: "
        f"{', '.join(config_names())} (`rlhf-ext data configs` lists them)"
    )


def load_task_config(
    source: str | Path | dict[str, Any] | DatagenConfig,
    overrides: typing.Iterable[str] = (),
    config_format: Literal["auto", "aif-gen", "rlhf-ext"] = "auto",
) -> DatagenConfig:
    """Load and validate a task config from a YAML path, a packaged config name or a mapping.

    ``config_format``: ``rlhf-ext``, ``aif-gen`` (AIF-Gen's ``task_specs`` configs) or ``auto`` (``aif-gen`` when the
    mapping has ``task_specs``). ``overrides``: ``key.sub=value`` strings on the rlhf-ext keys, applied after an
    AIF-Gen config is mapped. Errors are :class:`rlhf_ext.config.RecipeError` naming the file and key.
    """
    from rlhf_ext.datagen.aif_gen_config import CONFIG_FORMATS, config_to_rlhf_ext, detect_config_format

    if config_format not in CONFIG_FORMATS:
        raise RecipeError(f"unknown config format {config_format!r}; choose {', '.join(CONFIG_FORMATS)}")
    if isinstance(source, DatagenConfig):
        if not overrides:
            return source
        source = source.to_dict()
    where, name, data = "", "aif-gen", source
    if not isinstance(source, dict):
        path = config_path(source)
        where, name, data = f"{path}: ", path.stem, read_yaml(path)
    if config_format == "auto":
        config_format = detect_config_format(data)
    if config_format == "aif-gen":
        try:
            data = config_to_rlhf_ext(data, name)
        except RecipeError as e:
            raise RecipeError(f"{where}{e}") from None
    data = apply_overrides(data, overrides)
    try:
        return from_dict(DatagenConfig, data)
    except RecipeError as e:
        raise RecipeError(f"{where}{e}") from None
