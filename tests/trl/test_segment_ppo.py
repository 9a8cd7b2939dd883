"""SegmentPPOTrainer (TRL 1.16 GRPO subclass): rollouts with dense rewards, learning on the toy task, bad input."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from datasets import Dataset


@pytest.fixture(scope="module")
def segment_rm(cache_dir) -> str:
    from rlhf_ext.pipelines.builtins import resolve_model

    return resolve_model("builtin:tiny-segment-rm", cache_dir)


@pytest.fixture(scope="module")
def prompts(toy_data):
    return Dataset.from_list([{"prompt": r["prompt"]} for r in toy_data["train"]])


def _config(tmp_path, segment_rm, **kw):
    from rlhf_ext.trl.segment_ppo import SegmentPPOConfig

    base = dict(
        output_dir=str(tmp_path / "ppo"), reward_model_path=segment_rm, granularity="segment",  # paper 003's mode
        per_device_train_batch_size=8, num_generations=2, max_completion_length=64, learning_rate=3e-4,
        critic_learning_rate=1e-4, max_steps=1,
        logging_steps=1, bf16=False, use_cpu=True, report_to="none", save_strategy="no",
        gradient_checkpointing=False, disable_tqdm=True, seed=0,
    )  # fmt: skip
    base.update(kw)
    return SegmentPPOConfig(**base)


def _segment_score_of_samples(trainer, prompts: list[str], seed: int = 0) -> float:
    """Mean PPO objective before the KL penalty on fresh samples: the sum of the normalized, interpolated segment
    rewards the reward model assigns (``segment/score``), measured by the trainer's own rollout in eval mode."""
    torch.manual_seed(seed)
    was_training = trainer.model.training
    trainer.model.eval()
    trainer._generate_and_score_completions([{"prompt": p} for p in prompts])
    trainer.model.train(was_training)
    return trainer._metrics["eval"]["segment/score"][-1]


def test_rollout_produces_dense_per_token_advantages(tmp_path, tiny_sft_path, toy_tok, toy_data, segment_rm, prompts):
    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer

    trainer = SegmentPPOTrainer(
        model=tiny_sft_path,
        args=_config(tmp_path, segment_rm),
        train_dataset=prompts,
        processing_class=toy_tok,
        calibration_dataset=toy_data["test"],
    )
    assert trainer.normalizer.kind == "regression" and trainer.normalizer.num_points > 100
    assert trainer.entropy_cutoff == 2.0  # read from the reward model's segment_config.json
    batch = [{"prompt": p} for p in prompts["prompt"][:4] for _ in range(2)]
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); we call compute_loss directly
    out = trainer._generate_and_score_completions(batch)
    assert "advantages" not in out  # on-policy: finished in the loss, from its own policy forward
    trainer.compute_loss(trainer.model, out)
    mask = out["completion_mask"].bool()
    adv = out["advantages"]
    assert adv.shape == out["completion_ids"].shape  # [B, T], not one scalar per sequence
    assert (adv[~mask] == 0).all()
    assert abs(adv[mask].mean().item()) < 1e-4 and adv[mask].std().item() == pytest.approx(1.0, abs=0.05)
    assert out["returns"].shape == adv.shape and (out["old_values"][~mask] == 0).all()
    # dense: tokens of one response do not all share one advantage (it would with a bandit reward and no critic)
    assert (adv[0][mask[0]].unique().numel()) > 3
    metrics = trainer._metrics["train"]
    assert metrics["segment/segments_per_response"][-1] > 2
    assert math.isfinite(metrics["segment/kl"][-1])


def test_no_grpo_placeholder_metrics_are_logged(tmp_path, tiny_sft_path, toy_tok, segment_rm, prompts):
    """GRPO's statistics of its placeholder reward function were logged every step (`rewards/segment_reward/mean`
    always 0, `frac_reward_zero_std` always 1); with a segment reward model the groups' rewards differ, so the true
    fraction of zero-std groups is 0."""
    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer

    args = _config(tmp_path, segment_rm, normalizer_kind="none", advantage_estimator="reinforce")
    trainer = SegmentPPOTrainer(model=tiny_sft_path, args=args, train_dataset=prompts, processing_class=toy_tok)
    trainer.model.train()
    trainer._generate_and_score_completions([{"prompt": p} for p in prompts["prompt"][:4] for _ in range(2)])
    metrics = trainer._metrics["train"]
    assert not [k for k in metrics if k.startswith("rewards/segment_reward/")]
    assert metrics["frac_reward_zero_std"] == [0.0]


