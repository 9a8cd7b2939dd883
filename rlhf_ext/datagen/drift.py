"""Drift schedules: from a task sequence to time steps (stages), each a mixture of source tasks (paper section 4).

* **Piecewise** non-stationarity (Figure 2d): stage ``t`` is exactly one task; the sequence ``tasks * cycles`` is
  walked in order, so the reward/prompt distribution switches suddenly at every stage boundary.
* **Lipschitz** non-stationarity (Figure 2e): consecutive tasks of ``tasks * cycles`` are blended. With Lipschitz
  constant ``C`` each transition takes ``m = ceil(1 / C)`` steps; at step ``s`` of the transition from task ``a`` to
  task ``b`` the mixture is ``(1 - s/m) * a + (s/m) * b``. Every task's mixture weight therefore changes by at most
  ``1/m <= C`` between consecutive stages, the discrete form of ``|r_t - r_t'| <= C |t - t'|``.

Each sample is drawn from one source task (prompt *and* preference); a stage's counts per source task are allocated
by largest remainder (``|count_k / n - w_k| < 1 / n``), in a seeded shuffle. Modes of drift (Figure 2a-c): objective
or domain changes -> ``prompt``; preference -> ``preference``; both -> ``combined``.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import asdict, dataclass
from typing import Any

from rlhf_ext.datagen.schema import DatagenConfig, TaskSpec
from rlhf_ext.runtime.io import stable_hash

#: Weights closer than this to 0 are dropped from a stage's mixture (floating-point noise of the interpolation).
_EPS = 1e-12


@dataclass(frozen=True)
class Stage:
    """One time step of the continual dataset.

    Attributes:
        index / seed: position in the sequence (0-based); the stage's seed (from the config seed and ``index``).
        name: ``task`` (piecewise; ``task#c2`` in cycle 2, ...) or ``a>b[0.25]`` (Lipschitz blend, weight of ``b``).
        weights: mixture weight of each source task (sums to 1, only non-zero entries).
        num_samples / test_ratio: the mixture of the tasks' ``num_samples`` (train + test) and ``test_ratio``.
    """

    index: int
    name: str
    weights: dict[str, float]
    num_samples: int
    test_ratio: float
    seed: int

    @property
    def dirname(self) -> str:
        return stage_dirname(self.index, self.name)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "dir": self.dirname}


def stage_dirname(index: int, name: str) -> str:
    """``NNN-<name>`` with characters outside ``[A-Za-z0-9_.-]`` replaced (a stage's directory name)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "stage"
    return f"{index:03d}-{slug}"


def derive_seed(*parts: Any) -> int:
    """A 31-bit seed from JSON-serialisable parts (stable across processes and platforms)."""
    return int(stable_hash(*parts, length=8), 16) & 0x7FFFFFFF


def lipschitz_weights(num_anchors: int, lipschitz_constant: float) -> list[list[float]]:
    """Mixture weights over ``num_anchors`` consecutive anchors, moving by at most ``lipschitz_constant`` per step.

    Returns ``1 + (num_anchors - 1) * ceil(1 / C)`` weight vectors of length ``num_anchors``; the first is pure
    anchor 0, the last pure anchor ``num_anchors - 1``, and every anchor appears pure once, in order.
    """
    if num_anchors < 1:
        raise ValueError("need at least one anchor task")
    if not 0.0 < lipschitz_constant <= 1.0:
        raise ValueError(f"lipschitz_constant must be in (0, 1], got {lipschitz_constant}")
    m = max(1, math.ceil(1.0 / lipschitz_constant - 1e-9))
    out = [[1.0 if k == 0 else 0.0 for k in range(num_anchors)]]
    for a in range(num_anchors - 1):
        for s in range(1, m + 1):
            w = [0.0] * num_anchors
            w[a + 1] = s / m
            w[a] = 1.0 - w[a + 1]
            out.append(w)
    return out


def _anchor_names(config: DatagenConfig) -> list[tuple[str, int]]:
    """``(task name, cycle)`` for ``tasks * cycles`` in order (cycles 1-based)."""
    return [(t.name, c) for c in range(1, config.drift.cycles + 1) for t in config.tasks]


def _label(name: str, cycle: int, cycles: int) -> str:
    return name if cycles == 1 or cycle == 1 else f"{name}#c{cycle}"


def build_schedule(config: DatagenConfig) -> list[Stage]:
    """The stages of ``config`` (see the module docstring)."""
    anchors = _anchor_names(config)
    cycles = config.drift.cycles
    if config.drift.type == "piecewise":
        mixtures = [({name: 1.0}, _label(name, c, cycles)) for name, c in anchors]
    else:
        mixtures = []
        for vec in lipschitz_weights(len(anchors), float(config.drift.lipschitz_constant)):
            active = [(i, w) for i, w in enumerate(vec) if w > _EPS]
            weights: dict[str, float] = {}
            for i, w in active:
                weights[anchors[i][0]] = weights.get(anchors[i][0], 0.0) + w
            if len(active) == 1:
                label = _label(*anchors[active[0][0]], cycles)
            else:
                (ia, _), (ib, wb) = active
                label = f"{_label(*anchors[ia], cycles)}>{_label(*anchors[ib], cycles)}[{wb:.3g}]"
            mixtures.append((weights, label))
    stages = []
    for i, (weights, label) in enumerate(mixtures):
        n = sum(w * config.task(name).num_samples for name, w in weights.items())
        ratio = sum(w * config.task(name).test_ratio for name, w in weights.items())
        stages.append(Stage(i, label, weights, max(1, round(n)), ratio, derive_seed("stage", config.seed, i)))
    return stages


def allocate_sources(stage: Stage) -> list[str]:
    """The source task of each of the stage's samples: largest-remainder counts, then a seeded shuffle."""
    names = sorted(stage.weights)
    n = stage.num_samples
    exact = [stage.weights[k] * n for k in names]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(names)), key=lambda i: (-(exact[i] - counts[i]), names[i]))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    sources = [name for name, c in zip(names, counts) for _ in range(c)]
    random.Random(derive_seed("sources", stage.seed)).shuffle(sources)
    return sources


def transition_mode(a: TaskSpec, b: TaskSpec) -> str:
    """``none`` | ``prompt`` | ``preference`` | ``combined`` for the switch from task ``a`` to task ``b``."""
    prompt = a.prompt_fingerprint() != b.prompt_fingerprint()
    preference = a.preference_fingerprint() != b.preference_fingerprint()
    return {(False, False): "none", (True, False): "prompt", (False, True): "preference"}.get(
        (prompt, preference), "combined"
    )


def overall_mode(modes: set[str]) -> str:
    """The one mode of drift besides ``none`` in ``modes``, ``none`` without any, ``combined`` with several."""
    modes = modes - {"none"}
    return modes.pop() if len(modes) == 1 else ("none" if not modes else "combined")


def drift_summary(config: DatagenConfig) -> dict[str, Any]:
    """Type and modes of drift of ``config``: one mode per transition between consecutive anchors, and overall."""
    anchors = _anchor_names(config)
    cycles = config.drift.cycles
    transitions = [
        {
            "from": _label(a, ca, cycles),
            "to": _label(b, cb, cycles),
            "mode": transition_mode(config.task(a), config.task(b)),
        }
        for (a, ca), (b, cb) in zip(anchors, anchors[1:])
    ]
    return {
        "type": config.drift.type,
        "mode": overall_mode({t["mode"] for t in transitions}),
        "cycles": config.drift.cycles,
        "lipschitz_constant": config.drift.lipschitz_constant,
        "transitions": transitions,
    }
