"""Synthetic continual preference data (paper 000, AIF-GEN): YAML task sequences -> drift schedule -> prompt and
response mappers -> backend (offline / hf / openai) -> resumable cache -> ``ContinualDataset``.

Quick start::

    from rlhf_ext.datagen import generate_dataset, load_continual_dataset

    ds = generate_dataset("continual-piecewise-preference", "runs/pp", num_samples=200)
    for stage in load_continual_dataset("runs/pp"):   # one DatasetDict (train/test) per time step
        ...

Engine-free: nothing here imports trl, openrlhf, deepspeed, ray or vllm; ``datasets``, ``aiohttp`` and
``transformers`` are imported only by the functions that need them.
"""

from rlhf_ext.datagen.backends import (
    Backend,
    BackendError,
    BackendUnavailable,
    ChatCompletion,
    ChatRequest,
    HFBackend,
    OfflineBackend,
    OpenAIBackend,
    RequestRejected,
    make_backend,
)
from rlhf_ext.datagen.cache import CacheLockedError, SampleCache
from rlhf_ext.datagen.dataset import (
    ContinualDataset,
    load_continual_dataset,
    merge,
    preference_swap,
    resplit,
    subsample,
)
from rlhf_ext.datagen.drift import Stage, allocate_sources, build_schedule, drift_summary, lipschitz_weights
from rlhf_ext.datagen.generate import GenerationPlan, agenerate_dataset, generate_dataset, plan_generation
from rlhf_ext.datagen.judge import LLMJudge, RuleJudge, Verdict
from rlhf_ext.datagen.phrasebank import PhraseBank, Rubric, gold_score, load_phrase_bank, rubric_for
from rlhf_ext.datagen.schema import (
    DatagenConfig,
    DomainComponent,
    DriftSpec,
    GenerationSpec,
    OutputSpec,
    TaskMetadata,
    TaskSpec,
    config_names,
    config_path,
    load_task_config,
)

__all__ = [
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "CacheLockedError",
    "ChatCompletion",
    "ChatRequest",
    "ContinualDataset",
    "DatagenConfig",
    "DomainComponent",
    "DriftSpec",
    "GenerationPlan",
    "GenerationSpec",
    "HFBackend",
    "LLMJudge",
    "OfflineBackend",
    "OpenAIBackend",
    "OutputSpec",
    "PhraseBank",
    "RequestRejected",
    "Rubric",
    "RuleJudge",
    "SampleCache",
    "Stage",
    "TaskMetadata",
    "TaskSpec",
    "Verdict",
    "agenerate_dataset",
    "allocate_sources",
    "build_schedule",
    "config_names",
    "config_path",
    "drift_summary",
    "generate_dataset",
    "gold_score",
    "lipschitz_weights",
    "load_continual_dataset",
    "load_phrase_bank",
    "load_task_config",
    "make_backend",
    "merge",
    "plan_generation",
    "preference_swap",
    "resplit",
    "rubric_for",
    "subsample",
]