def test_ppo_raises_the_reward_models_score_while_kl_stays_finite(tmp_path, tiny_sft_path, toy_tok, toy_data,
                                                                  segment_rm, prompts):  # fmt: skip
    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer

    args = _config(tmp_path, segment_rm, max_steps=24, per_device_train_batch_size=16,
                   advantage_estimator="reinforce_baseline")  # fmt: skip
    trainer = SegmentPPOTrainer(
        model=tiny_sft_path, args=args, train_dataset=prompts, processing_class=toy_tok,
        calibration_dataset=toy_data["train"],
    )  # fmt: skip
    held_out = [r["prompt"] for r in toy_data["test"]][:64]
    before = _segment_score_of_samples(trainer, held_out)
    trainer.train()
    after = _segment_score_of_samples(trainer, held_out)
    kls = [h["segment/kl"] for h in trainer.state.log_history if "segment/kl" in h]
    assert after > before + 2.0, (before, after)  # measured: 6.4 -> 18.8 at 30 steps
    assert all(math.isfinite(k) for k in kls) and max(kls) < 20.0


def test_gae_training_step_updates_critic_and_saves(tmp_path, tiny_sft_path, toy_tok, toy_data, segment_rm, prompts):
    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer

    trainer = SegmentPPOTrainer(
        model=tiny_sft_path, args=_config(tmp_path, segment_rm, max_steps=2), train_dataset=prompts,
        processing_class=toy_tok, calibration_dataset=toy_data["test"],
    )  # fmt: skip
    critic_before = [p.detach().clone() for p in trainer.critic.model.parameters()]
    trainer.train()
    changed = any(not torch.equal(a, b) for a, b in zip(critic_before, trainer.critic.model.parameters()))
    assert changed, "the critic's optimizer never stepped"
    logs = [h for h in trainer.state.log_history if "critic/value_loss" in h]
    assert logs and all(math.isfinite(h["critic/value_loss"]) for h in logs)
    trainer.save_model()
    from rlhf_ext.runtime.calibration import load_normalizer

    assert load_normalizer(tmp_path / "ppo" / "normalizer.json") == trainer.normalizer
    assert (tmp_path / "ppo" / "critic" / "config.json").exists()


def test_missing_normalizer_file_is_a_clear_error(tmp_path, tiny_sft_path, toy_tok, segment_rm, prompts):
    from rlhf_ext.segment import NormalizerError
    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer

    args = _config(tmp_path, segment_rm, normalizer_path=str(tmp_path / "nope.json"), advantage_estimator="reinforce")
    with pytest.raises(NormalizerError, match="does not exist"):
        SegmentPPOTrainer(model=tiny_sft_path, args=args, train_dataset=prompts, processing_class=toy_tok)


def test_no_calibration_data_warns_and_runs_unnormalized(tmp_path, tiny_sft_path, toy_tok, segment_rm, prompts):
    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer

    args = _config(tmp_path, segment_rm, advantage_estimator="reinforce")
    with pytest.warns(UserWarning, match="not normalized"):
        trainer = SegmentPPOTrainer(model=tiny_sft_path, args=args, train_dataset=prompts, processing_class=toy_tok)
    assert trainer.normalizer.kind == "none"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beta": 0.1}, "set kl_coef, not beta"),
        ({"granularity": "sentence"}, "granularity must be one of"),
        ({"interpolation": "spread"}, "interpolation must be one of"),
        ({"advantage_estimator": "ppo"}, "one of gae, reinforce, reinforce_baseline"),
        ({"entropy_cutoff": -1.0}, r"entropy_cutoff must be a number >= 0 \(or inf\), or null; got -1.0"),
        ({"kl_coef": -0.1}, "kl_coef must be a number >= 0; got -0.1"),
    ],
)
def test_bad_config_is_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, "rm", **kwargs)


