"""Tokenisation, truncation, entropy preprocessing, caching and collation of segment preference data."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from rlhf_ext.algos.segment_dense import GRANULARITIES
from rlhf_ext.runtime.segment_data import (
    DatasetFormatError,
    add_entropy_columns,
    collate_segment_pairs,
    prepare_segment_dataset,
    sft_token_entropy,
    tokenize_pair,
    tokenize_preference_dataset,
)
from rlhf_ext.segment import token_entropy


def test_tokenize_pair_exact_boundary_and_eos(toy_tok):
    row = tokenize_pair({"prompt": "Question: hi\nAnswer:", "chosen": " Many people", "rejected": ""}, toy_tok)
    prompt_ids = toy_tok("Question: hi\nAnswer:")["input_ids"]
    eos = toy_tok.eos_token_id
    assert row["prompt_len"] == len(prompt_ids)
    assert row["chosen_ids"] == prompt_ids + toy_tok(" Many people", add_special_tokens=False)["input_ids"] + [eos]
    # an empty response becomes EOS alone: one response token, never an empty response
    assert row["rejected_ids"] == prompt_ids + [eos]


def test_truncation_cuts_prompt_left_and_response_right_keeping_eos(toy_tok):
    prompt, response = "a b c d e f g h", " one two three four five six"
    p = toy_tok(prompt)["input_ids"]
    r = toy_tok(response, add_special_tokens=False)["input_ids"]
    eos = toy_tok.eos_token_id
    row = tokenize_pair({"prompt": prompt, "chosen": response, "rejected": response}, toy_tok, 8, max_prompt_length=3)
    assert row["prompt_len"] == 3
    assert row["chosen_ids"][:3] == p[-3:]  # left-truncated prompt
    assert len(row["chosen_ids"]) == 8
    assert row["chosen_ids"][3:] == r[:4] + [eos]  # right-truncated response, last kept token replaced by EOS


def test_conversational_implicit_prompt(toy_tok):
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Many people"}]
    row = tokenize_pair({"chosen": conv, "rejected": conv[:1] + [{"role": "assistant", "content": "x"}]}, toy_tok, None)
    prompt_text = toy_tok.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True)
    assert row["prompt_len"] == len(toy_tok(prompt_text, add_special_tokens=False)["input_ids"])
    assert toy_tok.decode(row["chosen_ids"][row["prompt_len"] :]).startswith("Many people")


def test_missing_column_names_the_column(toy_tok):
    ds = Dataset.from_list([{"prompt": "p", "good": "a", "rejected": "b"}])
    with pytest.raises(DatasetFormatError, match="no column 'chosen'.*columns: prompt, good, rejected"):
        tokenize_preference_dataset(ds, toy_tok)


def test_wrong_value_type_is_named(toy_tok):
    with pytest.raises(DatasetFormatError, match="column 'chosen' must hold text or chat messages"):
        tokenize_pair({"prompt": "p", "chosen": 3, "rejected": "b"}, toy_tok)


def test_sft_entropy_chunked_head_matches_full_logits(tiny_sft_path, toy_tok):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_sft_path).eval()
    ids = torch.tensor([toy_tok("Question: What should I know about tides?\nAnswer: Many people")["input_ids"]] * 2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on the second row
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
    torch.testing.assert_close(sft_token_entropy(model, ids, mask), token_entropy(logits), atol=1e-5, rtol=1e-5)


def test_entropy_columns_align_with_response_tokens(tiny_sft_path, toy_tok, toy_data):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_sft_path).eval()
    tokenized = tokenize_preference_dataset(toy_data["train"].select(range(3)), toy_tok)
    out = add_entropy_columns(tokenized, model, batch_size=2, pad_token_id=toy_tok.pad_token_id)
    row = out[1]
    assert len(row["chosen_entropy"]) == len(row["chosen_ids"]) - row["prompt_len"]
    with torch.no_grad():
        logits = model(torch.tensor([row["chosen_ids"]])).logits
    expected = token_entropy(logits)[0, row["prompt_len"] :]
    torch.testing.assert_close(torch.tensor(row["chosen_entropy"]), expected, atol=1e-4, rtol=1e-4)


def test_prepare_uses_cache_on_second_call(tiny_sft_path, toy_tok, toy_data, tmp_path, monkeypatch):
    import rlhf_ext.runtime.segment_data as data_module

    small = toy_data["train"].select(range(4))
    first = prepare_segment_dataset(small, toy_tok, sft_model_name_or_path=tiny_sft_path, cache_dir=tmp_path)
    calls = []
    monkeypatch.setattr(data_module, "add_entropy_columns", lambda *a, **k: calls.append(1))
    second = prepare_segment_dataset(small, toy_tok, sft_model_name_or_path=tiny_sft_path, cache_dir=tmp_path)
    assert calls == []  # served from the cache
    assert second["chosen_entropy"] == first["chosen_entropy"]
    with pytest.raises(ValueError, match="needs the SFT model"):
        prepare_segment_dataset(small, toy_tok)


@pytest.mark.parametrize("side", ["left", "right"])
def test_collate_places_entropy_on_response_tokens(side):
    ex = [
        {"chosen_ids": [1, 2, 3, 4], "rejected_ids": [1, 2, 5], "prompt_len": 2,
         "chosen_entropy": [0.5, 1.5], "rejected_entropy": [2.5], "margin": 1.0},
    ]  # fmt: skip
    out = collate_segment_pairs(ex, pad_token_id=0, padding_side=side)
    assert out["input_ids"].shape == (2, 4)
    rejected = out["input_ids"][1].tolist()
    assert rejected == ([0, 1, 2, 5] if side == "left" else [1, 2, 5, 0])
    am = out["action_mask"]
    assert am.sum(1).tolist() == [2, 1]
    assert out["entropy"][am].tolist() == [0.5, 1.5, 2.5]
    assert (out["entropy"][~am] == 0).all()
    assert out["margin"].tolist() == [1.0]
    assert out["attention_mask"].sum().item() == 7


def test_collate_rejects_stale_entropy():
    ex = [{"chosen_ids": [1, 2, 3], "rejected_ids": [1, 2], "prompt_len": 1, "chosen_entropy": [0.1],
           "rejected_entropy": [0.2]}]  # fmt: skip
    with pytest.raises(DatasetFormatError, match="stale segment cache"):
        collate_segment_pairs(ex, 0)


def test_gpt2_bpe_pair_and_bandit_reward_equal_hf_pooling(gpt2_tok):
    """Real GPT-2 BPE: exact prompt/response split, and the c_ent = inf reward equals HF's own pooled logit."""
    from rlhf_ext.runtime.token_scores import token_scores
    from rlhf_ext.segment import evaluate_sequences
    from rlhf_ext.zoo.models import tiny_reward_model

    rows = [
        {"prompt": "Explain mitochondria.", "chosen": " The mitochondria is the powerhouse", "rejected": " No idea"},
        {"prompt": "Hi", "chosen": " Hello there, friend!", "rejected": " Go away."},
    ]
    tokenized = [tokenize_pair(r, gpt2_tok) for r in rows]
    for r, t in zip(rows, tokenized):
        assert gpt2_tok.decode(t["chosen_ids"][t["prompt_len"] :]) == r["chosen"] + gpt2_tok.eos_token
        assert gpt2_tok.decode(t["chosen_ids"][: t["prompt_len"]]) == r["prompt"]

    def zeros(t, side):
        return [0.0] * (len(t[f"{side}_ids"]) - t["prompt_len"])

    examples = [
        {**t, "chosen_entropy": zeros(t, "chosen"), "rejected_entropy": zeros(t, "rejected")} for t in tokenized
    ]
    batch = collate_segment_pairs(examples, gpt2_tok.pad_token_id)
    model = tiny_reward_model(gpt2_tok).eval()  # vocabulary 50258, pad token distinct from EOS
    scores = token_scores(model, batch["input_ids"], batch["attention_mask"])
    ev = evaluate_sequences(scores, batch["entropy"], batch["action_mask"], float("inf"))
    with torch.no_grad():
        pooled = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    torch.testing.assert_close(ev.values, pooled, atol=1e-5, rtol=1e-5)


