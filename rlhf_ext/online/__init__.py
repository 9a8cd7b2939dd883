"""Online preference learning: best/worst-of-n pairs (paper 004) and one-step asynchronous training (paper 001).

A facade over :mod:`rlhf_ext.algos` (pair selection, importance weights) and :mod:`rlhf_ext.runtime` (the async runner,
the pair store); ``torch`` only at import. Samplers, reward functions and pair collection are in
:mod:`rlhf_ext.runtime`; the iteration loop and its recipe in :mod:`rlhf_ext.pipelines.iterative_dpo`.
The TRL adapter is :class:`rlhf_ext.trl.IterativeDPOTrainer`.
"""

from rlhf_ext.algos.importance import ImportanceWeights, truncated_importance_weights
from rlhf_ext.algos.pair_selection import (
    SELECTION_RULES,
    PairSelection,
    select_pairs,
    text_ids,
)
from rlhf_ext.runtime.async_runner import (
    AsyncRunnerError,
    Batch,
    OneStepAsyncRunner,
    RunnerStats,
    StalenessError,
    torch_threads,
)
from rlhf_ext.runtime.pair_store import PairStore

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
    "select_pairs",
    "text_ids",
    "torch_threads",
    "truncated_importance_weights",
]
