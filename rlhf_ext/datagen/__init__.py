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
    name: f"rlhf_ext.datagen.{module}"
    for module, names in {
        "backends": "HFBackend OfflineBackend make_backend",
        "builtin": "load_continual_dataset",
        "cache": "CacheLockedError SampleCache",
        "chat": "Backend BackendError BackendUnavailable ChatCompletion ChatRequest RequestRejected",
        "dataset": "ContinualDataset merge preference_swap resplit subsample",
        "drift": "Stage allocate_sources build_schedule drift_summary lipschitz_weights",
        "generate": "agenerate_dataset generate_dataset",
        "judge": "LLMJudge RuleJudge Verdict",
        "openai_backend": "OpenAIBackend",
        "phrasebank": "PhraseBank Rubric gold_score load_phrase_bank rubric_for",
        "plan": "GenerationPlan plan_generation",
        "schema": "DatagenConfig DomainComponent DriftSpec GenerationSpec OutputSpec TaskMetadata TaskSpec "
        "config_names config_path load_task_config",
    }.items()
    for name in names.split()
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
