"""OpenRLHF continual actor on CPU with real OpenRLHF objects: ContinualPolicyLoss vs the stock PolicyLoss, and the
ContinualActorPPOTrainer.training_step (previous-task model loaded as an OpenRLHF Actor) vs the stock one."""

from __future__ import annotations

import types

import pytest
import torch

from rlhf_ext.continual import batch_stats, cppo_sample_weights, kl_to_previous, mean_log_prob, per_token_kl

oc = pytest.importorskip("rlhf_ext.openrlhf.continual_actor")
from openrlhf.models import Actor, PolicyLoss  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402


def _batch(seed=0, b=3, a=6):
    g = torch.Generator().manual_seed(seed)
    log_probs = (-torch.rand(b, a, generator=g) * 3).requires_grad_()
    old = log_probs.detach() + 0.2 * torch.randn(b, a, generator=g)
    prev = log_probs.detach() + 0.5 * torch.randn(b, a, generator=g)
    adv = torch.randn(b, a, generator=g)
    mask = torch.ones(b, a, dtype=torch.bool)
    mask[1, -2:] = False
    return log_probs, old, prev, adv, mask


def _same(a, b):
    for x, y in zip(a, b):
        assert (x is None and y is None) or torch.equal(x, y)


@pytest.mark.parametrize("loss_kwargs", [{}, {"dual_clip": 3.0}, {"token_level_loss": False}])
def test_weight_zero_or_no_previous_policy_equals_stock_policy_loss(loss_kwargs):
    log_probs, old, prev, adv, mask = _batch()
    stock = PolicyLoss(**loss_kwargs)(log_probs, old, adv, action_mask=mask)
    zero = oc.ContinualPolicyLoss(continual_kl_coef=0.0, **loss_kwargs)
    _same(zero(log_probs, old, adv, action_mask=mask, prev_log_probs=prev), stock)
    assert zero.last_prev_task_kl is None
    no_prev = oc.ContinualPolicyLoss(continual_kl_coef=1.0, **loss_kwargs)
    _same(no_prev(log_probs, old, adv, action_mask=mask), stock)


def test_adds_exactly_c_times_kl_token_mean():
    log_probs, old, prev, adv, mask = _batch()
    c = 0.3
    stock = PolicyLoss()(log_probs, old, adv, action_mask=mask)[0]
    loss = oc.ContinualPolicyLoss(continual_kl_coef=c)(log_probs, old, adv, action_mask=mask, prev_log_probs=prev)[0]
    kl = kl_to_previous(log_probs, prev, mask, "k3")
    assert (loss - stock).item() == pytest.approx(c * kl.item(), rel=1e-6)
    # gradients: the extra term contributes exactly c * grad KL (prev is a constant)
    (g_loss,) = torch.autograd.grad(loss, log_probs)
    (g_stock,) = torch.autograd.grad(stock, log_probs)
    (g_kl,) = torch.autograd.grad(kl, log_probs)
    torch.testing.assert_close(g_loss - g_stock, c * g_kl)


def test_kl_uses_the_policy_losss_normalisation():
    """Global token count x DP size (OpenRLHF's sharding-invariant token-mean) and sequence-mean mode."""
    log_probs, old, prev, adv, mask = _batch(1)
    kl_tok = per_token_kl(log_probs, prev, "k2").detach() * mask
    info = dict(dp_size=2, batch_num_tokens=torch.tensor(40.0), global_batch_size=torch.tensor(8.0))
    for token_level, expected in (
        (True, kl_tok.sum() / 40.0 * 2),
        (False, (kl_tok.sum(-1) / mask.sum(-1)).sum() / 8.0 * 2),
    ):
        stock = PolicyLoss(token_level_loss=token_level)(log_probs, old, adv, action_mask=mask, **info)[0]
        cont = oc.ContinualPolicyLoss(continual_kl_coef=1.0, continual_kl_estimator="k2", token_level_loss=token_level)
        loss = cont(log_probs, old, adv, action_mask=mask, prev_log_probs=prev, **info)[0]
        assert (loss - stock).item() == pytest.approx(expected.item(), rel=1e-5)
        assert cont.last_prev_task_kl.item() == pytest.approx(expected.item(), rel=1e-5)


