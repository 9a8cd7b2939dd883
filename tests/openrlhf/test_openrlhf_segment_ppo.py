"""Segment PPO on OpenRLHF's real experience maker and Ray actor classes, on CPU (the Ray pipeline needs GPUs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf_ext.algos.ppo import per_token_kl, ppo_advantages
from rlhf_ext.runtime.calibration import save_normalizer
from rlhf_ext.runtime.resources import Cluster
from rlhf_ext.segment import LocationNormalizer, dense_segment_rewards, token_entropy


@pytest.fixture(scope="module")
def seg_ppo():
    import rlhf_ext.openrlhf.segment_ppo as seg_ppo

    seg_ppo.install_in_process()
    return seg_ppo


def _args(estimator="gae", granularity="segment", normalizer=None, n_samples=1, reward_model=None):
    return SimpleNamespace(
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator=estimator, gamma=1.0, lambd=0.95, no_std_norm=False)),
        rollout=SimpleNamespace(n_samples_per_prompt=n_samples, max_new_tokens=None),
        reward=SimpleNamespace(clip_range=None, model_name_or_path=reward_model),
        data=SimpleNamespace(max_len=64),
        ext=SimpleNamespace(
            granularity=granularity, interpolation="even_split", entropy_cutoff=2.0, aggregation="softmax",
            tau=0.5, normalizer=normalizer, reward_model_id=None, chunk_size=4,
        ),
    )  # fmt: skip


def _maker(cls, args, kl_coef=0.01):
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    return cls(None, None, None, None, FixedKLController(kl_coef), SimpleNamespace(args=args), tokenizer=None)


def _experience(seed=0, b=4, prompt=3, a=7):
    """A real OpenRLHF Experience: left-padded prompts, right-padded responses of different lengths."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 5, 3, 6])[:b]
    action_mask = torch.arange(a).unsqueeze(0) < lengths.unsqueeze(1)
    t = prompt + a
    exp = Experience(
        sequences=torch.randint(0, 50, (b, t), generator=g),
        attention_mask=torch.cat([torch.ones(b, prompt, dtype=torch.long), action_mask.long()], dim=1),
        action_mask=action_mask,
        values=torch.randn(b, a, generator=g) * action_mask,
        kl=torch.randn(b, a, generator=g).abs() * 0.1 * action_mask,
        info={},
    )
    exp.index = list(range(b))
    return exp, torch.randn(b, t, generator=g), torch.rand(b, a, generator=g) * 4


