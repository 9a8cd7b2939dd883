"""Forgetting metrics from a performance matrix (paper 000, Appendix C.3, Fig. 10).

``R`` is a ``K x K`` matrix: ``R[k, t]`` is the performance on task ``k`` of the checkpoint taken after training on
task ``t``; entries with ``t < k`` are not read and may be NaN.

* Normalised backward transfer (C.3): for a task ``k`` and a later checkpoint ``T > k``,
  ``(R[k, T] - R[k, k]) / R[k, k]``. :func:`backward_transfer` averages it over ``k < K - 1`` at the final checkpoint
  ``T = K - 1``; :func:`backward_transfer_curve` gives mean / min / max over the tasks seen so far at every ``T``
  (Fig. 10). Negative = forgetting. Normalising needs ``R[k, k] > 0``; ``normalized=False`` gives the classic BWT of
  Lopez-Paz & Ranzato (2017).
* :func:`forgetting` (Chaudhry et al., 2018): ``mean_{k < K-1} max_{k <= t < K-1} R[k, t] - R[k, K-1]``, the drop
  from the best performance a task ever had to its final one (>= 0).
* :func:`average_performance`: ``mean_k R[k, K-1]``, the final checkpoint's mean performance over all tasks.

Pure numpy; accepts anything ``numpy.asarray`` accepts (lists, arrays, CPU tensors).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


def check_performance_matrix(R: Any, name: str = "R") -> np.ndarray:
    """Validate and return ``R`` as a float64 ``[K, K]`` array (NaN allowed only below the diagonal, ``t < k``)."""
    arr = np.asarray(R, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1]:
        raise ValueError(
            f"{name} must be a square K x K matrix (R[k, t] = performance on task k after training task t); "
            f"got shape {arr.shape}"
        )
    if arr.shape[0] == 0:
        raise ValueError(f"{name} is empty; it needs one row and one column per task")
    seen = np.triu(np.ones_like(arr, dtype=bool))  # t >= k
    bad = np.argwhere(seen & ~np.isfinite(arr))
    if len(bad):
        where = ", ".join(f"R[{k}, {t}]" for k, t in bad[:5].tolist())
        raise ValueError(
            f"{name} has NaN/inf at {where}{' ...' if len(bad) > 5 else ''}: every task must be evaluated by its own "
            "checkpoint and every later one (a failed evaluation has to be rerun, not left empty)"
        )
    return arr


def _transfer(arr: np.ndarray, normalized: bool, name: str) -> np.ndarray:
    """``[K, K]`` matrix of (normalised) differences ``R[k, T] - R[k, k]``; NaN where ``T <= k``."""
    diag = np.diag(arr)
    diff = arr - diag[:, None]
    if normalized:
        bad = np.flatnonzero(diag <= 0)
        if len(bad):
            k = int(bad[0])
            raise ValueError(
                f"normalized backward transfer divides by {name}[k, k], which is {float(diag[k]):g} for task {k}; it "
                "needs positive performances such as accuracies. Use normalized=False (absolute BWT) for scores that "
                "can be zero or negative"
            )
        diff = diff / diag[:, None]
    later = np.triu(np.ones_like(arr, dtype=bool), k=1)  # T > k
    return np.where(later, diff, np.nan)


def _need_two(arr: np.ndarray, what: str) -> None:
    if arr.shape[0] < 2:
        raise ValueError(f"{what} needs at least 2 tasks (a later checkpoint to compare against); got K=1")


def backward_transfer(R: Any, normalized: bool = True) -> float:
    """Final backward transfer: ``mean_{k < K-1} (R[k, K-1] - R[k, k]) / R[k, k]`` (Appendix C.3).

    Args:
        R: ``[K, K]`` performance matrix, ``K >= 2``.
        normalized: divide by ``R[k, k]`` (paper, default) or not (classic BWT).

    Returns:
        A float; negative means forgetting.
    """
    arr = check_performance_matrix(R)
    _need_two(arr, "backward transfer")
    return float(_transfer(arr, normalized, "R")[:-1, -1].mean())


def backward_transfer_curve(R: Any, normalized: bool = True) -> dict[str, list[float]]:
    """Fig. 10: at each checkpoint ``T = 1 .. K-1``, the mean / min / max over tasks ``k < T`` of the (normalised)
    transfer ``(R[k, T] - R[k, k]) / R[k, k]``.

    Returns:
        ``{"checkpoint": [1, ..., K-1], "mean": [...], "min": [...], "max": [...]}`` (lists of length ``K - 1``).
    """
    arr = check_performance_matrix(R)
    _need_two(arr, "a backward-transfer curve")
    transfer = _transfer(arr, normalized, "R")[:, 1:]  # columns T = 1 .. K-1, NaN where k >= T
    return {
        "checkpoint": list(range(1, arr.shape[0])),
        "mean": np.nanmean(transfer, axis=0).tolist(),
        "min": np.nanmin(transfer, axis=0).tolist(),
        "max": np.nanmax(transfer, axis=0).tolist(),
    }


def forgetting(R: Any) -> float:
    """Average forgetting (Chaudhry et al., 2018): ``mean_{k < K-1} (max_{k <= t < K-1} R[k, t]) - R[k, K-1]``."""
    arr = check_performance_matrix(R)
    _need_two(arr, "forgetting")
    k_idx, t_idx = np.indices(arr.shape)
    window = (t_idx >= k_idx) & (t_idx < arr.shape[0] - 1)
    best = np.where(window, arr, -np.inf).max(axis=1)[:-1]
    return float((best - arr[:-1, -1]).mean())


def average_performance(R: Any) -> float:
    """Mean performance of the final checkpoint over all tasks: ``mean_k R[k, K-1]``."""
    arr = check_performance_matrix(R)
    return float(arr[:, -1].mean())


def task_curves(R: Any) -> list[list[float]]:
    """Per-task curves: row ``k`` of ``R`` from its own checkpoint on, ``[R[k, k], R[k, k+1], ..., R[k, K-1]]``."""
    arr = check_performance_matrix(R)
    return [arr[k, k:].tolist() for k in range(arr.shape[0])]


@dataclass
class ContinualSummary:
    """All forgetting figures of one performance matrix (JSON-friendly via :meth:`to_dict`)."""

    num_tasks: int
    average_performance: float
    newest_task_performance: float
    backward_transfer: float | None
    backward_transfer_absolute: float | None
    forgetting: float | None
    task_curves: list[list[float]]
    backward_transfer_curve: dict[str, list[float]] | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(R: Any) -> ContinualSummary:
    """Every metric of this module for ``R``; transfer metrics are ``None`` for one task, and the normalised ones
    are ``None`` when some ``R[k, k] <= 0`` (the absolute ones are still given)."""
    arr = check_performance_matrix(R)
    k = arr.shape[0]
    positive = bool((np.diag(arr) > 0).all())
    return ContinualSummary(
        num_tasks=k,
        average_performance=average_performance(arr),
        newest_task_performance=float(arr[-1, -1]),
        backward_transfer=backward_transfer(arr) if k > 1 and positive else None,
        backward_transfer_absolute=backward_transfer(arr, normalized=False) if k > 1 else None,
        forgetting=forgetting(arr) if k > 1 else None,
        task_curves=task_curves(arr),
        backward_transfer_curve=backward_transfer_curve(arr, normalized=positive) if k > 1 else None,
    )