def test_segment_granularity_with_infinite_cutoff_is_refused(tmp_path, tiny_sft_path, toy_tok, segment_rm, prompts):
    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer

    args = _config(tmp_path, segment_rm, entropy_cutoff=math.inf, normalizer_kind="none")
    with pytest.raises(ValueError, match="infinite cutoff is the bandit setting"):
        SegmentPPOTrainer(model=tiny_sft_path, args=args, train_dataset=prompts, processing_class=toy_tok)


def test_cppo_term_adds_exactly_c_times_kl_to_previous(tmp_path, tiny_sft_path, tiny_base_path, toy_tok, segment_rm,
                                                       prompts):  # fmt: skip
    """Eq. 7 (paper 000): loss = PPO loss + c * KL(pi_theta || pi_prev); c = 0 is plain PPO."""
    from transformers import AutoModelForCausalLM

    from rlhf_ext.continual import kl_to_previous
    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer

    args = _config(tmp_path, segment_rm, advantage_estimator="reinforce", normalizer_kind="none", continual_kl_coef=2.0,
                   continual_kl_estimator="k3")  # fmt: skip
    prev = AutoModelForCausalLM.from_pretrained(tiny_base_path)  # a different policy: KL > 0
    trainer = SegmentPPOTrainer(model=tiny_sft_path, args=args, train_dataset=prompts, processing_class=toy_tok,
                                prev_model=prev)  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); we call compute_loss directly
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in prompts["prompt"][:4] for _ in range(2)])
    assert batch["prev_per_token_logps"].shape == batch["completion_ids"].shape
    with torch.no_grad():
        with_kl = trainer.compute_loss(trainer.model, dict(batch)).item()
        logps = trainer._last_policy_logps
        kl = kl_to_previous(logps, batch["prev_per_token_logps"], batch["completion_mask"].bool(), "k3").item()
        trainer.args.continual_kl_coef = 0.0
        plain = trainer.compute_loss(trainer.model, dict(batch)).item()
    assert kl > 0.01
    assert with_kl == pytest.approx(plain + 2.0 * kl, rel=1e-5, abs=1e-6)
    # the previous policy equal to the current one gives a zero KL
    with torch.no_grad():
        zero = kl_to_previous(logps, logps, batch["completion_mask"].bool(), "k3").item()
    assert zero == 0.0


def test_one_step_async_rollouts_are_exactly_one_version_old(tmp_path, tiny_sft_path, toy_tok, segment_rm, prompts):
    """Paper 001, Appendix D: batch t+1 is generated with theta_t while training on batch t; nothing left running."""
    import threading

    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer

    args = _config(tmp_path, segment_rm, advantage_estimator="reinforce", normalizer_kind="none", max_steps=4,
                   async_generation=True)  # fmt: skip
    trainer = SegmentPPOTrainer(model=tiny_sft_path, args=args, train_dataset=prompts, processing_class=toy_tok)
    trainer.train()
    stats = trainer.async_rollout.stats
    assert stats.staleness == {0: 1, 1: 3}  # batch 0 is on-policy, every later one exactly one update behind
    assert stats.trained == [(0, 0, 0), (1, 0, 1), (2, 1, 2), (3, 2, 3)]  # (batch, generated by, trained by)
    assert not [t for t in threading.enumerate() if t.name.startswith("rlhf-ext-ppo-generator")]
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 4 and all(math.isfinite(h["reward"]) for h in logs)


def _count_policy_forwards(trainer) -> dict:
    """Count the policy's forward calls outside ``generate`` (log-prob forwards: old log-probs, the loss)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    counts = {"forwards": 0, "generate_calls": 0, "in_generate": False}

    def pre_hook(module, args):
        if not counts["in_generate"]:
            counts["forwards"] += 1

    generate = model.generate

    def counted_generate(*args, **kwargs):
        counts["generate_calls"] += 1
        counts["in_generate"] = True
        try:
            return generate(*args, **kwargs)
        finally:
            counts["in_generate"] = False

    model.register_forward_pre_hook(pre_hook)
    model.generate = counted_generate
    return counts


def _even_token_reward(completion_ids, **kwargs):
    """A plain reward function: the fraction of even token ids in each completion."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


