"""The reference forward's one-pass log-probs/entropies and the critic's fused AdamW on a CUDA device (marker
``gpu``: skipped without CUDA), against fp64 references computed on the CPU and torch's multi-tensor AdamW."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf_ext.algos.segment_reward import logprobs_and_entropy
from tests.algos.test_logprobs_entropy import fp32_tolerance, reference_entropy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_and_entropy_on_cuda_equal_the_fp64_values_to_fp32_rounding(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 40, 151936, generator=g) * 3.0).to(dtype)  # Qwen-sized vocabulary
    logits[0, 5, torch.rand(151936, generator=g) < 0.5] = -torch.inf  # a masked vocabulary row
    labels = torch.randint(0, 151936, (2, 40), generator=g)
    labels[0, 5] = int(torch.isfinite(logits[0, 5]).nonzero()[0])
    lp, ent = logprobs_and_entropy(logits.cuda(), labels.cuda())
    exact = logits.double()
    exact_lp = exact.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(exact, -1)
    tol = fp32_tolerance(logits)
    torch.testing.assert_close(lp.cpu().double(), exact_lp, atol=tol, rtol=0)
    torch.testing.assert_close(ent.cpu().double(), reference_entropy(exact), atol=tol, rtol=0)


def test_fused_critic_adamw_on_cuda_gives_torchs_default_update():
    from rlhf_ext.trl.critic import critic_optimizer
    from rlhf_ext.zoo.builtins import toy_tokenizer
    from rlhf_ext.zoo.models import tiny_reward_model
    from tests.trl.test_critic_optimizer import _value_loss_step

    fused_critic = tiny_reward_model(toy_tokenizer(), seed=3).cuda()
    plain_critic = copy.deepcopy(fused_critic)
    fused = critic_optimizer(fused_critic, lr=1e-3)
    plain = torch.optim.AdamW(plain_critic.parameters(), lr=1e-3, betas=(0.9, 0.95))  # torch's default (foreach)
    assert fused.param_groups[0]["fused"] and not plain.param_groups[0]["fused"]
    start = {name: p.detach().clone() for name, p in fused_critic.named_parameters()}
    for step in range(3):
        _value_loss_step(fused_critic, fused, seed=step)
        _value_loss_step(plain_critic, plain, seed=step)
    for (name, a), b in zip(fused_critic.named_parameters(), plain_critic.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    assert any(not torch.equal(p, start[n]) for n, p in fused_critic.named_parameters())
