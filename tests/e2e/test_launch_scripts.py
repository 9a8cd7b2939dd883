"""The launch scripts as users run them: python, and torchrun with two CPU processes (DDP over gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def test_train_segment_rm_script_runs(tmp_path, tiny_sft_path):
    out = tmp_path / "rm"
    cmd = [sys.executable, str(ROOT / "launch" / "train_segment_rm.py"), "--config", "segment_rm_tiny",
           f"train.output_dir={out}", "data.max_train_samples=64", "data.max_eval_samples=16"]  # fmt: skip
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "segment reward model trained" in proc.stdout
    assert json.loads((out / "metrics.json").read_text())["engine"] == "trl"


def test_train_segment_rm_script_reports_bad_recipe(tmp_path):
    cmd = [sys.executable, str(ROOT / "launch" / "train_segment_rm.py"), "--config", "segment_rm_tiny", "train.lr=1"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown key 'train.lr'" in proc.stderr


@pytest.mark.slow
def test_train_segment_ppo_under_torchrun_two_processes(tmp_path, tiny_sft_path, cache_dir):
    """Segment PPO with a critic under DDP (2 CPU processes, gloo): both ranks step, rank 0 writes the results."""
    from rlhf_ext.pipelines.builtins import resolve_model

    resolve_model("builtin:tiny-segment-rm", cache_dir)  # build once, outside the two ranks
    out = tmp_path / "ppo"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           str(ROOT / "launch" / "train_segment_ppo.py"), "--config", "segment_ppo_tiny", f"train.output_dir={out}",
           "train.max_steps=2", "train.micro_batch_size=8", "data.max_calibration_pairs=64"]  # fmt: skip
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("segment PPO finished") == 1  # only rank 0 reports
    metrics = json.loads((out / "ppo_metrics.json").read_text())
    assert [row["step"] for row in metrics["curve"]] == [1, 2]
    assert (out / "critic" / "config.json").exists() and (out / "normalizer.json").exists()