@pytest.mark.parametrize("estimator", ["reinforce", "reinforce_baseline", pytest.param("gae", marks=pytest.mark.slow)])
def test_on_policy_steps_run_no_extra_policy_forward(tmp_path, tiny_sft_path, tiny_base_path, toy_tok,
                                                     segment_rm, prompts, estimator):  # fmt: skip
    """On-policy REINFORCE or GAE: one policy forward per step outside generation (the loss's), as stock GRPO with
    beta > 0 (whose reference forward runs on its own model); the old log-probs' no-grad forward changes nothing."""
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer

    steps, common = 2, dict(max_completion_length=16, learning_rate=1e-3, loss_type="bnpo")
    runs = {}
    for reuse in (True, False):
        args = _config(tmp_path / str(reuse), segment_rm, advantage_estimator=estimator, normalizer_kind="none",
                       max_steps=steps, **common)  # fmt: skip
        ref = AutoModelForCausalLM.from_pretrained(tiny_base_path)  # a different reference: KL != 0
        trainer = SegmentPPOTrainer(tiny_sft_path, args=args, train_dataset=prompts, processing_class=toy_tok,
                                    ref_model=ref)  # fmt: skip
        trainer._reuse_policy_logps = reuse  # False: the extra no-grad old-log-prob forward of every rollout
        counts = _count_policy_forwards(trainer)
        trainer.train()
        runs[reuse] = (counts, trainer)
    grpo_args = GRPOConfig(
        output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=8, num_generations=2, max_steps=steps,
        beta=0.04, scale_rewards="none", bf16=False, use_cpu=True, report_to="none", save_strategy="no",
        gradient_checkpointing=False, disable_tqdm=True, seed=0, logging_steps=1, **common,
    )  # fmt: skip
    grpo = GRPOTrainer(tiny_sft_path, _even_token_reward, grpo_args, train_dataset=prompts, processing_class=toy_tok)
    assert grpo.ref_model is not None  # beta > 0 pays a reference forward, on its own model
    grpo_counts = _count_policy_forwards(grpo)
    grpo.train()

    assert grpo_counts["generate_calls"] == runs[True][0]["generate_calls"] == steps
    assert grpo_counts["forwards"] == steps  # the loss forward only
    assert runs[True][0]["forwards"] == grpo_counts["forwards"]
    assert runs[False][0]["forwards"] == 2 * steps  # what every step cost before
    # the same numbers with and without the extra forward: each step's loss and metrics, the weights after both steps
    on, off = runs[True][1], runs[False][1]
    assert on.state.log_history[0]["segment/kl"] != 0.0
    for log_on, log_off in zip(on.state.log_history[:steps], off.state.log_history[:steps], strict=True):
        for key in ("loss", "reward", "reward_std", "segment/kl", "segment/score", "grad_norm"):
            assert log_on[key] == pytest.approx(log_off[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(on.model.parameters(), off.model.parameters()):  # Adam: within a tenth of one step (lr 1e-3)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_advantages_finished_in_the_loss_equal_the_rollouts(tmp_path, tiny_sft_path, tiny_base_path, toy_tok,
                                                            segment_rm, prompts):  # fmt: skip
    """Same batch, with and without the old-log-prob forward: the same advantages, loss and gradient."""
    from transformers import AutoModelForCausalLM

    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer

    args = _config(tmp_path, segment_rm, advantage_estimator="reinforce_baseline", normalizer_kind="none",
                   max_completion_length=16)  # fmt: skip
    ref = AutoModelForCausalLM.from_pretrained(tiny_base_path)
    trainer = SegmentPPOTrainer(tiny_sft_path, args=args, train_dataset=prompts, processing_class=toy_tok,
                                ref_model=ref)  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); we call compute_loss directly
    rows = [{"prompt": p} for p in prompts["prompt"][:4] for _ in range(2)]
    results = {}
    for reuse in (True, False):
        trainer._reuse_policy_logps = reuse
        torch.manual_seed(0)
        batch = trainer._generate_and_score_completions(rows)
        assert ("advantages" in batch) is not reuse and ("old_per_token_logps" in batch) is not reuse
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
        metrics = {k: trainer._metrics["train"][k][-1] for k in ("reward", "segment/kl")}
        results[reuse] = (batch["completion_ids"], batch["advantages"], loss.item(), grads, metrics)
    ids_on, adv_on, loss_on, grad_on, m_on = results[True]
    ids_off, adv_off, loss_off, grad_off, m_off = results[False]
    assert torch.equal(ids_on, ids_off)
    torch.testing.assert_close(adv_on, adv_off, rtol=1e-5, atol=1e-5)
    assert loss_on == pytest.approx(loss_off, abs=1e-6)
    torch.testing.assert_close(grad_on, grad_off, rtol=1e-4, atol=1e-7)
    assert grad_on.abs().sum() > 0 and m_on == pytest.approx(m_off, rel=1e-5) and m_on["segment/kl"] != 0.0
    # off-policy rollouts (GRPO computed old log-probs) and several loss calls per rollout keep the old forward
    from rlhf_ext.trl.segment_ppo import finishes_in_loss

    assert finishes_in_loss(trainer.args, {}, "train")
    assert not finishes_in_loss(trainer.args, {"old_per_token_logps": adv_off}, "train")
    trainer.args.steps_per_generation = 2
    assert not finishes_in_loss(trainer.args, {}, "train") and finishes_in_loss(trainer.args, {}, "eval")


