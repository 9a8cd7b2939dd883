"""Drift schedules: piecewise boundaries, Lipschitz weights (property tests), source allocation, modes of drift."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_ext.datagen import allocate_sources, build_schedule, drift_summary, lipschitz_weights, load_task_config
from rlhf_ext.datagen.drift import Stage


def config(n_tasks=3, drift=None, counts=None, domains=None, prefs=None):
    tasks = []
    for i in range(n_tasks):
        tasks.append(
            {
                "name": f"t{i}",
                "objective": "Ask a question.",
                "preference": (prefs or ["Explain like I'm five."] * n_tasks)[i],
                "domain": {(domains or ["d"] * n_tasks)[i]: {"seed_words": ["x", "y"]}},
                "num_samples": (counts or [10] * n_tasks)[i],
                "test_ratio": 0.1 * (i % 3),
            }
        )
    return load_task_config({"name": "c", "tasks": tasks, "drift": drift or {}})


def test_piecewise_boundaries_land_where_configured():
    cfg = config(3, {"type": "piecewise", "cycles": 2}, counts=[10, 20, 5])
    stages = build_schedule(cfg)
    assert [s.name for s in stages] == ["t0", "t1", "t2", "t0#c2", "t1#c2", "t2#c2"]
    assert [s.weights for s in stages] == [{"t0": 1.0}, {"t1": 1.0}, {"t2": 1.0}] * 2
    assert [s.num_samples for s in stages] == [10, 20, 5] * 2
    assert [s.test_ratio for s in stages] == [0.0, 0.1, 0.2] * 2
    assert len({s.seed for s in stages}) == 6  # a repeated task draws new samples in every cycle
    assert [s.dirname for s in stages][3] == "003-t0_c2"
    for s in stages:
        assert allocate_sources(s) == [next(iter(s.weights))] * s.num_samples


def test_lipschitz_schedule_example():
    stages = build_schedule(config(3, {"type": "lipschitz", "lipschitz_constant": 0.3}, counts=[10, 20, 40]))
    # ceil(1 / 0.3) = 4 steps per transition
    assert [round(s.weights.get("t1", 0.0), 4) for s in stages] == [0, 0.25, 0.5, 0.75, 1, 0.75, 0.5, 0.25, 0]
    assert stages[2].name == "t0>t1[0.5]" and stages[2].num_samples == 15
    assert stages[6].weights == pytest.approx({"t1": 0.5, "t2": 0.5}) and stages[6].num_samples == 30
    assert stages[4].weights == {"t1": 1.0} and stages[4].name == "t1"


@settings(max_examples=200, deadline=None)
@given(k=st.integers(1, 7), c=st.floats(0.01, 1.0))
def test_lipschitz_weights_never_move_by_more_than_c(k, c):
    ws = lipschitz_weights(k, c)
    m = math.ceil(1 / c - 1e-9)
    assert len(ws) == 1 + (k - 1) * m
    for w in ws:
        assert all(x >= 0 for x in w) and sum(w) == pytest.approx(1.0)
        assert sum(x > 0 for x in w) <= 2  # only consecutive tasks are blended
    for a, b in zip(ws, ws[1:]):
        assert max(abs(x - y) for x, y in zip(a, b)) <= c + 1e-12
    pure = [w.index(1.0) for w in ws if 1.0 in w]
    assert pure == list(range(k))  # every task appears pure once, in order
    assert ws[0][0] == 1.0 and ws[-1][-1] == 1.0


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 4),
    c=st.floats(0.05, 1.0),
    cycles=st.integers(1, 3),
    counts=st.lists(st.integers(1, 60), min_size=4, max_size=4),
)
def test_lipschitz_stage_mixtures_move_by_at_most_c_per_step(k, c, cycles, counts):
    cfg = config(k, {"type": "lipschitz", "lipschitz_constant": c, "cycles": cycles}, counts=counts[:k])
    stages = build_schedule(cfg)
    names = [t.name for t in cfg.tasks]
    for a, b in zip(stages, stages[1:]):
        assert max(abs(a.weights.get(n, 0.0) - b.weights.get(n, 0.0)) for n in names) <= c + 1e-12
    for s in stages:
        sources = allocate_sources(s)
        assert len(sources) == s.num_samples
        for n in names:  # the realised mixture is the configured one up to rounding
            assert abs(sources.count(n) - s.weights.get(n, 0.0) * s.num_samples) < 1.0


@settings(max_examples=100, deadline=None)
@given(
    weights=st.lists(st.floats(0.01, 1.0), min_size=1, max_size=5),
    n=st.integers(1, 300),
    seed=st.integers(0, 2**31 - 1),
)
def test_allocation_matches_weights_and_is_deterministic(weights, n, seed):
    total = sum(weights)
    stage = Stage(0, "s", {f"t{i}": w / total for i, w in enumerate(weights)}, n, 0.0, seed)
    sources = allocate_sources(stage)
    assert sources == allocate_sources(stage)
    assert len(sources) == n
    for name, w in stage.weights.items():
        assert abs(sources.count(name) - w * n) < 1.0


def test_modes_of_drift_follow_the_changed_components():
    same = config(2)
    assert drift_summary(same)["mode"] == "none"
    prompt = config(2, domains=["bio", "history"])
    assert drift_summary(prompt)["mode"] == "prompt"
    pref = config(2, prefs=["Explain like I'm five.", "Explain at an expert level."])
    assert drift_summary(pref)["mode"] == "preference"
    both = config(2, domains=["bio", "history"], prefs=["Explain like I'm five.", "Explain at an expert level."])
    assert drift_summary(both)["transitions"][0]["mode"] == "combined"
    mixed = config(3, domains=["bio", "history", "history"], prefs=["Be brief."] * 2 + ["Be formal."])
    summary = drift_summary(mixed)
    assert [t["mode"] for t in summary["transitions"]] == ["prompt", "preference"]
    assert summary["mode"] == "combined"
    cyc = config(2, {"type": "piecewise", "cycles": 2}, prefs=["A.", "B."])
    assert [(t["from"], t["to"]) for t in drift_summary(cyc)["transitions"]] == [
        ("t0", "t1"),
        ("t1", "t0#c2"),
        ("t0#c2", "t1#c2"),
    ]
