"""The simulator's ranking gate (issue 30: the order of well-separated methods must hold in CI).

``rlhf-ext sim compare --config sim_compare --budget gate`` runs, as a user runs it, the packaged recipe's SFT model,
simulated feedback and bandit reward model on one seed, then SFT, best-of-16 and FeedME, each judged against the SFT
model on 64 held-out prompts x 2 samples by the evaluation annotators. Best-of-n with a reward model learnt from the
simulated labels must beat both the SFT model itself and FeedME (supervised fine-tuning on the preferred responses)
on the length-controlled win rate by more than three standard errors of the difference: in the packaged 3-seed
comparison it leads them by 0.23 and 0.23 (``benchmarks/results/sim_compare_seeds123.md``). A simulator whose
annotators, reward model or best-of-n stopped carrying the gold preference fails here.
"""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from rlhf_ext.cli import main

pytestmark = pytest.mark.slow


def test_best_of_n_beats_sft_and_feedme_by_three_standard_errors(tmp_path):
    out = tmp_path / "gate"
    result = CliRunner().invoke(
        main, ["sim", "compare", "--config", "sim_compare", "--budget", "gate", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output[-3000:]
    summary = json.loads((out / "sim_compare.json").read_text())
    (seed,) = {s["seed"] for m in summary["methods"] for s in m["per_seed"]}
    rows = {m["method"]: m["per_seed"][0] for m in summary["methods"]}
    assert sorted(rows) == ["best_of_n", "feedme", "sft"] and seed == 1
    assert all(r["num_comparisons"] == 128 for r in rows.values())
    best = rows["best_of_n"]
    for other in ("sft", "feedme"):
        gap = best["lc_win_rate"] - rows[other]["lc_win_rate"]
        se = math.hypot(best["lc_stderr"], rows[other]["lc_stderr"])
        assert gap > 3 * se, f"best_of_n leads {other} by {gap:.3f} LC win rate, not > 3 x {se:.3f}"
