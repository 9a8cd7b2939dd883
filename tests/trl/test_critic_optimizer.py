"""The GAE critic's optimizer: torch's fused AdamW, the same update as the per-parameter default to fp32 rounding,
a clear fallback where torch has no fused kernel, and a checkpoint of either kind resumes fused."""

from __future__ import annotations

import copy
import logging

import torch

from rlhf_ext.trl.critic import Critic, critic_optimizer
from rlhf_ext.zoo.models import tiny_reward_model


def _value_loss_step(critic, optimizer, seed: int) -> None:
    """One step on a fixed random batch: squared error of every position's value to a random target."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, critic.config.vocab_size, (4, 12), generator=generator).to(critic.device)
    target = torch.randn(4, 12, generator=generator).to(critic.device)
    values = critic.model(input_ids=ids).last_hidden_state @ critic.score.weight.T  # [B, T, 1]
    ((values.squeeze(-1) - target) ** 2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_fused_critic_adamw_gives_the_per_parameter_update(tmp_path):
    torch.set_num_threads(1)
    fused_critic = tiny_reward_model(seed=3)
    plain_critic = copy.deepcopy(fused_critic)
    fused = critic_optimizer(fused_critic, lr=1e-3)
    plain = torch.optim.AdamW(plain_critic.parameters(), lr=1e-3, betas=(0.9, 0.95))  # torch's default on CPU
    assert fused.param_groups[0]["fused"] and not plain.param_groups[0]["fused"]
    start = {name: p.detach().clone() for name, p in fused_critic.named_parameters()}
    for step in range(3):
        _value_loss_step(fused_critic, fused, seed=step)
        _value_loss_step(plain_critic, plain, seed=step)
    moved = 0
    for (name, a), b in zip(fused_critic.named_parameters(), plain_critic.parameters(), strict=True):
        # the same update to fp32 rounding: a few ulps of the weights, far below one step (lr 1e-3)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
        moved += not torch.equal(a, start[name])
    assert moved > 0

    # a checkpoint of the per-parameter AdamW (older runs) resumes on the fused kernel, at the same state
    from accelerate import Accelerator

    accelerator = Accelerator()
    saved = Critic(plain_critic, accelerator, 1e-3)
    saved.optimizer, saved.micro_steps = plain, 6
    saved.save_weights(str(tmp_path))
    saved.save_state(str(tmp_path))
    resumed = Critic(tiny_reward_model(seed=4), accelerator, 1e-3)
    resumed.load(str(tmp_path))
    assert resumed.micro_steps == 6 and resumed.optimizer.param_groups[0]["fused"]
    resumed_critic = resumed.model
    _value_loss_step(resumed_critic, resumed.optimizer, seed=9)
    _value_loss_step(plain_critic, plain, seed=9)
    for a, b in zip(resumed_critic.parameters(), plain_critic.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_critic_without_a_fused_kernel_falls_back_and_says_why(caplog):
    critic = torch.nn.Linear(3, 1, device="meta")  # no fused AdamW on the meta device
    with caplog.at_level(logging.WARNING, logger="rlhf_ext.trl.critic"):
        optimizer = critic_optimizer(critic, lr=1e-3)
    assert not optimizer.param_groups[0]["fused"]
    assert [r.getMessage() for r in caplog.records] == [
        "critic optimizer: torch has no fused AdamW for parameters of torch.float32 on meta (fused kernels need "
        "floating-point parameters on mps/cuda/xpu/hpu/cpu/mtia/privateuseone); using the slower per-parameter AdamW"
    ]
