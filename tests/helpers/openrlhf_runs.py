"""Run ``python -m rlhf_ext.openrlhf.train_ppo_ray`` in a fresh process and read OpenRLHF's per-step metrics.

Shared by the end-to-end tests and ``benchmarks/openrlhf_ppo.py``. The metrics are the dicts OpenRLHF's trainer logs
as ``Global step N: {...}`` (rewards, losses, ``timing/*``).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path

STEP_LINE = re.compile(r"Global step (\d+): (\{.*\})")


def toy_prompts_file(root: Path) -> str:
    """``root/prompts.jsonl``: the 8 training prompts of the toy preference task (``{"prompt": ...}`` per line)."""
    import json

    from rlhf_ext.zoo.toy import toy_preference_dataset

    path = Path(root) / "prompts.jsonl"
    data = toy_preference_dataset(n_train=8, n_test=4, seed=0)["train"]
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in data["prompt"]))
    return str(path)


def tiny_ppo_argv(sft: str, rm: str, prompts: str, out_dir: Path, episodes: int = 2) -> list[str]:
    """OpenRLHF flags for a tiny CPU run: 8 prompts per step, 24 new tokens, one Ray actor per role."""
    return [
        "--actor.model_name_or_path", sft, "--reward.model_name_or_path", rm,
        "--data.prompt_dataset", prompts, "--data.input_key", "prompt", "--data.max_len", "96",
        "--rollout.max_new_tokens", "24", "--rollout.batch_size", "8", "--rollout.micro_batch_size", "4",
        "--train.batch_size", "8", "--train.micro_batch_size", "4", "--train.max_epochs", "1",
        "--train.num_episodes", str(episodes), "--train.seed", "7",
        "--actor.num_gpus_per_node", "1", "--ref.num_gpus_per_node", "1", "--reward.num_gpus_per_node", "1",
        "--critic.num_gpus_per_node", "1", "--algo.kl.init_coef", "0.01", "--ds.param_dtype", "bf16",
        "--actor.adam.lr", "1e-2", "--actor.lr_warmup_ratio", "0", "--critic.lr_warmup_ratio", "0",
        "--ckpt.output_dir", str(out_dir), "--ckpt.path", str(out_dir / "ckpt"),
    ]  # fmt: skip


#: A hang guard, not a speed limit: each Ray actor starts a Python process that imports torch, DeepSpeed and
#: transformers (~60 s per wave of actors on 2 cores while the other test worker runs); the largest run here (ZeRO-3,
#: two policy and two reference ranks, previous-task model, async) starts 12 and took 357 s on an idle 2-core machine
#: and over 400 s in CI.
RAY_RUN_TIMEOUT_S = 1200


def run_logged(
    cmd: list[str], log_file: Path, timeout: float = RAY_RUN_TIMEOUT_S, ray_address: str | None = None
) -> tuple[dict, float]:
    """Run ``cmd`` (a private local Ray cluster, or the cluster at ``ray_address``; no log deduplication); returns
    ({step: metrics}, wall s).

    Raises ``RuntimeError`` with the log's tail if the command fails."""
    env = {**os.environ, "RAY_DEDUP_LOGS": "0", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.perf_counter() - start
    log = proc.stdout + proc.stderr
    Path(log_file).write_text(log)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} exited {proc.returncode}; log {log_file}:\n{log[-4000:]}")
    return {int(m.group(1)): ast.literal_eval(m.group(2)) for m in STEP_LINE.finditer(log)}, wall


def run_train_ppo_ray(
    argv: list[str], log_file: Path, methods: bool = True, timeout: float = RAY_RUN_TIMEOUT_S
) -> tuple[dict, float]:
    """``python -m rlhf_ext.openrlhf.train_ppo_ray ARGV`` (``methods=False``: stock OpenRLHF with only the CPU
    pieces installed); see :func:`run_logged`."""
    code = f"import sys; from rlhf_ext.openrlhf.train_ppo_ray import main; main(sys.argv[1:], methods={methods})"
    return run_logged([sys.executable, "-c", code, *argv], log_file, timeout)
