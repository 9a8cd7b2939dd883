"""Synthetic continual preference data (paper 000, AIF-GEN): YAML task sequences -> drift schedule -> prompt and
response mappers -> backend (offline / hf / openai) -> resumable cache -> ``ContinualDataset``.

Quick start::

    from rlhf_ext.datagen import generate_dataset, load_continual_dataset

    ds = generate_dataset("continual-piecewise-preference", "runs/pp", num_samples=200)
    for stage in load_continual_dataset("runs/pp"):   # one DatasetDict (train/test) per time step
        ...

Engine-free: nothing here imports trl, openrlhf, deepspeed, ray or vllm; ``datasets``, ``openai`` and
``transformers`` are imported only by the functions that need them.
"""

from __future__ import annotations

from rlhf_ext.runtime.io import lazy_exports

#: public name -> defining module (imported on first access, so ``rlhf-ext --help`` stays fast)
_EXPORTS = {
    "Backend": "rlhf_ext.datagen.chat",
    "BackendError": "rlhf_ext.datagen.chat",
    "BackendUnavailable": "rlhf_ext.datagen.chat",
    "CacheLockedError": "rlhf_ext.datagen.cache",
    "ChatCompletion": "rlhf_ext.datagen.chat",
    "ChatRequest": "rlhf_ext.datagen.chat",
    "ContinualDataset": "rlhf_ext.datagen.dataset",
    "DatagenConfig": "rlhf_ext.datagen.schema",
    "DomainComponent": "rlhf_ext.datagen.schema",
    "DriftSpec": "rlhf_ext.datagen.schema",
    "GenerationPlan": "rlhf_ext.datagen.plan",
    "GenerationSpec": "rlhf_ext.datagen.schema",
    "HFBackend": "rlhf_ext.datagen.backends",
    "LLMJudge": "rlhf_ext.datagen.judge",
    "OfflineBackend": "rlhf_ext.datagen.backends",
    "OpenAIBackend": "rlhf_ext.datagen.openai_backend",
    "OutputSpec": "rlhf_ext.datagen.schema",
    "PhraseBank": "rlhf_ext.datagen.phrasebank",
    "RequestRejected": "rlhf_ext.datagen.chat",
    "Rubric": "rlhf_ext.datagen.phrasebank",
    "RuleJudge": "rlhf_ext.datagen.judge",
    "SampleCache": "rlhf_ext.datagen.cache",
    "Stage": "rlhf_ext.datagen.drift",
    "TaskMetadata": "rlhf_ext.datagen.schema",
    "TaskSpec": "rlhf_ext.datagen.schema",
    "Verdict": "rlhf_ext.datagen.judge",
    "agenerate_dataset": "rlhf_ext.datagen.generate",
    "allocate_sources": "rlhf_ext.datagen.drift",
    "build_schedule": "rlhf_ext.datagen.drift",
    "config_names": "rlhf_ext.datagen.schema",
    "config_path": "rlhf_ext.datagen.schema",
    "drift_summary": "rlhf_ext.datagen.drift",
    "generate_dataset": "rlhf_ext.datagen.generate",
    "gold_score": "rlhf_ext.datagen.phrasebank",
    "lipschitz_weights": "rlhf_ext.datagen.drift",
    "load_continual_dataset": "rlhf_ext.datagen.builtin",
    "load_phrase_bank": "rlhf_ext.datagen.phrasebank",
    "load_task_config": "rlhf_ext.datagen.schema",
    "make_backend": "rlhf_ext.datagen.backends",
    "merge": "rlhf_ext.datagen.dataset",
    "plan_generation": "rlhf_ext.datagen.plan",
    "preference_swap": "rlhf_ext.datagen.dataset",
    "resplit": "rlhf_ext.datagen.dataset",
    "rubric_for": "rlhf_ext.datagen.phrasebank",
    "subsample": "rlhf_ext.datagen.dataset",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
