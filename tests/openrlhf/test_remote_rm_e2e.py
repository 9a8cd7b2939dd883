"""OpenRLHF with the segment RM server, run the way a user runs it: ``rlhf-ext serve rm`` in one process and
``python -m rlhf_ext.openrlhf.train_ppo_ray ... --reward.remote_url URL/get_reward --ext.granularity bandit``."""

from __future__ import annotations

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


def _run(served, name, estimator, stock=False):
    from tests.helpers.openrlhf_runs import run_train_ppo_ray, tiny_ppo_argv

    root, sft, rm, prompts, url = served
    argv = tiny_ppo_argv(sft, rm, prompts, root / name)
    i = argv.index("--reward.model_name_or_path")
    argv[i : i + 2] = ["--reward.remote_url", url]  # the server instead of a local reward model actor
    argv += ["--algo.advantage.estimator", estimator, "--ext.granularity", "bandit"]
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
