"""The launch modules as users run them: ``python -m rlhf_ext.launch.*``, the repository's ``launch/*.py`` wrappers,
``deepspeed --module`` (which appends ``--local_rank``), ``accelerate launch -m``, and torchrun with two CPU processes
(DDP over gloo)."""

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


def test_train_segment_rm_module_runs(tmp_path, tiny_sft_path):
    out = tmp_path / "rm"
    cmd = [sys.executable, "-m", "rlhf_ext.launch.train_segment_rm", "--config", "segment_rm_tiny",
           f"train.output_dir={out}", "data.max_train_samples=64", "data.max_eval_samples=16"]  # fmt: skip
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "segment reward model trained" in proc.stdout
    assert json.loads((out / "metrics.json").read_text())["engine"] == "trl"


BAD_RECIPE = ["--config", "segment_rm_tiny", "train.lr=1"]


@pytest.mark.parametrize(
    "launcher",
    [
        [sys.executable, str(ROOT / "launch" / "train_segment_rm.py")],  # the repository's thin wrapper
        [sys.executable, "-m", "rlhf_ext.launch.train_segment_rm", "--local_rank=0"],  # what deepspeed appends
    ],
    ids=["repo-wrapper", "module-with-local-rank"],
)
def test_launch_reports_bad_recipe_in_one_line(tmp_path, launcher):
    proc = subprocess.run([*launcher, *BAD_RECIPE], env=_env(), capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "unknown key 'train.lr'" in proc.stderr and "Traceback" not in proc.stderr


def _launcher_bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


@pytest.mark.parametrize(
    "launcher",
    [
        [_launcher_bin("deepspeed"), "--num_accelerators", "1", "--module"],
        [_launcher_bin("accelerate"), "launch", "--cpu", "--num_processes", "1", "-m"],
    ],
    ids=["deepspeed", "accelerate"],
)
def test_launchers_start_the_module(tmp_path, launcher):
    """The real launchers start ``rlhf_ext.launch.train_segment_rm`` and its recipe check runs inside (deepspeed
    passes ``--local_rank=0``, which the module drops instead of failing with "No such option")."""
    proc = subprocess.run([*launcher, "rlhf_ext.launch.train_segment_rm", *BAD_RECIPE], env=_env(),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert proc.returncode != 0
    assert "unknown key 'train.lr'" in proc.stdout + proc.stderr
    assert "No such option" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_train_segment_ppo_under_torchrun_two_processes(tmp_path, tiny_sft_path, cache_dir):
    """Segment PPO with a critic under DDP (2 CPU processes, gloo): both ranks step, rank 0 writes the results. The
    recipe's micro batch (16) is fitted to the two processes (8 each), as README's line runs it: it used to exit 1
    ("train.batch_size (16) must be a multiple of micro_batch_size x processes (16 x 2)", printed twice)."""
    from rlhf_ext.pipelines.builtins import resolve_model

    resolve_model("builtin:tiny-segment-rm", cache_dir)  # build once, outside the two ranks
    out = tmp_path / "ppo"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "-m", "rlhf_ext.launch.train_segment_ppo", "--config", "segment_ppo_tiny", f"train.output_dir={out}",
           "train.max_steps=2", "data.max_calibration_pairs=64"]  # fmt: skip
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("using micro batch 8 per process") == 1  # one notice, from rank 0
    assert proc.stdout.count("segment PPO finished") == 1  # only rank 0 reports
    metrics = json.loads((out / "ppo_metrics.json").read_text())
    assert [row["step"] for row in metrics["curve"]] == [1, 2]
    assert (out / "critic" / "config.json").exists() and (out / "normalizer.json").exists()
