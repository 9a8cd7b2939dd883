"""Online preference learning: best/worst-of-n pairs (paper 004) and one-step asynchronous training (paper 001).

A facade over :mod:`rlhf_ext.algos` and :mod:`rlhf_ext.runtime` (``torch`` only at import); the iteration loop is in
:mod:`rlhf_ext.pipelines.iterative_dpo`, the TRL adapter is :class:`rlhf_ext.trl.IterativeDPOTrainer`.
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
