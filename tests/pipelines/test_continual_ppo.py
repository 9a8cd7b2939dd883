"""CPPO-style continual PPO through the task-sequence runner (paper 000, Eq. 7) at a tiny size."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlhf_ext.config import load_recipe
from rlhf_ext.pipelines.continual import run_continual
from rlhf_ext.pipelines.continual_recipe import ContinualRecipe
from rlhf_ext.recipes import recipe_path

SMALL = [
    "data.num_tasks=2", "data.max_train_samples=32", "data.max_test_samples=8", "ppo.max_steps=2",
    "ppo.batch_size=8", "ppo.max_completion_length=32", "ppo.eval_prompts=8", "reward_model.train.num_train_epochs=1",
    "plots=false",
]  # fmt: skip


def test_continual_ppo_applies_the_kl_to_the_previous_task_only_after_the_first(
    tmp_path, cache_dir, tiny_sft_path, monkeypatch
):
    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer

    # keep the tensors every Eq. 7 term was computed from (the trainer logs only the reduced value)
    calls = []
    compute_loss = SegmentPPOTrainer.compute_loss

    def recording_compute_loss(self, model, inputs, *args, **kwargs):
        loss = compute_loss(self, model, inputs, *args, **kwargs)
        if self.prev_model is not None and "prev_per_token_logps" in inputs:
            keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "prev_per_token_logps")
            calls.append({k: inputs[k].detach().clone() for k in keys} | {"logp": self._last_policy_logps.detach()})
        return loss

    monkeypatch.setattr(SegmentPPOTrainer, "compute_loss", recording_compute_loss)
    out = tmp_path / "cppo"
    recipe = load_recipe(ContinualRecipe, recipe_path("continual_ppo_tiny"), [*SMALL, f"output_dir={out}"])
    summary = run_continual(recipe)
    assert summary["finished_tasks"] == 2 and summary["continual_kl_coefs"] == [0.0, 1.0]
    matrix = json.loads((out / "performance.json").read_text())["performance_matrix"]
    assert len(matrix) == 2 and all(len(row) == 2 for row in matrix)
    assert all(math.isfinite(v) for row in matrix for v in row)
    assert (out / "task_01" / "policy" / "config.json").exists()
    first = json.loads((out / "task_00" / "result.json").read_text())["metrics"]["kl_to_previous"]
    second = json.loads((out / "task_01" / "result.json").read_text())["metrics"]["kl_to_previous"]
    assert first == []  # task 0 has no predecessor: plain PPO, no frozen copy
    # the Eq. 7 term ran once per step of task 1 and its logged value is the k3 estimate of the tensors it saw:
    # the masked token mean of r - 1 - log r, log r = prev_logp - logp (recomputed here in float64)
    assert len(second) == len(calls) == 2
    for logged, call in zip(second, calls):
        mask = call["completion_mask"].bool()
        log_r = call["prev_per_token_logps"].double() - call["logp"].double()
        k3 = (log_r.exp() - 1 - log_r)[mask].mean().item()
        assert logged == pytest.approx(k3, rel=1e-4, abs=1e-7)
    # task 1 starts from task 0's snapshot: zero at the first step, positive once the policy has moved
    assert second[0] == pytest.approx(0.0, abs=1e-6) and second[1] > 0
    # the frozen policy is task 0's snapshot: its log-probs of the sampled tokens, recomputed from the saved weights
    from transformers import AutoModelForCausalLM

    snapshot = AutoModelForCausalLM.from_pretrained(out / "task_00" / "policy", dtype=torch.float32).eval()
    for call in calls:
        ids = torch.cat([call["prompt_ids"], call["completion_ids"]], 1)
        c = call["completion_ids"].shape[1]
        with torch.no_grad():
            attention = torch.cat([call["prompt_mask"], call["completion_mask"]], 1)
            logits = snapshot(input_ids=ids, attention_mask=attention).logits[:, -c - 1 : -1].float()
        logp = logits.log_softmax(-1).gather(-1, call["completion_ids"].unsqueeze(-1)).squeeze(-1)
        mask = call["completion_mask"].bool()
        torch.testing.assert_close(call["prev_per_token_logps"][mask], logp[mask], atol=1e-4, rtol=1e-4)


def test_continual_ppo_trains_with_its_sections_training_keys_and_names_the_unread_train_keys(tmp_path, caplog):
    """``algorithm: ppo`` builds its ``DensePPOConfig`` from the ``ppo`` section through the one mapping of every
    ``train`` section: ``ppo.max_grad_norm``, ``ppo.weight_decay``, ``ppo.trl_args`` reach the config (before: unknown
    keys, and TRL options such as ``deepspeed`` could only go to ``train.trl_args``, which the PPO stage did not read),
    and the ``train.*`` keys it does not read (the DPO stage's) are named in one warning instead of ignored silently;
    so are the ``ppo.*`` keys with ``algorithm: dpo``."""
    import logging
    import types

    from rlhf_ext.pipelines.continual_stages import PPOPolicyStage

    overrides = ["ppo.max_steps=5", "ppo.max_grad_norm=0.5", "ppo.weight_decay=0.1", "ppo.trl_args={adam_beta2: 0.98}"]
    recipe = load_recipe(ContinualRecipe, recipe_path("continual_ppo_tiny"), overrides)
    task = types.SimpleNamespace(reward_model_dirs=["rm0", "rm1"], index=1, seed=7, continual_kl_coef=1.0,
                                 previous_policy="prev")  # fmt: skip
    with caplog.at_level(logging.WARNING):
        args = PPOPolicyStage(recipe).config(task, tmp_path / "work")
    assert (args.max_steps, args.max_grad_norm, args.weight_decay, args.adam_beta2) == (5, 0.5, 0.1, 0.98)
    assert (args.per_device_train_batch_size, args.learning_rate, args.reward_model_path) == (16, 3e-4, "rm1")
    assert (args.continual_kl_coef, args.continual_previous_model) == (1.0, "prev")
    assert "not read" not in caplog.text
    set_for_dpo = ["train.learning_rate=1e-4", "train.trl_args={deepspeed: ds.json, report_to: none}"]
    unread = load_recipe(ContinualRecipe, recipe_path("continual_ppo_tiny"), set_for_dpo)
    with caplog.at_level(logging.WARNING):
        PPOPolicyStage(unread)
    assert "ppo.trl_args ...); not read: train.learning_rate, train.trl_args.deepspeed" in caplog.text
    caplog.clear()  # the other way round: the DPO stage does not read the ppo section
    from rlhf_ext.pipelines.continual_stages import DPOPolicyStage

    dpo = load_recipe(ContinualRecipe, recipe_path("continual_dpo_tiny"), ["ppo.learning_rate=1e-4", "dpo.beta=0.2"])
    with caplog.at_level(logging.WARNING):
        DPOPolicyStage(dpo)
    assert "algorithm: dpo trains the policy with the train and dpo sections; not read: ppo.learning_rate" in (
        caplog.text
    )