def test_bandit_granularity_reproduces_stock_openrlhf_exactly(seg_ppo):
    """Dense path with granularity=bandit = OpenRLHF's scalar reward on the last token, same advantages/returns."""
    RemoteExperienceMaker = seg_ppo.RemoteExperienceMaker  # the stock class (the module attribute is replaced)

    stock_exp, scores, _ = _experience()
    a = stock_exp.action_mask.shape[1]
    last = a - 1 - stock_exp.action_mask.long().fliplr().argmax(dim=1)
    stock_exp.rewards = scores[:, -a:].gather(1, last[:, None]).squeeze(1)  # the RM's scalar: score at EOS
    ours_exp, _, _ = _experience()
    ours_exp.rewards = scores.clone()  # SegmentRewardModelActor returns [B, T]

    for estimator in ("gae", "reinforce"):
        s, o = _experience()[0], _experience()[0]
        s.rewards, o.rewards = stock_exp.rewards.clone(), scores.clone()
        stock = _maker(RemoteExperienceMaker, _args(estimator)).compute_advantages_and_returns([s])[0]
        maker = _maker(seg_ppo.SegmentExperienceMaker, _args(estimator, granularity="bandit"))
        maker.attach_dense_rewards([o], None)
        ours = maker.compute_advantages_and_returns([o])[0]
        torch.testing.assert_close(ours.advantages, stock.advantages, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ours.returns, stock.returns, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "granularity", ["segment", "chunk", "token", "bandit", "bandit_as_segment", "segment_as_bandit"]
)
@pytest.mark.parametrize("estimator", ["gae", "reinforce", "reinforce_baseline"])
def test_trl_and_openrlhf_paths_give_identical_rewards_and_advantages(seg_ppo, granularity, estimator):
    """Identical tensors through OpenRLHF's experience maker (its GAE loop, its reward clip, its group baseline and
    whitening) and the TRL trainer's functions: the same numbers for every granularity x estimator, with 2 samples
    per prompt and a clip range small enough to bite."""
    exp, scores, entropy = _experience(seed=3)
    logp = torch.randn(exp.action_mask.shape) * exp.action_mask
    ref = logp - exp.kl  # k1 KL = logp - ref = the experience's kl
    norm = LocationNormalizer(kind="regression", w_mu=0.3, b_mu=-0.2, w_sigma=-0.5, b_sigma=0.1)
    args = _args(estimator, granularity=granularity, n_samples=2)
    args.reward.clip_range = (-1.5, 1.5)
    maker = _maker(seg_ppo.SegmentExperienceMaker, args, kl_coef=0.05)
    maker.normalizer = norm
    values = exp.values.clone()
    exp.rewards = scores.clone()
    maker.attach_dense_rewards([exp], [entropy])
    out = maker.compute_advantages_and_returns([exp])[0]

    mask = exp.action_mask
    a = mask.shape[1]
    dense_trl = dense_segment_rewards(scores[:, -a:], mask, entropy, normalizer=norm, entropy_cutoff=2.0,
                                      granularity=granularity)  # fmt: skip
    kl = torch.where(mask, per_token_kl(logp, ref, "k1"), 0.0)
    _, adv, ret = ppo_advantages(
        dense_trl.rewards, kl, mask, 0.05, values if estimator == "gae" else None, estimator, 1.0, 0.95,
        group_size=2, clip_range=(-1.5, 1.5),
    )  # fmt: skip
    torch.testing.assert_close(out.advantages * mask, adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.returns * mask, ret, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.info["reward"].float().reshape(-1), dense_trl.sequence_reward.reshape(-1))
    if estimator == "reinforce_baseline":  # the group baseline acted: advantages differ from plain reinforce
        _, plain, _ = ppo_advantages(dense_trl.rewards, kl, mask, 0.05, None, "reinforce", group_size=2,
                                     clip_range=(-1.5, 1.5))  # fmt: skip
        assert not torch.allclose(plain, adv, atol=1e-3)


def test_chunk_rewards_do_not_depend_on_the_segmentation_the_policy_can_steer(seg_ppo):
    """The robust mode on OpenRLHF's experience maker: for fixed responses and scores, entropies that would move or
    multiply entropy boundaries (a lower effective cutoff, shuffled positions) leave every dense reward unchanged;
    the paper's mode gets a different summed reward from the same responses."""
    exp, scores, entropy = _experience(seed=5)
    steered = entropy[:, torch.randperm(entropy.shape[1], generator=torch.Generator().manual_seed(0))] + 1.5
    norm = LocationNormalizer(kind="regression", w_mu=0.3, b_mu=-2.0, w_sigma=-0.5, b_sigma=0.1)
    summed = {}
    for granularity in ("chunk", "segment"):
        for name, ent in (("sft", entropy), ("steered", steered)):
            e = _experience(seed=5)[0]
            e.rewards = scores.clone()
            maker = _maker(seg_ppo.SegmentExperienceMaker, _args("reinforce", granularity=granularity))
            maker.normalizer = norm
            maker.attach_dense_rewards([e], [ent])
            summed[granularity, name] = (getattr(e.kl, seg_ppo.DENSE_ATTR), e.info["reward"])
    assert torch.equal(summed["chunk", "sft"][0], summed["chunk", "steered"][0])
    assert torch.equal(summed["chunk", "sft"][1], summed["chunk", "steered"][1])
    assert not torch.equal(summed["segment", "sft"][1], summed["segment", "steered"][1])


