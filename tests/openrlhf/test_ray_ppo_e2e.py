"""OpenRLHF's real Ray PPO loop on CPU, run the way users run it: ``python -m rlhf_ext.openrlhf.train_ppo_ray``.

Each run goes through OpenRLHF's own CLI module, ``PPOTrainer``/``PPOTrainerAsync``, Ray actors for the policy,
reference, reward model and critic, DeepSpeed (ZeRO-2 and ZeRO-3, one and two policy ranks) and the HF rollout
engine. The metrics are OpenRLHF's own per-step log line. Runs are shared between the tests (one xdist group, module
fixtures) so that each configuration runs once: 90 to 360 s each on 2 idle cores (Ray actor start-up).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray_ppo")]
ROOT = Path(__file__).resolve().parents[2]


def _run(out_dir, models, prompts, *flags, stock=False) -> list[dict]:
    """Run the CLI in a fresh process with tiny models; return its per-step metrics.

    2 episodes over the same 8 prompts = 2 PPO steps that each see every prompt: OpenRLHF's controller shuffles
    prompts with an unseeded generator, so only a step holding the whole prompt set is the same batch from run to run
    (the HF engine then hands its samples over in a canonical order)."""
    from tests.helpers.openrlhf_runs import run_train_ppo_ray, tiny_ppo_argv

    argv = tiny_ppo_argv(*models, prompts, out_dir) + list(flags)
    steps, _ = run_train_ppo_ray(argv, out_dir.parent / f"{out_dir.name}.log", methods=not stock)
    assert sorted(steps) == [1, 2], f"see {out_dir.parent / f'{out_dir.name}.log'}"
    return [steps[1], steps[2]]


@pytest.fixture(scope="module")
def ray_env(tmp_path_factory, tiny_sft_path, cache_dir):
    from rlhf_ext.pipelines.builtins import resolve_model
    from tests.helpers.openrlhf_runs import toy_prompts_file

    root = tmp_path_factory.mktemp("ray_ppo")
    prompts = toy_prompts_file(root)
    return root, (tiny_sft_path, resolve_model("builtin:tiny-segment-rm", cache_dir)), str(prompts)


@pytest.fixture(scope="module")
def bandit_runs(ray_env):
    """The same GAE run twice: stock OpenRLHF (only the CPU pieces installed) and rlhf-ext with bandit granularity,
    on the segment RM's bandit copy (cutoff inf: rlhf-ext refuses bandit granularity on a segment RM, whose sequence
    score is e_phi, not the last-token score stock OpenRLHF reads)."""
    import math
    import shutil

    from rlhf_ext.runtime.segment_data import load_segment_settings, save_segment_settings

    root, (sft, rm), prompts = ray_env
    bandit_rm = root / "bandit_rm"
    shutil.copytree(rm, bandit_rm)
    save_segment_settings(bandit_rm, {**load_segment_settings(rm), "entropy_cutoff": math.inf})
    models = (sft, str(bandit_rm))
    flags = ["--algo.advantage.estimator", "gae", "--ds.zero_stage", "2", "--ext.granularity", "bandit",
             "--rollout.micro_batch_size", "8", "--train.micro_batch_size", "8"]  # fmt: skip
    stock = _run(root / "stock", models, prompts, *flags, stock=True)
    ours = _run(root / "bandit", models, prompts, *flags)
    return root, stock, ours


@pytest.fixture(scope="module")
def segment_task0(ray_env):
    """The recipe path a user starts from: ``python -m rlhf_ext.launch.train_segment_ppo --engine openrlhf
    --config segment_ppo_tiny`` (normalizer fitted by the launcher, GAE critic from the segment RM, 2 samples per
    prompt), here with two policy ranks under ZeRO-2 and as the first task of a continual sequence."""
    from tests.helpers.openrlhf_runs import run_logged

    root, (sft, rm), _ = ray_env
    out = root / "task0"
    cmd = [
        sys.executable, "-m", "rlhf_ext.launch.train_segment_ppo", "--engine", "openrlhf",
        "--config", "segment_ppo_tiny", f"model.sft_model={sft}", f"model.reward_model={rm}",
        f"train.output_dir={out}", "train.max_steps=2", "train.batch_size=8", "train.micro_batch_size=4",
        "train.bf16=true", "data.max_completion_length=24", "data.max_calibration_pairs=64",
        "train.openrlhf_args={actor.num_gpus_per_node: 2, ref.num_gpus_per_node: 2, ext.continual_kl_coef: 1.0, "
        "actor.adam.lr: 0.01, actor.lr_warmup_ratio: 0, train.seed: 7}",
    ]  # fmt: skip
    steps, _ = run_logged(cmd, root / "task0.log")
    assert sorted(steps) == [1, 2], f"see {root / 'task0.log'}"
    return out, [steps[1], steps[2]]


@pytest.fixture(scope="module")
def segment_task1(ray_env, segment_task0):
    """Segment rewards + REINFORCE, one-step async, ZeRO-3 with two policy ranks, second task (CPPO-style KL)."""
    root, (_, rm), prompts = ray_env
    prev, _ = segment_task0
    out = root / "task1"
    steps = _run(
        out, (str(prev), rm), prompts,
        "--algo.advantage.estimator", "reinforce", "--ds.zero_stage", "3", "--actor.num_gpus_per_node", "2",
        "--ref.num_gpus_per_node", "2", "--train.async_enable", "--train.async_queue_size", "1",
        "--ext.granularity", "segment", "--ext.continual_previous_model", str(prev), "--ext.continual_kl_coef", "1.0",
    )  # fmt: skip
    return out, steps


def _finite(step: dict, keys) -> None:
    for key in keys:
        assert key in step, f"{key} not logged: {sorted(step)}"
        assert math.isfinite(step[key]), (key, step[key])


def test_bandit_through_rlhf_ext_equals_stock_openrlhf(bandit_runs):
    """Same seeds, same rollouts (the HF engine's sampling is batch-independent and hands samples over in a canonical
    order), same rewards, returns, losses, gradients and final weights, bit for bit: the subclasses change nothing at
    bandit granularity."""
    from safetensors.torch import load_file

    root, stock, ours = bandit_runs
    for s, o in zip(stock, ours):
        logged = {k: v for k, v in s.items() if not k.startswith("timing/")}
        assert {k: o[k] for k in logged} == logged
    assert stock[1]["kl"] > 0 and stock[0]["reward"] != 0  # the policy moved, so step 2 compares updated policies
    a, b = load_file(root / "stock" / "model.safetensors"), load_file(root / "bandit" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_segment_gae_two_ranks_zero2(segment_task0, tiny_sft_path):
    """Dense segment rewards through the critic, launched from the recipe: finite metrics, a real (non-zero) logged
    reward, a checkpoint plain transformers loads, the fitted normalizer, and the first task's previous-task KL
    logged as 0."""
    from transformers import AutoModelForCausalLM

    out, steps = segment_task0
    for step in steps:
        _finite(step, ["reward", "return", "policy_loss", "critic_loss", "values", "segments_per_response"])
        assert step["reward"] != 0.0 and step["rollout/reward_mean"] == pytest.approx(step["reward"], rel=1e-5)
        assert step["segments_per_response"] > 1  # dense segments (the recipe: chunks of 4), not one bandit segment
        assert step["prev_task_kl"] == 0.0 and step["staleness"] == 0.0
    assert (out / "normalizer.json").exists() and (out / "prompts.jsonl").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(tiny_sft_path)
    moved = [(p - q).abs().max().item() for p, q in zip(model.parameters(), base.parameters())]
    assert max(moved) > 1e-3


def test_segment_reinforce_async_zero3_second_task(segment_task1):
    """One-step off-policy (paper 001): the second batch was generated before the first update (staleness 1); the
    CPPO-style KL to the previous task's policy is 0 before the first update and positive after it."""
    out, (first, second) = segment_task1
    for step in (first, second):
        _finite(step, ["reward", "return", "policy_loss", "prev_task_kl", "staleness"])
    assert first["staleness"] == 0.0 and second["staleness"] == 1.0
    assert first["prev_task_kl"] == 0.0 and second["prev_task_kl"] > 0.0
    assert (out / "config.json").exists()


