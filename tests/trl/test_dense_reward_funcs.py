"""DensePPOTrainer(reward_funcs=[...]) with dense reward sources: spans or per-token rewards from a function, rules, a
process reward model, a segment reward model with another tokenizer, and the reward server."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset

from rlhf_ext.algos.location_norm import LocationNormalizer
from rlhf_ext.runtime.spans import RewardOutputError, dense_rewards, fit_span_normalizer, parse_outputs
from tests.helpers.dense_ppo import tiny_dense_ppo_config


@pytest.fixture(scope="module")
def prompts(toy_data):
    return Dataset.from_list([{"prompt": r["prompt"]} for r in toy_data["train"]])


def _record(trainer) -> list:
    """The dense rewards the trainer computes for each rollout, with the completion ids and mask they are for."""
    seen = []
    original = trainer._dense_rewards

    def recording(input_ids, attention_mask, completion_ids, mask, ref_entropy):
        dense, scores = original(input_ids, attention_mask, completion_ids, mask, ref_entropy)
        seen.append((completion_ids.clone(), mask.clone(), dense))
        return dense, scores

    trainer._dense_rewards = recording
    return seen


def token_id_reward(prompts, completions, completion_ids, **kwargs):
    """Per-token rewards (the source shares the policy's tokenizer): (id mod 7) / 8, one per completion token."""
    return [torch.tensor(ids, dtype=torch.float32).remainder(7) / 8 for ids in completion_ids]


def test_per_token_rewards_land_on_their_tokens_and_equal_char_spans_over_them(tmp_path, tiny_sft_path, toy_tok,
                                                                               prompts):  # fmt: skip
    """A per-token source's rewards are the dense rewards at the completion's tokens, exactly; the same values as
    character spans over each token's text (through the policy tokenizer's offsets) give the same tensor, except
    on tokens without text (EOS), which no span can reach."""
    from rlhf_ext.runtime.spans import token_char_offsets
    from rlhf_ext.trl.segment_ppo import DensePPOTrainer

    args = tiny_dense_ppo_config(tmp_path, max_completion_length=64)
    trainer = DensePPOTrainer(tiny_sft_path, [token_id_reward], args, prompts, None, toy_tok)
    assert trainer.reward_funcs == [token_id_reward]  # the user's functions, as given
    seen = _record(trainer)
    trainer.train()
    (ids, mask, batch), = seen  # fmt: skip
    expected = torch.where(mask, ids.remainder(7).float() / 8, 0.0)
    assert torch.equal(batch.rewards, expected)
    spans = []
    for row, m in zip(ids, mask):
        _, offsets = token_char_offsets(toy_tok, row[m].tolist())
        spans.append([(a, b, (t % 7) / 8) for (a, b), t in zip(offsets, row[m].tolist()) if b > a])
    as_chars = dense_rewards([parse_outputs("spans", spans, len(spans))], [1.0], toy_tok, ids, mask)
    text = torch.zeros_like(mask)
    for i, (row, m) in enumerate(zip(ids, mask)):
        _, offsets = token_char_offsets(toy_tok, row[m].tolist())
        text[i, m.nonzero().flatten()] = torch.tensor([b > a for a, b in offsets])
    assert torch.equal(as_chars.rewards, torch.where(text, expected, 0.0))
    assert bool((~text & mask).any())  # EOS tokens were sampled: the difference is real


def test_a_users_span_function_trains_and_logs_what_it_paid(tmp_path, tiny_sft_path, toy_tok, prompts):
    """One span over each completion's first half, rewarded by its length: the logged reward function mean is the
    mean paid, the dense sequence reward the same (an even split keeps each span's total), one span per response,
    and the policy moves."""
    from rlhf_ext.trl.segment_ppo import DensePPOTrainer

    paid: list[float] = []

    def first_half(prompts, completions, **kwargs):
        spans = [[(0, len(c) // 2, len(c) / 50)] if len(c) >= 2 else [] for c in completions]
        paid.extend(r for row in spans for _, _, r in row)
        return spans

    trainer = DensePPOTrainer(tiny_sft_path, first_half, tiny_dense_ppo_config(tmp_path), prompts, None, toy_tok)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    log = trainer.state.log_history[0]
    assert len(paid) == 8
    assert log["rewards/first_half/mean"] == pytest.approx(sum(paid) / 8, abs=1e-6)
    assert log["segment/score"] == pytest.approx(sum(paid) / 8, abs=1e-5)
    assert log["segment/segments_per_response"] == 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_span_normalizer_fitted_on_calibration_pairs(toy_tok, toy_data):
    """One whole-text span per response rewarded by its length: every span is at location 1, so a ``global`` fit is
    the mean and standard deviation of the calibration responses' lengths."""

    def length(prompts, completions, **kwargs):
        return [[(0, len(c), float(len(c)))] for c in completions]

    pairs = toy_data["train"].select(range(16))
    norm = fit_span_normalizer([length], toy_tok, pairs, kind="global")
    lengths = torch.tensor(
        [float(len(c)) for c in list(pairs["chosen"]) + list(pairs["rejected"])], dtype=torch.float64
    )
    assert norm.mean(torch.tensor(1.0)).item() == pytest.approx(lengths.mean().item(), rel=1e-6)
    assert norm.std(torch.tensor(1.0)).item() == pytest.approx(lengths.std().item(), rel=1e-3)
    with pytest.raises(ValueError, match="0 of the reward functions returned spans"):
        fit_span_normalizer([lambda prompts, completions, **kw: [1.0] * len(completions)], toy_tok, pairs)


def test_bad_answers_and_settings_are_one_clear_line(tmp_path, tiny_sft_path, toy_tok, prompts):
    from rlhf_ext.trl.segment_ppo import DensePPOTrainer

    with pytest.raises(ValueError, match="granularity 'chunk' segments a reward model's token scores"):
        args = tiny_dense_ppo_config(tmp_path, granularity="chunk")
        DensePPOTrainer(tiny_sft_path, token_id_reward, args, prompts, None, toy_tok)
    with pytest.raises(RewardOutputError, match="returned str for completion 0"):
        parse_outputs("f", ["oops"], 1)
    with pytest.raises(RewardOutputError, match=r"returned \(1, 2\) in the spans of completion 0"):
        parse_outputs("f", [[(1, 2)]], 1)
    with pytest.raises(RewardOutputError, match="3 per-token rewards for completion 0, which has 2 tokens"):
        parse_outputs("f", [[0.1, 0.2, 0.3]], 1, [2])
    with pytest.raises(RewardOutputError, match="2 items for 1 completions"):
        parse_outputs("f", [1.0, 2.0], 1)
    with pytest.raises(ValueError, match="fitted to one reward source; 2 sources returned spans"):
        out = parse_outputs("f", [[(0, 1, 1.0)]], 1)
        norm = LocationNormalizer(kind="global")
        dense_rewards([out, out], [1.0, 1.0], toy_tok, torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.bool),
                      normalizer=norm)  # fmt: skip
    assert math.isnan(parse_outputs("f", [None], 1).totals()[0])  # unscored stays NaN


def test_rules_learned_from_pairs_pay_their_weights_on_the_policys_tokens(tmp_path, tiny_sft_path, toy_tok, toy_data,
                                                                          prompts):  # fmt: skip
    """KeywordCredit learned from the toy pairs (deterministic), saved and loaded, in DensePPOTrainer: with
    ``segment_end`` each rollout row's dense rewards sum to the weights of the rules found in its decoded text
    (recounted here with ``str.find``), on as many tokens as rules found."""
    from rlhf_ext.runtime.dense_sources import KeywordCredit
    from rlhf_ext.trl.segment_ppo import DensePPOTrainer

    pairs = toy_data["train"]
    learned = KeywordCredit.learn(pairs["chosen"], pairs["rejected"], top_k=8, ngram=(1, 1))
    learned.save(tmp_path / "rules.yaml")
    rules = KeywordCredit.load(tmp_path / "rules.yaml")
    assert rules.rules == learned.rules and len(rules.rules) >= 2
    assert any(w > 0 for _, w in rules.rules) and any(w < 0 for _, w in rules.rules)
    args = tiny_dense_ppo_config(tmp_path, max_completion_length=48, interpolation="segment_end")
    trainer = DensePPOTrainer(tiny_sft_path, [rules], args, prompts, None, toy_tok)
    seen = _record(trainer)
    trainer.train()
    (ids, mask, batch), = seen  # fmt: skip
    paid_rows = 0
    for row, m, rewards in zip(ids, mask, batch.rewards):
        text = toy_tok.decode(row[m].tolist(), skip_special_tokens=True).lower()
        found = [w for p, w in rules.rules if text.find(p.lower()) >= 0]
        assert rewards.sum().item() == pytest.approx(sum(found), abs=1e-5)
        assert int((rewards != 0).sum()) <= len(found)
        paid_rows += bool(found)
    assert paid_rows > 0  # the sampled responses hit the learned phrases
