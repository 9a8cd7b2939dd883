"""The main job end to end at a small size: every stage runs, writes its outputs, and a rerun reuses them."""

from __future__ import annotations

import json

from click.testing import CliRunner

from rlhf_ext.cli import main

SMALL = [
    "data.num_samples=120", "data.eval_prompts=8", "model.hidden_size=32", "model.sft_epochs=2",
    "training.rm_epochs=1", "training.ppo_steps=2", "training.ppo_batch_size=8", "training.max_completion_length=48",
]  # fmt: skip


def test_demo_pipeline_end_to_end_and_resume(tmp_path, cache_dir):
    out = tmp_path / "demo"
    first = CliRunner().invoke(main, ["demo", "--out", str(out), *SMALL])
    assert first.exit_code == 0, first.output
    assert "demo finished" in first.output and "win rate PPO vs SFT" in first.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0.0 <= metrics["win_rate_ppo_vs_sft"] <= 1.0 and metrics["comparisons"] == 8
    assert len(metrics["ppo_curve"]) == 2 and metrics["normalizer"]["kind"] == "regression"
    assert 0.5 < metrics["annotator_label_agreement"] < 0.95  # 25% flips plus annotator disagreement
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and html.count('class="seg"') >= 4
    stages = sorted(p.stem for p in (out / "stages").glob("*.json"))
    assert stages == sorted(["data", "sft", "labels", "rm", "normalizer", "ppo", "eval", "report"])

    second = CliRunner().invoke(main, ["demo", "--out", str(out), *SMALL])
    assert second.exit_code == 0, second.output
    assert second.output.count("reusing") == 8  # nothing is recomputed
    assert json.loads((out / "metrics.json").read_text()) == metrics
