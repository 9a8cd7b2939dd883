"""Segment rewards with ``--ds.packing_samples`` (and dynamic batching) on OpenRLHF 0.11.2's real models, on CPU.

With packing, OpenRLHF's ``Actor`` and reward model run on the real tokens of all rows concatenated (``[1, N]``) and pad
only their own return values back; the segment actors read entropies and per-token scores from that packed forward
and put them back in their rows (``segment_ppo.padded``). On CPU the packed forward attends through ``sdpa`` with the
block-diagonal mask transformers builds from the reset ``position_ids`` (flash-attention's varlen kernel is the GPU
path, not run here); everything else is the code that runs on GPUs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf_ext.segment import LocationNormalizer

LENGTHS = [(4, 9), (6, 3), (3, 7), (5, 6)]  # (prompt, response) tokens of the 4 samples: 2 prompts x 2 samples


@pytest.fixture(scope="module")
def seg_ppo():
    import rlhf_ext.openrlhf.segment_ppo as seg_ppo

    seg_ppo.install_in_process()
    return seg_ppo


@pytest.fixture(scope="module")
def models(tiny_sft_path):
    """OpenRLHF's reference ``Actor`` and reward model, unpacked and packed, with the same fp32 weights."""
    from openrlhf.models import Actor
    from openrlhf.models.model import _get_reward_model
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaModel, LlamaPreTrainedModel

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(tiny_sft_path).eval()
    config = AutoConfig.from_pretrained(tiny_sft_path)
    config.normalize_reward = False
    out = {}
    for packing in (False, True):
        actor = Actor(tiny_sft_path, attn_implementation="sdpa", param_dtype="bf16", packing_samples=packing)
        actor = actor.float().eval()
        actor.model.load_state_dict(hf.state_dict())
        rm = _get_reward_model(LlamaPreTrainedModel, LlamaModel, "score", packing_samples=packing)(config).eval()
        rm.model.load_state_dict(hf.model.state_dict())
        torch.manual_seed(1)
        torch.nn.init.normal_(rm.score.weight, std=0.5)  # a reward head that varies along the sequence
        out[packing] = (actor, rm)
    return out


def _actors(seg_ppo, models, packing: bool):
    """The segment reference and reward actors around OpenRLHF's models (no Ray: the Ray-wrapped classes' bodies)."""
    from rlhf_ext.runtime.token_scores import TokenScoreCapture

    actor_model, rm = models[packing]
    strategy = SimpleNamespace(ring_attn_group=None, args=SimpleNamespace(ds=SimpleNamespace(packing_samples=packing)))
    ref = seg_ppo._SegmentReferenceActor.__new__(seg_ppo._SegmentReferenceActor)
    ref.model, ref.strategy = actor_model, strategy
    reward = seg_ppo._SegmentRewardActor.__new__(seg_ppo._SegmentRewardActor)
    reward.model, reward.strategy = rm, strategy
    reward._capture = TokenScoreCapture(rm)
    return ref, reward


def _samples(seed: int = 0):
    """OpenRLHF 0.11.2's rollout samples: one ``[1, L]`` row each, no padding, ``action_mask`` ``[1, L - 1]`` over
    positions 1..L-1 (true at response tokens), plus per-sample critic values and KL."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, (p, r) in enumerate(LENGTHS):
        length = p + r
        action = torch.zeros(length - 1, dtype=torch.long)
        action[p - 1 :] = 1
        sample = Experience(
            sequences=torch.randint(3, 500, (1, length), generator=g),
            attention_mask=torch.ones(1, length, dtype=torch.long),
            action_mask=action[None],
            values=torch.randn(1, length - 1, generator=g) * action,
            kl=torch.rand(1, length - 1, generator=g) * 0.1 * action,
            info={},
        )
        sample.index = [i]
        samples.append(sample)
    return samples


def _experiences(samples, partition, pad_token_id=0):
    """Micro batches as OpenRLHF's ``split_rollout_samples`` builds them (right-padded concatenation)."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    return [Experience.concat_experiences([samples[i] for i in part], pad_token_id) for part in partition]


def _maker(seg_ppo, estimator: str):
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    args = SimpleNamespace(
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator=estimator, gamma=1.0, lambd=0.95, no_std_norm=False)),
        rollout=SimpleNamespace(n_samples_per_prompt=2, max_new_tokens=None),
        reward=SimpleNamespace(clip_range=(-3.0, 3.0), model_name_or_path=None),
        data=SimpleNamespace(max_len=64),
        ext=SimpleNamespace(
            granularity="segment", interpolation="even_split", entropy_cutoff=1.0, aggregation="softmax", tau=0.5,
            normalizer=None, reward_model_id=None, chunk_size=4,
        ),
    )  # fmt: skip
    maker = seg_ppo.SegmentExperienceMaker(
        None, None, None, None, FixedKLController(0.05), SimpleNamespace(args=args), tokenizer=None
    )
    maker.normalizer = LocationNormalizer(kind="regression", w_mu=0.2, b_mu=-0.1, w_sigma=-0.3, b_sigma=0.05)
    return maker