def test_cppo_weights_scale_each_samples_policy_loss_and_kl():
    log_probs, old, prev, adv, mask = _batch(2)
    alpha, beta = torch.tensor([2.0, 0.5, 1.0]), torch.tensor([0.2, 2.0, 1.0])
    n = mask.sum().float()
    for dual_clip in (None, 3.0):
        cont = oc.ContinualPolicyLoss(continual_kl_coef=0.7, dual_clip=dual_clip)
        loss = cont(
            log_probs,
            old,
            adv,
            action_mask=mask,
            batch_num_tokens=n,
            prev_log_probs=prev,
            learning_weights=alpha,
            retention_weights=beta,
        )[0]
        # oracle: each sample's stock loss (same global normaliser) times its alpha, plus beta-weighted KL
        per_sample = [
            PolicyLoss(dual_clip=dual_clip)(
                log_probs[i : i + 1], old[i : i + 1], adv[i : i + 1], action_mask=mask[i : i + 1], batch_num_tokens=n
            )[0]
            for i in range(3)
        ]
        expected = sum(a * loss_i for a, loss_i in zip(alpha, per_sample)) + 0.7 * kl_to_previous(
            log_probs, prev, mask, sample_weights=beta
        )
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
        assert cont.last_prev_task_kl.item() == pytest.approx(kl_to_previous(log_probs, prev, mask).item(), rel=1e-5)


def test_from_policy_loss_keeps_every_setting():
    stock = PolicyLoss(
        clip_eps_low=0.1,
        clip_eps_high=0.3,
        dual_clip=2.0,
        token_level_loss=False,
        is_correction_level="token",
        is_correction_threshold=(0.4, 4.0),
    )
    cont = oc.ContinualPolicyLoss.from_policy_loss(stock, continual_kl_coef=0.0)
    for name in (
        "clip_eps_low",
        "clip_eps_high",
        "dual_clip",
        "token_level_loss",
        "policy_loss_type",
        "is_correction_level",
        "is_correction_mode",
        "is_correction_gating",
        "is_correction_threshold",
    ):
        assert getattr(cont, name) == getattr(stock, name), name
    with pytest.raises(ValueError, match="continual_kl_coef must be a number >= 0; got -1.0"):
        oc.ContinualPolicyLoss(continual_kl_coef=-1.0)


# -------------------------------------------------------------------------------------------- actor training step
ARGS = types.SimpleNamespace(
    actor=types.SimpleNamespace(
        eps_clip_low_high=(0.2, 0.2),
        dual_clip=None,
        loss_agg_mode="token-mean",
        policy_loss_type="ppo",
        aux_loss_coef=0.0,
        entropy_coef=None,
    ),
    algo=types.SimpleNamespace(
        advantage=types.SimpleNamespace(
            is_correction_level="off",
            is_correction_mode="mask",
            is_correction_gating="ratio",
            is_correction_threshold=(0.5, 5.0),
        ),
        kl=types.SimpleNamespace(use_loss=False, init_coef=0.0, estimator="k3", unbiased_gradient=False),
    ),
    train=types.SimpleNamespace(max_epochs=1, dynamic_batch_enable=False, colocate_all=False, async_enable=False),
    ds=types.SimpleNamespace(packing_samples=False, tensor_parallel_size=1),
    vllm=types.SimpleNamespace(sync_backend="gloo"),
)


class RecordingStrategy:
    """The DeepSpeed strategy's training-step interface on one CPU process: records the loss it is asked to
    back-propagate (optimizer steps are no-ops, so both trainers see identical weights)."""

    def __init__(self):
        self.args, self.ring_attn_group, self.losses = ARGS, None, []

    def backward(self, loss, model, optimizer):
        self.losses.append(loss.detach())

    def optimizer_step(self, optimizer, model, scheduler, name=None):
        pass

    def get_grad_norm(self, model):
        return 0.0


