"""Dense reward sources (spans) on OpenRLHF's real experience maker: the same rewards, advantages and returns as the
TRL trainer's functions on identical tensors, for every kind of ``--ext.reward_source``: a rules file, a user's
callable, a segment reward model and a process reward model (both on GPT-2's tokenizer, the policy's is the toy BPE).
The Ray loop runs one kind end to end (``test_ray_ppo_e2e.py``); the actor loads every kind through the same
:func:`rlhf_ext.zoo.builtins.resolve_reward_source`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf_ext.algos.ppo import per_token_kl, ppo_advantages
from rlhf_ext.runtime.spans import CapturedSource, dense_rewards
from rlhf_ext.segment import LocationNormalizer

USER_SOURCE = '''
def first_words(prompts, completions, **kwargs):
    """A user's dense reward: 0.5 on each completion's first word, -0.25 on its last character."""
    out = []
    for text in completions:
        first = text.split(" ")[0]
        out.append([(0, len(first), 0.5), (len(text) - 1, len(text), -0.25)] if text else [])
    return out
'''

RESPONSES = [
    "Many people wonder about this, and the answer is simple.",
    "Thank you for asking: café au lait is ☕ coffee with milk.",
    "No.",
    "Sure, thank you, here is the answer you asked for.",
]


@pytest.fixture(scope="module")
def seg_ppo():
    import rlhf_ext.openrlhf.segment_ppo as seg_ppo

    seg_ppo.install_in_process()
    return seg_ppo


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    (root / "rules.yaml").write_text("rules:\n- {pattern: thank you, weight: 1.0}\n- {pattern: answer, weight: -0.5}\n")
    (root / "user_source.py").write_text(USER_SOURCE)
    from tests.helpers.cross_tokenizer import gpt2_segment_rm

    rm = gpt2_segment_rm(root / "models")
    return {"rules": f"rules:{root / 'rules.yaml'}", "callable": f"{root / 'user_source.py'}:first_words",
            "segment-rm": f"segment-rm:{rm}", "prm": f"prm:{rm}"}  # fmt: skip


def _rollout(tok, seed=0, prompt_len=3):
    """A real OpenRLHF Experience holding ``RESPONSES`` tokenised by ``tok`` (EOS after the first two), left-padded
    prompts and right-padded responses, with random values and KL."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    ids = [tok(r, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if i < 2 else [])
           for i, r in enumerate(RESPONSES)]  # fmt: skip
    b, a = len(ids), max(map(len, ids))
    g = torch.Generator().manual_seed(seed)
    action = torch.zeros(b, a, dtype=torch.long)
    action_mask = torch.zeros(b, a, dtype=torch.bool)
    for i, row in enumerate(ids):
        action[i, : len(row)], action_mask[i, : len(row)] = torch.tensor(row), True
    exp = Experience(
        sequences=torch.cat([torch.randint(5, 50, (b, prompt_len), generator=g), action], dim=1),
        attention_mask=torch.cat([torch.ones(b, prompt_len, dtype=torch.long), action_mask.long()], dim=1),
        action_mask=action_mask,
        values=torch.randn(b, a, generator=g) * action_mask,
        kl=torch.randn(b, a, generator=g).abs() * 0.1 * action_mask,
        info={},
        prompts=[f"prompt {i}" for i in range(b)],
    )
    exp.index = list(range(b))
    return exp


def _args(estimator, granularity, spec):
    return SimpleNamespace(
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator=estimator, gamma=1.0, lambd=0.95, no_std_norm=False)),
        rollout=SimpleNamespace(n_samples_per_prompt=2, max_new_tokens=None),
        reward=SimpleNamespace(clip_range=(-1.5, 1.5), model_name_or_path=None),
        data=SimpleNamespace(max_len=64),
        ext=SimpleNamespace(
            granularity=granularity, interpolation="even_split", entropy_cutoff=None, aggregation=None, tau=None,
            normalizer=None, reward_model_id=None, chunk_size=4, reward_source=spec, step_separator="\n",
        ),
    )  # fmt: skip


@pytest.mark.parametrize("granularity", ["segment", "bandit", "segment_as_bandit"])
@pytest.mark.parametrize("estimator", ["gae", "reinforce_baseline"])
@pytest.mark.parametrize("source", ["rules", "callable", "segment-rm", "prm"])
def test_trl_and_openrlhf_give_identical_span_rewards_and_advantages(seg_ppo, sources, toy_tok, source, granularity,
                                                                     estimator):  # fmt: skip
    """``--ext.reward_source`` through OpenRLHF's experience maker (its decode, its GAE loop, reward clip, group
    baseline and whitening) = the TRL trainer's path (TRL's decode of the completions, the reward function wrapped as
    DensePPOTrainer wraps it, :func:`dense_rewards`, :func:`ppo_advantages`) on identical tensors."""
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    from rlhf_ext.runtime.dense_sources import load_reward_source

    exp = _rollout(toy_tok)
    mask, values = exp.action_mask, exp.values.clone()
    logp = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    ref = logp - exp.kl  # k1 KL = logp - ref = the experience's kl
    norm = LocationNormalizer(kind="regression", w_mu=0.3, b_mu=-0.2, w_sigma=-0.5, b_sigma=0.1)
    maker = seg_ppo.SegmentExperienceMaker(None, None, None, None, FixedKLController(0.05),
                                           SimpleNamespace(args=_args(estimator, granularity, sources[source])),
                                           tokenizer=toy_tok)  # fmt: skip
    maker.normalizer = norm
    batches = [maker.source_rewards(exp)]
    assert torch.equal(exp.rewards, torch.zeros(4))  # OpenRLHF then calls no reward model
    maker.attach_source_rewards([exp], batches)
    attached = getattr(exp.kl, seg_ppo.DENSE_ATTR)
    out = maker.compute_advantages_and_returns([exp])[0]

    completion_ids = exp.sequences[:, -mask.shape[1] :]
    ids = [row[m].tolist() for row, m in zip(completion_ids, mask)]
    completions = toy_tok.batch_decode(ids, skip_special_tokens=True)  # as TRL decodes them for reward functions
    assert completions == RESPONSES
    func = CapturedSource(load_reward_source(sources[source]))
    func(prompts=list(exp.prompts), completions=completions, completion_ids=ids)
    dense = dense_rewards([func.pop()], [1.0], toy_tok, completion_ids, mask, normalizer=norm,
                          granularity=granularity)  # fmt: skip
    kl = torch.where(mask, per_token_kl(logp, ref, "k1"), 0.0)
    _, adv, ret = ppo_advantages(dense.rewards, kl, mask, 0.05, values if estimator == "gae" else None, estimator,
                                 1.0, 0.95, group_size=2, clip_range=(-1.5, 1.5))  # fmt: skip
    assert torch.equal(attached, dense.rewards)
    assert torch.equal(out.info["reward"], dense.sequence_reward)
    torch.testing.assert_close(out.advantages * mask, adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.returns * mask, ret, atol=1e-5, rtol=1e-5)
    assert dense.rewards.abs().sum() > 0  # every response of the fixture earns something from both sources