def test_reinforce_path_matches_reward_to_go(seg_ppo):
    exp, scores, entropy = _experience(seed=5)
    maker = _maker(seg_ppo.SegmentExperienceMaker, _args("reinforce"), kl_coef=0.0)
    exp.rewards = scores.clone()
    maker.attach_dense_rewards([exp], [entropy])
    dense = getattr(exp.kl, seg_ppo.DENSE_ATTR).clone()
    out = maker.compute_advantages_and_returns([exp])[0]
    expected = torch.flip(torch.cumsum(torch.flip(dense, [1]), 1), [1]) * exp.action_mask
    torch.testing.assert_close(out.returns * exp.action_mask, expected, atol=1e-5, rtol=1e-5)


def test_scalar_rewards_with_segment_granularity_are_refused(seg_ppo):
    exp, _, entropy = _experience()
    exp.rewards = torch.zeros(4)
    maker = _maker(seg_ppo.SegmentExperienceMaker, _args("gae"))
    with pytest.raises(ValueError, match="one score per sample"):
        maker.attach_dense_rewards([exp], [entropy])
    with pytest.raises(ValueError, match="need the reference model's entropies"):
        maker.attach_dense_rewards([exp], None)
    with pytest.raises(ValueError, match="need --algo.advantage.estimator gae | reinforce | reinforce_baseline"):
        _maker(seg_ppo.SegmentExperienceMaker, _args("rloo"))


def test_normalizer_for_another_reward_model_is_refused(seg_ppo, tmp_path):
    path = tmp_path / "n.json"
    save_normalizer(LocationNormalizer(kind="global", reward_model="/models/rm-a"), path)
    args = _args(normalizer=str(path))
    args.ext.reward_model_id = "/models/rm-b"
    with pytest.raises(ValueError, match="fitted for reward model"):
        _maker(seg_ppo.SegmentExperienceMaker, args)


def test_reward_actor_returns_scores_at_every_position(seg_ppo, tiny_sft_path, toy_tok):
    """SegmentRewardModelActor.forward on OpenRLHF's reward model: one score per position, last = stock reward."""
    from openrlhf.models.model import _get_reward_model
    from transformers import AutoConfig, AutoModelForSequenceClassification, LlamaModel, LlamaPreTrainedModel

    from rlhf_ext.runtime.token_scores import TokenScoreCapture, token_scores

    hf = AutoModelForSequenceClassification.from_pretrained(tiny_sft_path, num_labels=1).eval()
    config = AutoConfig.from_pretrained(tiny_sft_path)
    config.normalize_reward = False
    model = _get_reward_model(LlamaPreTrainedModel, LlamaModel, "score")(config).eval()
    model.load_state_dict(hf.state_dict())
    actor = seg_ppo._SegmentRewardActor.__new__(seg_ppo._SegmentRewardActor)
    actor.model = model
    actor.strategy = SimpleNamespace(
        ring_attn_group=None, args=SimpleNamespace(ds=SimpleNamespace(packing_samples=False))
    )
    actor._capture = TokenScoreCapture(model)
    ids = torch.tensor([toy_tok("Question: hi\nAnswer: Many people wonder about this.")["input_ids"]] * 2)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    scores = actor.forward(ids, mask)
    assert scores.shape == ids.shape
    with torch.no_grad():
        stock = model(ids, attention_mask=mask)  # OpenRLHF's scalar: the score at the last real token
    torch.testing.assert_close(scores[:, -1], stock)
    torch.testing.assert_close(scores[0], token_scores(hf, ids[:1], mask[:1])[0], atol=1e-5, rtol=1e-5)


