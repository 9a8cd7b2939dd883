"""The task-sequence runner's bookkeeping with a recording stand-in stage (no engine): wiring of snapshots and KL
weights, the performance matrix, kill + resume, and the errors a user can cause. Real DPO runs: tests/trl."""

from __future__ import annotations

import json
import sys

import pytest

from rlhf_ext.config import from_dict
from rlhf_ext.pipelines.continual import ContinualRunner, TaskSequenceError, format_summary
from rlhf_ext.pipelines.continual_recipe import ContinualRecipe
from rlhf_ext.runtime.io import atomic_directory
from rlhf_ext.zoo.continual_toy import toy_task_sequence


class RecordingStage:
    """Writes a fake snapshot and returns scores that depend on the task and the test set."""

    def __init__(self, fail_on: int | None = None, writes: str = "policy_dir"):
        self.fail_on = fail_on
        self.writes = writes
        self.calls = []

    def run_task(self, task, test_sets):
        self.calls.append(task)
        if task.index == self.fail_on:
            raise RuntimeError("killed")
        with atomic_directory(getattr(task, self.writes)) as tmp:
            (tmp / "config.json").write_text(json.dumps({"task": task.index}))
        scores = [round(0.9 - 0.2 * max(task.index - k, 0) + 0.01 * k, 6) for k in range(len(test_sets))]
        return {"scores": scores, "metrics": {"steps": 3}}


@pytest.fixture(scope="module")
def tasks():
    return toy_task_sequence("preference_shift", num_tasks=3, n_train=4, n_test=2)


def _recipe(tmp_path, **overrides):
    (tmp_path / "sft").mkdir(parents=True, exist_ok=True)  # the recording stages never load it; the runner checks it
    data = {
        "output_dir": str(tmp_path / "run"),
        "plots": False,
        "model": {"sft_model": str(tmp_path / "sft")},
        "continual": {"continual_kl_coef": 0.5},
    }
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        if name:
            data.setdefault(section, {})[name] = value
        else:
            data[section] = value
    return from_dict(ContinualRecipe, data)


def test_snapshots_and_kl_weights_are_wired_task_to_task(tmp_path, tasks):
    stage = RecordingStage()
    recipe = _recipe(tmp_path, plots=True, continual__continual_kl_coef_schedule=[0.25, 0.0])
    summary = ContinualRunner(recipe, tasks, policy_stage=stage).run()
    run = tmp_path / "run"
    assert summary["plots"] == {"performance": str(run / "performance.png")}
    assert (run / "performance.png").stat().st_size > 10_000
    first, second, third = stage.calls
    assert (first.init_policy, first.previous_policy, first.continual_kl_coef) == (str(tmp_path / "sft"), None, 0.0)
    assert second.init_policy == second.previous_policy == str(run / "task_00" / "policy")
    assert third.previous_policy == str(run / "task_01" / "policy")
    assert [second.continual_kl_coef, third.continual_kl_coef] == [0.25, 0.0]
    assert all(c.reference_policy == str(tmp_path / "sft") for c in stage.calls)
    assert [c.seed for c in stage.calls] == [42, 43, 44]
    # R[k][t] is column t of the stage's scores
    assert summary["performance_matrix"][0] == pytest.approx([0.9, 0.7, 0.5])
    assert summary["performance_matrix"][2] == pytest.approx([0.92, 0.92, 0.92])
    assert summary["metrics"]["backward_transfer"] == pytest.approx(((0.5 - 0.9) / 0.9 + (0.71 - 0.91) / 0.91) / 2)
    assert json.loads((run / "performance.json").read_text())["performance_matrix"] == summary["performance_matrix"]
    assert json.loads((run / "task_01" / "result.json").read_text())["continual_kl_coef"] == 0.25
    assert "after 02" in format_summary(summary) and "backward transfer" in format_summary(summary)


def test_killed_sequence_resumes_at_the_last_finished_task(tmp_path, tasks):
    full = ContinualRunner(_recipe(tmp_path / "a"), tasks, policy_stage=RecordingStage()).run()

    recipe = _recipe(tmp_path / "b")
    with pytest.raises(RuntimeError, match="killed"):
        ContinualRunner(recipe, tasks, policy_stage=RecordingStage(fail_on=1)).run()
    run = tmp_path / "b" / "run"
    assert (run / "task_00" / "result.json").exists() and not (run / "task_01" / "result.json").exists()
    partial = json.loads((run / "performance.json").read_text())
    assert partial["finished_tasks"] == 1 and "metrics" not in partial
    (run / "task_01" / "work").mkdir(parents=True)  # debris of the killed task
    (run / "task_01" / "work" / "junk").write_text("partial")

    stage = RecordingStage()
    resumed = ContinualRunner(recipe, tasks, policy_stage=stage).run()
    assert [c.index for c in stage.calls] == [1, 2]  # task 0 is not retrained
    assert resumed["performance_matrix"] == full["performance_matrix"]
    assert resumed["metrics"] == full["metrics"]
    assert not (run / "task_01" / "work").exists()
    again = RecordingStage()
    ContinualRunner(recipe, tasks, policy_stage=again).run()  # everything finished: nothing to do
    assert again.calls == []


