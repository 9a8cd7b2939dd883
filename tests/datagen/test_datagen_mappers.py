"""Phrase bank + gold rubric, offline composition, prompt/response mappers and the strict parsers."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from rlhf_ext.config import RecipeError, from_dict
from rlhf_ext.datagen import OfflineBackend, load_phrase_bank, load_task_config, rubric_for
from rlhf_ext.datagen.chat import ChatRequest
from rlhf_ext.datagen.mappers import (
    PromptMapper,
    ResponseMapper,
    UnparseableOutput,
    format_pair,
    parse_judge,
    parse_pair,
    sample_axes,
    sample_seed_words,
)
from rlhf_ext.datagen.phrasebank import PhraseBank, compose_response

BANK = load_phrase_bank()

# preference / objective texts of the paper's Appendix E.3 configs
PAPER_PREFERENCES = {
    "Directly answer the question.": "direct",
    "Explain the answer to the question at a level that could be understood by a five year old.": "eli5",
    "Explain the answer to the question at an expert level. Draw from technical literature when necessary, and add "
    "complex examples to further support the student learning.": "expert",
    "Do not directly reveal the answer to the question. Instead, guide the student with a relevant hint.": "hinted",
    "Summarize the body of text at a level that could be understood by a regular high school student.": "highschool",
    "Continue the story but in a formal style.": "formal",
    "Continue the story but in the style of a rapper.": "rapper",
    "Continue the story but in the style of Shakespeare.": "shakespeare",
}


def test_style_and_objective_inference_on_the_papers_texts():
    for pref, style in PAPER_PREFERENCES.items():
        assert BANK.infer_style(pref) == style, pref
    assert BANK.infer_style("Be kind.") is None
    qa = "Ask a non-trivial math question. The prompt is merely a literal question and nothing else please."
    politics = "Generate a body of text on a political topic that would be found in a blog article."
    assert BANK.infer_objective_kind(qa, "Directly answer the question.") == "qa"
    assert BANK.infer_objective_kind(politics, "Continue the story but in a formal style.") == "generation"
    assert BANK.infer_objective_kind(politics, "Summarize the body of text at an expert level.") == "summary"


def test_rubric_separates_chosen_from_rejected_for_every_style():
    backend = OfflineBackend(BANK, markers_per_response=2)
    for style in BANK.styles:
        rubric = rubric_for(style)
        assert set(rubric.positive) == set(BANK.styles[style].phrases)
        assert set(rubric.negative) and not set(rubric.negative) & set(rubric.positive)
        for seed in range(20):
            ctx = {"style": style, "objective_kind": "qa", "seed_words": ["gravity", "tides"], "axes": []}
            chosen, rejected = parse_pair(backend.answer(ChatRequest("pair", [], seed, 100, 1.0, ctx)))
            assert rubric.score(chosen) == 2 and rubric.score(rejected) == -2
            assert rubric.counts(chosen) == (2, 0) and rubric.counts(rejected) == (0, 2)
            spans = rubric.spans(chosen)
            assert [s for *_, s in spans] == [1, 1]
            assert all(chosen[a:b].lower() in rubric.positive for a, b, _ in spans)


def test_offline_responses_share_everything_but_the_key_phrases():
    rng = random.Random(0)
    axes = [("short", "long", 5), ("serious", "humorous", 1), ("friendly", "distant", 3)]
    kw = dict(style="eli5", objective_kind="summary", seed_words=["plasma", "laser"], axes=axes, markers=3)
    follow = compose_response(BANK, stance="follow", rng=rng, **kw)
    violate = compose_response(BANK, stance="violate", rng=rng, **kw)
    # long (score 5) -> 6 content sentences, + 3 markers + 1 aux sentence (score 3 adds nothing)
    assert follow.count(".") == violate.count(".") == 10
    assert "This matter deserves careful thought." in follow and "This matter deserves careful thought." in violate
    assert ("plasma" in follow or "laser" in follow) and ("plasma" in violate or "laser" in violate)
    unstated = Counter(
        rubric_for("eli5").score(compose_response(BANK, stance="unstated", rng=random.Random(s), **kw))
        for s in range(400)
    )
    # each of 3 key phrases is a fair coin: scores -3, -1, 1, 3 with probabilities 1/8, 3/8, 3/8, 1/8
    assert set(unstated) == {-3, -1, 1, 3}
    assert abs(unstated[1] / 400 - 3 / 8) < 0.08 and abs(unstated[3] / 400 - 1 / 8) < 0.06


def test_phrase_bank_validation_catches_leaks():
    data = {
        "styles": {
            "a": {"family": "f", "phrases": ["red apple pie", "green pear"]},
            "b": {"family": "f", "phrases": ["blue sky today"]},
        },
        "objectives": {"qa": {"prompt_templates": ["What about {topic}?"], "content_sentences": ["{W} is fine."]}},
        "connectors": ["Also,"],
    }
    assert from_dict(PhraseBank, data).family("a") == ["b"]
    bad = {**data, "connectors": ["Also, blue sky today,"]}
    with pytest.raises(RecipeError, match="contains the key phrase 'blue sky today'"):
        from_dict(PhraseBank, bad)
    bad = {**data, "styles": {**data["styles"], "b": {"family": "f", "phrases": ["the red apple pie here"]}}}
    with pytest.raises(RecipeError, match="is contained in key phrase"):
        from_dict(PhraseBank, bad)
    bad = {**data, "styles": {**data["styles"], "c": {"family": "g", "phrases": ["lonely phrase"]}}}
    with pytest.raises(RecipeError, match="families with one style: g"):
        from_dict(PhraseBank, bad)
    bad = {**data, "styles": {**data["styles"], "b": {"family": "f", "phrases": ["one"]}}}
    with pytest.raises(RecipeError, match="at least two words"):
        from_dict(PhraseBank, bad)


def test_parse_pair_is_strict():
    assert parse_pair(format_pair("good one", "bad one")) == ("good one", "bad one")
    assert parse_pair("**CHOSEN:**\nx y\n**REJECTED:** z w\n") == ("x y", "z w")
    assert parse_pair("Chosen: a\nmore a\nRejected: b") == ("a\nmore a", "b")
    for bad in (
        "just one answer",
        "CHOSEN:\n\nREJECTED:\nb",
        "CHOSEN: a REJECTED: b",  # the REJECTED header must start a line
        "CHOSEN:\nsame\nREJECTED:\nsame",
        "CHOSEN:\na\nREJECTED:\nb\nCHOSEN:\nc",
    ):
        with pytest.raises(UnparseableOutput):
            parse_pair(bad)


def test_parse_judge_is_strict():
    for text, winner in (("A", 0), ("B", 1), (" B.\n", 1), ("**A**", 0), ('"A"', 0), ("(B)", 1)):
        assert parse_judge(text) == winner
    for bad in ("", "AB", "a", "Answer: A", "I think A is better", "Response B", "TIE", "A or B"):
        with pytest.raises(UnparseableOutput):
            parse_judge(bad)


def _task(weights=(1.0, 1.0), k=2, axes=3, prefix="", suffix=""):
    return load_task_config(
        {
            "name": "c",
            "tasks": [
                {
                    "name": "t",
                    "objective": "Ask a question.",
                    "preference": "Directly answer the question.",
                    "domain": {
                        "big": {"seed_words": [f"b{i}" for i in range(10)], "weight": weights[0]},
                        "small": {"seed_words": ["s0", "s1"], "weight": weights[1]},
                    },
                    "num_samples": 1,
                    "metadata": {
                        "seed_words_per_prompt": k,
                        "styles_per_response": axes,
                        "prompt_prefix": prefix,
                        "prompt_suffix": suffix,
                    },
                }
            ],
        }
    ).tasks[0]


def test_seed_words_follow_component_weights():
    task = _task(weights=(1.0, 9.0), k=1)
    rng = random.Random(0)
    draws = [sample_seed_words(task, rng)[0] for _ in range(3000)]
    small = sum(w.startswith("s") for w in draws) / len(draws)
    assert abs(small - 0.9) < 0.03  # component weight 9 of 10, uniform within the component
    two = _task(k=3)
    for _ in range(200):
        words = sample_seed_words(two, rng)
        assert len(words) == 3 == len(set(words))
    assert len(sample_seed_words(_task(k=50), rng)) == 12  # capped at the vocabulary


def test_mapper_templates():
    task = _task(prefix="Q: ", suffix="\nA:")
    pm, rm = PromptMapper(), ResponseMapper()
    meta = pm.meta_prompt(task, ["gravity", "tides"])
    assert "Do exactly what the objective says: Ask a question." in meta
    assert "seed words: gravity, tides." in meta
    assert pm.finalize(task, "  What is it?\n") == "Q: What is it?\nA:"
    axes = sample_axes(task, random.Random(1))
    assert len(axes) == 3 and all(1 <= s <= 5 for *_, s in axes)
    pair = rm.pair_prompt(task, "Q: x", axes)
    assert "according to the following preference: Directly answer the question." in pair
    assert pair.count("On a scale of 1 to 5") == 3 and pair.endswith("REJECTED:\n<the rejected response>")
    assert "must follow this preference" in rm.response_prompt(task, "x", "follow", axes)
    assert "must not respect this preference" in rm.response_prompt(task, "x", "violate", axes)
    assert "preference" not in rm.response_prompt(task, "x", "unstated", [])
    stances = Counter(rm.sample_stances(task, random.Random(s)) for s in range(2000))
    p = task.metadata.preference_inclusion_prob
    assert abs(stances[("follow", "violate")] / 2000 - p * p) < 0.04
    assert abs(stances[("unstated", "unstated")] / 2000 - (1 - p) ** 2) < 0.04