def test_reference_actor_returns_entropies_from_the_same_forward(seg_ppo, tiny_sft_path, toy_tok):
    from openrlhf.models import Actor
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_sft_path).eval()
    actor_model = Actor(tiny_sft_path, attn_implementation="sdpa", param_dtype="bf16").float().eval()
    actor_model.model.load_state_dict(hf.state_dict())  # the same fp32 weights (Actor loads bf16)
    actor = seg_ppo._SegmentReferenceActor.__new__(seg_ppo._SegmentReferenceActor)
    actor.model = actor_model
    actor.strategy = SimpleNamespace(
        ring_attn_group=None, args=SimpleNamespace(ds=SimpleNamespace(packing_samples=False))
    )
    ids = torch.tensor([toy_tok("Question: hi\nAnswer: Many people wonder about this.")["input_ids"]])
    a = 6
    action_mask = torch.ones(1, a, dtype=torch.bool)
    log_probs, entropy = actor.forward(ids, action_mask, torch.ones_like(ids))
    with torch.no_grad():
        logits = hf(ids).logits
    torch.testing.assert_close(entropy, token_entropy(logits)[:, -a:], atol=1e-4, rtol=1e-4)
    expected_lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)[:, -a:]
    torch.testing.assert_close(log_probs, expected_lp, atol=1e-4, rtol=1e-4)


def test_reference_actor_takes_one_log_softmax_and_returns_openrlhfs_log_probs(seg_ppo, tiny_sft_path, monkeypatch):
    """The reference forward shares one log-softmax between the KL's log-probs and the entropies: OpenRLHF's
    ``log_probs_from_logits`` and every ``torch.logsumexp`` stay uncalled (before: OpenRLHF's log-probs, then
    ``token_entropy``'s own logsumexp), and the log-probs are the stock reference actor's bit for bit."""
    import openrlhf.models.actor as actor_module
    from openrlhf.models import Actor
    from openrlhf.models.utils import compute_entropy

    actor_model = Actor(tiny_sft_path, attn_implementation="sdpa", param_dtype="bf16").float().eval()
    actor = seg_ppo._SegmentReferenceActor.__new__(seg_ppo._SegmentReferenceActor)
    actor.model = actor_model
    actor.strategy = SimpleNamespace(
        ring_attn_group=None, args=SimpleNamespace(ds=SimpleNamespace(packing_samples=False))
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (3, 14), generator=g)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :2] = 0  # a left-padded prompt
    action_mask = torch.ones(3, 6, dtype=torch.bool)
    action_mask[1, 4:] = False  # a shorter response
    with torch.no_grad():
        stock_lp, output = actor_model(ids, action_mask, attention_mask, return_output=True)
        stock_ent = compute_entropy(output["logits"])[:, -7:-1] * action_mask
    calls = []
    real_lp, real_lse = actor_module.log_probs_from_logits, torch.logsumexp
    monkeypatch.setattr(actor_module, "log_probs_from_logits", lambda *a, **k: calls.append("lp") or real_lp(*a, **k))
    monkeypatch.setattr(torch, "logsumexp", lambda *a, **k: calls.append("lse") or real_lse(*a, **k))
    log_probs, entropy = actor.forward(ids, action_mask, attention_mask)
    assert calls == []
    assert torch.equal(log_probs, stock_lp)
    torch.testing.assert_close(entropy, stock_ent, atol=1e-5, rtol=0)


def test_flatten_results_splits_reference_tuples(seg_ppo):
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        maker = _maker(seg_ppo.SegmentExperienceMaker, _args())
        refs = [ray.put([(torch.ones(1), torch.zeros(1)), (torch.ones(2), torch.zeros(2))])]
        log_probs = maker._flatten_results(refs, 1)
        assert [lp.numel() for lp in log_probs] == [1, 2] and [e.numel() for e in maker._ref_entropies] == [1, 2]
        plain = maker._flatten_results([ray.put([torch.ones(3)])], 1)
        assert plain[0].numel() == 3
    finally:
        ray.shutdown()


def test_install_patches_openrlhf_modules(seg_ppo):
    import openrlhf.trainer.ppo_trainer as ppo_trainer
    import openrlhf.trainer.ppo_utils.experience_maker as em
    import openrlhf.trainer.ray.launcher as launcher

    assert ppo_trainer.RemoteExperienceMaker is seg_ppo.SegmentExperienceMaker
    assert em.compute_reward is seg_ppo.dense_aware_compute_reward
    assert launcher.RewardModelActor is seg_ppo.SegmentRewardModelActor
    assert launcher.ReferenceModelActor is seg_ppo.SegmentReferenceModelActor


