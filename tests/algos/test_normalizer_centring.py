"""The location-aware normalizer centres every location on responses it was not fitted on (paper 003, Eq. 6).

The fixtures are real segment rewards from the simulator (``benchmarks/normalizer_centring.py``, seeds 0-2 of
``sim_compare``): the normalizer is fitted on what the simulator's segment PPO fits it on (the segment reward model's
scores of 256 feedback pairs, chosen and rejected) and applied to held-out SFT samples on the evaluation prompts. Both
engines normalize through this one function (``dense_segment_rewards``; the engine-equality tests hold them equal).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from rlhf_ext.algos.location_norm import LocationNormalizer

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "normalizer_centring"
_spec = importlib.util.spec_from_file_location("normalizer_centring", ROOT / "benchmarks" / "normalizer_centring.py")
centring = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(centring)


def _load(seed: int) -> dict:
    with gzip.open(FIXTURES / f"seed{seed}.json.gz", "rt") as f:
        return json.load(f)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_location_bucket_and_the_last_segment_are_centred_on_held_out_samples(seed):
    data = _load(seed)
    normalizer = LocationNormalizer.fit(*centring.points(data["calibration"]))
    for rows in (data["calibration"], data["held_out"]):
        means = centring.bucket_means(normalizer, rows)
        assert len(means) == 5 and all(abs(m) <= 0.2 for m in means.values()), means


def test_the_fixture_points_are_what_the_script_reads():
    """``points`` reads a response of T segments as locations 1/T .. T/T, in order, with its rewards."""
    p, r = centring.points([{"T": 2, "rewards": [0.5, -1.0]}, {"T": 1, "rewards": [2.0]}])
    assert p.tolist() == [0.5, 1.0, 1.0] and r.tolist() == [0.5, -1.0, 2.0]
