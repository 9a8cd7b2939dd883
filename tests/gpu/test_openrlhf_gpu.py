"""GPU checks of the OpenRLHF path (marker ``gpu``: skipped without CUDA): the shipped ``segment_ppo_openrlhf`` recipe
through ``python -m rlhf_ext.launch.train_segment_ppo --engine openrlhf`` for 2 PPO steps on one GPU with vLLM
rollouts, NCCL weight sync (OpenRLHF's default ``--vllm.sync_backend nccl``) and ZeRO-3, then the same with
``--ds.packing_samples`` (flash-attention's varlen path).

One GPU cannot give vLLM GPUs of its own, so the recipe runs on-policy (``ppo.async_generation=false``): the hybrid
engine shares the GPU with the colocated models, as the recipe does on any node in sync mode. The policy is a small
Llama built here with 64-dimensional attention heads (vLLM's attention kernels); the segment reward model is
``builtin:tiny-segment-rm``. Needs ``vllm==0.29.0`` (``pip install "rlhf-ext[openrlhf,vllm]"``) and, for packing,
``flash-attn``; no network.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> str:
    """A randomly initialised 2-layer Llama (hidden 256, 4 heads of 64) with the toy tokenizer."""
    from rlhf_ext.zoo.builtins import toy_tokenizer
    from rlhf_ext.zoo.models import save_tiny_checkpoint, tiny_causal_lm

    tokenizer = toy_tokenizer()
    model = tiny_causal_lm(tokenizer, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                           num_key_value_heads=4)  # fmt: skip
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("gpu") / "policy", model, tokenizer))


def _run(tmp_path: Path, policy: str, cache_dir: str, *openrlhf_args: str) -> dict:
    from tests.helpers.openrlhf_runs import run_logged

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (pip install 'rlhf-ext[openrlhf,vllm]')")
    out = tmp_path / "run"
    extra = ", ".join(("vllm.gpu_memory_utilization: 0.3", *openrlhf_args))
    cmd = [
        sys.executable, "-m", "rlhf_ext.launch.train_segment_ppo", "--engine", "openrlhf",
        "--config", "segment_ppo_openrlhf", f"model.sft_model={policy}", "model.reward_model=builtin:tiny-segment-rm",
        "data.prompts=builtin:toy-keyphrase", "data.prompt_key=prompt", "data.calibration=builtin:toy-keyphrase",
        "data.max_calibration_pairs=64", "data.max_prompt_length=64", "data.max_completion_length=32",
        "ppo.async_generation=false", "train.max_steps=2", "train.batch_size=8", "train.micro_batch_size=4",
        "train.zero_stage=3", f"train.output_dir={out}", f"train.openrlhf_args={{{extra}}}",
    ]  # fmt: skip
    steps, _ = run_logged(cmd, tmp_path / "run.log", timeout=1800)
    log = (tmp_path / "run.log").read_text()
    assert sorted(steps) == [1, 2], f"see {tmp_path / 'run.log'}"
    assert "rollouts: 1 vLLM engines x tp 1 on the actor's GPUs (hybrid)" in log  # the plan: vLLM, from the cluster
    assert (out / "config.json").exists() and (out / "normalizer.json").exists()
    return steps


def test_shipped_recipe_two_steps_vllm_nccl_zero3(tmp_path, policy, cache_dir):
    steps = _run(tmp_path, policy, cache_dir)
    for step in steps.values():
        assert step["segments_per_response"] >= 1 and step["reward"] != 0.0


def test_shipped_recipe_two_steps_with_packing(tmp_path, policy, cache_dir):
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("--ds.packing_samples on GPUs runs flash-attention's varlen kernels: pip install flash-attn")
    steps = _run(tmp_path, policy, cache_dir, "ds.packing_samples: true")
    for step in steps.values():
        assert step["segments_per_response"] >= 1 and step["reward"] != 0.0