def test_recipe_maps_to_train_ppo_ray_flags(seg_ppo, tmp_path):
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe, openrlhf_argv
    from rlhf_ext.recipes import recipe_path

    recipe = load_recipe(SegmentPPORecipe, recipe_path("segment_ppo_openrlhf"))
    recipe.model.sft_model, recipe.model.reward_model = "/m/sft", "/m/rm"
    normalizer = str(tmp_path / "n.json")
    save_normalizer(LocationNormalizer(kind="global", reward_model="/m/rm"), normalizer)
    argv = openrlhf_argv(recipe, "/tmp/p.jsonl", normalizer, Cluster((8,), 80.0))
    pairs = {flag: value for flag, value in zip(argv, argv[1:]) if flag.startswith("--") and not value.startswith("--")}
    assert "--train.async_enable" in argv and pairs["--train.async_queue_size"] == "1"
    assert pairs["--algo.kl.init_coef"] == "0.01" and pairs["--critic.value_clip"] == "0.25"
    assert pairs["--ext.granularity"] == "chunk" and pairs["--ext.normalizer"] == normalizer  # the recipe's
    from rlhf_ext.openrlhf.train_ppo_ray import parse_ext_args

    rest, ext = parse_ext_args(argv)
    assert not any(a.startswith("--ext.") for a in rest) and ext["normalizer"] == normalizer


def test_recipe_flags_on_a_cpu_machine(seg_ppo):
    """``train.max_steps`` and ``train.bf16`` reach OpenRLHF; no GPU-only defaults (colocation, vLLM engine count,
    flash-attention) on a CPU, the HF rollout engine; fp32 is refused with the fix (OpenRLHF trains in bf16/fp16
    only)."""
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe, openrlhf_argv

    recipe = load_recipe(SegmentPPORecipe, None, ["engine=openrlhf", "train.max_steps=3", "train.batch_size=8",
                                                  "train.micro_batch_size=8", "train.bf16=true"])  # fmt: skip
    recipe.model.sft_model, recipe.model.reward_model = "/m/sft", "/m/rm"
    cpu = Cluster((0,))
    argv = openrlhf_argv(recipe, "/tmp/p.jsonl", None, cpu)
    pairs = {flag: value for flag, value in zip(argv, argv[1:]) if flag.startswith("--") and not value.startswith("--")}
    assert pairs["--data.max_samples"] == "24" and pairs["--ds.param_dtype"] == "bf16"
    assert pairs["--ext.rollout_engine"] == "hf"
    assert pairs["--ds.attn_implementation"] == "sdpa" and pairs["--actor.num_gpus_per_node"] == "1"
    assert "--train.colocate_all" not in argv and "--vllm.num_engines" not in argv
    recipe.train.openrlhf_args = {"actor.num_gpus_per_node": 2}  # two actor ranks: micro batch 8 -> 4 each
    argv = openrlhf_argv(recipe, "/tmp/p.jsonl", None, cpu)
    assert argv[argv.index("--train.micro_batch_size") + 1] == "4"
    recipe.train.bf16, recipe.train.openrlhf_args = False, {}
    with pytest.raises(ValueError, match="OpenRLHF trains in bf16 or fp16 only"):
        openrlhf_argv(recipe, "/tmp/p.jsonl", None, cpu)


