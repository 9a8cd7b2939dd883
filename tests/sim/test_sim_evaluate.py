"""win_rate / HFPolicy / best-of-n on the tiny SFT model of the toy task (the whole evaluation path, real sampling)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_ext.runtime.sampling import Samples
from rlhf_ext.sim import AnnotatorPool, BestOfNPolicy, GoldScorer, HFPolicy, best_of_n, win_rate


@pytest.fixture(scope="module")
def sft_policy(tiny_sft_path) -> HFPolicy:
    torch.set_num_threads(1)
    return HFPolicy(tiny_sft_path, max_new_tokens=64, temperature=1.0)


@pytest.fixture(scope="module")
def eval_prompts(toy_data) -> list[str]:
    return list(toy_data["test"]["prompt"])[:48]


def test_policy_against_itself_is_even(sft_policy, eval_prompts):
    res = win_rate(sft_policy, sft_policy, eval_prompts, judge=AnnotatorPool.default(seed=3), samples_per_prompt=2)
    assert res.num_comparisons == 96 and res.wins + res.ties + res.losses == 96
    assert 0 < res.stderr < 0.1
    assert abs(res.win_rate - 0.5) < 3.5 * max(res.stderr, 0.5 / math.sqrt(48))
    assert res.kl == 0.0  # log pi(y|x) - log pi(y|x), same weights: exactly zero
    assert res.avg_length_chars > 20 and res.kl_method == "sequence_log_ratio"


def test_best_of_n_with_the_gold_scorer_beats_sft(sft_policy, eval_prompts):
    gold = GoldScorer()
    bon = BestOfNPolicy(sft_policy, gold, n=8)
    res = win_rate(bon, sft_policy, eval_prompts, judge=AnnotatorPool.default(seed=1), gold=gold, seed=5)
    assert res.win_rate > 0.5 + 3 * res.stderr
    assert res.gold_mean > res.ref_gold_mean
    assert res.kl == pytest.approx(math.log(8) - 7 / 8) and res.kl_method == "analytic_best_of_n"
    by_gold = win_rate(bon, sft_policy, eval_prompts, judge="gold", gold=gold, seed=5, compute_kl=False)
    assert by_gold.win_rate > 0.5 and by_gold.ties > 0  # equal gold rewards are ties, counted 1/2
    assert by_gold.win_rate == pytest.approx((by_gold.wins + 0.5 * by_gold.ties) / by_gold.num_comparisons)
    # the helper returns one best response per prompt, and none is worse than a plain sample under the scorer
    best = best_of_n(sft_policy, eval_prompts[:8], gold, n=8, seed=2)
    assert len(best) == 8 and (gold(eval_prompts[:8], best) >= 0).float().mean() >= 0.75


def test_logprobs_match_a_direct_computation(sft_policy, toy_tok):
    prompt, response = "Question: What should I know about glaciers?\nAnswer:", " Many people wonder about this."
    lp = sft_policy.logprobs([prompt, prompt], [response, response], [False, True])
    p_ids = toy_tok(prompt)["input_ids"]
    r_ids = toy_tok(response, add_special_tokens=False)["input_ids"] + [toy_tok.eos_token_id]
    ids = torch.tensor([p_ids + r_ids])
    with torch.no_grad():
        logp = torch.log_softmax(sft_policy.model(input_ids=ids).logits[0, :-1].float(), -1)
    targets = ids[0, 1:]
    per_token = logp[torch.arange(len(targets)), targets][len(p_ids) - 1 :]
    assert lp[0].item() == pytest.approx(per_token.sum().item(), abs=1e-4)
    assert lp[1].item() == pytest.approx(per_token[:-1].sum().item(), abs=1e-4)  # truncated: no EOS term
    hot = HFPolicy(sft_policy.model, toy_tok, temperature=2.0)
    assert hot.logprobs([prompt], [response], [False]).item() != pytest.approx(lp[0].item(), abs=1e-3)


def test_kl_of_a_different_policy_is_positive(sft_policy, tiny_base_path, eval_prompts):
    res = win_rate(sft_policy, HFPolicy(tiny_base_path, max_new_tokens=64), eval_prompts[:16], seed=1)
    assert res.kl > 5 * res.kl_stderr > 0  # the SFT model is far from the untrained base
    assert res.ref_gold_mean == 0.0  # the untrained model's text carries no key phrase of either kind


class FixedPolicy:
    """A test double of the policy protocol: always the same responses."""

    def __init__(self, texts: list[str]):
        self.texts, self.name = texts, "fixed"

    def sample(self, prompts, n, seed):
        rows = [[t] * n for t in self.texts]
        return Samples(rows, torch.full((len(rows), n), 5), torch.zeros(len(rows), n, dtype=torch.bool), [1.0] * n)


def test_gold_judge_counts_ties_as_half():
    from rlhf_ext.zoo.toy import KEY_PHRASES, WEAK_PHRASES

    good, bad, meh = f"It is {KEY_PHRASES[0]}.", f"It is {WEAK_PHRASES[0]}.", "It is so."
    mine = FixedPolicy([good, good, meh, bad])
    ref = FixedPolicy([bad, good, meh, good])
    res = win_rate(mine, ref, ["a", "b", "c", "d"], judge="gold", compute_kl=False)
    assert (res.wins, res.ties, res.losses) == (1, 2, 1) and res.win_rate == 0.5
    assert res.gold_mean == pytest.approx(0.25) and res.ref_gold_mean == pytest.approx(0.25)
    with pytest.raises(ValueError, match="logprobs"):
        win_rate(mine, ref, ["a", "b", "c", "d"], judge="gold")


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        HFPolicy(str(tmp_path))
    with pytest.raises(ValueError, match="tokenizer="):
        HFPolicy(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="at least one prompt"):
        win_rate(FixedPolicy([]), FixedPolicy([]), [], compute_kl=False)


def test_exact_token_kl_matches_a_direct_computation(sft_policy, tiny_base_path, toy_tok):
    base = HFPolicy(tiny_base_path, max_new_tokens=64)
    prompt, response = "Question: What should I know about glaciers?\nAnswer:", " Many people wonder about this."
    kl = sft_policy.token_kl(base, [prompt, prompt], [response, response], [False, True])
    p_ids = toy_tok(prompt)["input_ids"]
    ids = torch.tensor([p_ids + toy_tok(response, add_special_tokens=False)["input_ids"] + [toy_tok.eos_token_id]])
    with torch.no_grad():
        lp = torch.log_softmax(sft_policy.model(input_ids=ids).logits[0, :-1].double(), -1)
        lq = torch.log_softmax(base.model(input_ids=ids).logits[0, :-1].double(), -1)
    per_position = (lp.exp() * (lp - lq)).sum(-1)[len(p_ids) - 1 :]  # logits at t predict token t + 1
    assert kl[0].item() == pytest.approx(per_position.sum().item(), rel=1e-4)
    assert kl[1].item() == pytest.approx(per_position[:-1].sum().item(), rel=1e-4)  # truncated: no EOS position
    assert sft_policy.token_kl(sft_policy, [prompt], [response], [False]).item() == 0.0


def test_the_exact_kl_is_never_negative_where_the_log_ratio_mean_is(sft_policy, toy_tok, eval_prompts):
    """Issue 23 item 16: the demo printed KL(PPO || SFT) = -0.257 nats (the mean log-ratio over few samples of a
    policy close to its reference). The exact per-token KL of the same samples is >= 0 sample by sample."""
    import copy

    near = copy.deepcopy(sft_policy.model)
    with torch.no_grad():
        for i, p in enumerate(near.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 1e-3)
    close = HFPolicy(near, toy_tok, max_new_tokens=64)
    prompts = eval_prompts[:8]
    ratio = win_rate(close, sft_policy, prompts, judge="gold", seed=0)
    exact = win_rate(close, sft_policy, prompts, judge="gold", seed=0, kl_estimator="exact")
    assert ratio.kl_method == "sequence_log_ratio" and ratio.kl < 0  # what the demo printed
    assert exact.kl_method == "exact_token_sum" and exact.kl > 0 and exact.kl_stderr > 0
    samples = close.sample(prompts, 1, seed=0)
    per_sample = close.token_kl(sft_policy, prompts, samples.flat(), samples.truncated.flatten())
    assert bool((per_sample >= 0).all()) and per_sample.double().mean().item() == pytest.approx(exact.kl)
