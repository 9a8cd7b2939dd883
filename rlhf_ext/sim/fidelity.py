"""Statistics for the simulator's fidelity: does its ranking of methods match a published one?

AlpacaFarm (paper 002, section 4.2) validates its simulator by the rank correlation of methods' simulated win rates
with their human-feedback ones (Spearman 0.98). For ``rlhf-ext sim compare``: Spearman's rho and Kendall's tau-b (with
ties), a bootstrap over seeds of the per-method mean, and an ordering check against a published order (paper 003,
Table 1: segment > token > bandit PPO). Pure numpy; ``benchmarks/sim_fidelity.py`` feeds it the results.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: Paper 003 ("Segmenting Text and Learning Their Rewards for Improved RLHF in Language Models"), Table 1: length
#: controlled AlpacaEval 2.0 win rate (%) of the PPO policies per action definition, named after the simulator's
#: methods (``token_ppo`` is not one of them yet). The paper's order: segment > token > bandit.
PAPER003_TABLE1_ALPACAEVAL_LC: dict[str, float] = {
    "segment_ppo": 19.68,
    "token_ppo": 17.00,
    "bandit_ppo": 14.98,
}


def average_ranks(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """Ranks 1..n of ``values`` (shape ``[n]``), tied values sharing the mean of their ranks ("average" method).

    Example: ``[10, 20, 20, 5] -> [2, 3.5, 3.5, 1]``.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"expected a 1-d array, got shape {x.shape}")
    # a group of c equal values ending at sorted position `stop` holds ranks stop-c+1..stop: their mean is stop-(c-1)/2
    _, group, counts = np.unique(x, return_inverse=True, return_counts=True, equal_nan=False)
    return (np.cumsum(counts) - (counts - 1) / 2.0)[group]


def _paired(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(x, dtype=np.float64)
    b = np.asarray(y, dtype=np.float64)
    if a.ndim != 1 or a.shape != b.shape:
        raise ValueError(f"expected two 1-d arrays of one length, got shapes {a.shape} and {b.shape}")
    if len(a) < 2:
        raise ValueError("a rank correlation needs at least two items")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("rank correlations of non-finite values are undefined")
    return a, b


def spearman_rho(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """Spearman's rank correlation of ``x`` and ``y`` (shape ``[n]`` each): the Pearson correlation of their average
    ranks, ``rho = sum_i (r_i - mean r)(s_i - mean s) / sqrt(sum_i (r_i - mean r)^2 sum_i (s_i - mean s)^2)``.

    Ties take average ranks (as ``scipy.stats.spearmanr``). NaN when either side is constant (undefined).
    """
    a, b = _paired(x, y)
    r = average_ranks(a) - (len(a) + 1) / 2.0
    s = average_ranks(b) - (len(b) + 1) / 2.0
    denominator = math.sqrt(float(r @ r) * float(s @ s))
    if denominator == 0.0:
        return float("nan")
    return float(r @ s) / denominator


def kendall_tau_b(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """Kendall's tau-b of ``x`` and ``y`` (shape ``[n]`` each), over the ``n0 = n(n-1)/2`` pairs of items:

    ``tau_b = (P - Q) / sqrt((n0 - n1)(n0 - n2))`` with ``P``/``Q`` the concordant/discordant pairs, ``n1`` the pairs
    tied in ``x`` and ``n2`` the pairs tied in ``y`` (a pair tied in both counts in both). NaN when either side is
    constant (undefined), as ``scipy.stats.kendalltau``.
    """
    a, b = _paired(x, y)
    upper = np.triu_indices(len(a), k=1)
    sign_x = np.sign(a[:, None] - a[None, :])[upper]  # [n0]
    sign_y = np.sign(b[:, None] - b[None, :])[upper]  # [n0]
    n0 = len(sign_x)
    untied_x = n0 - int((sign_x == 0).sum())
    untied_y = n0 - int((sign_y == 0).sum())
    if untied_x == 0 or untied_y == 0:
        return float("nan")
    return float((sign_x * sign_y).sum()) / math.sqrt(untied_x * untied_y)  # (concordant - discordant) / ...


def bootstrap_seed_means(per_seed: Sequence[Sequence[float]], num_resamples: int, seed: int = 0) -> np.ndarray:
    """Bootstrap of each method's mean over seeds: per resample, each method's per-seed values ``per_seed[m]`` are
    drawn with replacement (as many as it has, methods independently) and averaged. Returns ``[num_resamples,
    num_methods]``, the same for the same ``seed``."""
    if num_resamples < 1:
        raise ValueError(f"num_resamples must be >= 1, got {num_resamples}")
    rng = np.random.default_rng(seed)
    columns = []
    for m, values in enumerate(per_seed):
        v = np.asarray(values, dtype=np.float64)
        if v.ndim != 1 or len(v) == 0:
            raise ValueError(f"method {m} has no per-seed values")
        picks = rng.integers(0, len(v), size=(num_resamples, len(v)))  # [R, seeds]
        columns.append(v[picks].mean(axis=1))
    return np.stack(columns, axis=1)


@dataclass(frozen=True)
class CorrelationInterval:
    """Bootstrap summary of one rank correlation: percentile interval of the finite resamples, fraction of all
    resamples above 0, and how many resamples were undefined (a constant side)."""

    low: float
    high: float
    fraction_positive: float
    num_resamples: int
    num_undefined: int


def bootstrap_rank_correlation(
    per_seed: Sequence[Sequence[float]],
    reference: Sequence[float],
    statistic: str = "spearman",
    num_resamples: int = 10_000,
    seed: int = 0,
    percentiles: tuple[float, float] = (2.5, 97.5),
) -> CorrelationInterval:
    """Bootstrap interval of the rank correlation (``statistic``: ``"spearman"`` or ``"kendall"``) between the
    methods' seed-mean scores and ``reference`` (shape ``[num_methods]``), resampling seeds per method
    (:func:`bootstrap_seed_means`). ``percentiles`` use numpy's linear interpolation over the defined resamples."""
    functions = {"spearman": spearman_rho, "kendall": kendall_tau_b}
    if statistic not in functions:
        raise ValueError(f"statistic must be one of {sorted(functions)}, got {statistic!r}")
    if len(reference) != len(per_seed):
        raise ValueError(f"{len(per_seed)} methods but {len(reference)} reference values")
    means = bootstrap_seed_means(per_seed, num_resamples, seed)
    values = np.array([functions[statistic](row, reference) for row in means])
    defined = values[~np.isnan(values)]
    low, high = (float(p) for p in np.percentile(defined, percentiles)) if len(defined) else (math.nan, math.nan)
    positive = float((defined > 0).sum()) / num_resamples
    return CorrelationInterval(low, high, positive, num_resamples, num_resamples - len(defined))


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error ``sqrt(var / n)`` (``var`` with ``n - 1``) of ``values``; s.e. NaN for one value."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) == 0:
        raise ValueError("no values")
    if len(v) == 1:
        return float(v[0]), float("nan")
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v)))


def ordering_agrees(scores: Mapping[str, float], expected_order: Sequence[str]) -> bool | None:
    """Whether ``scores`` rank the methods of ``expected_order`` (best first) that they contain strictly in that
    order; ``None`` when fewer than two of them are present (nothing to compare)."""
    present = [m for m in expected_order if m in scores]
    if len(present) < 2:
        return None
    return all(scores[a] > scores[b] for a, b in zip(present, present[1:], strict=False))