def test_grpo_positional_arguments_and_reward_funcs(tmp_path, tiny_sft_path, toy_tok, prompts):
    """GRPO's order (model, reward_funcs, args, train_dataset, eval_dataset, processing_class); a reward function is
    the sequence-level reward: one step trains and the logged reward is the function's mean output."""
    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer

    outputs: list[float] = []

    def even_reward(completion_ids, **kwargs):
        out = _even_token_reward(completion_ids)
        outputs.extend(out)
        return out

    args = _config(tmp_path, None, advantage_estimator="reinforce", kl_coef=0.0, max_completion_length=16)
    trainer = SegmentPPOTrainer(tiny_sft_path, even_reward, args, prompts, None, toy_tok)
    assert trainer.reward_funcs == [even_reward] and trainer.reward_model is None
    assert trainer.processing_class is toy_tok and trainer.train_dataset is prompts
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 1 and len(outputs) == 8
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    log = trainer.state.log_history[0]
    mean = sum(outputs) / len(outputs)
    assert log["reward"] == pytest.approx(mean, abs=1e-6)
    assert log["rewards/even_reward/mean"] == pytest.approx(mean, abs=1e-6)
    assert log["segment/score"] == pytest.approx(mean, abs=1e-6)
    assert log["segment/segments_per_response"] == 1.0  # a bandit reward


def test_reward_funcs_and_a_segment_reward_model_is_one_clear_error(tmp_path, tiny_sft_path, toy_tok, segment_rm,
                                                                     prompts):  # fmt: skip
    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer

    args = _config(tmp_path, segment_rm, advantage_estimator="reinforce")
    with pytest.raises(ValueError, match="both reward_funcs= and a segment reward model") as err:
        SegmentPPOTrainer(tiny_sft_path, _even_token_reward, args, prompts, processing_class=toy_tok)
    message = str(err.value)
    assert "\n" not in message and "reward_model_path" in message and "drop reward_funcs" in message
    with pytest.raises(ValueError, match="needs a reward"):
        SegmentPPOTrainer(tiny_sft_path, args=_config(tmp_path, None), train_dataset=prompts, processing_class=toy_tok)


