"""The main job end to end at a small size: every stage runs, writes its outputs, and a rerun reuses them."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from rlhf_ext.cli import main

SMALL = [
    "data.num_samples=120", "data.eval_prompts=8", "model.hidden_size=32", "train.sft.num_train_epochs=2",
    "train.reward_model.num_train_epochs=1",
    "train.ppo.max_steps=2", "train.ppo.batch_size=8", "train.ppo.micro_batch_size=8",
    "data.max_completion_length=48",
]  # fmt: skip


def test_demo_pipeline_end_to_end_and_resume(tmp_path, cache_dir):
    out = tmp_path / "demo"
    first = CliRunner().invoke(main, ["demo", "--out", str(out), *SMALL])
    assert first.exit_code == 0, first.output
    assert "demo finished" in first.output and "win rate PPO vs SFT" in first.output
    metrics = json.loads((out / "metrics.json").read_text())
    # the reported win rate and its standard error are those of the eval stage's 8 pool judgements (binary, no
    # ties): p = wins / n and se = std(outcomes, unbiased) / sqrt(n) = sqrt(p (1 - p) / (n - 1))
    ev = json.loads((out / "stages" / "eval.json").read_text())["ppo_vs_sft"]
    assert metrics["comparisons"] == ev["num_comparisons"] == 8
    assert ev["ties"] == 0 and ev["wins"] + ev["losses"] == 8
    win = ev["wins"] / 8
    assert metrics["win_rate_ppo_vs_sft"] == pytest.approx(win, abs=1e-12)
    assert metrics["win_rate_stderr"] == pytest.approx(math.sqrt(win * (1 - win) / 7), abs=1e-9)
    assert len(metrics["ppo_curve"]) == 2 and metrics["normalizer"]["kind"] == "regression"
    assert 0.5 < metrics["annotator_label_agreement"] < 0.95  # 25% flips plus annotator disagreement
    from datasets import load_from_disk

    labels = load_from_disk(str(out / "labels"))  # the labelled pairs: `sim_swapped` where the pool's label differs
    assert metrics["annotator_label_agreement"] == pytest.approx(1 - sum(labels["sim_swapped"]) / len(labels))
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and html.count('class="seg"') >= 4
    stages = sorted(p.stem for p in (out / "stages").glob("*.json"))
    assert stages == sorted(["data", "sft", "labels", "rm", "normalizer", "ppo", "eval", "report"])

    second = CliRunner().invoke(main, ["demo", "--out", str(out), *SMALL])
    assert second.exit_code == 0, second.output
    assert second.output.count("reusing") == 8  # nothing is recomputed
    assert json.loads((out / "metrics.json").read_text()) == metrics
