"""``report_to`` (TRL's key) reaches every command with one key: a flat ``--report_to``, ``train.trl_args``, a recipe
key; the TRL engine writes TensorBoard events / an offline wandb run, the OpenRLHF engine gets its logger flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlhf_ext.cli import main
from rlhf_ext.config import RecipeError, load_recipe
from rlhf_ext.recipes import recipe_path
from rlhf_ext.runtime.resources import Cluster

REPO = Path(__file__).resolve().parents[2]


def scalars(logdir: Path) -> dict[str, list[float]]:
    """Every scalar TensorBoard wrote under ``logdir`` (all event files), by tag, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[float]] = {}
    files = sorted(logdir.rglob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event files under {logdir}"
    for path in files:
        events = EventAccumulator(str(path))
        events.Reload()
        for tag in events.Tags()["scalars"]:
            out.setdefault(tag, []).extend(e.value for e in events.Scalars(tag))
    return out


# ------------------------------------------------------------------------------------------------ one key, every form
def test_report_to_routes_to_train_trl_args_in_every_recipe(tmp_path):
    from rlhf_ext.pipelines.continual_recipe import ContinualRecipe
    from rlhf_ext.pipelines.iterative_dpo import OnlineDPORecipe
    from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe
    from rlhf_ext.pipelines.segment_rm import SegmentRMRecipe

    cases = [(SegmentRMRecipe, "segment_rm_tiny"), (SegmentPPORecipe, "segment_ppo_tiny"),
             (OnlineDPORecipe, "online_dpo_tiny"), (ContinualRecipe, "continual_dpo_tiny")]  # fmt: skip
    for cls, name in cases:
        flat = load_recipe(cls, recipe_path(name), ["--report_to", "tensorboard"])
        nested = load_recipe(cls, recipe_path(name), ["train.trl_args={report_to: [wandb]}"])
        in_file = tmp_path / f"{name}.yaml"
        in_file.write_text(recipe_path(name).read_text() + "\nreport_to: tensorboard\n")
        assert flat.train.trl_args == {"report_to": "tensorboard"}, name
        assert nested.train.trl_args == {"report_to": ["wandb"]}, name
        assert load_recipe(cls, in_file).train.trl_args == {"report_to": "tensorboard"}, name


def test_the_demo_hands_report_to_to_every_training_stage(tmp_path, monkeypatch):
    """The demo's ``report_to`` key: the reward-model and PPO recipes get it in ``train.trl_args`` (with the
    overrides of their ``train`` sections), the SFT stage as ``fine_tune(report_to=...)``; it is not a result setting,
    so changing it keeps the finished stages. (The slow end-to-end test below reads the events of all three stages.)"""
    import rlhf_ext.trl.sft as sft
    from rlhf_ext.demo import DemoPipeline, DemoRecipe
    from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe
    from rlhf_ext.pipelines.segment_rm import SegmentRMRecipe

    out = tmp_path / "demo"
    recipe = load_recipe(DemoRecipe, recipe_path("demo"), [f"out={out}", "--report_to", "tensorboard"])
    pipeline = DemoPipeline(recipe)
    for cls, stage in ((SegmentRMRecipe, "reward_model"), (SegmentPPORecipe, "ppo")):
        recipe = load_recipe(cls, None, pipeline._train_overrides(stage))
        assert recipe.train.trl_args == {"report_to": "tensorboard"}
    seen = {}
    monkeypatch.setattr(sft, "fine_tune", lambda *args, **kwargs: seen.update(kwargs) or str(out / "sft"))
    monkeypatch.setattr(DemoPipeline, "_stage_split", lambda self: ([], [], []))
    pipeline.recipe.model.base_model = "builtin:tiny"
    pipeline.stage_sft({})
    assert seen["report_to"] == "tensorboard"
    DemoPipeline(load_recipe(DemoRecipe, recipe_path("demo"), [f"out={out}"]))  # report_to "none" in the same run
    # directory: not refused as "different settings"


def test_openrlhf_argv_maps_report_to_onto_openrlhfs_logger_flags(tmp_path, monkeypatch):
    """OpenRLHF 0.11.2's train_rm / train_ppo_ray flags: --logger.tensorboard_dir, --logger.wandb.key (its switch)."""
    from rlhf_ext.openrlhf.cli_runner import parsed_args
    from rlhf_ext.pipelines import segment_ppo, segment_rm

    monkeypatch.setenv("WANDB_PROJECT", "my-project")
    rm_out, ppo_out = str(tmp_path / "rm"), str(tmp_path / "ppo")

    def rm_argv(report_to: str) -> list[str]:
        recipe = load_recipe(segment_rm.SegmentRMRecipe, recipe_path("segment_rm_tiny"),
                             [f"report_to={report_to}", f"train.output_dir={rm_out}"])  # fmt: skip
        return segment_rm.openrlhf_argv(recipe, "train_dir", None)

    def ppo_argv(report_to: str) -> list[str]:
        recipe = load_recipe(segment_ppo.SegmentPPORecipe, recipe_path("segment_ppo_tiny"),
                             [f"report_to={report_to}", f"train.output_dir={ppo_out}", "train.bf16=true"])  # fmt: skip
        return segment_ppo.openrlhf_argv(recipe, "prompts.jsonl", None, Cluster((0,)))

    def logger_flags(argv: list[str]) -> list[str]:
        i = 0
        out = []
        while i < len(argv):
            if argv[i].startswith(("--logger.tensorboard", "--logger.wandb")):
                out += argv[i : i + 2]
                i += 2
            else:
                i += 1
        return out

    key = segment_rm.OPENRLHF_WANDB_KEY_PLACEHOLDER
    for argv, out in ((rm_argv, rm_out), (ppo_argv, ppo_out)):
        assert logger_flags(argv("none")) == []
        assert logger_flags(argv("tensorboard")) == ["--logger.tensorboard_dir", os.path.join(out, "runs")]
        assert logger_flags(argv("wandb")) == ["--logger.wandb.key", key, "--logger.wandb.project", "my-project"]
        assert logger_flags(argv("[tensorboard, wandb]")) == [
            "--logger.tensorboard_dir", os.path.join(out, "runs"),
            "--logger.wandb.key", key, "--logger.wandb.project", "my-project",
        ]  # fmt: skip
        with pytest.raises(RecipeError, match="the OpenRLHF engine logs to tensorboard or wandb only, not mlflow"):
            argv("mlflow")
    # the flags are OpenRLHF's own: its CLIs parse them into args.logger
    for module, argv, out in (("train_rm", rm_argv, rm_out), ("train_ppo_ray", ppo_argv, ppo_out)):
        ours = argv("[tensorboard, wandb]")
        without_ext = [
            a for i, a in enumerate(ours) if not a.startswith("--ext.") and not ours[i - 1].startswith("--ext.")
        ]
        parsed = parsed_args(f"openrlhf.cli.{module}", without_ext)  # OpenRLHF's own parser and fix-ups
        assert parsed.logger.tensorboard_dir == os.path.join(out, "runs") and parsed.logger.wandb.key == key


# ------------------------------------------------------------------------------------------ the TRL engine, for real
def test_segment_rm_report_to_tensorboard_writes_the_trainers_loss(tmp_path, tiny_sft_path):
    out = tmp_path / "rm"
    result = CliRunner().invoke(main, [
        "train", "segment-rm", "--config", "segment_rm_tiny", "--report_to", "tensorboard", f"train.output_dir={out}",
        f"model.sft_model={tiny_sft_path}", "train.max_steps=2", "train.logging_steps=1", "data.max_train_samples=32",
        "data.max_eval_samples=8",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    logged = scalars(out / "runs")
    assert len(logged["train/loss"]) == 2  # one per step (logging_steps=1)
    metrics = json.loads((out / "metrics.json").read_text())
    assert logged["eval/accuracy"][-1] == pytest.approx(metrics["eval"]["eval_accuracy"], abs=1e-6)


@pytest.mark.slow
def test_continual_runner_takes_report_to_in_trl_args(tmp_path, tiny_sft_path):
    """``train.trl_args={report_to: tensorboard}`` used to crash the runner ("multiple values for keyword argument
    'report_to'"); each task's events are kept in ``task_dir/runs/dpo`` (the trainer's own dir is deleted)."""
    out = tmp_path / "continual"
    result = CliRunner().invoke(main, [
        "train", "continual", "--config", "continual_dpo_tiny", "train.trl_args={report_to: tensorboard}",
        f"output_dir={out}", f"model.sft_model={tiny_sft_path}", "train.max_steps=2", "train.logging_steps=1",
        "data.num_tasks=2", "data.max_train_samples=32", "data.max_test_samples=16", "plots=false",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    for task in ("task_00", "task_01"):
        history = json.loads((out / task / "result.json").read_text())["metrics"]["log_history"]
        logged = scalars(out / task / "runs" / "dpo")["train/loss"]
        assert logged == pytest.approx([h["loss"] for h in history], rel=1e-6)  # TensorBoard keeps float32


@pytest.mark.slow
def test_online_dpo_report_to_wandb_writes_an_offline_run_with_history(tmp_path, tiny_sft_path):
    from tests.helpers.wandb_offline import wandb_history

    out, wandb_dir = tmp_path / "online", tmp_path / "wandb"
    wandb_dir.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "rlhf_ext.cli", "train", "online-dpo", "--config", "online_dpo_tiny",
         "--report_to", "wandb", f"train.output_dir={out}", f"policy.sft_model={tiny_sft_path}",
         "online.num_iterations=1", "online.prompts_per_iteration=8", "online.num_generations=2",
         "online.eval_samples_per_prompt=1", "data.max_eval_prompts=4", "train.max_steps=2", "train.logging_steps=1"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (wandb_dir / "wandb").glob("offline-run-*")
    losses = [float(row["train/loss"]) for row in wandb_history(run_dir) if "train/loss" in row]
    assert len(losses) == 2  # the DPO steps of the one iteration (logging_steps=1)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"][0]["pairs"]["num_pairs"] == 8


@pytest.mark.slow
def test_segment_ppo_report_to_tensorboard_writes_the_reward_curve(tmp_path, tiny_sft_path, cache_dir):
    out = tmp_path / "ppo"
    result = CliRunner().invoke(main, [
        "train", "segment-ppo", "--config", "segment_ppo_tiny", "--report_to", "tensorboard", f"train.output_dir={out}",
        "train.max_steps=2",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    logged = scalars(out / "runs")
    curve = json.loads((out / "ppo_metrics.json").read_text())["curve"]
    assert len(logged["train/loss"]) == 2
    assert logged["train/reward"] == pytest.approx([row["reward"] for row in curve], rel=1e-6)


@pytest.mark.slow
def test_demo_report_to_tensorboard_logs_every_training_stage(tmp_path, cache_dir):
    from tests.e2e.test_demo import SMALL

    out = tmp_path / "demo"
    result = CliRunner().invoke(main, ["demo", "--out", str(out), "--report_to", "tensorboard", *SMALL])
    assert result.exit_code == 0, result.output
    # the SFT and reward-model stages log every 20 / 10 steps, more than this small run has: their trainers' loss is
    # the run's mean (train_loss); PPO logs every step
    for stage, loss in (("sft", "train/train_loss"), ("rm", "train/train_loss"), ("ppo", "train/loss")):
        assert loss in scalars(out / stage / "runs"), stage
    curve = json.loads((out / "stages" / "ppo.json").read_text())["curve"]
    assert scalars(out / "ppo" / "runs")["train/reward"] == pytest.approx([row["reward"] for row in curve], rel=1e-6)