def test_segment_settings_survive_a_new_working_directory_and_a_move(tmp_path, monkeypatch):
    """`segment_config.json` used to record the SFT model as given (`runs/demo/sft`, relative to the working
    directory), so `rlhf-ext segment show` failed from another directory or after the run was moved."""
    import shutil

    from rlhf_ext.runtime.segment_data import load_segment_settings, save_segment_settings

    run = tmp_path / "runs" / "demo"
    (run / "sft").mkdir(parents=True)
    (run / "rm").mkdir()
    monkeypatch.chdir(tmp_path)
    save_segment_settings(run / "rm", {"entropy_cutoff": 2.0, "sft_model_name_or_path": "runs/demo/sft"})
    monkeypatch.chdir(run / "rm")  # another working directory
    assert load_segment_settings(run / "rm")["sft_model_name_or_path"] == str((run / "sft").resolve())
    moved = tmp_path / "elsewhere"
    shutil.move(str(run), str(moved))  # the RM and its SFT model moved together
    settings = load_segment_settings(moved / "rm")
    assert settings["sft_model_name_or_path"] == str((moved / "sft").resolve())
    assert "sft_model_relative_path" not in settings
    save_segment_settings(moved / "rm", {"entropy_cutoff": 2.0, "sft_model_name_or_path": "org/hub-model"})
    assert load_segment_settings(moved / "rm")["sft_model_name_or_path"] == "org/hub-model"  # hub ids unchanged


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_run_settings_treat_every_entropy_granularity_alike(granularity, tmp_path):
    """The granularities that segment at the cutoff (``Granularity.needs_entropy``) warn when the reward model records
    no settings and refuse an infinite cutoff; the others do neither (they never read the cutoff)."""
    import math
    import warnings
    from types import SimpleNamespace

    from rlhf_ext.algos.segment_dense import Granularity
    from rlhf_ext.runtime.segment_data import segment_settings

    segments = Granularity(granularity).needs_entropy
    assert segments == (granularity in ("segment", "bandit_as_segment", "segment_as_bandit"))
    unrecorded = SimpleNamespace(reward_model_path=str(tmp_path), granularity=granularity, entropy_cutoff=None,
                                 aggregation=None, tau=None)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert segment_settings(unrecorded, True) == (2.0, "softmax", 0.5)
    assert any("records no segment settings" in str(w.message) for w in caught) == segments
    infinite = SimpleNamespace(**{**vars(unrecorded), "entropy_cutoff": math.inf})
    if segments:
        with pytest.raises(ValueError, match="infinite cutoff is the bandit setting"):
            segment_settings(infinite, True)
    else:
        assert segment_settings(infinite, True)[0] == math.inf
