"""Online preference learning: best/worst-of-n pairs (paper 004) and one-step asynchronous training (paper 001).

Engine-free (``torch`` only at import). :mod:`rlhf_ext.online.rollout` adds samplers (HF ``generate`` / vLLM),
reward adapters and pair collection, importing ``transformers`` / vLLM when used; :mod:`rlhf_ext.online.recipe` is
the typed recipe. The TRL adapter is :class:`rlhf_ext.trl.IterativeDPOTrainer`.
"""

from rlhf_ext.online.async_runner import (
    AsyncRunnerError,
    Batch,
    OneStepAsyncRunner,
    RunnerStats,
    StalenessError,
    torch_threads,
)
from rlhf_ext.online.importance import ImportanceWeights, truncated_importance_weights
from rlhf_ext.online.selection import (
    SELECTION_RULES,
    PairSelection,
    check_num_samples,
    select_pairs,
    text_ids,
)
from rlhf_ext.online.store import PairStore

__all__ = [
    "SELECTION_RULES",
    "AsyncRunnerError",
    "Batch",
    "ImportanceWeights",
    "OneStepAsyncRunner",
    "PairSelection",
    "PairStore",
    "RunnerStats",
    "StalenessError",
    "check_num_samples",
    "select_pairs",
    "text_ids",
    "torch_threads",
    "truncated_importance_weights",
]
