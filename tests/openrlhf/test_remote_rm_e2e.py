"""OpenRLHF with the segment RM server, run the way a user runs it: ``rlhf-ext serve rm`` in one process and
``python -m rlhf_ext.openrlhf.train_ppo_ray ... --reward.remote_url URL/get_reward --ext.granularity bandit`` (the
scalar answers) or ``segment`` (the server's spans, scored in the experience maker); and the TRL recipe of the server
source on the same server."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray_ppo")]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_sft_path, cache_dir):
    from rlhf_ext.pipelines.builtins import resolve_model
    from tests.helpers.openrlhf_runs import toy_prompts_file

    root = tmp_path_factory.mktemp("remote_rm")
    prompts = toy_prompts_file(root)
    rm = resolve_model("builtin:tiny-segment-rm", cache_dir)
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_ext.cli", "serve", "rm", "--model", rm, "--port", "0"],
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        for line in proc.stderr:
            if line.startswith("serving "):
                break
        url = re.search(r" at (http://[0-9.]+:[0-9]+): ", line).group(1)
        yield root, tiny_sft_path, rm, str(prompts), f"{url}/get_reward"
    finally:
        proc.terminate()
        proc.wait(30)


def _run(served, name, estimator, stock=False, granularity="bandit"):
    from tests.helpers.openrlhf_runs import run_train_ppo_ray, tiny_ppo_argv

    root, sft, rm, prompts, url = served
    argv = tiny_ppo_argv(sft, rm, prompts, root / name)
    i = argv.index("--reward.model_name_or_path")
    argv[i : i + 2] = ["--reward.remote_url", url]  # the server instead of a local reward model actor
    argv += ["--algo.advantage.estimator", estimator, "--ext.granularity", granularity]
    steps, _ = run_train_ppo_ray(argv, root / f"{name}.log", methods=not stock)
    assert sorted(steps) == [1, 2], f"see {root / f'{name}.log'}"
    return steps


def test_remote_rm_with_bandit_granularity_trains_as_stock_openrlhf(served):
    """It crashed at step 1 (``entropy (2, 1) and action_mask (2, 38) must match``) under reinforce and gae; now
    both run, and step 1 (same rollouts, same server) logs the same rewards and return as stock OpenRLHF."""
    stock = _run(served, "stock_reinforce", "reinforce", stock=True)
    ours = _run(served, "reinforce", "reinforce")
    for key in ("reward", "rollout/reward_mean", "rollout/reward_std", "return", "response_length"):
        assert ours[1][key] == pytest.approx(stock[1][key], rel=1e-6), key
    assert ours[1]["reward"] != 0
    gae = _run(served, "gae", "gae")
    assert gae[1]["reward"] == pytest.approx(stock[1]["reward"], rel=1e-6)  # the same rollouts' rewards


def test_remote_rm_spans_train_on_the_ray_loop_and_on_trl(served, tmp_path):
    """``--ext.granularity segment`` with the server: 2 REINFORCE steps whose rewards are the server's spans mapped
    onto the policy's tokens (several segments per response, no reward-model actor); the TRL recipe of the server
    source (``segment_ppo_server_tiny``) trains 2 steps on the same server."""
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe, run_segment_ppo
    from rlhf_ext.recipes import recipe_path

    root, url = served[0], served[-1]
    steps = _run(served, "segment_spans", "reinforce", granularity="segment")
    log_text = (root / "segment_spans.log").read_text()
    assert "RewardModelActor pid" not in log_text and "RewardActor pid" not in log_text
    for step in (steps[1], steps[2]):
        assert step["segments_per_response"] > 1 and math.isfinite(step["reward"])
    small = ["train.max_steps=2", "train.batch_size=8", "train.micro_batch_size=8", "data.max_completion_length=24",
             "data.max_calibration_pairs=32", f"train.output_dir={tmp_path / 'trl'}"]  # fmt: skip
    recipe = load_recipe(
        SegmentPPORecipe, recipe_path("segment_ppo_server_tiny"), [f"model.reward_source={url}", *small]
    )
    curve = run_segment_ppo(recipe)["curve"]
    assert [c["step"] for c in curve] == [1, 2]
    assert all(c["segment/segments_per_response"] > 1 and math.isfinite(c["reward"]) for c in curve)