def test_stop_after_runs_a_prefix(tmp_path, tasks):
    stage = RecordingStage()
    summary = ContinualRunner(_recipe(tmp_path), tasks, policy_stage=stage).run(stop_after=2)
    assert [c.index for c in stage.calls] == [0, 1] and summary["finished_tasks"] == 2
    assert summary["performance_matrix"][0][2] is None


def test_resuming_with_a_different_recipe_or_sequence_is_refused(tmp_path, tasks):
    ContinualRunner(_recipe(tmp_path), tasks, policy_stage=RecordingStage(fail_on=2)).run(stop_after=1)
    with pytest.raises(TaskSequenceError, match=r"different recipe \(changed: continual.continual_kl_coef\)"):
        ContinualRunner(_recipe(tmp_path, continual__continual_kl_coef=0.1), tasks, policy_stage=RecordingStage()).run()
    with pytest.raises(TaskSequenceError, match="different task sequence"):
        ContinualRunner(_recipe(tmp_path), list(reversed(tasks)), policy_stage=RecordingStage()).run()
    with pytest.raises(TaskSequenceError, match="resume is false"):
        ContinualRunner(_recipe(tmp_path, resume=False), tasks, policy_stage=RecordingStage()).run()
    # output_dir / plots / resume may change between a run and its resumption
    ContinualRunner(_recipe(tmp_path, plots=True), tasks, policy_stage=RecordingStage()).run(stop_after=1)


def test_finished_task_without_snapshot_is_reported(tmp_path, tasks):
    ContinualRunner(_recipe(tmp_path), tasks, policy_stage=RecordingStage()).run(stop_after=1)
    (tmp_path / "run" / "task_00" / "policy" / "config.json").unlink()
    with pytest.raises(TaskSequenceError, match="policy snapshot is missing"):
        ContinualRunner(_recipe(tmp_path), tasks, policy_stage=RecordingStage()).run()


def test_schedule_length_is_checked_before_any_training(tmp_path, tasks):
    stage = RecordingStage()
    with pytest.raises(ValueError, match="kl_coef_schedule has 1 entries but the sequence has 3 tasks"):
        ContinualRunner(_recipe(tmp_path, continual__continual_kl_coef_schedule=[1.0]), tasks, policy_stage=stage)
    assert stage.calls == []


def test_task_sequence_validation(tmp_path, tasks):
    from datasets import Dataset, DatasetDict

    stage = RecordingStage()
    no_test = [DatasetDict(train=tasks[0]["train"])]
    with pytest.raises(TaskSequenceError, match=r"task 0 must be a DatasetDict with 'train' and 'test'.*has: train"):
        ContinualRunner(_recipe(tmp_path), no_test, policy_stage=stage)
    renamed = [DatasetDict(train=tasks[0]["train"].rename_column("chosen", "better"), test=tasks[0]["test"])]
    with pytest.raises(TaskSequenceError, match="task 0 split 'train' has no column 'chosen'"):
        ContinualRunner(_recipe(tmp_path), renamed, policy_stage=stage)
    empty = [DatasetDict(train=tasks[0]["train"], test=Dataset.from_dict({c: [] for c in tasks[0]["test"].features}))]
    with pytest.raises(TaskSequenceError, match="task 0 split 'test' is empty"):
        ContinualRunner(_recipe(tmp_path), empty, policy_stage=stage)
    with pytest.raises(TaskSequenceError, match="sequence is empty"):
        ContinualRunner(_recipe(tmp_path), [], policy_stage=stage)
    with pytest.raises(TaskSequenceError, match="data.num_tasks is 5 but the sequence has 3 tasks"):
        ContinualRunner(_recipe(tmp_path, data={"num_tasks": 5}), tasks, policy_stage=stage)


def test_sources_builtin_and_missing_paths_without_importing_datagen(tmp_path):
    sys.modules.pop("rlhf_ext.datagen", None)
    recipe = _recipe(tmp_path, data={"tasks": "builtin:toy-continual-domains", "num_tasks": 2, "max_test_samples": 3})
    runner = ContinualRunner(recipe, policy_stage=RecordingStage())
    assert runner.num_tasks == 2 and len(runner.tasks[1]["test"]) == 3
    with pytest.raises(TaskSequenceError, match="neither a builtin sequence"):
        ContinualRunner(recipe, tmp_path / "nope", policy_stage=RecordingStage())
    with pytest.raises(ValueError, match="unknown builtin task sequence"):
        ContinualRunner(recipe, "builtin:toy-continual-lipschitz", policy_stage=RecordingStage())
    assert "rlhf_ext.datagen" not in sys.modules