def _run(seg_ppo, models, packing: bool, partition, estimator: str) -> dict[str, list[torch.Tensor]]:
    """Forward both segment actors on each micro batch, then OpenRLHF's experience maker with dense rewards; returns
    per-sample (in sample order) response-token dense rewards, advantages, returns, entropies and scores."""
    ref, reward = _actors(seg_ppo, models, packing)
    experiences = _experiences(_samples(), partition)
    entropies = []
    for exp in experiences:
        _, entropy = ref.forward(exp.sequences, exp.action_mask, exp.attention_mask)
        entropies.append(entropy)
        exp.rewards = reward.forward(exp.sequences, exp.attention_mask)
        exp.info["score_rows"] = exp.rewards.clone()
    maker = _maker(seg_ppo, estimator)
    maker.attach_dense_rewards(experiences, entropies)
    dense = [getattr(e.kl, seg_ppo.DENSE_ATTR).clone() for e in experiences]
    experiences = maker.compute_advantages_and_returns(experiences)
    out: dict[str, list] = {k: [None] * len(LENGTHS) for k in ("dense", "advantages", "returns", "entropy", "scores")}
    for exp, d, ent in zip(experiences, dense, entropies):
        for row, i in enumerate(exp.index):
            real = exp.action_mask[row].bool()
            out["dense"][i] = d[row][real]
            out["advantages"][i] = exp.advantages[row][real]
            out["returns"][i] = exp.returns[row][real]
            out["entropy"][i] = ent[row][real]
            out["scores"][i] = exp.info["score_rows"][row][exp.attention_mask[row].bool()]
    return out


def _max_abs_diff(a: dict, b: dict, key: str) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a[key], b[key]))


@pytest.mark.parametrize("estimator", ["gae", "reinforce_baseline"])
def test_packed_dense_rewards_and_advantages_equal_the_unpacked_run(seg_ppo, models, estimator):
    """Unpacked micro batches of 2 in sample order vs packed micro batches in another order (as dynamic batching's
    length-balanced partitions come): per sample, the same scores, entropies, dense rewards, advantages and returns
    (the packed and padded attention differ by fp32 rounding only; measured max abs diff ~1e-6)."""
    unpacked = _run(seg_ppo, models, False, [[0, 1], [2, 3]], estimator)
    packed = _run(seg_ppo, models, True, [[3, 0], [1, 2]], estimator)
    for key in ("scores", "entropy", "dense", "advantages", "returns"):
        assert _max_abs_diff(unpacked, packed, key) < 2e-5, key
    assert all(len(d) == r for d, (_, r) in zip(packed["dense"], LENGTHS))
    assert any(float(d.abs().max()) > 0.1 for d in packed["dense"])  # real dense rewards, not zeros


def test_packed_forward_really_packs_and_segments_never_cross_samples(seg_ppo, models):
    """The packed forward sees one ``[1, N]`` row of the real tokens; changing one sample's tokens changes nothing in
    the other samples of the same packed batch (no attention, segment or reward leakage across sub-sequences)."""
    ref, reward = _actors(seg_ppo, models, True)
    seen = []
    hook = models[True][1].score.register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape)))
    exp = _experiences(_samples(), [[0, 1, 2, 3]])[0]
    n = int(exp.attention_mask.sum())
    try:
        scores = reward.forward(exp.sequences, exp.attention_mask)
    finally:
        hook.remove()
    assert seen == [(1, n, 1)] and scores.shape == exp.sequences.shape
    assert torch.all(scores[exp.attention_mask == 0] == 0)  # padding gets nothing from the packed tokens

    changed = _samples()
    changed[1].sequences = torch.randint(3, 500, changed[1].sequences.shape, generator=torch.Generator().manual_seed(9))
    exp2 = _experiences(changed, [[0, 1, 2, 3]])[0]
    _, ent1 = ref.forward(exp.sequences, exp.action_mask, exp.attention_mask)
    _, ent2 = ref.forward(exp2.sequences, exp2.action_mask, exp2.attention_mask)
    scores2 = reward.forward(exp2.sequences, exp2.attention_mask)
    others = [0, 2, 3]
    assert torch.equal(ent1[others], ent2[others]) and torch.equal(scores[others], scores2[others])
    assert not torch.equal(ent1[1], ent2[1])
    maker = _maker(seg_ppo, "gae")
    rewards = []
    for e, ent, s in ((exp, ent1, scores), (exp2, ent2, scores2)):
        e.rewards = s
        maker.attach_dense_rewards([e], [ent])
        rewards.append(getattr(e.kl, seg_ppo.DENSE_ATTR))
    assert torch.equal(rewards[0][others], rewards[1][others])
