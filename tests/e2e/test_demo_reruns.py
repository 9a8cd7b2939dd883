"""Nothing silent, nothing stuck: a demo rerun never trains on an earlier run's data, refuses changed settings by
name (the content of a ``data.config`` file included), and recovers from a kill while ``rm_data`` is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from datasets import load_from_disk

from rlhf_ext.config import load_recipe
from rlhf_ext.datagen.schema import config_path
from rlhf_ext.demo import STAGES, DemoRecipe
from rlhf_ext.recipes import recipe_path
from rlhf_ext.runtime.rundir import RunSettingsChanged
from tests.helpers.kill_points import run_cli, was_killed
from tests.helpers.recording_demo import RecordingDemo

CONFIG = "continual-piecewise-preference"


def _recipe(out: Path, *overrides: str) -> DemoRecipe:
    return load_recipe(DemoRecipe, recipe_path("demo"), [f"out={out}", "data.eval_prompts=4", *overrides])


def test_force_with_new_settings_trains_on_the_new_pairs_not_the_old_rm_data(tmp_path):
    """The issue's case: `--force` with twice the samples trained the reward model and PPO on the first run's
    `rm_data` (51 pairs instead of 102)."""
    out = tmp_path / "demo"
    first = RecordingDemo(_recipe(out, "data.num_samples=60"), echo=lambda m: None).run()
    assert first["rm"]["train_pairs"] == first["labels"]["pairs"]

    with pytest.raises(RunSettingsChanged, match=r"changed: data\.num_samples: 60 -> 120\)"):
        RecordingDemo(_recipe(out, "data.num_samples=120"), echo=lambda m: None)
    second = RecordingDemo(_recipe(out, "data.num_samples=120"), force=True, echo=lambda m: None).run()
    assert second["labels"]["pairs"] > first["labels"]["pairs"]
    assert second["rm"]["train_pairs"] == second["labels"]["pairs"]  # the new labels, not the stale rm_data
    assert second["ppo"]["prompts"] == second["labels"]["pairs"]  # PPO's prompts: the same preference split
    assert len(load_from_disk(str(out / "rm_data"))["train"]) == second["labels"]["pairs"]


def test_a_changed_data_config_file_is_refused_by_name(tmp_path):
    """The same `data.config` path with other content used to reuse every stage and report the old numbers."""
    config = tmp_path / "my_task.yaml"
    shutil.copy(config_path(CONFIG), config)
    recipe = _recipe(tmp_path / "demo", f"data.config={config}", "data.num_samples=30")
    RecordingDemo(recipe, echo=lambda m: None).run()
    RecordingDemo(recipe, echo=lambda m: None)  # unchanged: accepted

    config.write_text(config.read_text().replace("seed: 0", "seed: 1", 1))
    with pytest.raises(RunSettingsChanged, match=r"changed: data_config_sha256: \"[0-9a-f]{16}\" -> \"[0-9a-f]{16}\""):
        RecordingDemo(recipe, echo=lambda m: None)


SMALL = [
    "data.num_samples=60", "data.eval_prompts=4", "model.hidden_size=32", "train.sft.num_train_epochs=1",
    "train.reward_model.num_train_epochs=1",
    "train.ppo.max_steps=1", "train.ppo.batch_size=8", "train.ppo.micro_batch_size=8",
    "data.max_completion_length=32",
]  # fmt: skip


@pytest.mark.slow
def test_demo_killed_while_rm_data_is_written_completes_on_the_rerun(tmp_path, cache_dir):
    """Every rerun used to fail with FileNotFoundError (a half-written `rm_data` was taken as finished), even with
    --force."""
    out = tmp_path / "demo"
    killed = run_cli(["demo", "--out", str(out), *SMALL], fault_at="written:rm_data")
    assert was_killed(killed), killed.stderr[-3000:]
    assert not (out / "rm_data").exists() and list(out.glob(".rm_data.tmp-*"))

    rerun = run_cli(["demo", "--out", str(out), *SMALL])
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "demo finished" in rerun.stdout and rerun.stdout.count("reusing") == 3  # data, sft, labels
    assert sorted(p.stem for p in (out / "stages").glob("*.json")) == sorted(STAGES)
    # nothing half-written is left; the stages' output-directory locks (``.rm.lock``, claim_output_dir) are by design
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".") and p.suffix != ".lock") == []
    rm_data, labels = load_from_disk(str(out / "rm_data")), load_from_disk(str(out / "labels"))
    assert rm_data["train"].to_list() == labels.to_list()  # exactly what an uninterrupted run trains on
    assert json.loads((out / "stages" / "rm.json").read_text())["path"] == str(out / "rm")