PAYING_SOURCE = '''
import json

def pays(prompts, completions, **kwargs):
    """0.1 per character of each completion's first word, on that word; each call's totals appended to LOG."""
    spans = [[(0, len(c.split(" ")[0]), 0.1 * len(c.split(" ")[0]))] if c.split(" ")[0] else [] for c in completions]
    with open(LOG, "a") as f:
        f.write(json.dumps([sum(r for _, _, r in row) for row in spans]) + "\\n")
    return spans
'''


def test_span_reward_source_on_the_ray_loop(ray_env):
    """``--ext.reward_source`` (a user's callable in a file) instead of a reward model: 2 REINFORCE steps through
    OpenRLHF's Ray loop with no reward-model actor; the logged reward of each step is the mean of what the callable
    paid for that step's 8 responses (an even split keeps each span's total). One kind runs here: the actors load
    every kind through the same resolver, and ``test_openrlhf_span_sources.py`` checks each kind (rules, callable,
    segment RM, process RM) on OpenRLHF's experience maker against the TRL path."""
    root, (sft, _), prompts = ray_env
    out = root / "source_callable"
    out.mkdir()
    log = out / "paid.jsonl"
    (out / "source.py").write_text(f"LOG = {str(log)!r}\n" + PAYING_SOURCE)
    spec = f"{out / 'source.py'}:pays"
    from tests.helpers.openrlhf_runs import run_train_ppo_ray, tiny_ppo_argv

    argv = tiny_ppo_argv(sft, "unused", prompts, out / "run")
    i = argv.index("--reward.model_name_or_path")
    argv = argv[:i] + argv[i + 2 :] + ["--ext.reward_source", spec, "--algo.advantage.estimator", "reinforce"]
    steps, _ = run_train_ppo_ray(argv, out / "run.log")
    assert sorted(steps) == [1, 2], f"see {out / 'run.log'}"
    log_text = (out / "run.log").read_text()
    assert "PolicyModelActor pid" in log_text  # the actors' names: none scores rewards
    assert "RewardActor pid" not in log_text and "RewardModelActor pid" not in log_text
    for step in (steps[1], steps[2]):
        _finite(step, ["reward", "return", "policy_loss", "segments_per_response"])
    paid = [t for line in log.read_text().splitlines() for t in json.loads(line)]
    assert len(paid) == 16
    for k, step in ((1, steps[1]), (2, steps[2])):
        assert step["rollout/reward_mean"] == pytest.approx(sum(paid[8 * (k - 1) : 8 * k]) / 8, rel=1e-5, abs=1e-6)
