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


def test_partial_credit_hand_computed():
    # "dropping bars about the ballot box": its 5 bigrams are distinctive; a fragment with 3 of them earns 3/5.
    g = GoldScorer("rapper")
    assert "dropping bars about the ballot box" in POS
    fragment = "Then dropping bars about the town. The end."  # (dropping bars), (bars about), (about the)
    assert g.score(["p"], [fragment]).item() == pytest.approx(3 / 5)
    # a fragment of a competing (negative) phrase costs its share: "forsooth the realm is" = 3 of 5 bigrams
    assert g.score(["p"], ["forsooth the realm is quiet."]).item() == pytest.approx(-3 / 5)
    # bigrams across punctuation do not count: "dropping. bars about" keeps only (bars about)
    assert g.score(["p"], ["dropping. bars about nothing"]).item() == pytest.approx(1 / 5)
    # generic bigrams of two stop words earn nothing ("and the" is in "the beat drops and the people rise")
    assert g.score(["p"], ["and the"]).item() == 0.0
    # exact credit pays only whole phrases; both pay 1 for a whole phrase
    exact = GoldScorer("rapper", phrase_credit="exact")
    assert exact.score(["p"], [fragment]).tolist() == [0.0]
    whole = f"So {POS[1]}. And {NEG[2]} and the rest."
    assert g.score(["p"], [whole]).tolist() == exact.score(["p"], [whole]).tolist() == [0.0]
    with pytest.raises(ValueError, match="phrase_credit"):
        GoldScorer("rapper", phrase_credit="fuzzy")


def test_partial_credit_ignores_neutral_text_and_shared_bigrams():
    from rlhf_ext.datagen import load_phrase_bank

    bank = load_phrase_bank()
    g = GoldScorer("rapper")
    neutral = bank.neutral_texts()
    assert g.score(["p"] * len(neutral), neutral).abs().max().item() == 0.0  # no neutral text earns credit
    # every distinctive bigram belongs to exactly one phrase of the bank: a whole phrase credits only itself
    for style in ("rapper", "formal", "shakespeare"):
        for phrase in bank.style(style).phrases:
            pos, neg = g.counts([phrase], ["rapper"])
            assert (pos.item(), neg.item()) == ((1.0, 0.0) if style == "rapper" else (0.0, 1.0))


def test_partial_credit_is_exact_credit_on_generated_responses(tmp_path):
    # responses made of whole key phrases and neutral text score the same under both credits
    from rlhf_ext.datagen import generate_dataset, load_continual_dataset

    generate_dataset("continual-piecewise-preference", tmp_path / "d", num_samples=30, overrides=["drift.cycles=1"])
    partial, exact = GoldScorer(), GoldScorer(phrase_credit="exact")
    for stage in load_continual_dataset(tmp_path / "d"):
        cols = stage["train"].to_dict()
        texts, styles = cols["chosen"] + cols["rejected"], cols["style"] * 2
        assert torch.equal(
            partial.score(cols["prompt"] * 2, texts, styles), exact.score(cols["prompt"] * 2, texts, styles)
        )


def test_partial_credit_grades_recombined_phrases():
    # random recombinations of phrase words (what a small SFT model produces): exact credit ties most pairs at 0,
    # partial credit almost never ties, and it is monotone: adding a distinctive bigram never lowers P
    import random

    rng = random.Random(0)

    def fragment() -> str:  # 2 to 4 consecutive words of a random key phrase
        words = rng.choice(POS + NEG).split()
        n = rng.randint(2, 4)
        start = rng.randrange(len(words) - n + 1)
        return " ".join(words[start : start + n])

    texts = [". ".join(fragment() for _ in range(3)) + "." for _ in range(400)]
    partial, exact = GoldScorer("rapper"), GoldScorer("rapper", phrase_credit="exact")
    p = partial.score(["p"] * 400, texts).view(200, 2)
    e = exact.score(["p"] * 400, texts).view(200, 2)
    assert (e[:, 0] == e[:, 1]).float().mean() > 0.9
    assert (p[:, 0] == p[:, 1]).float().mean() < 0.2
    for t in texts[:50]:
        pos, _ = partial.counts([t], ["rapper"])
        more, _ = partial.counts([t + " " + POS[0]], ["rapper"])
        assert more.item() >= pos.item() and more.item() >= 1.0
