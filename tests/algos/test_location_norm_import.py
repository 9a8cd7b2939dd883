"""Paper 003's released normalizers (its public code's ``param.json``) imported as :class:`LocationNormalizer`s, and
the public code's exact fit (``method="huber"``: Mean and Std linear in ln p, Huber regression)."""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from rlhf_ext.algos.location_norm import (
    LocationNormalizer,
    NormalizerError,
    huber_objective,
    huber_regression,
    reference_location_statistics,
)
from rlhf_ext.algos.segment_dense import dense_segment_rewards
from rlhf_ext.runtime.calibration import (
    import_reference_normalizer,
    load_normalizer,
    read_reference_params,
    save_normalizer,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "denserlhf"
PARAM_JSON = FIXTURES / "param.json"
#: The fixture's entries, written out by hand from the file: (model type, cutoff key) -> [a, b, c, d]; every entry
#: is under dataset preference700k_60000, method peak, aggregation avg.
RELEASED = {
    ("rlhflow_llama_3_sft_8b_v2", "2.0"): [0.8967, 0.5680, 0.8572, 4.1667],
    ("rlhflow_llama_3_sft_8b_v2", "0"): [1.7340, 0.9906, 1.3212, 5.4513],
    ("phi3-instruct", "2.0"): [0.7209, 0.2330, 0.6055, 2.6555],
    ("phi3-instruct", "1.75"): [0.7668, 0.2569, 0.4705, 2.8339],
    ("phi3-instruct", "0"): [0.9628, 0.3796, 1.2917, 3.5006],
    ("meta_llama_3_1_instruct_8b", "2.0"): [0.8345, 0.4780, 0.8798, 3.7358],
    ("meta_llama_3_1_instruct_8b", "0"): [1.6268, 0.6254, 0.6419, 4.9217],
}
#: The one entry whose Std(p) = 0.9906 ln p + 5.4513 is <= 0 on the public PPO's locations p >= 1/1024: for
#: p <= exp(-5.4513 / 0.9906) = 0.00407441, the first segments of responses with 246 or more segments.
NONPOSITIVE = ("rlhflow_llama_3_sft_8b_v2", "0")
NONPOSITIVE_MESSAGE = (
    "param.json entry rlhflow_llama_3_sft_8b_v2/preference700k_60000/peak/avg/0: Std(p) = 0.9906 * ln(p) + 5.4513 is "
    "<= 0 for p in [0.000976562, 0.00407441], i.e. the first segments of responses with 246 or more segments (at "
    "most 1024 segments per response). Paper 003's public PPO divides by it as is (flipping the sign of those "
    "segments' normalized rewards; inf at the root); rlhf-ext does not: clamp it with std_floor (`rlhf-ext segment "
    "import-normalizer --std-floor VALUE`), or set max_segments (`--max-segments N`) to N < 246 if responses are "
    "never that long"
)
LOCATIONS = [1.0, 0.5, 1 / 3, 0.1, 0.01, 1 / 1024]


def _import(model_type: str, cutoff: float, **kwargs) -> LocationNormalizer:
    return import_reference_normalizer(PARAM_JSON, model_type, "preference700k_60000", "peak", "avg", cutoff, **kwargs)


def test_fixture_is_the_released_file():
    """The fixture is the blob named in its README (``git hash-object`` of the file)."""
    content = PARAM_JSON.read_bytes()
    blob = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
    assert blob == "e7f44acb54d8fbadb4e6f722560e55651c07bde7"
    assert blob in (FIXTURES / "README.md").read_text() and (FIXTURES / "LICENSE").is_file()


def test_read_reference_params_lists_every_entry_in_file_order():
    entries = read_reference_params(PARAM_JSON)
    assert [(e.model_type, e.cutoff) for e in entries] == list(RELEASED)
    assert {(e.dataset, e.method, e.aggregation) for e in entries} == {("preference700k_60000", "peak", "avg")}
    assert [list(e.params) for e in entries] == list(RELEASED.values())


@pytest.mark.parametrize(("model_type", "cutoff"), list(RELEASED))
def test_every_released_entry_imports_with_mean_and_std_linear_in_ln_p(model_type, cutoff):
    a, b, c, d = RELEASED[(model_type, cutoff)]
    floor = 0.5 if (model_type, cutoff) == NONPOSITIVE else None
    norm = _import(model_type, float(cutoff), std_floor=floor)
    assert (norm.kind, norm.basis, norm.method, norm.std_link) == ("regression", "log", "huber", "identity")
    assert norm.source == f"param.json entry {model_type}/preference700k_60000/peak/avg/{cutoff}"
    p = torch.tensor(LOCATIONS)
    expected_mean = torch.tensor([a * math.log(q) + c for q in LOCATIONS])
    expected_std = torch.tensor([max(b * math.log(q) + d, floor or -math.inf) for q in LOCATIONS])
    torch.testing.assert_close(norm.mean(p), expected_mean)
    torch.testing.assert_close(norm.std(p), expected_std)
    assert norm.mean(torch.tensor(1.0)).item() == pytest.approx(c) and norm.std(torch.tensor(1.0)).item() == (
        pytest.approx(d)
    )


def test_mean_and_std_equal_hand_computed_values():
    """phi3-instruct, cutoff 1.75, [0.7668, 0.2569, 0.4705, 2.8339] at p = 0.5 (ln 0.5 = -0.6931472):
    Mean = -0.5315053 + 0.4705 = -0.0610053, Std = -0.1780695 + 2.8339 = 2.6558305."""
    norm = _import("phi3-instruct", 1.75)
    assert norm.mean(torch.tensor(0.5)).item() == pytest.approx(-0.0610053, abs=1e-6)
    assert norm.std(torch.tensor(0.5)).item() == pytest.approx(2.6558305, abs=1e-6)
    rewards = torch.tensor([[1.0, 2.0, 0.0]])
    positions = torch.tensor([[0.5, 1.0, 0.0]])  # the last column is padding
    out = norm.normalize(rewards, positions)
    torch.testing.assert_close(out, torch.tensor([[(1.0 + 0.0610053) / 2.6558305, (2.0 - 0.4705) / 2.8339, 0.0]]))


def test_imported_normalizer_drives_dense_segment_rewards():
    """Segment rewards normalized in the dense-reward path equal ``(r - (a ln p + c)) / (b ln p + d)`` by hand."""
    a, b, c, d = RELEASED[("meta_llama_3_1_instruct_8b", "2.0")]
    norm = _import("meta_llama_3_1_instruct_8b", 2)
    mask = torch.tensor([[False, True, True, True, True]])
    entropy = torch.tensor([[0.0, 0.0, 3.0, 0.0, 0.0]])  # token 2 starts a segment: segments {1}, {2, 3, 4}
    scores = torch.tensor([[0.0, 1.5, 0.0, 0.0, -0.5]])
    out = dense_segment_rewards(scores, mask, entropy, normalizer=norm, entropy_cutoff=2.0, interpolation="segment_end")
    expected = [(1.5 - (a * math.log(0.5) + c)) / (b * math.log(0.5) + d), (-0.5 - c) / d]
    torch.testing.assert_close(out.seg_rewards[0, :2], torch.tensor(expected))


def test_nonpositive_std_entry_is_refused_with_its_p_range():
    a, b, c, d = RELEASED[NONPOSITIVE]
    # what the public PPO would divide by at the first segment of a 1024-segment response (p = 1/1024)
    assert b * math.log(1 / 1024) + d == pytest.approx(-1.41501, abs=1e-5)
    with pytest.raises(NormalizerError) as refused:
        _import(*NONPOSITIVE[:1], 0)
    assert str(refused.value) == NONPOSITIVE_MESSAGE
    assert math.exp(-d / b) == pytest.approx(0.00407441, abs=1e-8) and 1 / 246 < math.exp(-d / b) < 1 / 245


def test_nonpositive_std_entry_with_std_floor_clamps_exactly_there():
    norm = _import("rlhflow_llama_3_sft_8b_v2", 0, std_floor=0.5)
    assert norm.std_floor == 0.5
    # line: 0.9906 ln p + 5.4513 = -1.41501 (p = 1/1024), 0.20271 (p = 0.005), 0.889 (p = 0.01), 5.4513 (p = 1)
    torch.testing.assert_close(
        norm.std(torch.tensor([1 / 1024, 0.005, 0.01, 1.0])),
        torch.tensor([0.5, 0.5, 0.9906 * math.log(0.01) + 5.4513, 5.4513]),
    )


def test_nonpositive_std_entry_imports_for_short_responses_and_refuses_longer_ones_at_run_time():
    _import("rlhflow_llama_3_sft_8b_v2", 0, max_segments=245)  # p >= 1/245 > 0.00407441: Std > 0 throughout
    with pytest.raises(NormalizerError, match=r"with 246 or more segments \(at most 246 segments per response\)"):
        _import("rlhflow_llama_3_sft_8b_v2", 0, max_segments=246)
    norm = _import("rlhflow_llama_3_sft_8b_v2", 0, max_segments=245)
    positions = torch.tensor([[1 / 300, 2 / 300, 1.0]])
    with pytest.raises(NormalizerError, match=r"is <= 0 for p in \[0.00333333, 0.00407441\]"):
        norm.normalize(torch.zeros(1, 3), positions)
    ok = norm.normalize(torch.zeros(1, 3), torch.tensor([[1 / 245, 0.0, 0.0]]))  # padding is never evaluated
    assert torch.isfinite(ok).all()


def test_imported_normalizer_round_trips_and_keeps_its_reward_model(tmp_path):
    norm = _import("rlhflow_llama_3_sft_8b_v2", 0, std_floor=0.25, reward_model="yyqoni/rm-token")
    path = tmp_path / "normalizer.json"
    save_normalizer(norm, path)
    loaded = load_normalizer(path, reward_model="yyqoni/rm-token")
    assert loaded == norm
    torch.testing.assert_close(loaded.std(torch.tensor([0.001])), torch.tensor([0.25]))
    with pytest.raises(NormalizerError, match="fitted for reward model 'yyqoni/rm-token', not 'other'"):
        load_normalizer(path, reward_model="other")


def test_a_normalizer_file_from_before_std_links_still_loads_as_log_std():
    old = {"format": "rlhf_ext.LocationNormalizer/1", "kind": "global", "basis": "linear", "w_mu": 0.0,
           "b_mu": 1.0, "w_sigma": 0.0, "b_sigma": math.log(2.0), "num_points": 5, "num_locations": 3,
           "r2_mean": None, "r2_log_std": None, "reward_model": None, "fallback": None}  # fmt: skip
    norm = LocationNormalizer.from_dict(old)
    assert (norm.method, norm.std_link, norm.std_floor) == ("ols", "log", None)
    assert norm.std(torch.tensor(0.3)).item() == pytest.approx(2.0)


def test_missing_entry_and_malformed_files_are_errors(tmp_path):
    missing = r"has no entry phi3-instruct/preference700k_60000/peak/avg/3; its entries .*: rlhflow_llama_3_sft_8b_v2/"
    with pytest.raises(NormalizerError, match=missing):
        _import("phi3-instruct", 3)
    bad = tmp_path / "param.json"
    bad.write_text(json.dumps({"m": {"d": {"peak": {"avg": {"2.0": [1.0, 2.0, 3.0]}}}}}))
    with pytest.raises(NormalizerError, match=r"param.json entry m/d/peak/avg/2.0 must be four finite numbers"):
        import_reference_normalizer(bad, "m", "d", "peak", "avg", 2)
    bad.write_text(json.dumps({"m": {"d": {"peak": {"avg": [1.0, 2.0, 3.0, 4.0]}}}}))
    with pytest.raises(NormalizerError, match=r"m/d/peak/avg must map cutoff keys to entries"):
        read_reference_params(bad)
    bad.write_text(json.dumps({"m": {"d": {"peak": {"avg": {"high": [1.0, 2.0, 3.0, 4.0]}}}}}))
    with pytest.raises(NormalizerError, match=r"cutoff key 'high' of m/d/peak/avg is not a number"):
        read_reference_params(bad)


# ------------------------------------------------------------------------------------------------- CLI
def test_cli_imports_an_entry_and_reports_the_nonpositive_one(tmp_path):
    from rlhf_ext.cli import main

    keys = ["--dataset", "preference700k_60000", "--method", "peak", "--aggregation", "avg"]
    out = tmp_path / "norm.json"
    result = CliRunner().invoke(
        main, ["segment", "import-normalizer", str(PARAM_JSON), "--model-type", "phi3-instruct", *keys, "--cutoff",
               "1.75", "-o", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "Std(p)  = 0.2569 * ln(p) + 2.8339" in result.output
    assert load_normalizer(out) == _import("phi3-instruct", 1.75)

    refused = CliRunner().invoke(
        main, ["segment", "import-normalizer", str(PARAM_JSON), "--model-type", "rlhflow_llama_3_sft_8b_v2", *keys,
               "--cutoff", "0", "-o", str(out)],
    )  # fmt: skip
    assert refused.exit_code == 2
    assert refused.stderr == f"error: {NONPOSITIVE_MESSAGE}\n"

    clamped = CliRunner().invoke(
        main, ["segment", "import-normalizer", str(PARAM_JSON), "--model-type", "rlhflow_llama_3_sft_8b_v2", *keys,
               "--cutoff", "0", "-o", str(out), "--std-floor", "0.5"],
    )  # fmt: skip
    assert clamped.exit_code == 0, clamped.output
    assert "Std(p)  = 0.9906 * ln(p) + 5.4513, clamped at >= 0.5" in clamped.output
    assert load_normalizer(out).std_floor == 0.5


# ------------------------------------------------------------------------------------------ the exact fit
def _random_regression(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Heavy-tailed noise around a line in ln p (a D_norm with outliers)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(30, 300))
    x = np.log(rng.uniform(1e-3, 1.0, n))
    return x, 0.9 * x + 0.8 + 0.3 * rng.standard_t(2, n)


def test_huber_regression_is_the_minimum_of_the_documented_objective():
    """No reference library needed: the gradient of the Huber objective vanishes at the fit, and nudging any
    parameter raises the objective."""
    x, y = (torch.from_numpy(v) for v in _random_regression(0))
    fit = huber_regression(x, y)
    params = torch.tensor([fit.w, fit.b, fit.scale], dtype=torch.float64, requires_grad=True)
    loss = huber_objective(params[0], params[1], params[2], x, y)
    (grad,) = torch.autograd.grad(loss, params)
    assert grad.abs().max().item() < 1e-6
    for i in range(3):
        for step in (-1e-3, 1e-3):
            nudged = params.detach().clone()
            nudged[i] += step
            assert huber_objective(nudged[0], nudged[1], nudged[2], x, y).item() > loss.item()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_huber_regression_matches_sklearn(seed):
    sklearn_linear = pytest.importorskip("sklearn.linear_model")
    x, y = _random_regression(seed)
    reference = sklearn_linear.HuberRegressor(epsilon=1.35).fit(x.reshape(-1, 1), y)
    fit = huber_regression(torch.from_numpy(x), torch.from_numpy(y))
    # scikit-learn stops L-BFGS-B at a gradient of ~1e-4 (tol 1e-5); the parameters agree to 1e-5
    assert fit.w == pytest.approx(reference.coef_[0], abs=1e-5)
    assert fit.b == pytest.approx(reference.intercept_, abs=1e-5)
    assert fit.scale == pytest.approx(reference.scale_, abs=1e-5)
    ours = huber_objective(*(torch.tensor(v, dtype=torch.float64) for v in (fit.w, fit.b, fit.scale)),
                           torch.from_numpy(x), torch.from_numpy(y))  # fmt: skip
    theirs = huber_objective(*(torch.tensor(float(v), dtype=torch.float64) for v in
                               (reference.coef_[0], reference.intercept_, reference.scale_)),
                             torch.from_numpy(x), torch.from_numpy(y))  # fmt: skip
    assert ours.item() <= theirs.item() + 1e-9


def test_reference_location_statistics_bucket_to_three_decimals_with_population_std():
    """f"{p:.3f}" keys: 1/16 = 0.0625 -> "0.062" (round half to even), 0.0624 -> "0.062", 3/16 = 0.1875 ->
    "0.188"; per key the mean and the population std; a key seen once has std 0."""
    positions = torch.tensor([1 / 16, 0.0624, 3 / 16, 1.0, 1.0, 1.0], dtype=torch.float64)
    rewards = torch.tensor([1.0, 3.0, 5.0, 0.0, 3.0, 6.0], dtype=torch.float64)
    locations, means, stds = reference_location_statistics(positions, rewards)
    assert locations.dtype == torch.float64 and locations.tolist() == [0.062, 0.188, 1.0]  # the keys' floats
    torch.testing.assert_close(means, torch.tensor([2.0, 5.0, 3.0], dtype=torch.float64))
    torch.testing.assert_close(stds, torch.tensor([1.0, 0.0, math.sqrt(6.0)], dtype=torch.float64))


def _calibration_from_released_entry(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibration pairs whose D_norm lies on the released rlhflow/2.0 lines up to noise 0.02, with outliers of +-3
    (mean) and +-0.2 (std) at every 10th location: each location 0.001, 0.004, ... holds two rewards m +- s, so its
    mean is m and its population std s."""
    a, b, c, d = RELEASED[("rlhflow_llama_3_sft_8b_v2", "2.0")]
    g = torch.Generator().manual_seed(seed)
    p = torch.arange(1, 1001, 3, dtype=torch.float64) / 1000
    noise = 0.02 * torch.randn(2, p.numel(), generator=g, dtype=torch.float64)
    outlier = torch.zeros(p.numel(), dtype=torch.float64)
    outlier[::20], outlier[10::20] = 1.0, -1.0
    m = a * p.log() + c + noise[0] + 3.0 * outlier
    s = b * p.log() + d + noise[1] + 0.2 * outlier
    return torch.cat([p, p]), torch.cat([m - s, m + s])


def test_huber_fit_recovers_released_parameters_exactly_from_noise_free_data():
    """Every location holds m +- s with m, s on the released rlhflow/2.0 lines: the fit returns them (up to the
    reference's log(p + 1e-10), which moves ln p by at most 1e-7 at p >= 0.001)."""
    a, b, c, d = RELEASED[("rlhflow_llama_3_sft_8b_v2", "2.0")]
    p = torch.arange(1, 1001, 3, dtype=torch.float64) / 1000
    m, s = a * p.log() + c, b * p.log() + d
    norm = LocationNormalizer.fit(torch.cat([p, p]), torch.cat([m - s, m + s]), method="huber")
    assert [norm.w_mu, norm.w_sigma, norm.b_mu, norm.b_sigma] == pytest.approx([a, b, c, d], abs=1e-7)
    assert norm.r2_mean == pytest.approx(1.0) and norm.r2_std == pytest.approx(1.0)


def test_huber_fit_recovers_released_parameters_from_synthetic_calibration_data():
    a, b, c, d = RELEASED[("rlhflow_llama_3_sft_8b_v2", "2.0")]
    positions, rewards = _calibration_from_released_entry(seed=0)
    norm = LocationNormalizer.fit(positions, rewards, method="huber")
    assert (norm.basis, norm.std_link, norm.num_locations) == ("log", "identity", 334)
    # the noise (sd 0.02 over 334 locations) leaves a standard error of ~0.002 per parameter
    assert norm.w_mu == pytest.approx(a, abs=0.01) and norm.b_mu == pytest.approx(c, abs=0.01)
    assert norm.w_sigma == pytest.approx(b, abs=0.01) and norm.b_sigma == pytest.approx(d, abs=0.01)


def test_huber_fit_equals_the_public_pipeline_with_sklearn():
    """The public code: D_norm keyed by f"{p:.3f}" with numpy mean / std, then ``HuberRegressor(epsilon=1.35)`` on
    ``log(p + 1e-10)`` for the means and for the stds. 20 responses of 100..300 segments: ~4 rewards per key, so
    some keys are seen once (std 0) and kept."""
    sklearn_linear = pytest.importorskip("sklearn.linear_model")
    a, b, c, d = RELEASED[("phi3-instruct", "1.75")]
    g = torch.Generator().manual_seed(3)
    positions, rewards = [], []
    for total in torch.randint(100, 301, (20,), generator=g).tolist():
        p = torch.arange(1, total + 1, dtype=torch.float64) / total
        positions.append(p)
        rewards.append(a * p.log() + c + (b * p.log() + d) * torch.randn(total, generator=g, dtype=torch.float64))
    positions, rewards = torch.cat(positions), torch.cat(rewards)

    groups: dict[str, list[float]] = defaultdict(list)
    for p, r in zip(positions.tolist(), rewards.tolist(), strict=True):
        groups[f"{p:.3f}"].append(r)
    keys = sorted(groups, key=float)
    x = np.log(np.array([float(k) for k in keys]).reshape(-1, 1) + 1e-10)
    mean_ref = sklearn_linear.HuberRegressor(epsilon=1.35).fit(x, np.array([np.mean(groups[k]) for k in keys]))
    std_ref = sklearn_linear.HuberRegressor(epsilon=1.35).fit(x, np.array([np.std(groups[k]) for k in keys]))
    assert sum(len(groups[k]) == 1 for k in keys) > 0

    norm = LocationNormalizer.fit(positions, rewards, method="huber")
    assert norm.num_locations == len(keys)
    assert norm.w_mu == pytest.approx(mean_ref.coef_[0], abs=1e-5)
    assert norm.b_mu == pytest.approx(mean_ref.intercept_, abs=1e-5)
    assert norm.w_sigma == pytest.approx(std_ref.coef_[0], abs=1e-5)
    assert norm.b_sigma == pytest.approx(std_ref.intercept_, abs=1e-5)


def test_ols_log_basis_is_not_the_public_fit():
    """``basis="log"`` alone fits log Std by least squares (rlhf-ext's variant); only ``method="huber"`` fits Std."""
    positions, rewards = _calibration_from_released_entry(seed=0)
    ols = LocationNormalizer.fit(positions, rewards, basis="log")
    assert (ols.method, ols.std_link) == ("ols", "log")
    with pytest.raises(ValueError, match="std_floor applies to method='huber'"):
        LocationNormalizer.fit(positions, rewards, basis="log", std_floor=0.1)


def test_huber_fit_with_nonpositive_std_on_its_own_locations_warns():
    """Released rlhflow/0 lines, locations down to 0.001: the fitted Std crosses zero near 0.0041."""
    a, b, c, d = RELEASED[NONPOSITIVE]
    p = torch.arange(1, 1001, dtype=torch.float64) / 1000
    s = (b * p.log() + d).clamp_min(0.0)
    m = a * p.log() + c
    with pytest.warns(UserWarning, match=r"Std\(p\) = 0.99\d* \* ln\(p\) \+ 5.45\d* is <= 0 for p in \[0.001, "):
        norm = LocationNormalizer.fit(torch.cat([p, p]), torch.cat([m - s, m + s]), method="huber")
    assert norm.nonpositive_std_locations(0.001) is not None
