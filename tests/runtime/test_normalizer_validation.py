"""Issue 23 item 10: every normalizer is validated on load, on both engines (both read it with
``rlhf_ext.runtime.calibration.load_normalizer``): an infinite std trained segment PPO on all-zero rewards and exited
0, NaN was found only later in sampling, a string ``w_sigma`` was a traceback."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from rlhf_ext.algos.location_norm import LocationNormalizer, NormalizerError
from rlhf_ext.runtime.calibration import load_normalizer, save_normalizer


@pytest.mark.parametrize(
    "fields, problem",
    [
        ('"b_sigma": Infinity', "normalizer b_sigma must be a finite number; got inf"),
        ('"w_mu": NaN', "normalizer w_mu must be a finite number; got nan"),
        ('"w_sigma": "abc"', "normalizer w_sigma must be a finite number; got 'abc'"),
        ('"num_points": -3', "normalizer num_points must be an integer >= 0; got -3"),
        ('"b_sigma": 1000000.0', "normalizer Mean(p) = 0 or Std(p) (line 1e+06, log link) overflows float32 at "
                                 "p = 0.000976562: every normalized reward would be 0 or NaN; refit it"),
    ],
)  # fmt: skip
def test_a_poisoned_normalizer_file_is_refused_on_load_naming_the_file_and_field(fields, problem, tmp_path):
    path = tmp_path / "normalizer.json"
    path.write_text('{"format": "rlhf_ext.LocationNormalizer/1", "kind": "global", ' + fields + "}")
    with pytest.raises(NormalizerError) as info:
        load_normalizer(path)
    assert str(info.value) == f"{path}: {problem}"


def test_a_fitted_normalizer_round_trips(tmp_path):
    g = torch.Generator().manual_seed(0)
    p = torch.randint(1, 9, (400,), generator=g) / 8.0
    norm = LocationNormalizer.fit(p, 2 * p + 0.1 * torch.randn(400, generator=g), kind="regression")
    save_normalizer(norm, tmp_path / "n.json")
    assert load_normalizer(tmp_path / "n.json") == norm


def test_segment_ppo_refuses_a_poisoned_normalizer_before_loading_a_model(tmp_path):
    from rlhf_ext.cli import main

    path = tmp_path / "normalizer.json"
    path.write_text(json.dumps({"kind": "global", "b_sigma": float("inf")}))
    out = tmp_path / "ppo"
    args = ["train", "segment-ppo", "--config", "segment_ppo_tiny", f"model.normalizer={path}",
            f"train.output_dir={out}", f"model.sft_model={tmp_path / 'missing-sft'}"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [f"error: {path}: normalizer b_sigma must be a finite number; got inf"]
    assert not out.exists()
