"""Dense reward sources with their own tokenizer: a segment reward model on GPT-2's BPE rewarding the toy policy's
completions (cross-tokenizer spans), and a process reward model read at step separators."""

from __future__ import annotations

import pytest
import torch

from rlhf_ext.runtime.spans import dense_rewards, parse_outputs
from tests.helpers.cross_tokenizer import gpt2_segment_rm

RESPONSES = [
    " Many people wonder about this. The facts about tides are backed by peer-reviewed evidence.",
    " Café owners say ☕ helps.\nThen again, some experts disagree.\nNo one knows.",
    " Short.",
]


@pytest.fixture(scope="module")
def gpt2_rm(tmp_path_factory):
    return gpt2_segment_rm(tmp_path_factory.mktemp("gpt2_rm"))


def _policy_batch(tok, texts):
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    c = max(map(len, ids))
    completion_ids = torch.zeros(len(ids), c, dtype=torch.long)
    mask = torch.zeros(len(ids), c, dtype=torch.bool)
    for i, row in enumerate(ids):
        completion_ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), True
    return completion_ids, mask


def test_segment_rm_with_another_tokenizer_rewards_the_policys_tokens(gpt2_rm, toy_tok):
    """The GPT-2-tokenizer segment RM's spans are its own segments (same text, same rewards as its in-process
    ``SegmentScorer.score``); mapped onto the toy policy's 512-token BPE with an even split, each response's summed
    reward is the sum of its segment rewards (every segment has text, so every span covers a policy token)."""
    from rlhf_ext.runtime.dense_sources import SegmentRewardSpans
    from rlhf_ext.runtime.token_scores import SegmentScorer

    source = SegmentRewardSpans(gpt2_rm, device="cpu")
    assert source.scorer.tokenizer.vocab_size != toy_tok.vocab_size
    prompts = ["Question: tides?\nAnswer:"] * len(RESPONSES)
    spans = source(prompts, RESPONSES)
    scorer = SegmentScorer(gpt2_rm)
    eos = scorer.tokenizer.eos_token
    split_chars = 0
    for prompt, response, row in zip(prompts, RESPONSES, spans):
        view = scorer.score(prompt, response)
        assert len(row) == len(view.segments) >= 1
        texts = [response[a:b] for a, b, _ in row]
        own = [t.removesuffix(eos) for t in view.segments]
        # a segment of EOS alone is attached to the response's last character; a segment edge inside a multi-byte
        # character (GPT-2's byte tokens) decodes to U+FFFD in the view, while the spans give both segments the
        # whole character
        for t, o in zip(texts, own):
            assert t == o or not o or ("\ufffd" in o and t.startswith(o.split("\ufffd")[0])), (t, o)
        split_chars += sum("\ufffd" in o for o in own)
        assert [r for _, _, r in row] == pytest.approx(view.rewards, abs=1e-5)
    assert split_chars > 0  # the fixture exercises a segment edge inside "☕"
    completion_ids, mask = _policy_batch(toy_tok, RESPONSES)
    batch = dense_rewards([parse_outputs("segment_rm", spans, len(spans))], [1.0], toy_tok, completion_ids, mask)
    expected = torch.tensor([sum(r for _, _, r in row) for row in spans])
    torch.testing.assert_close(batch.sequence_reward, expected, atol=1e-5, rtol=1e-5)
    assert batch.segments_per_response.tolist() == [len(row) for row in spans]


def test_process_reward_model_scores_each_step_at_its_last_token(gpt2_rm, tmp_path):
    """Steps end after each separator; step ``k``'s reward is the classifier's score at the last token of the
    prompt + response up to the end of step ``k`` (a causal model: its score there does not see later steps)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_ext.runtime.dense_sources import ProcessRewardModel
    from rlhf_ext.runtime.token_scores import token_scores

    prm = ProcessRewardModel(gpt2_rm, step_separator="\n", device="cpu")
    text = RESPONSES[1]
    assert prm.steps(text) == [(0, 26), (26, 61), (61, len(text))]
    assert prm.steps("a\n") == [(0, 2)] and prm.steps("") == []
    (row,) = prm(["Question: coffee?\nAnswer:"], [text])
    assert [(a, b) for a, b, _ in row] == prm.steps(text)
    tok = AutoTokenizer.from_pretrained(gpt2_rm)
    model = AutoModelForSequenceClassification.from_pretrained(gpt2_rm, num_labels=1).eval()
    prompt_ids = tok("Question: coffee?\nAnswer:", add_special_tokens=False)["input_ids"]
    for _, b, reward in row[:-1]:  # steps ending at a separator: their tokens end there (GPT-2 keeps "\n" apart)
        ids = torch.tensor([prompt_ids + tok(text[:b], add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            expected = token_scores(model, ids, torch.ones_like(ids))[0, -1].item()
        assert reward == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="step_separator must be a non-empty string"):
        ProcessRewardModel(gpt2_rm, step_separator="")


def test_model_sources_with_another_tokenizer_train_the_toy_policy(gpt2_rm, tmp_path, tiny_sft_path, toy_tok,
                                                                   toy_data):  # fmt: skip
    """DensePPOTrainer(reward_funcs=[SegmentRewardSpans, ProcessRewardModel]) on GPT-2-tokenizer models, the policy on
    the toy BPE: one step trains, and with an even split the dense reward per response (logged ``segment/score``) is
    the sum of the two sources' totals (each logged by GRPO as ``rewards/<name>/mean``)."""
    from datasets import Dataset

    from rlhf_ext.runtime.dense_sources import ProcessRewardModel, SegmentRewardSpans
    from rlhf_ext.trl.segment_ppo import DensePPOTrainer
    from tests.helpers.dense_ppo import tiny_dense_ppo_config

    prompts = Dataset.from_list([{"prompt": r["prompt"]} for r in toy_data["train"]])
    args = tiny_dense_ppo_config(tmp_path)
    sources = [SegmentRewardSpans(gpt2_rm, device="cpu"), ProcessRewardModel(gpt2_rm, device="cpu")]
    trainer = DensePPOTrainer(tiny_sft_path, sources, args, prompts, None, toy_tok)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    log = trainer.state.log_history[0]
    totals = log["rewards/segment_rm/mean"] + log["rewards/process_reward_model/mean"]
    assert log["segment/score"] == pytest.approx(totals, abs=1e-4)
    assert log["segment/segments_per_response"] > 1
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
