"""GoldScorer: exact values, repetition earns nothing, agreement with the generators' own labels."""

from __future__ import annotations

import pytest
import torch

from rlhf_ext.datagen import gold_score, rubric_for
from rlhf_ext.sim import GoldScorer
from rlhf_ext.zoo.toy import KEY_PHRASES, WEAK_PHRASES, has_key_phrase, toy_preference_rows

RAP = rubric_for("rapper")
POS, NEG = RAP.positive, RAP.negative


def test_exact_values_hand_computed():
    text = f"Intro. So {POS[0]}. Then {POS[1]}. But {NEG[0]}. Filler sentence."
    g = GoldScorer("rapper")
    assert g.score(["p"], [text]).tolist() == [1.0]  # 2 distinct positive - 1 negative
    weighted = GoldScorer("rapper", positive_weight=1.5, negative_weight=0.5)
    assert weighted.score(["p"], [text]).tolist() == [2.5]
    with_len = GoldScorer("rapper", length_weight=0.5)
    assert with_len.score(["p"], [text]).item() == pytest.approx(1.0 + 0.5 * len(text) / 100)
    assert g.score(["p"], ["nothing relevant here at all"]).tolist() == [0.0]
    assert g.score(["p"], [text.upper()]).tolist() == [1.0]  # case-insensitive, like the generator's rubric


def test_repeated_key_phrases_earn_nothing_more():
    once = f"Start. {POS[0]}. End."
    thrice = f"Start. {POS[0]}. {POS[0]}, {POS[0]}. End."
    g = GoldScorer("rapper")
    assert g.score(["p", "p"], [once, thrice]).tolist() == [1.0, 1.0]
    # the generator's occurrence-counting rubric would pay 3x for the repetition: ours must not
    assert gold_score(thrice, "rapper") == 3
    # repeated *negative* phrases are not punished more either, and distinct ones each count
    assert g.score(["p"], [f"{NEG[0]}. {NEG[0]}. {NEG[1]}."]).tolist() == [-2.0]
    two = f"{POS[0]}. {POS[1]}."
    assert g.score(["p"], [two]).tolist() == [2.0]


def test_toy_mode_matches_has_key_phrase_and_orders_pairs():
    rows = toy_preference_rows(200, seed=3)
    g = GoldScorer()  # style None = toy task
    texts = [r[k] for r in rows for k in ("chosen", "rejected")]
    pos, _ = g.counts(texts, [None] * len(texts))
    assert ((pos >= 1) == torch.tensor([has_key_phrase(t) for t in texts])).all()
    scores = g.score([r["prompt"] for r in rows for _ in range(2)], texts).view(-1, 2)
    assert (scores[:, 0] == 1).all() and (scores[:, 1] == -1).all()
    assert GoldScorer("toy").score(["p"], [KEY_PHRASES[0] + " and " + WEAK_PHRASES[0]]).tolist() == [0.0]


def test_generated_pairs_are_ordered_by_gold(tmp_path):
    from rlhf_ext.datagen import generate_dataset, load_continual_dataset

    generate_dataset("continual-piecewise-preference", tmp_path / "d", num_samples=12, overrides=["drift.cycles=1"])
    g = GoldScorer()
    for stage in load_continual_dataset(tmp_path / "d"):
        for split in stage.values():
            n, cols = len(split), split.to_dict()
            s = g.score(cols["prompt"] * 2, cols["chosen"] + cols["rejected"], cols["style"] * 2)
            assert (s[:n] > 0).all() and (s[n:] < 0).all()  # chosen follow the style, rejected violate it


def test_styles_argument_forms_and_errors():
    g = GoldScorer({"p1": "rapper", "p2": "formal"})
    t = f"{POS[0]}."
    assert g.score(["p1", "p2"], [t, t]).tolist() == [1.0, -1.0]  # rapper is a competitor of formal
    assert GoldScorer().score(["x", "y"], [t, t], styles="rapper").tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="no style"):
        g.score(["p3"], [t])
    with pytest.raises(ValueError, match="unknown style 'nope'"):
        GoldScorer("nope")
    with pytest.raises(ValueError, match="one prompt per response"):
        GoldScorer("rapper").score(["p"], [t, t])
    with pytest.raises(ValueError, match="one style per row"):
        GoldScorer().score(["p", "q"], [t, t], styles=["rapper"])
    with pytest.raises(ValueError, match=">= 0"):
        GoldScorer(negative_weight=-1)


def test_callable_as_reward_function_and_chat_responses():
    g = GoldScorer("rapper")
    assert g(["p"], [f"{POS[2]}."]).tolist() == [1.0]
    chat = [{"role": "assistant", "content": f"{POS[2]}."}]
    assert g.score(["p"], [chat]).tolist() == [1.0]
