"""Draws count half a win, as in AlpacaEval: identical responses without asking, an annotator's explicit draw answer.

Win rates and standard errors here are computed by hand: outcomes ``o_i`` in {1, 1/2, 0}, win rate ``mean(o)``,
standard error ``std(o, ddof=1) / sqrt(n)`` (AlpacaEval's ``standard_error`` of ``preference - 1``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlhf_ext.sim import AnnotatorPool, BTAnnotator, win_rate
from rlhf_ext.sim.annotators import pair_uniforms
from rlhf_ext.zoo.toy import KEY_PHRASES, WEAK_PHRASES
from tests.helpers.chat_server import AF_BAD, AF_EVEN, AF_GOOD, FakeChatServer, alpaca_farm_responder
from tests.helpers.fixed_policy import FixedPolicy

LMSYS = Path(__file__).resolve().parents[1] / "fixtures" / "alpaca_eval" / "lmsys_gpt4"
GOOD, BAD = f"It is {KEY_PHRASES[0]}.", f"It is {WEAK_PHRASES[0]}."


class RecordingUtility:
    """A gold-like utility (+1 for the key phrase, -1 for the weak one) that records every response it scores."""

    def __init__(self):
        self.seen: list[str] = []

    def __call__(self, prompts, responses, styles):
        self.seen += responses
        return torch.tensor([float(KEY_PHRASES[0] in r) - float(WEAK_PHRASES[0] in r) for r in responses])


def test_pool_win_rate_counts_draws_as_half():
    utility = RecordingUtility()
    pool = AnnotatorPool([BTAnnotator("deterministic", utility, temperature=0.0)], flip_prob=0.25)
    # win; identical responses (a draw, never shown to the annotator); equal utilities (the annotator's draw); loss
    mine = FixedPolicy([GOOD, GOOD, "It is so.", BAD], [3, 3, 3, 3])
    ref = FixedPolicy([BAD, GOOD, "It is fine.", GOOD], [3, 3, 3, 3])
    res = win_rate(mine, ref, ["p1", "p2", "p3", "p4"], judge=pool, compute_kl=False)
    # outcomes [1, 1/2, 1/2, 0]: mean 1/2; sum of squared deviations 1/4 + 0 + 0 + 1/4 = 1/2, variance 1/6
    assert (res.wins, res.ties, res.losses) == (1, 2, 1)
    assert res.win_rate == 0.5 and res.tie_rate == 0.5
    assert res.stderr == pytest.approx(math.sqrt(1 / 6) / 2, abs=1e-12)  # 0.2041; a coin would give 0 or 0.2887
    assert utility.seen == [GOOD, "It is so.", BAD, BAD, "It is fine.", GOOD]  # p2 (identical) was not asked
    gold = win_rate(mine, ref, ["p1", "p2", "p3", "p4"], judge="gold", compute_kl=False)
    assert (gold.win_rate, gold.stderr, gold.tie_rate) == (res.win_rate, res.stderr, res.tie_rate)


def test_draws_with_two_samples_per_prompt_use_per_prompt_means():
    pool = AnnotatorPool.gold_only()
    mine = FixedPolicy([GOOD, GOOD, BAD], [3, 3, 3])
    ref = FixedPolicy([BAD, GOOD, BAD], [3, 3, 3])
    res = win_rate(mine, ref, ["p1", "p2", "p3"], judge=pool, samples_per_prompt=2, compute_kl=False)
    # per-prompt means [1, 1/2, 1/2] (both samples alike): mean 2/3; deviations 1/3, -1/6, -1/6 -> variance 1/12
    assert (res.wins, res.ties, res.losses, res.num_comparisons) == (2, 4, 0, 6)
    assert res.win_rate == pytest.approx(2 / 3, abs=1e-12) and res.tie_rate == pytest.approx(2 / 3, abs=1e-12)
    assert res.stderr == pytest.approx(math.sqrt(1 / 12) / math.sqrt(3), abs=1e-12)  # 1/6


def test_an_alpaca_eval_annotators_draw_answer_is_half_a_win():
    from rlhf_ext.datagen import OpenAIBackend

    # lmsys_gpt4 answers two scores; equal scores are a draw (AlpacaEval preference 0 -> 1.5)
    mine = FixedPolicy([f"Sure. {AF_GOOD}", f"Maybe. {AF_EVEN}", "Same."], [2, 2, 1])
    ref = FixedPolicy([f"No. {AF_BAD}", f"Perhaps. {AF_EVEN}", "Same."], [2, 2, 1])
    with FakeChatServer(alpaca_farm_responder) as server:
        pool = AnnotatorPool.from_alpaca_farm(
            str(LMSYS), backend_factory=lambda model: OpenAIBackend(server.url, model=model, max_retries=0),
            models=["fake-model"],
        )  # fmt: skip
        res = win_rate(mine, ref, ["q1", "q2", "q3"], judge=pool, compute_kl=False)
    assert server.requests == 2  # the identical pair is a draw without a request
    assert pool.annotators[0].stats == {"requests": 2, "examples": 2, "unparseable": 0, "draws": 1}
    # outcomes [1, 1/2, 1/2]: mean 2/3, variance ((1/3)^2 + 2 (1/6)^2) / 2 = 1/12, s.e. sqrt(1/12) / sqrt(3) = 1/6
    assert (res.wins, res.ties, res.losses) == (1, 2, 0)
    assert res.win_rate == pytest.approx(2 / 3, abs=1e-12) and res.tie_rate == pytest.approx(2 / 3, abs=1e-12)
    assert res.stderr == pytest.approx(1 / 6, abs=1e-12)


def test_training_noise_replaces_draw_answers_at_twice_the_flip_rate():
    n = 2000
    prompts = [f"p{i}" for i in range(n)]
    a = [f"It is so {i}." for i in range(n)]  # equal utilities everywhere: the deterministic annotator's draws
    b = [f"It is fine {i}." for i in range(n)]
    pool = AnnotatorPool.gold_only(flip_prob=0.25, seed=2)
    evals, train = pool.decide(prompts, a, b, train=False), pool.decide(prompts, a, b, train=True)
    assert evals.tie.all() and (evals.outcome == 0.5).all()
    u, _ = pair_uniforms(2, prompts, a, b)
    assert torch.equal(train.tie, u[:, 2] >= 0.5)  # AlpacaFarm: a label is noised with probability 2 * p_label_flip
    assert abs(train.tie.double().mean().item() - 0.5) < 3 * math.sqrt(0.25 / n)
    same = pool.decide(prompts, a, a, train=True)
    assert same.tie.all() and (same.outcome == 0.5).all()  # identical responses stay draws even in training