@pytest.mark.parametrize("estimator", ["gae", "reinforce"])
def test_bandit_granularity_keeps_per_sample_remote_rewards(seg_ppo, estimator):
    """``--reward.remote_url`` (and agents) give one reward per sample, stacked by OpenRLHF as ``[B, 1]``; bandit
    granularity read it as per-token scores and crashed at step 1 (``entropy (4, 1) and action_mask (4, 7) must
    match``). Now the run equals stock OpenRLHF's on the same rewards."""
    RemoteExperienceMaker = seg_ppo.RemoteExperienceMaker
    remote = torch.tensor([[0.5], [-1.25], [2.0], [0.75]])  # what the server answered, one per sample
    s, o = _experience()[0], _experience()[0]
    s.rewards, o.rewards = remote.clone(), remote.clone()
    stock = _maker(RemoteExperienceMaker, _args(estimator)).compute_advantages_and_returns([s])[0]
    maker = _maker(seg_ppo.SegmentExperienceMaker, _args(estimator, granularity="bandit"))
    maker.attach_dense_rewards([o], None)
    assert torch.equal(o.rewards, remote) and torch.equal(o.info["reward"], remote)
    ours = maker.compute_advantages_and_returns([o])[0]
    assert torch.equal(ours.advantages, stock.advantages) and torch.equal(ours.returns, stock.returns)


def test_the_train_sections_optimisation_keys_reach_openrlhfs_parsed_args(seg_ppo):
    """``train.weight_decay``, ``warmup_ratio``, ``lr_scheduler_type`` and ``max_grad_norm`` reach the actor (and the
    clip the critic, which TRL's engine clips with the same norm) as OpenRLHF's own parser reads them. Before, the PPO
    argv left them out and OpenRLHF trained with its defaults (weight decay 0, warm-up 0.03, cosine, norm 1.0)
    whatever the recipe said, while the TRL engine honoured them: the same recipe trained differently per engine."""
    from rlhf_ext.config import load_recipe
    from rlhf_ext.openrlhf.cli_runner import parsed_args
    from rlhf_ext.openrlhf.train_ppo_ray import for_cluster, parse_ext_args
    from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe, openrlhf_argv

    keys = ["train.weight_decay=0.1", "train.warmup_ratio=0.2", "train.lr_scheduler_type=linear",
            "train.max_grad_norm=0.5"]  # fmt: skip
    base = ["engine=openrlhf", "train.max_steps=3", "train.batch_size=8", "train.micro_batch_size=8", "train.bf16=true"]
    recipe = load_recipe(SegmentPPORecipe, None, [*base, *keys])
    recipe.model.sft_model, recipe.model.reward_model = "/m/sft", "/m/rm"
    cluster = Cluster((0,))
    rest, _ = for_cluster(*parse_ext_args(openrlhf_argv(recipe, "/tmp/p.jsonl", None, cluster)), cluster)
    args = parsed_args("openrlhf.cli.train_ppo_ray", rest)
    actor, critic = vars(args)["actor"], vars(args)["critic"]
    assert (actor.adam.weight_decay, actor.lr_warmup_ratio, actor.lr_scheduler, actor.max_norm) == (
        0.1, 0.2, "linear", 0.5)  # fmt: skip
    assert critic.max_norm == 0.5


def test_a_fractional_epoch_count_is_refused_on_the_openrlhf_engine_not_rounded(seg_ppo):
    """OpenRLHF counts passes over the prompts in whole episodes: ``train.num_train_epochs: 1.5`` became 2 episodes
    (the TRL engine trains 1.5 epochs). Now one error naming the fix, as the reward model's OpenRLHF path does."""
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe, openrlhf_argv

    recipe = load_recipe(SegmentPPORecipe, None, ["engine=openrlhf", "train.num_train_epochs=1.5", "train.bf16=true"])
    recipe.model.sft_model, recipe.model.reward_model = "/m/sft", "/m/rm"
    with pytest.raises(ValueError, match="set train.num_train_epochs to an integer, or train.max_steps"):
        openrlhf_argv(recipe, "/tmp/p.jsonl", None, Cluster((0,)))
    recipe.train.num_train_epochs = 2.0
    argv = openrlhf_argv(recipe, "/tmp/p.jsonl", None, Cluster((0,)))
    assert argv[argv.index("--train.num_episodes") + 1] == "2"
