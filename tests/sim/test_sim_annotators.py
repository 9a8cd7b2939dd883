"""AnnotatorPool: noise-free agreement with gold, measured flip rate = injected noise, reproducibility, relabel."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from rlhf_ext.datagen import rubric_for
from rlhf_ext.sim import DEFAULT_ANNOTATORS, AnnotatorPool, AnnotatorSpec, BTAnnotator, GoldScorer
from rlhf_ext.zoo.toy import toy_preference_rows

RAP = rubric_for("rapper")


def mixed_pairs(n: int, seed: int = 0) -> tuple[list[str], list[str], list[str]]:
    """Pairs of random responses with 0-3 distinct positive and 0-3 negative rapper phrases (many gold ties)."""
    rng = random.Random(seed)

    def resp() -> str:
        parts = ["Some neutral sentence."] * rng.randint(1, 3)
        parts += [f"{p}." for p in rng.sample(RAP.positive, rng.randint(0, 3))]
        parts += [f"{q}." for q in rng.sample(RAP.negative, rng.randint(0, 3))]
        rng.shuffle(parts)
        return " ".join(parts)

    return [f"prompt {i}" for i in range(n)], [resp() for _ in range(n)], [resp() for _ in range(n)]


def binomial_bound(p: float, n: int, z: float = 4.5) -> float:
    return z * math.sqrt(p * (1 - p) / n)


def test_noise_free_pool_agrees_with_gold():
    prompts, a, b = mixed_pairs(2000)
    gold = GoldScorer("rapper")
    g = gold.score(prompts + prompts, a + b)
    diff = g[:2000] - g[2000:]
    pool = AnnotatorPool.gold_only("rapper", flip_prob=0.0, seed=1)
    for train in (False, True):  # flip_prob 0: training labels are noise-free too
        label = pool.prefer(prompts, a, b, train=train)
        decided = diff != 0
        assert (label[decided] == (diff[decided] > 0)).all()
    ties = (diff == 0).sum().item()
    assert ties > 100  # ties are resolved by a fair coin, not always for one side
    share = pool.prefer(prompts, a, b, train=False)[diff == 0].float().mean().item()
    assert abs(share - 0.5) < binomial_bound(0.5, ties)
    # every default annotator made deterministic (temperature 0, no length preference) agrees with gold wherever one
    # response dominates the other (at least as many positive and at most as many negative phrases, one strict)
    specs = [dataclasses.replace(s, temperature=0.0, length_weight=0.0) for s in DEFAULT_ANNOTATORS]
    strict = AnnotatorPool.default("rapper", flip_prob=0.0, specs=specs, seed=2)
    pa, na = gold.counts(a, ["rapper"] * 2000)
    pb, nb = gold.counts(b, ["rapper"] * 2000)
    dominates = (pa >= pb) & (na <= nb) & ((pa > pb) | (na < nb))
    dominated = (pa <= pb) & (na >= nb) & ((pa < pb) | (na > nb))
    label = strict.prefer(prompts, a, b, train=False)
    assert dominates.sum() > 300 and label[dominates].all() and not label[dominated].any()


@pytest.mark.parametrize("q", [0.1, 0.25, 0.4])
def test_measured_flip_rate_is_the_injected_noise(q):
    prompts, a, b = mixed_pairs(4000, seed=7)
    pool = AnnotatorPool.default("rapper", flip_prob=q, seed=3)
    train = pool.decide(prompts, a, b, train=True)
    evals = pool.decide(prompts, a, b, train=False)
    flips = (train.prefer_a != evals.prefer_a).float()
    assert abs(flips.mean().item() - q) < binomial_bound(q, 4000)
    assert (flips.bool() == train.flipped).all() and not evals.flipped.any()
    assert (train.annotator == evals.annotator).all()
    # against a deterministic gold annotator, training labels agree with gold at rate 1 - q
    gold_pool = AnnotatorPool.gold_only("rapper", flip_prob=q, seed=4)
    rows = toy_preference_rows(4000, seed=1)
    p, c, r = [x["prompt"] for x in rows], [x["chosen"] for x in rows], [x["rejected"] for x in rows]
    agree = gold_pool.prefer(p, c, r, styles="toy", train=True).float().mean().item()
    assert abs(agree - (1 - q)) < binomial_bound(q, 4000)


def test_labels_are_reproducible_order_free_and_antisymmetric():
    prompts, a, b = mixed_pairs(500, seed=11)
    pool = AnnotatorPool.default("rapper", seed=5)
    first = pool.decide(prompts, a, b, train=True)
    again = AnnotatorPool.default("rapper", seed=5).decide(prompts, a, b, train=True)
    assert torch.equal(first.prefer_a, again.prefer_a) and torch.equal(first.annotator, again.annotator)
    perm = torch.randperm(500, generator=torch.Generator().manual_seed(0)).tolist()
    shuffled = pool.prefer([prompts[i] for i in perm], [a[i] for i in perm], [b[i] for i in perm], train=True)
    assert torch.equal(shuffled, first.prefer_a[perm])
    distinct = torch.tensor([x != y for x, y in zip(a, b)])
    swapped = pool.prefer(prompts, b, a, train=True)
    assert torch.equal(swapped[distinct], ~first.prefer_a[distinct])
    other = AnnotatorPool.default("rapper", seed=6).prefer(prompts, a, b, train=True)
    assert (other != first.prefer_a).any()
    # annotators are drawn uniformly per pair
    counts = torch.bincount(first.annotator, minlength=len(DEFAULT_ANNOTATORS)).float()
    assert (counts - 500 / 6).abs().max() < 4.5 * math.sqrt(500 * (1 / 6) * (5 / 6))


def test_bradley_terry_probability_hand_computed():
    ann = BTAnnotator("len", lambda p, r, s: torch.tensor([float(len(x)) for x in r]), temperature=2.0)
    p = ann.probability(["x", "x"], ["aaaa", "a"], ["a", "a"], [None, None])
    assert p.tolist() == pytest.approx([1 / (1 + math.exp(-1.5)), 0.5])
    hard = BTAnnotator("len", ann.utility, temperature=0.0)
    assert hard.probability(["x"] * 3, ["aa", "a", "a"], ["a", "aa", "a"], [None] * 3).tolist() == [1.0, 0.0, 0.5]
    with pytest.raises(ValueError, match="temperature"):
        BTAnnotator("bad", ann.utility, temperature=-1)


def test_reward_model_backend_uses_any_reward_function():
    longer = lambda prompts, responses: torch.tensor([float(len(r)) for r in responses])  # noqa: E731
    pool = AnnotatorPool.from_reward_models([longer], temperatures=0.0, flip_prob=0.0)
    assert pool.prefer(["p", "p"], ["long answer", "a"], ["short", "bb"], train=False).tolist() == [True, False]


def test_relabel_is_p_sim(toy_data):
    data = toy_data["train"]
    flip = [i % 3 == 0 for i in range(len(data))]
    swapped = data.map(
        lambda row, i: (
            {"chosen": row["rejected"], "rejected": row["chosen"], "swapped": flip[i]}
            if flip[i]
            else {**row, "swapped": False}
        ),
        with_indices=True,
    )
    noise_free = AnnotatorPool.gold_only(flip_prob=0.0).relabel(swapped, train=True)
    assert noise_free.column_names == [*swapped.column_names, "sim_annotator", "sim_swapped"]
    gold = GoldScorer()
    n, cols = len(noise_free), noise_free.to_dict()
    s = gold.score(cols["prompt"] * 2, cols["chosen"] + cols["rejected"])
    assert (s[:n] > s[n:]).all()  # every pair is back in gold order
    assert set(noise_free["sim_annotator"]) == {"gold"}
    assert sum(noise_free["sim_swapped"]) == sum(swapped["swapped"]) > 0
    noisy = AnnotatorPool.default(flip_prob=0.25, seed=1).relabel(data)
    wrong = sum(noisy["sim_swapped"]) / n  # the toy pairs are easy: nearly every swap is a training flip
    assert abs(wrong - 0.25) < 0.02 + binomial_bound(0.25, n)
    assert set(noisy["sim_annotator"]) <= {s.name for s in DEFAULT_ANNOTATORS}
    with pytest.raises(ValueError, match="missing"):
        AnnotatorPool.gold_only().relabel(noise_free.remove_columns("chosen"))


def test_agreement_report_values():
    prompts, a, b = mixed_pairs(800, seed=2)
    report = AnnotatorPool.gold_only("rapper", flip_prob=0.25).agreement(prompts, a, b)
    assert report.with_gold == {"gold": 1.0} and report.with_gold_train["gold"] == pytest.approx(0.75)
    assert report.pool_eval_with_gold == 1.0 and report.pool_train_with_gold == pytest.approx(0.75)
    assert 0 < report.gold_tie_fraction < 1 and report.num_pairs == 800
    default = AnnotatorPool.default("rapper").agreement(prompts, a, b)
    m = torch.tensor(default.matrix)
    assert torch.allclose(m, m.T) and (m <= 1).all() and (m >= 0.5).all()
    decisive = default.names.index("decisive")
    assert m[decisive, decisive] > m[default.names.index("prefers_long"), default.names.index("prefers_long")]
    assert 0.5 < default.pool_train_with_gold < default.pool_eval_with_gold < 1
    assert "| **pool** |" in default.as_markdown()


def test_pool_errors():
    with pytest.raises(ValueError, match="flip_prob"):
        AnnotatorPool.default(flip_prob=0.7)
    with pytest.raises(ValueError, match="unique"):
        AnnotatorPool.default(specs=[AnnotatorSpec("x"), AnnotatorSpec("x")])
    with pytest.raises(ValueError, match="must match"):
        AnnotatorPool.default().prefer(["p"], ["a", "b"], ["c"], train=False)
    with pytest.raises(TypeError):
        AnnotatorPool.default().prefer(["p"], ["a"], ["c"])  # train= is required: training or evaluation labels?


def test_llm_backend_through_a_chat_server():
    from rlhf_ext.datagen import OpenAIBackend
    from tests.helpers.chat_server import FakeChatServer

    # the fake server's judge picks the response that contains "careful"
    a = ["A careful answer.", "A sloppy answer.", "Careless text.", "Be careful here."]
    b = ["A sloppy answer.", "A careful answer.", "Another careless one", "Also careful."]
    with FakeChatServer() as server:
        backend = OpenAIBackend(server.url, model="fake-model", max_retries=0)
        pool = AnnotatorPool.from_llm([backend], preference="Be careful.", flip_prob=0.0)
        p = pool.decide(["q"] * 4, a, b, train=False)
    assert p.prefer_a[:2].tolist() == [True, False]
    assert p.probability[:2].tolist() == [1.0, 0.0]
    assert server.requests == 4


def _careless_is_unparseable(body):
    """The fake judge, but off-format ("Neither.") when a response is careless: an unparseable answer."""
    from tests.helpers.chat_server import datagen_responder, last_user_message

    return "Neither." if "Careless" in last_user_message(body) else datagen_responder(body)


def test_unparseable_answers_are_counted_warned_and_settled_or_dropped(caplog):
    """An off-format judge's answers became coin flips with no word (54 of 78 against a real server). They are counted
    per annotator, warned about above 5%, and ``unparseable="drop"`` leaves them out of the training labels."""
    import logging

    from datasets import Dataset

    from rlhf_ext.datagen import OpenAIBackend
    from tests.helpers.chat_server import FakeChatServer

    a = ["A careful answer.", "Careless text.", "A sloppy answer.", "Careless again."]
    b = ["A sloppy answer.", "Be careful here.", "A careful answer.", "Also careful."]
    rows = [{"prompt": "q", "chosen": x, "rejected": y} for x, y in zip(a, b)]
    with FakeChatServer(_careless_is_unparseable) as server:
        pool = AnnotatorPool.from_llm([OpenAIBackend(server.url, model="fake-model", max_retries=0)], "Be careful.",
                                      flip_prob=0.0)  # fmt: skip
        with caplog.at_level(logging.WARNING, logger="rlhf_ext.sim.annotators"):
            dec = pool.decide(["q"] * 4, a, b, train=False)
        assert dec.unparseable.tolist() == [False, True, False, True]
        assert dec.probability.tolist() == [1.0, 0.5, 0.0, 0.5]
        assert pool.label_counts() == {"llm0:fake-model": {"labels": 4, "unparseable": 2, "rate": 0.5}}
        assert [r.getMessage() for r in caplog.records] == [
            "annotator llm0:fake-model: 2 of 4 answers unparseable (50%), settled by a coin (pool.unparseable: drop "
            "drops them, as AlpacaEval)"
        ]
        before = pool.label_counts()
        assert len(pool.relabel(Dataset.from_list(rows))) == 4  # coin: every row keeps a label
        pool.unparseable = "drop"
        kept = pool.relabel(Dataset.from_list(rows))
        assert kept["chosen"] == ["A careful answer.", "A careful answer."]  # the two parseable rows, relabelled
        assert pool.label_counts(since=before)["llm0:fake-model"] == {"labels": 8, "unparseable": 4, "rate": 0.5}
    with pytest.raises(ValueError, match="unparseable must be coin or drop"):
        AnnotatorPool(pool.annotators, unparseable="ignore")


def test_unparseable_counts_in_sim_compare_md():
    from rlhf_ext.sim.report import feedback_lines, markdown_table

    counts = {"llm0:m": {"labels": 40, "unparseable": 3, "rate": 0.075}, "llm1:m": {"labels": 38, "unparseable": 0,
                                                                                     "rate": 0.0}}  # fmt: skip
    labels = {"pairs": 78, "gold_tied_fraction": 0.0, "heldout_gold_tied_fraction": 0.0,
              "labels_agreeing_with_gold": 0.6, "unparseable": counts, "unparseable_policy": "coin"}  # fmt: skip
    summary = {"recipe": {"feedback": {"pairs": "sft_samples"}}, "feedback": {"0": {"labels": labels}}}
    assert feedback_lines(summary)[-1] == (
        "Unparseable annotator answers in the training labels: 3 of 78; unparseable per annotator: llm0:m 3 of 40 "
        "(7.5%), settled by a coin (pool.unparseable: drop leaves them out, as AlpacaEval)."
    )
    row = {"method": "ppo", "seeds": [0], "unparseable": {"llm0:m": {"labels": 64, "unparseable": 2, "rate": 2 / 64}},
           "alpacafarm_sim_winrate": None, "train_seconds": 1.0}  # fmt: skip
    for key in ("win_rate", "gold_mean", "kl", "avg_length_chars"):
        row[key], row[f"{key}_se"] = 0.5, 0.1
    sizes = {"comparisons_per_seed": 64, "eval_prompts": 32, "samples_per_prompt": 2}
    summary.update(methods=[row], sample_sizes=sizes)
    table = markdown_table(summary)
    assert "ppo; unparseable evaluation comparisons: llm0:m 2 of 64 (3.1%), settled by a coin." in table
