"""The README's demo block is what ``rlhf-ext demo`` prints: the block is read from README.md (a README change is
picked up) and compared with a fresh run's output and its ``metrics.json``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlhf_ext.cli import main

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parents[2] / "README.md"


def readme_demo_block() -> list[str]:
    """The lines of the README's fenced block that starts with ``demo finished in``."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    (block,) = [b for b in blocks if b.startswith("demo finished in ")]
    return block.splitlines()


def test_readme_demo_block_matches_a_run(tmp_path, cache_dir):
    out = tmp_path / "runs" / "demo"
    result = CliRunner().invoke(main, ["demo", "--out", str(out)])
    assert result.exit_code == 0, result.output
    printed = result.output.splitlines()
    start = next(i for i, line in enumerate(printed) if line.startswith("demo finished in "))
    ran = printed[start : start + 6]
    readme = readme_demo_block()
    # the numbers (win rate, gold rewards, KL) exactly as printed; the wall time and output paths are the run's own
    assert readme[1:4] == ran[1:4], "regenerate the README's demo block from this run:\n" + "\n".join(ran)
    assert [line.split(":")[0] for line in readme[4:]] == [line.split(":")[0] for line in ran[4:]]
    metrics = json.loads((out / "metrics.json").read_text())
    win = re.search(r"([0-9.]+) \+- ([0-9.]+) \((\d+) comparisons\)", readme[1])
    assert (float(win[1]), float(win[2]), int(win[3])) == (
        round(metrics["win_rate_ppo_vs_sft"], 3),
        round(metrics["win_rate_stderr"], 3),
        metrics["comparisons"],
    )
    gold = re.findall(r"[+-][0-9.]+", readme[2])
    assert [float(g) for g in gold] == [round(metrics["gold_reward_ppo"], 3), round(metrics["gold_reward_sft"], 3)]
