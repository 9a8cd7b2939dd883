"""GPU checks of the TRL engine (marker ``gpu``: skipped without CUDA): the four tiny TRL recipes as the README
launches them -- ``python -m rlhf_ext.launch.train_segment_rm``, ``... train_segment_ppo``, ``... train_continual``
and ``accelerate launch -m rlhf_ext.launch.train_online_dpo`` -- on one GPU, concurrently, in the recipes' own
precision (``bf16`` is left to the hardware: on by default where the GPU supports it).

Each run goes through a small wrapper that runs the launch module as ``__main__`` and prints the CUDA memory it
allocated at exit, so a run that silently fell back to the CPU fails here. Needs only the ``[trl]`` extra; no
network (the tiny models are built from config).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

WRAPPER = """import atexit, runpy, sys, torch
atexit.register(lambda: print(f"CUDA_PEAK_BYTES {torch.cuda.max_memory_allocated()}", flush=True))
module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def test_the_tiny_trl_recipes_train_on_the_gpu(tmp_path, cache_dir):
    wrapper = tmp_path / "on_gpu.py"
    wrapper.write_text(WRAPPER)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    build = ["zoo", "build", "tiny-sft", "tiny-segment-rm"]
    subprocess.run([sys.executable, "-c", "from rlhf_ext.cli import main; main()", *build], check=True, env=env)
    out = {name: tmp_path / name for name in ("rm", "ppo", "dpo", "continual")}
    runs = {
        "rm": [sys.executable, str(wrapper), "rlhf_ext.launch.train_segment_rm", "--config", "segment_rm_tiny",
               f"train.output_dir={out['rm']}"],
        "ppo": [sys.executable, str(wrapper), "rlhf_ext.launch.train_segment_ppo", "--config", "segment_ppo_tiny",
                f"train.output_dir={out['ppo']}"],
        "dpo": [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", str(wrapper),
                "rlhf_ext.launch.train_online_dpo", "--config", "online_dpo_tiny", f"train.output_dir={out['dpo']}"],
        "continual": [sys.executable, str(wrapper), "rlhf_ext.launch.train_continual", "--config",
                      "continual_ppo_tiny", f"output_dir={out['continual']}"],
    }  # fmt: skip
    logs = {name: tmp_path / f"{name}.log" for name in runs}
    procs = {
        name: subprocess.Popen(cmd, stdout=logs[name].open("w"), stderr=subprocess.STDOUT, env=env)
        for name, cmd in runs.items()
    }
    for name, proc in procs.items():
        assert proc.wait(timeout=900) == 0, f"{name} failed: see {logs[name]}"
    for name, log in logs.items():
        peak = [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("CUDA_PEAK_BYTES")]
        assert peak and peak[-1] > 0, f"{name} allocated no CUDA memory: see {log}"
    finished = {"rm": "metrics.json", "ppo": "ppo_metrics.json", "dpo": "summary.json", "continual": "performance.json"}
    for name, file in finished.items():
        assert (out[name] / file).exists(), f"{name} wrote no {file}: see {logs[name]}"
    for name in ("rm", "ppo"):  # the Trainer's own record of where it ran
        args = torch.load(Path(out[name]) / "training_args.bin", weights_only=False)
        assert args.use_cpu is False and args.device.type == "cuda", name