def test_recipe_validation_names_the_key(tmp_path):
    from rlhf_ext.config import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="continual.continual_kl_coef must be a number >= 0; got -1.0"):
        load_recipe(ContinualRecipe, None, ["continual.continual_kl_coef=-1"])
    with pytest.raises(
        RecipeError,
        match=r"unknown key 'continual.continual_kl_coeff' \(did you mean 'continual.continual_kl_coef'\?\)",
    ):
        load_recipe(ContinualRecipe, None, ["continual.continual_kl_coeff=1"])
    with pytest.raises(RecipeError, match="'continual.kl_coef' was renamed to 'continual.continual_kl_coef'"):
        load_recipe(ContinualRecipe, None, ["continual.kl_coef=1"])
    with pytest.raises(RecipeError, match="'algorithm' must be one of 'dpo', 'ppo'; got 'grpo'"):
        load_recipe(ContinualRecipe, None, ["algorithm=grpo"])
    with pytest.raises(RecipeError, match="estimator"):
        load_recipe(ContinualRecipe, None, ["continual.continual_kl_estimator=k5"])


def test_launch_module_reports_recipe_errors(capsys):
    """``python -m rlhf_ext.launch.train_continual`` (deepspeed's ``--local_rank`` included): one line, exit 2."""
    from rlhf_ext.launch import launch

    for argv, message in [
        (["--config", "continual_dpo_tiny", "continual.continual_kl_coef=-2", "--local_rank=0"],
         "continual.continual_kl_coef must be a number >= 0; got -2.0"),
        (["--config", "no_such_recipe"], "neither a file nor a packaged recipe"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            launch("train_continual", argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_reward_models_are_trained_for_every_task_first_and_resumed(tmp_path, tasks):
    policy, rm = RecordingStage(), RecordingStage(fail_on=2, writes="reward_model_dir")
    recipe = _recipe(tmp_path)
    with pytest.raises(RuntimeError, match="killed"):
        ContinualRunner(recipe, tasks, policy_stage=policy, reward_stage=rm).run()
    assert [c.index for c in rm.calls] == [0, 1, 2] and policy.calls == []  # all reward models before any policy
    rm2 = RecordingStage(writes="reward_model_dir")
    summary = ContinualRunner(recipe, tasks, policy_stage=policy, reward_stage=rm2).run()
    assert [c.index for c in rm2.calls] == [2]  # finished reward models are not retrained
    run = tmp_path / "run"
    assert policy.calls[1].reward_model_dirs == [run / f"task_{t:02d}" / "reward_model" for t in range(3)]
    # reward_model_accuracy[k][m]: reward model m on task k (the stand-in's scores depend on m and k)
    assert summary["reward_model_accuracy"][0] == pytest.approx([0.9, 0.7, 0.5])
    assert json.loads((run / "task_01" / "reward_model.json").read_text())["task"] == 1


def test_exponent_notation_without_a_dot_is_a_number():
    """YAML 1.1 reads ``1e-3`` as a string; recipes accept it for float fields (``train.learning_rate=1e-3``)."""
    from rlhf_ext.config import RecipeError, load_recipe

    recipe = load_recipe(ContinualRecipe, None, ["train.learning_rate=1e-3", "continual.continual_kl_coef=2E-1"])
    assert recipe.train.learning_rate == 1e-3 and recipe.continual.continual_kl_coef == 0.2
    with pytest.raises(RecipeError, match="'train.learning_rate' must be a number; got 'fast'"):
        load_recipe(ContinualRecipe, None, ["train.learning_rate=fast"])


def test_generated_sequences_go_through_datagen_lazily(tmp_path, tasks, monkeypatch):
    """Directories and non-toy builtin specs are read with rlhf_ext.datagen.load_continual_dataset (imported only
    then); it returns a sequence of DatasetDicts."""
    import types

    seen = []

    def load_continual_dataset(path):
        seen.append(path)
        return tuple(tasks)  # any sequence of DatasetDict

    monkeypatch.setitem(
        sys.modules, "rlhf_ext.datagen", types.SimpleNamespace(load_continual_dataset=load_continual_dataset)
    )
    recipe = _recipe(tmp_path, data={"tasks": "builtin:continual-piecewise-preference", "max_train_samples": 2})
    runner = ContinualRunner(recipe, policy_stage=RecordingStage())
    assert seen == ["builtin:continual-piecewise-preference"] and runner.num_tasks == 3
    assert len(runner.tasks[0]["train"]) == 2
    ContinualRunner(recipe, tmp_path, policy_stage=RecordingStage())
    assert seen[-1] == str(tmp_path)


def test_plots_without_matplotlib_warn_in_one_line(tmp_path, monkeypatch):
    import builtins

    from rlhf_ext.pipelines.continual import plot_run

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.warns(UserWarning, match="matplotlib is not installed, so no performance.png"):
        assert plot_run({}, [], tmp_path) is None
    assert not (tmp_path / "performance.png").exists()
