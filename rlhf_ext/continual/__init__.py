"""Continual RLHF (paper 000): KL to the previous task's policy, CPPO sample weights, forgetting metrics, and the
task-sequence runner.

Engine-free (``torch`` / ``numpy`` only): importing this package never imports trl, openrlhf, deepspeed, ray or vllm.

* :func:`kl_to_previous` — the plain regulariser of paper 000 Eq. 7 (masked token mean of a k1/k2/k3 KL estimate).
* :func:`cppo_sample_weights` — CPPO's optional learning / retention weights (alpha, beta), from the authors' code.
* :func:`backward_transfer`, :func:`forgetting`, :func:`average_performance`, :func:`summarize` — Appendix C.3.
* :mod:`rlhf_ext.pipelines.continual` — train a sequence of tasks with snapshots, evaluation matrix, plots and resume.
"""

from rlhf_ext.algos.continual_kl import (
    DEFAULT_KL_COEF,
    K3_MAX_LOG_RATIO,
    KL_ESTIMATORS,
    check_estimator,
    kl_to_previous,
    masked_token_mean,
    per_token_kl,
)
from rlhf_ext.algos.cppo_weights import (
    CATEGORY_NAMES,
    BatchStats,
    CPPOWeights,
    CPPOWeightSettings,
    batch_stats,
    cppo_sample_weights,
    mean_log_prob,
)
from rlhf_ext.algos.forgetting import (
    ContinualSummary,
    average_performance,
    backward_transfer,
    backward_transfer_curve,
    check_performance_matrix,
    forgetting,
    summarize,
    task_curves,
)
from rlhf_ext.pipelines.continual import ContinualRunner, TaskContext, TaskSequenceError, run_continual
from rlhf_ext.pipelines.continual_recipe import ContinualRecipe

__all__ = [
    "CATEGORY_NAMES",
    "DEFAULT_KL_COEF",
    "K3_MAX_LOG_RATIO",
    "KL_ESTIMATORS",
    "BatchStats",
    "CPPOWeightSettings",
    "CPPOWeights",
    "ContinualRecipe",
    "ContinualRunner",
    "ContinualSummary",
    "average_performance",
    "backward_transfer",
    "backward_transfer_curve",
    "batch_stats",
    "check_estimator",
    "check_performance_matrix",
    "cppo_sample_weights",
    "forgetting",
    "kl_to_previous",
    "masked_token_mean",
    "mean_log_prob",
    "per_token_kl",
    "run_continual",
    "summarize",
    "TaskContext",
    "TaskSequenceError",
    "task_curves",
]