def test_rules_put_credit_on_the_matched_tokens(seg_ppo, sources, toy_tok):
    """Hand-checked: with ``segment_end`` interpolation and no normalizer, the rules' +1.0 for "thank you" sits on the
    token holding its last character, and the sum per response is the rules' total."""
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    exp = _rollout(toy_tok)
    args = _args("reinforce", "segment", sources["rules"])
    args.ext.interpolation = "segment_end"
    maker = seg_ppo.SegmentExperienceMaker(None, None, None, None, FixedKLController(0.05), SimpleNamespace(args=args),
                                           tokenizer=toy_tok)  # fmt: skip
    (batch,) = [maker.source_rewards(exp)]
    expected_totals = torch.tensor([-0.5, 1.0, 0.0, 0.5])  # once per rule: "answer" -0.5, "thank you" +1.0
    assert torch.equal(batch.sequence_reward, expected_totals)
    assert batch.segments_per_response.tolist() == [1, 1, 0, 2]
    row = 1  # "Thank you ..." : +1.0 on the token holding the "u" of "you"
    ids = exp.sequences[row, -exp.action_mask.shape[1] :][exp.action_mask[row]].tolist()
    (at,) = batch.rewards[row].nonzero().flatten().tolist()
    assert batch.rewards[row, at] == 1.0
    assert len(toy_tok.decode(ids[:at], skip_special_tokens=True)) < len("Thank you")  # "u" not yet written
    assert toy_tok.decode(ids[: at + 1], skip_special_tokens=True).startswith("Thank you")


def test_remote_url_with_a_dense_granularity_asks_the_server_for_spans(seg_ppo, cache_dir):
    """``--reward.remote_url`` at ``rlhf-ext serve rm`` with ``--ext.granularity segment``: the launcher routes the URL
    to the experience maker (OpenRLHF builds no reward actor and the engines fetch nothing), which asks the server for
    spans; the rewards equal the TRL path's with ``RemoteSegmentReward(url, spans=True)``, and each response's summed
    reward is the sum of its in-process segment rewards (same tokenizer, even split, no normalizer)."""
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    from rlhf_ext.openrlhf.train_ppo_ray import route_rewards
    from rlhf_ext.pipelines.builtins import resolve_model
    from rlhf_ext.runtime.remote_reward import RemoteSegmentReward
    from rlhf_ext.runtime.token_scores import SegmentScorer
    from rlhf_ext.serve.server import RewardServer
    from rlhf_ext.serve.settings import ServeSettings

    rm_dir = resolve_model("builtin:tiny-segment-rm", cache_dir)
    scorer = SegmentScorer(rm_dir)
    tok = scorer.tokenizer
    with RewardServer(scorer, ServeSettings(port=0, max_request_pairs=64), model_dir=rm_dir) as server:
        args = _args("reinforce_baseline", "segment", None)
        args.reward.remote_url = [f"{server.url}/get_reward"]
        args.train = SimpleNamespace(agent_func_path=None)
        route_rewards(args)
        assert (
            args.reward.remote_url == [seg_ppo.REWARDS_IN_MAKER] and args.ext.remote_url == f"{server.url}/get_reward"
        )
        args.ext.remote_url = args.ext.remote_url  # the maker reads it from --ext (the launcher's attach_ext)
        exp = _rollout(tok)
        maker = seg_ppo.SegmentExperienceMaker(None, None, None, None, FixedKLController(0.05),
                                               SimpleNamespace(args=args), tokenizer=tok)  # fmt: skip
        assert isinstance(maker.source, RemoteSegmentReward) and maker.source.spans
        batch = maker.source_rewards(exp)
        mask = exp.action_mask
        completion_ids = exp.sequences[:, -mask.shape[1] :]
        ids = [row[m].tolist() for row, m in zip(completion_ids, mask)]
        completions = tok.batch_decode(ids, skip_special_tokens=True)
        func = CapturedSource(RemoteSegmentReward(server.url, spans=True))
        func(prompts=list(exp.prompts), completions=completions, completion_ids=ids)
        trl = dense_rewards([func.pop()], [1.0], tok, completion_ids, mask)
    assert torch.equal(batch.rewards, trl.rewards)
    for prompt, response, total in zip(exp.prompts, completions, batch.sequence_reward.tolist()):
        assert total == pytest.approx(sum(scorer.score(prompt, response).rewards), abs=1e-4)