@pytest.fixture
def cpu_openrlhf(monkeypatch):
    """The two CUDA calls ActorPPOTrainer.__init__ makes unconditionally (replay-buffer device, barrier)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(oc._ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None)


def _actor(path, perturb_seed=None):
    actor = Actor(path, attn_implementation="sdpa")
    actor.float()
    if perturb_seed is not None:
        g = torch.Generator().manual_seed(perturb_seed)
        with torch.no_grad():
            for p in actor.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return actor


def _trainer(cls, actor, **kwargs):
    opt = torch.optim.SGD(actor.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    return cls(RecordingStrategy(), actor, None, opt, sched, micro_train_batch_size=2, **kwargs)


def _experience(actor, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t, a = 3, 14, 6
    seq = torch.randint(3, 500, (b, t), generator=g)
    attn = torch.ones(b, t, dtype=torch.long)
    attn[2, :3] = 0  # a left-padded prompt
    act = torch.ones(b, a, dtype=torch.bool)
    act[1, -2:] = False  # a response that ended early
    with torch.no_grad():
        old = actor(seq, act, attention_mask=attn)
    return Experience(
        sequences=seq,
        attention_mask=attn,
        action_mask=act,
        action_log_probs=old,
        advantages=torch.randn(b, a, generator=g),
        rewards=torch.tensor([1.5, -1.0, 0.1]),
        info={},
    )


def _hf_action_log_probs(actor, exp):
    """Independent oracle: full-softmax log-probs of the action tokens from the HF model inside the Actor."""
    mask = exp.attention_mask
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = actor.model(exp.sequences, attention_mask=mask, position_ids=pos).logits.float()
    logp = logits[:, :-1].log_softmax(-1).gather(-1, exp.sequences[:, 1:, None]).squeeze(-1)
    return logp[:, -exp.action_mask.shape[1] :] * exp.action_mask


def _step(trainer, exp):
    info = {"dp_size": 1, "batch_num_tokens": exp.action_mask.sum().float(), "global_batch_size": torch.tensor(3.0)}
    exp.info = {}
    status = trainer.training_step(exp, 0.0, 0, info)
    return trainer.strategy.losses[-1], status


def test_training_step_weight_zero_equals_stock(tiny_sft_path, cpu_openrlhf):
    stock = _trainer(oc.ActorPPOTrainer, _actor(tiny_sft_path))
    cont = _trainer(
        oc.ContinualActorPPOTrainer,
        _actor(tiny_sft_path),
        prev_model=_actor(tiny_sft_path, perturb_seed=1),
        settings=oc.ContinualActorSettings(continual_kl_coef=0.0),
    )
    exp = _experience(stock.actor)
    stock_loss, _ = _step(stock, exp)
    cont_loss, status = _step(cont, exp)
    assert torch.equal(stock_loss, cont_loss)
    assert oc.PREV_TASK_KL_KEY not in status["metrics"]


def test_training_step_adds_c_times_kl_to_the_previous_task_actor(tiny_sft_path, cpu_openrlhf):
    c = 0.5
    prev = _actor(tiny_sft_path, perturb_seed=1)
    stock = _trainer(oc.ActorPPOTrainer, _actor(tiny_sft_path))
    cont = _trainer(
        oc.ContinualActorPPOTrainer,
        _actor(tiny_sft_path),
        prev_model=prev,
        settings=oc.ContinualActorSettings(continual_kl_coef=c, continual_kl_estimator="k3"),
    )
    exp = _experience(stock.actor)
    stock_loss, _ = _step(stock, exp)
    cont_loss, status = _step(cont, exp)
    expected_kl = kl_to_previous(
        _hf_action_log_probs(cont.actor, exp), _hf_action_log_probs(prev, exp), exp.action_mask
    )
    assert expected_kl.item() > 1e-3
    assert (cont_loss - stock_loss).item() == pytest.approx(c * expected_kl.item(), rel=1e-4)
    assert status["metrics"][oc.PREV_TASK_KL_KEY].item() == pytest.approx(expected_kl.item(), rel=1e-4)
    assert status["weights"][oc.PREV_TASK_KL_KEY] == "token"
    assert not prev.training and not any(p.requires_grad for p in prev.parameters())

    same = _trainer(
        oc.ContinualActorPPOTrainer,
        _actor(tiny_sft_path),
        prev_model=_actor(tiny_sft_path),
        settings=oc.ContinualActorSettings(continual_kl_coef=c),
    )
    same_loss, status = _step(same, exp)
    assert status["metrics"][oc.PREV_TASK_KL_KEY].item() == 0.0  # identical policies: exactly zero
    assert torch.equal(same_loss, stock_loss)


def test_training_step_with_cppo_weights(tiny_sft_path, cpu_openrlhf):
    prev = _actor(tiny_sft_path, perturb_seed=1)
    settings = oc.ContinualActorSettings(continual_kl_coef=0.5, continual_retention="cppo")
    cont = _trainer(oc.ContinualActorPPOTrainer, _actor(tiny_sft_path), prev_model=prev, settings=settings)
    exp = _experience(cont.actor)
    exp.rewards = torch.tensor([4.0, -4.0, 0.1])  # far above / below the rollout batch's reward band
    items = [
        Experience(rewards=r, action_log_probs=lp, action_mask=m)
        for r, lp, m in zip(torch.tensor([3.0, -3.0, 0.0, 0.2]), torch.randn(4, 6), torch.ones(4, 6, dtype=torch.bool))
    ]
    cont.cppo_stats = cont.cppo_batch_stats(items)
    assert cont.cppo_stats.reward_mean.item() == pytest.approx(0.05)
    loss, _ = _step(cont, exp)

    weights = cppo_sample_weights(
        exp.rewards, mean_log_prob(exp.action_log_probs, exp.action_mask), settings.cppo, stats=cont.cppo_stats
    )
    assert weights.alpha.tolist() == [2.0, 0.5, 1.0] and weights.beta.tolist() == pytest.approx([1.0, 0.2, 1.0])
    with torch.no_grad():
        logp = cont.actor(exp.sequences, exp.action_mask, attention_mask=exp.attention_mask)
        prev_logp = prev(exp.sequences, exp.action_mask, attention_mask=exp.attention_mask)
    expected = oc.ContinualPolicyLoss(continual_kl_coef=0.5)(
        logp,
        exp.action_log_probs,
        exp.advantages,
        action_mask=exp.action_mask,
        batch_num_tokens=exp.action_mask.sum().float(),
        prev_log_probs=prev_logp,
        learning_weights=weights.alpha,
        retention_weights=weights.beta,
    )[0]
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    ref = batch_stats(torch.tensor([3.0, -3.0, 0.0, 0.2]), torch.stack([i.action_log_probs.mean() for i in items]))
    assert cont.cppo_stats.logp_std.item() == pytest.approx(ref.logp_std.item(), rel=1e-5)


def test_settings_from_openrlhf_args():
    ns = types.SimpleNamespace(
        ext=types.SimpleNamespace(continual_previous_model="/ckpt", continual_kl_coef=0.2, continual_retention=None)
    )
    s = oc.ContinualActorSettings.from_args(ns)
    assert (s.continual_previous_model, s.continual_kl_coef, s.continual_kl_estimator, s.continual_retention) == (
        "/ckpt",
        0.2,
        "k3",
        "kl",
    )
    assert oc.ContinualActorSettings.from_args(types.SimpleNamespace()).continual_previous_model is None
    with pytest.raises(ValueError, match="retention must be 'kl' or 'cppo'"):
        oc.ContinualActorSettings(continual_retention="ewc")


def test_ray_policy_actor_builds_the_continual_trainer(monkeypatch):
    """The Ray actor swaps ActorPPOTrainer for ContinualActorPPOTrainer only while its init runs; the hook replaces
    the policy actor class on ``openrlhf.trainer.ray.ppo_actor``, where the CLI module (run as ``__main__``) imports
    it from when it starts."""
    stock = oc._ppo_actor.PolicyModelActor
    monkeypatch.setattr(oc._ppo_actor, "PolicyModelActor", stock)  # restored after the test
    oc.use_continual_actor()
    assert oc._ppo_actor.PolicyModelActor is oc.ContinualPolicyModelActor
    impl = oc.ContinualPolicyModelActor.__ray_actor_class__
    assert issubclass(impl, stock.__ray_actor_class__)

    seen = []

    def fake_base_init(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        seen.append(oc._ppo_actor.ActorPPOTrainer)  # what the stock init would construct

    monkeypatch.setattr(stock.__ray_actor_class__, "init_model_from_pretrained", fake_base_init)
    impl.init_model_from_pretrained(object.__new__(impl), None, "path")
    assert seen == [oc.ContinualActorPPOTrainer]
    assert oc._ppo_actor.ActorPPOTrainer is oc.ActorPPOTrainer  # restored
