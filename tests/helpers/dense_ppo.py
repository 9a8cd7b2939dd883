"""A tiny ``DensePPOConfig`` for one-step CPU runs of ``DensePPOTrainer`` in tests."""

from __future__ import annotations


def tiny_dense_ppo_config(tmp_path, **overrides):
    """``DensePPOConfig``: 1 REINFORCE step of 8 rollouts (2 per prompt, 24 new tokens) on CPU, no KL, no saving."""
    from rlhf_ext.trl.segment_ppo import DensePPOConfig

    base = dict(
        output_dir=str(tmp_path / "ppo"), per_device_train_batch_size=8, num_generations=2, max_completion_length=24,
        learning_rate=3e-4, max_steps=1, logging_steps=1, bf16=False, use_cpu=True, report_to="none",
        save_strategy="no", gradient_checkpointing=False, disable_tqdm=True, seed=0, advantage_estimator="reinforce",
        kl_coef=0.0,
    )  # fmt: skip
    return DensePPOConfig(**{**base, **overrides})
