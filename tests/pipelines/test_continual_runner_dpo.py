"""The task-sequence runner with real DPO on the tiny model: the CLI end to end, and a killed sequence resumed to
exactly the uninterrupted result (matrix and final weights)."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

OVERRIDES = [
    "data.num_tasks=2",
    "data.max_train_samples=8",
    "data.max_test_samples=6",
    "data.max_length=96",
    "train.batch_size=4",
    "train.micro_batch_size=4",
    "train.max_steps=2",
    "train.logging_steps=1",
    "continual.continual_kl_coef=0.5",
]


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@torch.no_grad()
def _implicit_reward_accuracy(policy_dir, ref_dir, pairs, max_length: int) -> float:
    """Fraction of ``pairs`` with log pi(y_c)/pi_ref(y_c) > log pi(y_r)/pi_ref(y_r), computed here from the saved
    weights, one sequence at a time, tokenised as TRL's DPO does (prompt + completion + EOS, completion from where
    the tokenised prompt stops being a prefix, keep-start truncation to ``max_length``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ref_dir)
    policy, ref = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (policy_dir, ref_dir))

    def prefix(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    def logp(model, ids, start):
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
        return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)[start - 1 :].sum()

    correct = 0
    for row in pairs:
        prompt = tok(row["prompt"])["input_ids"]
        chosen, rejected = (tok(row["prompt"] + row[k] + tok.eos_token)["input_ids"] for k in ("chosen", "rejected"))
        start = min(prefix(prompt, chosen), prefix(prompt, rejected))
        chosen, rejected = chosen[:max_length], rejected[:max_length]
        margin = (logp(policy, chosen, start) - logp(ref, chosen, start)) - (
            logp(policy, rejected, start) - logp(ref, rejected, start)
        )
        correct += int(margin > 0)
    return correct / len(pairs)


def test_cli_run_and_resumed_run_equal_the_uninterrupted_one(tiny_sft_path, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from rlhf_ext.cli import main, recipe_path
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.continual import ContinualRunner, load_task_sequence
    from rlhf_ext.pipelines.continual_recipe import ContinualRecipe
    from rlhf_ext.pipelines.continual_stages import DPOPolicyStage

    model = f"model.sft_model={tiny_sft_path}"
    full_dir = tmp_path / "full"
    result = CliRunner().invoke(
        main,
        ["train", "continual", "--config", "continual_dpo_tiny", model, f"output_dir={full_dir}", *OVERRIDES],
    )
    assert result.exit_code == 0, result.output
    assert "after 01" in result.output and "backward transfer" in result.output
    full = json.loads((full_dir / "performance.json").read_text())
    assert full["finished_tasks"] == 2 and (full_dir / "performance.png").exists()
    assert full["continual_kl_coefs"] == [0.0, 0.5]
    logged_kl = json.loads((full_dir / "task_01" / "result.json").read_text())["metrics"]["kl_to_previous"]
    assert len(logged_kl) == 2 and logged_kl[0] == pytest.approx(0.0, abs=1e-6)  # step 1: policy == snapshot

    recipe = load_recipe(ContinualRecipe, recipe_path("continual_dpo_tiny"), [model, *OVERRIDES])
    # performance_matrix[k][t]: implicit-reward accuracy (vs the SFT model) on task k's test split of the snapshot
    # after task t, recomputed here from the saved snapshots
    tests = [task["test"] for task in load_task_sequence(recipe)]
    assert [len(t) for t in tests] == [6, 6]
    recomputed = [
        [_implicit_reward_accuracy(full_dir / f"task_{t:02d}" / "policy", tiny_sft_path, tests[k], 96) for t in (0, 1)]
        for k in (0, 1)
    ]
    for row, expected in zip(full["performance_matrix"], recomputed):
        assert row == pytest.approx(expected, abs=1e-6)  # k / 6, reported as a float32 mean
    recipe.output_dir = str(tmp_path / "killed")

    class KilledDuringTask1(DPOPolicyStage):
        def run_task(self, task, test_sets):
            if task.index == 1:
                (task.work_dir / "trainer").mkdir(parents=True)  # what a kill mid-training leaves behind
                raise KeyboardInterrupt
            return super().run_task(task, test_sets)

    with pytest.raises(KeyboardInterrupt):
        ContinualRunner(recipe, policy_stage=KilledDuringTask1(recipe)).run()
    killed_dir = tmp_path / "killed"
    snapshot0 = (killed_dir / "task_00" / "policy" / "model.safetensors").stat().st_mtime_ns
    resumed = ContinualRunner(recipe).run()
    assert (killed_dir / "task_00" / "policy" / "model.safetensors").stat().st_mtime_ns == snapshot0
    assert resumed["performance_matrix"] == full["performance_matrix"]
    assert resumed["metrics"] == full["metrics"]
    for name in ("task_00", "task_01"):
        a, b = _weights(full_dir / name / "policy"), _weights(killed_dir / name / "policy")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_per_task_reward_model_stage(tiny_sft_path, tmp_path):
    """reward_model.enabled trains a Bradley-Terry reward model per task, saved next to the policy snapshot, and
    scores it on every task's test split."""
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.continual import run_continual
    from rlhf_ext.pipelines.continual_recipe import ContinualRecipe
    from rlhf_ext.recipes import recipe_path

    overrides = [o for o in OVERRIDES if not o.startswith("data.num_tasks")]
    rm_train = ["batch_size=4", "micro_batch_size=4", "max_steps=2", "learning_rate=1e-3"]
    recipe = load_recipe(
        ContinualRecipe,
        recipe_path("continual_dpo_tiny"),
        [
            f"model.sft_model={tiny_sft_path}",
            f"output_dir={tmp_path}",
            "plots=false",
            "data.num_tasks=1",
            *overrides,
            "reward_model.enabled=true",
            *(f"reward_model.train.{o}" for o in rm_train),
        ],
    )
    summary = run_continual(recipe)
    rm_dir = tmp_path / "task_00" / "reward_model"
    assert (rm_dir / "config.json").exists() and (tmp_path / "task_00" / "policy" / "config.json").exists()
    (acc,) = summary["reward_model_accuracy"][0]
    # the saved model's accuracy on task 0's 6 test pairs, recomputed through the inference scorer (e_phi at the
    # recorded cutoff inf: the Bradley-Terry score of the whole response), one forward per response
    from rlhf_ext.pipelines.continual import load_task_sequence
    from rlhf_ext.runtime.rewards import SegmentSequenceReward

    (task,) = load_task_sequence(recipe)
    pairs = task["test"]
    score, prompts = SegmentSequenceReward(str(rm_dir), batch_size=1), list(pairs["prompt"])
    chosen, rejected = score(prompts, list(pairs["chosen"])), score(prompts, list(pairs["rejected"]))
    assert len(pairs) == 6 and acc == pytest.approx((chosen > rejected).double().mean().item(), abs=1e-6)
    record = json.loads((tmp_path / "task_00" / "reward_model.json").read_text())
    assert record["path"] == str(rm_dir) and record["scores"] == [acc]
