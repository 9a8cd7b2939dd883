"""Location-aware reward normalizers (paper 003 Eq. 6, section 2.3; paper 003 Table 2 baselines; Appendix E).

A segment reward r at location p = t/T in (0, 1] (t = 1-based segment index, T = segments in the response) is
normalised as ``(r - Mean(p)) / Std(p)``. The kinds:

* ``regression`` (paper): regress D_norm = {(p, mu_p, sigma_p)} of calibration (p, r) pairs on ``x = p``
  (``basis="linear"``, the paper) or ``x = ln p`` (``basis="log"``, paper 003's public code), by one of:

  - ``method="ols"`` (default, rlhf-ext's variant): ``Mean(p) = w_mu * x + b_mu`` and ``log Std(p) = w_sigma * x +
    b_sigma`` (``std_link="log"``) by closed-form least squares on the interior locations ``p < 1``, ``mu_p`` weighted
    by its segment count and ``log sigma_p`` by the count less one; the last segment (``p = 1``, where a soft-max
    aggregated reward model puts its verdict) gets its own sample mean and std (``mu_last``, ``sigma_last``: the
    classical bandit normalizer, Appendix E).
  - ``method="huber"``: the public code's fit exactly: locations bucketed to 3 decimals, per-bucket mean and
    *population* std, then ``Mean(p)`` and ``Std(p)`` itself (``std_link="identity"``) fitted linearly in
    ``x = ln(p + 1e-10)`` by :func:`huber_regression` (scikit-learn's ``HuberRegressor``, epsilon 1.35, alpha 1e-4).
    The released ``param.json`` normalizers are of this form (:meth:`LocationNormalizer.from_reference_params`).

* ``global``: one mean and std over all segment rewards (Table 2 "Global Statistics of All").
* ``last``: mean and std of the last segment rewards (p = 1; Table 2 "Statistics of the Last Rewards"), everywhere.
* ``none``: identity.

Degenerate calibration data falls back (regression -> global -> none, or a floored std) with a warning, recorded.

A linear Std (``std_link="identity"``) can cross zero (a released entry does, for small p; the public PPO divides by
it as is). rlhf-ext never does: such a normalizer carries a clamp ``std_floor`` (``Std(p) = max(line, std_floor)``) or
raises :class:`NormalizerError` naming the locations, at import and when evaluated.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import Tensor

from rlhf_ext.algos.knobs import KnobError, check_knob, check_knobs, knob
from rlhf_ext.algos.names import StrEnum


class NormalizerKind(StrEnum):
    """Kind of location-aware normalizer: ``regression`` is paper 003 Eq. 6, the others paper 003 Table 2's
    baselines (see the module docstring)."""

    NONE = "none"
    GLOBAL = "global"
    LAST = "last"
    REGRESSION = "regression"


class FitMethod(StrEnum):
    """How a ``regression`` normalizer is fitted: ``ols`` (rlhf-ext's closed form, log Std) or ``huber`` (paper 003's
    public code: Huber regression of Mean and Std themselves)."""

    OLS = "ols"
    HUBER = "huber"


class StdLink(StrEnum):
    """How Std(p) depends on the regression line ``w_sigma * x + b_sigma``: ``log`` (Std = exp(line), positive by
    construction) or ``identity`` (Std = line, the public code's form, which can cross zero)."""

    LOG = "log"
    IDENTITY = "identity"


NORMALIZER_KINDS: tuple[str, ...] = NormalizerKind.values()
FORMAT = "rlhf_ext.LocationNormalizer/1"
MIN_POINTS = 8
STD_FLOOR = 1e-4
#: scikit-learn ``HuberRegressor``'s defaults, which the public fit script uses (``HuberRegressor(epsilon=1.35)``).
HUBER_EPSILON = 1.35
HUBER_ALPHA = 1e-4
#: The public statistics script keys each location by ``f"{p:.3f}"`` and fits on ``log(p + 1e-10)``.
REFERENCE_LOCATION_DECIMALS = 3
REFERENCE_LOG_OFFSET = 1e-10
#: The most segments a response has in the public PPO runs: one per generated token, ``--generate_max_len 1024``.
REFERENCE_MAX_SEGMENTS = 1024
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_LOG_FLOAT32_MAX = math.log(_FLOAT32_MAX)


class NormalizerError(ValueError):
    """A normalizer file is missing, malformed, or was fitted for a different reward model; or a normalizer's Std is
    not positive where it is used."""


def _ols(x: Tensor, y: Tensor, weight: Tensor | None = None) -> tuple[float, float, float]:
    """Closed-form (weighted) least squares ``y = w x + b``; returns (w, b, R^2). Requires var(x) > 0."""
    x, y = x.double(), y.double()
    weight = torch.ones_like(x) if weight is None else weight.double()
    xm, ym = (weight * x).sum() / weight.sum(), (weight * y).sum() / weight.sum()
    w = (weight * (x - xm) * (y - ym)).sum() / (weight * (x - xm) ** 2).sum()
    return float(w), float(ym - w * xm), _r2(y, w * x + ym - w * xm, weight)


def _r2(y: Tensor, predicted: Tensor, weight: Tensor | None = None) -> float:
    """(Weighted) coefficient of determination ``1 - SS_res / SS_tot`` (1.0 when ``y`` is constant)."""
    weight = torch.ones_like(y) if weight is None else weight
    ss_tot = (weight * (y - (weight * y).sum() / weight.sum()) ** 2).sum()
    return float(1.0 - (weight * (y - predicted) ** 2).sum() / ss_tot) if ss_tot > 0 else 1.0


@dataclass(frozen=True)
class HuberFit:
    """A Huber regression ``y ~ w * x + b`` with robust scale ``scale`` and the fit's R^2."""

    w: float
    b: float
    scale: float
    r2: float


def huber_objective(
    w: Tensor,
    b: Tensor,
    scale: Tensor,
    x: Tensor,
    y: Tensor,
    epsilon: float = HUBER_EPSILON,
    alpha: float = HUBER_ALPHA,
) -> Tensor:
    """Owen's (2007) joint Huber objective of location and scale, as scikit-learn's ``HuberRegressor`` minimises it:
    ``sum_i [scale + scale * H_eps((y_i - w x_i - b) / scale)] + alpha * w^2`` (``H_eps`` the Huber loss).

    Args:
        w, b, scale: 0-d tensors (``scale > 0``).
        x, y: ``[N]`` feature and target.
    """
    residual = (y - w * x - b).abs()
    inlier = residual <= epsilon * scale
    per_point = torch.where(inlier, residual**2 / scale, 2 * epsilon * residual - epsilon**2 * scale)
    return x.numel() * scale + per_point.sum() + alpha * w**2


def huber_regression(
    x: Tensor, y: Tensor, epsilon: float = HUBER_EPSILON, alpha: float = HUBER_ALPHA, max_iter: int = 1000
) -> HuberFit:
    """Fit ``y ~ w * x + b`` by minimising :func:`huber_objective` jointly over (w, b, scale), in float64.

    L-BFGS over (w, b, log scale) from the least-squares line, scale >= 10 machine epsilons: scikit-learn's
    ``HuberRegressor(epsilon, alpha)`` (used by paper 003's public code) without scikit-learn.

    Args:
        x, y: ``[N]`` feature and target, ``N >= 2`` with ``var(x) > 0``.
    """
    x = torch.as_tensor(x).flatten().double()
    y = torch.as_tensor(y).flatten().double()
    w0, b0, _ = _ols(x, y)
    mean_abs_residual = float((y - w0 * x - b0).abs().mean())
    scale0 = mean_abs_residual if mean_abs_residual > 0 else 1.0
    params = torch.tensor([w0, b0, math.log(scale0)], dtype=torch.float64, requires_grad=True)
    min_scale = 10 * torch.finfo(torch.float64).eps  # scikit-learn's lower bound on the scale (exact fits)
    optimizer = torch.optim.LBFGS(
        [params],
        lr=1.0,
        max_iter=max_iter,
        max_eval=2 * max_iter,
        tolerance_grad=1e-12,
        tolerance_change=1e-15,
        history_size=20,
        line_search_fn="strong_wolfe",
    )

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = huber_objective(params[0], params[1], params[2].exp().clamp_min(min_scale), x, y, epsilon, alpha)
        loss.backward()
        return loss

    optimizer.step(closure)
    w, b, log_scale = params.detach().tolist()
    return HuberFit(w=w, b=b, scale=max(math.exp(log_scale), min_scale), r2=_r2(y, w * x + b))


def reference_location_statistics(positions: Tensor, rewards: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """D_norm the way paper 003's public statistics script builds it: each location keyed by ``f"{p:.3f}"``, then
    per key the mean and the *population* std (``numpy.std``, ddof 0; a key seen once has std 0).

    Args:
        positions, rewards: ``[N]`` calibration pairs (positions computed in float64 as ``t / T`` bucket exactly
            like the reference; float32 ones can fall on the other side of a rounding tie, e.g. 3/80).

    Returns:
        ``(locations, means, stds)``, each ``[L]``, locations ascending (the rounded values).
    """
    positions, rewards = torch.as_tensor(positions).double(), torch.as_tensor(rewards).double()
    distinct, inverse = torch.unique(positions, return_inverse=True)
    keys = [float(f"{p:.{REFERENCE_LOCATION_DECIMALS}f}") for p in distinct.tolist()]
    locations, counts, means, squares = _grouped_moments(torch.tensor(keys, dtype=torch.float64)[inverse], rewards)
    return locations, means, (squares / counts).sqrt()


def _grouped_moments(keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per distinct key (ascending): the key, the count, the mean and the sum of squared deviations of ``values``."""
    groups, inverse = torch.unique(keys, return_inverse=True)
    counts = torch.zeros_like(groups).index_add_(0, inverse, torch.ones_like(values))
    means = torch.zeros_like(groups).index_add_(0, inverse, values) / counts
    return groups, counts, means, torch.zeros_like(groups).index_add_(0, inverse, (values - means[inverse]) ** 2)


@dataclass
class LocationNormalizer:
    """``(r - Mean(p)) / Std(p)`` (paper 003 Eq. 6) with ``Mean(p) = w_mu*x + b_mu`` and ``Std(p) = exp(w_sigma*x +
    b_sigma)`` (``std_link="log"``) or ``w_sigma*x + b_sigma`` (``"identity"``, clamped at ``std_floor`` if set);
    ``x = p`` or ``ln p`` (``basis``). ``global``/``last`` have ``w_mu = w_sigma = 0``. ``mu_last``/``sigma_last``
    replace the line at p = 1 (``ols`` fit). ``segments_per_token``/``above_cutoff_share``: the SFT model's rates on
    the calibration responses (the reference of :class:`~rlhf_ext.algos.segment_dense.SegmentationMonitor`).
    Build with :meth:`fit` or :meth:`from_reference_params`; persist with :mod:`rlhf_ext.runtime.calibration`.
    """

    kind: str = "none"
    basis: str = "linear"
    w_mu: float = knob(0.0)
    b_mu: float = knob(0.0)
    w_sigma: float = knob(0.0)
    b_sigma: float = knob(0.0)
    num_points: int = knob(0, ge=0)
    num_locations: int = knob(0, ge=0)
    r2_mean: float | None = knob(None)
    r2_log_std: float | None = knob(None)
    reward_model: str | None = None
    fallback: str | None = None
    method: str = "ols"
    std_link: str = "log"
    std_floor: float | None = knob(None, gt=0, help="Clamp Std(p) below at this value (identity link only).")
    r2_std: float | None = knob(None)
    source: str | None = None
    mu_last: float | None = knob(None)
    sigma_last: float | None = knob(None, gt=0)
    segments_per_token: float | None = knob(None, ge=0)
    above_cutoff_share: float | None = knob(None, ge=0, le=1)

    def __post_init__(self):
        try:
            check_knobs(self)  # every coefficient a finite number (a string or NaN in a file is refused here)
        except KnobError as e:
            raise NormalizerError(f"normalizer {e}") from None
        for name, kinds in (("kind", NormalizerKind), ("method", FitMethod), ("std_link", StdLink)):
            value = getattr(self, name)
            if value not in kinds.values():
                raise NormalizerError(f"normalizer {name} must be one of {', '.join(kinds.values())}; got {value!r}")
            setattr(self, name, kinds(value).value)  # a plain str, so that to_dict() stays JSON/YAML-safe
        if self.basis not in ("linear", "log"):
            raise NormalizerError(f"normalizer basis must be 'linear' or 'log'; got {self.basis!r}")
        if self.std_floor is not None and self.std_link != StdLink.IDENTITY:
            raise NormalizerError("std_floor applies to std_link='identity' only (a log-link Std is positive)")
        if (self.mu_last is None) != (self.sigma_last is None):
            raise NormalizerError("mu_last and sigma_last are set together (the last segment's own statistics)")
        if self.mu_last is not None and self.std_link != StdLink.LOG:
            raise NormalizerError("mu_last/sigma_last belong to the ols fit (std_link='log')")
        self._check_float32_range()

    def _check_float32_range(self) -> None:
        """Mean(p) and Std(p) must be finite float32 numbers at both ends of ``[1 / REFERENCE_MAX_SEGMENTS, 1]`` (the
        lines are monotone in ``x``)."""
        if self.kind == NormalizerKind.NONE:
            return
        for p in (1.0 / REFERENCE_MAX_SEGMENTS, 1.0):
            x = self._x_scalar(p)
            mean, line = self.w_mu * x + self.b_mu, self.w_sigma * x + self.b_sigma
            std_ok = line < _LOG_FLOAT32_MAX if self.std_link == StdLink.LOG else abs(line) < _FLOAT32_MAX
            if not (abs(mean) < _FLOAT32_MAX and std_ok):
                raise NormalizerError(
                    f"normalizer Mean(p) = {mean:g} or Std(p) (line {line:g}, {self.std_link} link) overflows float32 "
                    f"at p = {p:g}: every normalized reward would be 0 or NaN; refit it"
                )

    # ------------------------------------------------------------------------------------------------ fitting
    @classmethod
    def fit(
        cls,
        positions: Tensor,
        rewards: Tensor,
        kind: NormalizerKind | str = "regression",
        basis: Literal["linear", "log"] | None = None,
        reward_model: str | None = None,
        min_points: int = MIN_POINTS,
        method: FitMethod | str = "ols",
        std_floor: float | None = None,
    ) -> LocationNormalizer:
        """Fit from calibration pairs.

        Args:
            positions: ``[N]`` location indicators p in (0, 1] (e.g. ``Segments.locations[Segments.mask]``).
            rewards: ``[N]`` the reward model's segment rewards at those locations.
            kind, basis, method: see the module docstring; ``basis`` defaults to ``linear`` for ``ols``, ``log`` for
                ``huber``.
            reward_model: identifier of the reward model the rewards came from.
            min_points: below this many points a fit falls back to a simpler kind.
            std_floor: ``huber`` only: clamp the linear Std(p) below at this value (else a nonpositive Std warns).
        """
        if method not in FitMethod.values():
            raise ValueError(f"fit method must be one of {', '.join(FitMethod.values())}; got {method!r}")
        if std_floor is not None and method != FitMethod.HUBER:
            raise ValueError("std_floor applies to method='huber' (a linear Std); method='ols' fits log Std")
        if basis is None:
            basis = "log" if method == FitMethod.HUBER else "linear"
        positions = torch.as_tensor(positions).flatten().double()
        rewards = torch.as_tensor(rewards).flatten().double()
        if positions.shape != rewards.shape:
            raise ValueError(f"positions {tuple(positions.shape)} and rewards {tuple(rewards.shape)} must match")
        finite = torch.isfinite(rewards) & torch.isfinite(positions)
        if not bool(finite.all()):
            bad = (~finite).nonzero().flatten()[:5].tolist()
            raise ValueError(f"calibration data holds NaN/inf at indices {bad}; check the reward model's outputs")
        if bool(((positions <= 0) | (positions > 1)).any()):
            raise ValueError("locations p must lie in (0, 1] (p = t/T with 1-based segment index t)")
        base = dict(kind=kind, basis=basis, method=method, reward_model=reward_model, num_points=int(positions.numel()))
        if kind == NormalizerKind.NONE:
            return cls(**base)
        if kind == NormalizerKind.LAST:
            keep = positions == 1.0
            positions, rewards = positions[keep], rewards[keep]
            base["num_points"] = int(positions.numel())
        if kind in (NormalizerKind.GLOBAL, NormalizerKind.LAST) or positions.numel() < min_points:
            reason = f"only {positions.numel()} points (< {min_points})" if kind == NormalizerKind.REGRESSION else None
            return cls._scalar(positions, rewards, base, reason)
        if method == FitMethod.HUBER:
            return cls._fit_huber(positions, rewards, base, std_floor)
        # the last segment's own statistics, then the regression on D_norm = {(p, mu_p, sigma_p)} over p < 1
        last = positions == 1.0
        mu_last = sigma_last = None
        if int(last.sum()) >= 2 and int((~last).sum()) >= min_points:
            mu_last = float(rewards[last].mean())
            sigma_last = max(float(rewards[last].std()), STD_FLOOR)
            positions, rewards = positions[~last], rewards[~last]
        locs, counts, mu, sq = _grouped_moments(positions, rewards)
        if locs.numel() < 2:
            return cls._scalar(positions, rewards, base, "a single location in the calibration data")
        x = locs if basis == "linear" else locs.log()
        w_mu, b_mu, r2_mu = _ols(x, mu, weight=counts)  # each segment counts once, not each distinct location
        has_std = counts >= 2
        sigma = (sq[has_std] / (counts[has_std] - 1)).sqrt()
        positive = sigma > 0
        xs, log_sigma = x[has_std][positive], sigma[positive].log()
        fallback = None
        if xs.numel() >= 2 and float(xs.var()) > 0:
            w_s, b_s, r2_s = _ols(xs, log_sigma, weight=counts[has_std][positive] - 1)  # a std's degrees of freedom
        else:
            pooled = rewards.std() if rewards.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
            w_s, b_s, r2_s = 0.0, math.log(max(float(pooled), STD_FLOOR)), None
            fallback = "too few locations with a sample std: constant pooled std"
            warnings.warn(f"LocationNormalizer: {fallback}", stacklevel=2)
        return cls(
            w_mu=w_mu,
            b_mu=b_mu,
            w_sigma=w_s,
            b_sigma=b_s,
            num_locations=int(locs.numel()),
            r2_mean=r2_mu,
            r2_log_std=r2_s,
            fallback=fallback,
            mu_last=mu_last,
            sigma_last=sigma_last,
            **base,
        )

    @classmethod
    def _fit_huber(cls, positions: Tensor, rewards: Tensor, base: dict, std_floor: float | None) -> LocationNormalizer:
        """The public code's fit (module docstring): Huber lines for Mean(p) and Std(p) on the bucketed D_norm."""
        locations, means, stds = reference_location_statistics(positions, rewards)
        if locations.numel() < 2:
            return cls._scalar(positions, rewards, base, "a single location in the calibration data")
        x = locations if base["basis"] == "linear" else (locations + REFERENCE_LOG_OFFSET).log()
        mean_fit, std_fit = huber_regression(x, means), huber_regression(x, stds)
        norm = cls(
            w_mu=mean_fit.w,
            b_mu=mean_fit.b,
            w_sigma=std_fit.w,
            b_sigma=std_fit.b,
            std_link=StdLink.IDENTITY.value,
            std_floor=std_floor,
            num_locations=int(locations.numel()),
            r2_mean=mean_fit.r2,
            r2_std=std_fit.r2,
            **base,
        )
        region = norm.nonpositive_std_locations(float(positions.min()))
        if region is not None and std_floor is None:
            warnings.warn(f"LocationNormalizer: {norm._nonpositive_std_message(region)}", stacklevel=3)
        return norm

    @classmethod
    def _scalar(cls, positions: Tensor, rewards: Tensor, base: dict, reason: str | None) -> LocationNormalizer:
        """Constant mean/std (``global``/``last``, or the fallback of a degenerate ``regression``)."""
        kind = base["kind"]
        if rewards.numel() == 0:
            warnings.warn(f"LocationNormalizer({kind}): no calibration points; using no normalization", stacklevel=3)
            return cls(**{**base, "fallback": "no calibration points: identity"})
        if reason is not None:
            warnings.warn(f"LocationNormalizer({kind}): {reason}; falling back to global statistics", stacklevel=3)
        std = float(rewards.std()) if rewards.numel() > 1 else 0.0
        if std < STD_FLOOR:
            warnings.warn(
                f"LocationNormalizer({kind}): calibration rewards have (near-)zero variance; std floored at "
                f"{STD_FLOOR}",
                stacklevel=3,
            )
            reason = (reason + "; " if reason else "") + "zero variance: std floored"
        return cls(
            b_mu=float(rewards.mean()),
            b_sigma=math.log(max(std, STD_FLOOR)),
            num_locations=int(torch.unique(positions).numel()),
            fallback=reason,
            **base,
        )

    # ------------------------------------------------------------------------------------- released normalizers
    @classmethod
    def from_reference_params(
        cls,
        params: Sequence[float],
        *,
        source: str = "param.json entry",
        reward_model: str | None = None,
        std_floor: float | None = None,
        max_segments: int = REFERENCE_MAX_SEGMENTS,
    ) -> LocationNormalizer:
        """A normalizer released by paper 003's public code: a ``param.json`` entry ``[a, b, c, d]`` read as
        ``Mean(p) = a * ln p + c`` and ``Std(p) = b * ln p + d``, as its PPO's ``get_adjusted_mean_std`` reads it.

        Args:
            params: the entry's four numbers ``[a, b, c, d]``.
            source: where the entry came from (for messages and the saved file).
            reward_model: identifier of the released reward model it belongs to.
            std_floor: clamp Std(p) below at this value.
            max_segments: the most segments a response can have, so p >= 1 / max_segments.

        Raises:
            NormalizerError: ``params`` is not four finite numbers, or Std(p) <= 0 for some p in
                ``[1 / max_segments, 1]`` and no ``std_floor`` is given (the message names that p range).
        """
        numbers = list(params) if isinstance(params, list | tuple) else []
        finite = all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in numbers)
        if len(numbers) != 4 or not finite:
            raise NormalizerError(f"{source} must be four finite numbers [a, b, c, d]; got {params!r}")
        check_knob(ReferenceImport, "max_segments", max_segments)
        a, b, c, d = (float(v) for v in numbers)
        norm = cls(
            kind=NormalizerKind.REGRESSION.value,
            basis="log",
            method=FitMethod.HUBER.value,
            std_link=StdLink.IDENTITY.value,
            w_mu=a,
            b_mu=c,
            w_sigma=b,
            b_sigma=d,
            std_floor=std_floor,
            reward_model=reward_model,
            source=source,
        )
        region = norm.nonpositive_std_locations(1.0 / max_segments)
        if region is not None and std_floor is None:
            raise NormalizerError(norm._nonpositive_std_message(region, max_segments))
        return norm

    def _x_scalar(self, p: float) -> float:
        return p if self.basis == "linear" else math.log(max(p, 1e-12))

    def _p_scalar(self, x: float) -> float:
        return x if self.basis == "linear" else math.exp(x)

    def nonpositive_std_locations(self, min_location: float) -> tuple[float, float] | None:
        """The interval ``(lo, hi)`` of locations in ``[min_location, 1]`` where the unclamped line of a linear Std
        (``std_link="identity"``) is <= 0, or None (also for a log-link Std, which is always positive)."""
        if self.std_link != StdLink.IDENTITY:
            return None
        x_lo, x_hi = self._x_scalar(min_location), self._x_scalar(1.0)
        if self.w_sigma == 0.0:
            return (min_location, 1.0) if self.b_sigma <= 0 else None
        root = -self.b_sigma / self.w_sigma  # the line is <= 0 at x <= root (w_sigma > 0) or x >= root (w_sigma < 0)
        if self.w_sigma > 0:
            return None if root < x_lo else (min_location, self._p_scalar(min(root, x_hi)))
        return None if root > x_hi else (self._p_scalar(max(root, x_lo)), 1.0)

    def _nonpositive_std_message(self, region: tuple[float, float], max_segments: int | None = None) -> str:
        """Where Std(p) <= 0 (``region`` from :meth:`nonpositive_std_locations`), what the public code does there,
        and the two fixes."""
        lo, hi = region
        feature = "ln(p)" if self.basis == "log" else "p"
        where = f"p in [{lo:.6g}, {hi:.6g}]"
        fixes = "clamp it with std_floor (`rlhf-ext segment import-normalizer --std-floor VALUE`)"
        if hi < 1.0:
            fewest = math.ceil(1.0 / hi - 1e-9)  # p = 1/T <= hi from T = fewest segments on
            where += f", i.e. the first segments of responses with {fewest} or more segments"
            fixes += f", or set max_segments (`--max-segments N`) to N < {fewest} if responses are never that long"
        if max_segments is not None:
            where += f" (at most {max_segments} segments per response)"
        return (
            f"{self.source or 'this normalizer'}: Std(p) = {self.w_sigma:g} * {feature} + {self.b_sigma:g} is <= 0 "
            f"for {where}. Paper 003's public PPO divides by it as is (flipping the sign of those segments' "
            f"normalized rewards; inf at the root); rlhf-ext does not: {fixes}"
        )

    # ------------------------------------------------------------------------------------------- evaluation
    def _x(self, p: Tensor) -> Tensor:
        return p if self.basis == "linear" else p.clamp_min(1e-12).log()

    def mean(self, p: Tensor) -> Tensor:
        """Mean(p) (paper 003 Eq. 6), same shape as ``p`` (``mu_last`` at p = 1 when set)."""
        p = torch.as_tensor(p, dtype=torch.float32)
        line = self.w_mu * self._x(p) + self.b_mu
        return line if self.mu_last is None else torch.where(p == 1.0, self.mu_last, line)

    def std(self, p: Tensor) -> Tensor:
        """Std(p) (paper 003 Eq. 6), same shape as ``p``: ``exp(line)`` never below :data:`STD_FLOOR` (log link), or
        the line clamped at ``std_floor`` (identity link).

        Raises:
            NormalizerError: identity link without ``std_floor`` and the line is <= 0 at some p.
        """
        p = torch.as_tensor(p, dtype=torch.float32)
        line = self.w_sigma * self._x(p) + self.b_sigma
        if self.std_link == StdLink.LOG:
            std = torch.exp(line).clamp_min(STD_FLOOR)
            return std if self.sigma_last is None else torch.where(p == 1.0, self.sigma_last, std)
        if self.std_floor is not None:
            return line.clamp_min(self.std_floor)
        nonpositive = line <= 0
        if bool(nonpositive.any()):
            hit = float(p[nonpositive].min())  # (hit, hit): float32 rounding at the root
            raise NormalizerError(self._nonpositive_std_message(self.nonpositive_std_locations(hit) or (hit, hit)))
        return line

    def normalize(self, rewards: Tensor, positions: Tensor, mask: Tensor | None = None) -> Tensor:
        """``(r - Mean(p)) / Std(p)`` elementwise; positions outside ``mask`` (or with p <= 0) become 0.

        Args:
            rewards: ``[B, S]`` (or any shape) segment rewards.
            positions: same shape, location indicators p (0 at padding).
            mask: optional bool, true at real segments (default: ``positions > 0``).
        """
        valid = (positions > 0) if mask is None else mask.bool()
        if self.kind == NormalizerKind.NONE:
            out = rewards
        else:
            p = torch.where(valid, positions, torch.ones_like(positions)).to(rewards.dtype)  # padding: any p works
            out = (rewards - self.mean(p).to(rewards.dtype)) / self.std(p).to(rewards.dtype)
        return torch.where(valid, out, torch.zeros_like(out))

    # ------------------------------------------------------------------------------------------- serialisation
    def to_dict(self) -> dict:
        """A JSON-ready dict (file IO is :func:`rlhf_ext.runtime.calibration.save_normalizer`)."""
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict, source: str = "data") -> LocationNormalizer:
        """Inverse of :meth:`to_dict`; raises :class:`NormalizerError` naming ``source`` on a malformed dict (an
        unknown or missing field, a coefficient that is not a finite number, a Mean or Std that overflows)."""
        if not isinstance(data, dict):
            raise NormalizerError(f"{source} is not a LocationNormalizer file: it holds {type(data).__name__}")
        data = dict(data)
        data.pop("format", None)
        try:
            return cls(**data)
        except TypeError as e:
            raise NormalizerError(f"{source} is not a LocationNormalizer file: {e}") from e
        except NormalizerError as e:
            raise NormalizerError(f"{source}: {e}") from None


@dataclass
class ReferenceImport:
    """The range of :meth:`LocationNormalizer.from_reference_params`'s ``max_segments`` (``--max-segments`` of
    ``rlhf-ext segment import-normalizer``)."""

    max_segments: int = knob(REFERENCE_MAX_SEGMENTS, ge=1, help="Most segments a response has (p >= 1/N).")