# ------------------------------------------------------------------------ a segment reward model wherever accepted
def test_segment_rm_directory_in_reward_funcs_is_scored_by_e_phi(tmp_path, tiny_sft_path, toy_tok, segment_rm,
                                                                   prompts):  # fmt: skip
    """``reward_funcs="<segment RM dir>"`` used to load a sequence classifier and train on its last-token score of
    ``prompt + completion`` (GRPO's path); it is now the RM's e_phi, the score it was trained to give."""
    from transformers import AutoModelForSequenceClassification

    from rlhf_ext.runtime.rewards import SegmentSequenceReward
    from rlhf_ext.runtime.token_scores import SegmentScorer
    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer

    args = _config(tmp_path, None, advantage_estimator="reinforce", kl_coef=0.0, max_completion_length=16)
    trainer = SegmentPPOTrainer(tiny_sft_path, segment_rm, args, prompts, None, toy_tok)
    (func,) = trainer.reward_funcs
    assert isinstance(func, SegmentSequenceReward) and trainer.reward_func_names == [func.__name__]
    texts = [(prompts[i]["prompt"], c) for i, c in enumerate([" the crowd goes wild. Then more text here.", " no."])]
    got = func(prompts=[p for p, _ in texts], completions=[c for _, c in texts], completion_ids=None)
    scorer = SegmentScorer(segment_rm)
    e_phi = torch.tensor([scorer.score(p, c).evaluation for p, c in texts])
    torch.testing.assert_close(got, e_phi, rtol=1e-5, atol=1e-5)
    classifier = AutoModelForSequenceClassification.from_pretrained(segment_rm, num_labels=1).eval()
    ids = toy_tok([p + c + toy_tok.eos_token for p, c in texts], return_tensors="pt", padding=True)
    with torch.no_grad():
        last_token = classifier(**ids).logits[:, 0]
    assert not torch.allclose(got, last_token, atol=1e-3)  # the signal it used to train on
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0][f"rewards/{func.__name__}/mean"])


def test_a_loaded_segment_rm_or_bandit_granularity_on_it_is_refused(tmp_path, tiny_sft_path, toy_tok, segment_rm,
                                                                     prompts):  # fmt: skip
    from transformers import AutoModelForSequenceClassification

    from rlhf_ext.runtime.segment_data import load_segment_settings, save_segment_settings
    from rlhf_ext.trl.online_dpo import _reward_function
    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer

    loaded = AutoModelForSequenceClassification.from_pretrained(segment_rm, num_labels=1)
    args = _config(tmp_path, None, advantage_estimator="reinforce")
    fix = f"pass its directory '{segment_rm}' instead (scored by its sequence evaluation e_phi)"
    with pytest.raises(ValueError, match="reward_funcs\\[0\\] is a segment reward model") as err:
        SegmentPPOTrainer(tiny_sft_path, [loaded], args, prompts, processing_class=toy_tok)
    assert fix in str(err.value)
    with pytest.raises(ValueError, match="loaded as a sequence classifier"):
        _reward_function(loaded, toy_tok, 8)  # IterativeDPOTrainer(reward_funcs=<loaded model>)
    # granularity 'bandit' reads the last token: refused on a segment RM (cutoff 2.0) ...
    with pytest.raises(ValueError, match="granularity 'bandit' would train on its last-token score") as err:
        SegmentPPOTrainer(tiny_sft_path, args=_config(tmp_path, segment_rm, granularity="bandit"),
                          train_dataset=prompts, processing_class=toy_tok)  # fmt: skip
    assert "use granularity 'segment_as_bandit'" in str(err.value)
    # ... and allowed on a bandit RM (cutoff inf: one segment, e_phi is the last-token score)
    bandit_rm = tmp_path / "bandit_rm"
    shutil.copytree(segment_rm, bandit_rm)
    save_segment_settings(bandit_rm, {**load_segment_settings(segment_rm), "entropy_cutoff": math.inf})
    args = _config(tmp_path, str(bandit_rm), granularity="bandit", advantage_estimator="reinforce")
    SegmentPPOTrainer(tiny_sft_path, args=args, train_dataset=prompts, processing_class=toy_tok)


