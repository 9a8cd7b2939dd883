"""Location-aware reward normalizers (paper 003 Eq. 6, section 2.3; paper 003 Table 2 baselines; Appendix E).

A segment reward r at location p = t/T in (0, 1] (t = 1-based segment index, T = segments in the response) is
normalised as ``(r - Mean(p)) / Std(p)``. The kinds:

* ``regression`` (paper): from a calibration set of (p, r) pairs, build D_norm = {(p, mu_p, sigma_p)} over the
  distinct locations and fit ``Mean(p) = w_mu * x + b_mu`` and ``log Std(p) = w_sigma * x + b_sigma`` by ordinary
  least squares in closed form, with ``x = p`` (``basis="linear"``, the paper) or ``x = log p`` (``basis="log"``, the
  public reference code). Locations seen once have no sample std and are left out of the std regression.
* ``global``: one mean and std over all segment rewards (Table 2 "Global Statistics of All").
* ``last``: mean and std of each response's last segment reward, i.e. the points at p = 1 (Table 2 "Statistics of the
  Last Rewards", the classical bandit normalizer).
* ``none``: identity.

Degenerate calibration data never divides by zero: too few points, a single location or zero variance fall back to
a simpler kind (regression -> global -> none) or a floor on the std, with a warning, and the fallback is recorded.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import Tensor

from rlhf_ext.algos.names import StrEnum


class NormalizerKind(StrEnum):
    """Kind of location-aware normalizer: ``regression`` is paper 003 Eq. 6, the others paper 003 Table 2's
    baselines (see the module docstring)."""

    NONE = "none"
    GLOBAL = "global"
    LAST = "last"
    REGRESSION = "regression"


NORMALIZER_KINDS: tuple[str, ...] = NormalizerKind.values()
FORMAT = "rlhf_ext.LocationNormalizer/1"
MIN_POINTS = 8
STD_FLOOR = 1e-4


class NormalizerError(ValueError):
    """A normalizer file is missing, malformed, or was fitted for a different reward model."""


def _ols(x: Tensor, y: Tensor) -> tuple[float, float, float]:
    """Closed-form least squares ``y = w x + b``; returns (w, b, R^2). Requires var(x) > 0."""
    x, y = x.double(), y.double()
    xm, ym = x.mean(), y.mean()
    sxx = ((x - xm) ** 2).sum()
    w = ((x - xm) * (y - ym)).sum() / sxx
    b = ym - w * xm
    ss_tot = ((y - ym) ** 2).sum()
    ss_res = ((y - (w * x + b)) ** 2).sum()
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return float(w), float(b), float(r2)


@dataclass
class LocationNormalizer:
    """``(r - Mean(p)) / Std(p)`` with ``Mean(p) = w_mu*x + b_mu`` and ``Std(p) = exp(w_sigma*x + b_sigma)``.

    ``global``/``last`` are the special case ``w_mu = w_sigma = 0``; ``none`` has ``b_mu = 0, b_sigma = 0``.
    Build one with :meth:`fit`; persist with :meth:`save` / :meth:`load`.
    """

    kind: str = "none"
    basis: str = "linear"
    w_mu: float = 0.0
    b_mu: float = 0.0
    w_sigma: float = 0.0
    b_sigma: float = 0.0
    num_points: int = 0
    num_locations: int = 0
    r2_mean: float | None = None
    r2_log_std: float | None = None
    reward_model: str | None = None
    fallback: str | None = None

    def __post_init__(self):
        if self.kind not in NORMALIZER_KINDS:
            raise NormalizerError(f"normalizer kind must be one of {', '.join(NORMALIZER_KINDS)}; got {self.kind!r}")
        self.kind = NormalizerKind(self.kind).value  # a plain str, so that to_dict() stays JSON/YAML-safe
        if self.basis not in ("linear", "log"):
            raise NormalizerError(f"normalizer basis must be 'linear' or 'log'; got {self.basis!r}")

    # ------------------------------------------------------------------------------------------------ fitting
    @classmethod
    def fit(
        cls,
        positions: Tensor,
        rewards: Tensor,
        kind: NormalizerKind | str = "regression",
        basis: Literal["linear", "log"] = "linear",
        reward_model: str | None = None,
        min_points: int = MIN_POINTS,
    ) -> LocationNormalizer:
        """Fit from calibration pairs.

        Args:
            positions: ``[N]`` location indicators p in (0, 1] (e.g. ``Segments.locations[Segments.mask]``).
            rewards: ``[N]`` the reward model's segment rewards at those locations.
            kind, basis: see the module docstring.
            reward_model: identifier of the reward model the rewards came from (checked by :meth:`load`).
            min_points: below this many points a fit falls back to a simpler kind.
        """
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
        base = dict(kind=kind, basis=basis, reward_model=reward_model, num_points=int(positions.numel()))
        if kind == NormalizerKind.NONE:
            return cls(**base)
        if kind == NormalizerKind.LAST:
            keep = positions == 1.0
            positions, rewards = positions[keep], rewards[keep]
            base["num_points"] = int(positions.numel())
        if kind in (NormalizerKind.GLOBAL, NormalizerKind.LAST) or positions.numel() < min_points:
            if kind == NormalizerKind.REGRESSION:
                return cls._scalar(positions, rewards, base, f"only {positions.numel()} points (< {min_points})")
            return cls._scalar(positions, rewards, base, None)
        # regression on D_norm = {(p, mu_p, sigma_p)}
        locs, inverse, counts = torch.unique(positions, return_inverse=True, return_counts=True)
        if locs.numel() < 2:
            return cls._scalar(positions, rewards, base, "a single location in the calibration data")
        sums = torch.zeros_like(locs).index_add_(0, inverse, rewards)
        mu = sums / counts
        sq = torch.zeros_like(locs).index_add_(0, inverse, (rewards - mu[inverse]) ** 2)
        x = locs if basis == "linear" else locs.log()
        w_mu, b_mu, r2_mu = _ols(x, mu)
        has_std = counts >= 2
        sigma = (sq[has_std] / (counts[has_std] - 1)).sqrt()
        positive = sigma > 0
        xs, log_sigma = x[has_std][positive], sigma[positive].log()
        fallback = None
        if xs.numel() >= 2 and float(xs.var()) > 0:
            w_s, b_s, r2_s = _ols(xs, log_sigma)
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
            **base,
        )

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

    # ------------------------------------------------------------------------------------------- evaluation
    def _x(self, p: Tensor) -> Tensor:
        return p if self.basis == "linear" else p.clamp_min(1e-12).log()

    def mean(self, p: Tensor) -> Tensor:
        """Mean(p) (paper 003 Eq. 6)."""
        p = torch.as_tensor(p, dtype=torch.float32)
        return self.w_mu * self._x(p) + self.b_mu

    def std(self, p: Tensor) -> Tensor:
        """Std(p) = exp(w_sigma * x + b_sigma) (paper 003 Eq. 6), never below the floor."""
        p = torch.as_tensor(p, dtype=torch.float32)
        return torch.exp(self.w_sigma * self._x(p) + self.b_sigma).clamp_min(STD_FLOOR)

    def normalize(self, rewards: Tensor, positions: Tensor, mask: Tensor | None = None) -> Tensor:
        """``(r - Mean(p)) / Std(p)`` elementwise; positions outside ``mask`` (or with p <= 0) become 0.

        Args:
            rewards: ``[B, S]`` (or any shape) segment rewards.
            positions: same shape, location indicators p (0 at padding).
            mask: optional bool, true at real segments (default: ``positions > 0``).
        """
        if self.kind == NormalizerKind.NONE:
            out = rewards
        else:
            p = positions.to(rewards.dtype)
            out = (rewards - self.mean(p).to(rewards.dtype)) / self.std(p).to(rewards.dtype)
        valid = (positions > 0) if mask is None else mask.bool()
        return torch.where(valid, out, torch.zeros_like(out))

    # ------------------------------------------------------------------------------------------- serialisation
    def to_dict(self) -> dict:
        """A JSON-ready dict (file IO is :func:`rlhf_ext.runtime.calibration.save_normalizer`)."""
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict, source: str = "data") -> LocationNormalizer:
        """Inverse of :meth:`to_dict`; raises :class:`NormalizerError` naming ``source`` on a malformed dict."""
        data = dict(data)
        data.pop("format", None)
        try:
            return cls(**data)
        except TypeError as e:
            raise NormalizerError(f"{source} is not a LocationNormalizer file: {e}") from e
