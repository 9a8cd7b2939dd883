"""The simulated feedback's held-out pairs: ordered by gold, ties dropped, and the tie rate reported."""

from __future__ import annotations

import pytest
from datasets import Dataset

from rlhf_ext.datagen import rubric_for
from rlhf_ext.sim import GoldScorer
from rlhf_ext.sim.compare import order_by_gold
from rlhf_ext.sim.report import feedback_lines

POS, NEG = rubric_for("rapper").positive, rubric_for("rapper").negative


def test_order_by_gold_swaps_losers_and_drops_ties():
    rows = [
        {"prompt": "p0", "chosen": f"{POS[0]}.", "rejected": "plain.", "style": "rapper"},  # kept as is
        {"prompt": "p1", "chosen": f"{NEG[0]}.", "rejected": "plain.", "style": "rapper"},  # swapped
        {"prompt": "p2", "chosen": "plain one.", "rejected": "plain two.", "style": "rapper"},  # tie: dropped
        {"prompt": "p3", "chosen": "dropping bars about it.", "rejected": f"{POS[1]}.", "style": "rapper"},  # swapped
    ]
    ordered, tied = order_by_gold(GoldScorer("rapper"), Dataset.from_list(rows))
    assert tied == pytest.approx(1 / 4)
    assert ordered["prompt"] == ["p0", "p1", "p3"]
    assert ordered["chosen"] == [f"{POS[0]}.", "plain.", f"{POS[1]}."]
    assert ordered["rejected"] == ["plain.", f"{NEG[0]}.", "dropping bars about it."]
    # under exact credit the partial phrase is worth nothing: the last pair is still ordered, by the whole phrase
    _, tied_exact = order_by_gold(GoldScorer("rapper", phrase_credit="exact"), Dataset.from_list(rows))
    assert tied_exact == pytest.approx(1 / 4)
    # a fragment against plain text: ordered by partial credit, a tie (dropped) under exact credit
    fragment = [{"prompt": "p4", "chosen": "plain.", "rejected": "dropping bars about it.", "style": "rapper"}]
    ordered, tied = order_by_gold(GoldScorer("rapper"), Dataset.from_list(fragment))
    assert (tied, ordered["chosen"]) == (0.0, ["dropping bars about it."])
    ordered, tied = order_by_gold(GoldScorer("rapper", phrase_credit="exact"), Dataset.from_list(fragment))
    assert (tied, len(ordered)) == (1.0, 0)


def test_feedback_lines_report_tie_rates_agreement_and_rm_accuracy():
    summary = {
        "recipe": {"feedback": {"pairs": "sft_samples"}},
        "feedback": {
            "0": {"labels": {"pairs": 100, "gold_tied_fraction": 0.02, "heldout_gold_tied_fraction": 0.01,
                             "labels_agreeing_with_gold": 0.66}},
            "1": {"labels": {"pairs": 100, "gold_tied_fraction": 0.04, "heldout_gold_tied_fraction": 0.03,
                             "labels_agreeing_with_gold": 0.64}},
        },
        "reward_model_heldout_accuracy": {"bandit": {"0": 0.7, "1": 0.8}, "segment": {"0": 0.6, "1": 0.9}},
    }  # fmt: skip
    text = "\n".join(feedback_lines(summary))
    assert "two SFT samples per prompt, 2 seed(s)): 100 labelled pairs" in text
    assert "gold ties 3.0% of training pairs and 2.0% of held-out pairs" in text
    assert "agree with gold on 65.0% of untied pairs" in text
    assert "bandit 0.750, segment 0.750" in text
    assert feedback_lines({"recipe": {"feedback": {"pairs": "dataset"}}, "feedback": {}}) == []


def test_feedback_whose_held_out_pairs_all_tie_is_one_clear_error(tmp_path, monkeypatch):
    # an SFT model whose samples earn no credit makes every held-out pair a gold tie: no reward-model evaluation set
    from rlhf_ext.config import RecipeError, load_recipe
    from rlhf_ext.sim.compare import SimRun
    from rlhf_ext.sim.recipe import SimCompareRecipe

    recipe = load_recipe(SimCompareRecipe, None, [f"output_dir={tmp_path}", "task.source=toy", "task.num_samples=40",
                                                  "task.max_eval_prompts=8"])  # fmt: skip
    run = SimRun(recipe)

    def plain_pairs(prompts, styles, seed):
        rows = [
            {"prompt": p, "chosen": "plain one.", "rejected": "plain two.", "style": s} for p, s in zip(prompts, styles)
        ]
        return Dataset.from_list(rows)

    monkeypatch.setattr(run, "sft_pairs", plain_pairs)
    with pytest.raises(
        RecipeError, match=r"all \d+ held-out feedback pairs tie under the gold reward .*\(sft\.max_steps\)"
    ):
        run.feedback(0)
    assert not run.feedback_dir(0).exists()  # nothing half-written