def test_reward_funcs_with_gae_say_once_that_a_critic_trains(tmp_path, tiny_sft_path, toy_tok, prompts, caplog,
                                                              capfd):  # fmt: skip
    """A GRPO user passing reward_funcs got a critic (the default estimator is gae) without a word, and transformers'
    "score.weight | MISSING" load table mid-run."""
    import logging

    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer

    with caplog.at_level(logging.INFO, logger="rlhf_ext"):
        SegmentPPOTrainer(tiny_sft_path, _even_token_reward, _config(tmp_path, None), prompts, processing_class=toy_tok)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("rlhf_ext")]
    assert sum("advantage_estimator 'gae'" in m and "reinforce_baseline" in m for m in lines) == 1
    assert f"critic: {tiny_sft_path} with a fresh value head" in lines
    assert "LOAD REPORT" not in capfd.readouterr().err and "MISSING" not in caplog.text


def test_on_policy_gae_takes_old_logps_from_the_loss_forward(tmp_path, tiny_sft_path, tiny_base_path, toy_tok,
                                                             segment_rm, prompts):  # fmt: skip
    """GAE + critic, on-policy: one policy forward per step outside generation (the loss's; before, a no-grad
    old-log-prob forward ran too), and the very same step -- loss, advantages, returns, updated policy and critic
    weights bit for bit -- as with that forward (same rollout, one thread)."""
    import copy

    from transformers import AutoModelForCausalLM

    from rlhf_ext.trl.segment_ppo import SegmentPPOTrainer

    args = _config(tmp_path, segment_rm, advantage_estimator="gae", normalizer_kind="none", max_completion_length=16,
                   learning_rate=1e-3)  # fmt: skip
    ref = AutoModelForCausalLM.from_pretrained(tiny_base_path)  # a different reference: KL != 0
    trainer = SegmentPPOTrainer(tiny_sft_path, args=args, train_dataset=prompts, processing_class=toy_tok,
                                ref_model=ref)  # fmt: skip
    assert all(group["fused"] for group in trainer.critic.optimizer.param_groups)  # torch's fused AdamW kernel
    trainer.create_optimizer()
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); we run the step by hand
    critic = trainer.critic
    start = copy.deepcopy((trainer.model.state_dict(), critic.model.state_dict(), trainer.optimizer.state_dict(),
                           critic.optimizer.state_dict()))  # fmt: skip
    counts = _count_policy_forwards(trainer)
    rows = [{"prompt": p} for p in prompts["prompt"][:4] for _ in range(2)]
    torch.set_num_threads(1)
    results = {}
    for reuse in (True, False):
        for module, state in zip((trainer.model, critic.model, trainer.optimizer, critic.optimizer), start):
            module.load_state_dict(copy.deepcopy(state))
        trainer._reuse_policy_logps = reuse
        counts["forwards"] = 0
        torch.manual_seed(0)
        batch = trainer._generate_and_score_completions(rows)
        left_to_loss = "advantages" not in batch and "old_per_token_logps" not in batch
        loss = trainer.compute_loss(trainer.model, batch)  # finishes the advantages (reuse), steps the critic
        loss.backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        results[reuse] = dict(
            forwards=counts["forwards"], left_to_loss=left_to_loss, loss=loss.detach(), ids=batch["completion_ids"],
            advantages=batch["advantages"], returns=batch["returns"], kl=trainer._metrics["train"]["segment/kl"][-1],
            policy=[p.detach().clone() for p in trainer.model.parameters()],
            critic={name: p.detach().clone() for name, p in trainer.critic.model.named_parameters()},
        )  # fmt: skip
    on, off = results[True], results[False]
    assert on["forwards"] == 1 and off["forwards"] == 2  # the loss forward only; before: + the old-log-prob forward
    assert on["left_to_loss"] and not off["left_to_loss"]
    assert torch.equal(on["ids"], off["ids"]) and on["kl"] == off["kl"] != 0.0
    for key in ("loss", "advantages", "returns"):
        assert torch.equal(on[key], off[key]), key
    assert all(torch.equal(a, b) for a, b in zip(on["policy"], off["policy"], strict=True))
    assert on["critic"].keys() == off["critic"].keys()
    assert all(torch.equal(on["critic"][name], off["critic"][name]) for name in on["critic"])
    assert any(not torch.equal(p, start[1][name]) for name, p in on["critic"].items()), "the critic never stepped"
