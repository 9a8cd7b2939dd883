"""The resumable run directory: settings fingerprint, refusing changed settings, atomic stage markers, force."""

from __future__ import annotations

import json
import os

import pytest

from rlhf_ext.runtime.rundir import RunDir, RunSettingsChanged, changed_keys, fingerprint

SETTINGS = {"model": {"name": "tiny", "lr": 1e-4}, "seeds": [0, 1], "steps": 10}


def test_rerun_with_identical_settings_skips_finished_stages(tmp_path):
    run = RunDir(tmp_path / "run", SETTINGS, kind="test")
    assert not run.done("train")
    run.mark_done("train", {"loss": 0.5})
    run.mark_done("dpo/seed-0", {"win": 0.75})
    run_file = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run_file["kind"] == "test" and run_file["settings"] == SETTINGS
    assert run_file["fingerprint"] == fingerprint(SETTINGS) and "created" in run_file and "rlhf_ext_version" in run_file

    again = RunDir(tmp_path / "run", dict(reversed(list(SETTINGS.items()))), kind="test")
    assert again.done("train") and again.result("train") == {"loss": 0.5}
    assert again.done("dpo/seed-0") and again.result("dpo/seed-0") == {"win": 0.75}
    assert not again.done("eval") and again.result("eval") is None
    assert json.loads((tmp_path / "run" / "run.json").read_text())["created"] == run_file["created"]


def test_changed_nested_setting_is_refused_naming_the_key(tmp_path):
    RunDir(tmp_path, SETTINGS, kind="test").mark_done("train")
    changed = {**SETTINGS, "model": {"name": "tiny", "lr": 3e-4}}
    with pytest.raises(RunSettingsChanged) as err:
        RunDir(tmp_path, changed, kind="test")
    assert err.value.keys == ["model.lr"]
    message = str(err.value)
    assert "changed: model.lr: 0.0001 -> 0.0003)" in message and str(tmp_path) in message
    # a caller without a redo option (IterativeDPOTrainer, sim compare) must not advise one that does not exist
    assert "force" not in message and "delete it or choose a new output directory" in message
    assert "\n" not in message
    assert isinstance(err.value, ValueError)
    assert RunDir(tmp_path, SETTINGS, kind="test").done("train")  # the refused rerun changed nothing
    with pytest.raises(RunSettingsChanged) as err:
        RunDir(tmp_path, changed, kind="test", redo="rerun with --force")
    assert "; rerun with --force to redo its stages with the new settings, or choose a new output" in str(err.value)


def test_a_setting_recorded_under_its_old_name_is_named_by_its_current_name(tmp_path):
    """Runs recorded before a rename keep the old key (their fingerprint holds); the refusal names the knob the user
    sets (it used to say ``num_samples`` to a user who had set ``num_generations``)."""
    names = {"num_generations": "num_samples"}
    RunDir(tmp_path, {"num_samples": 4, "beta": 0.1}, kind="test", recorded_names=names)
    with pytest.raises(RunSettingsChanged) as err:
        RunDir(tmp_path, {"num_samples": 6, "beta": 0.1}, kind="test", recorded_names=names)
    assert err.value.keys == ["num_generations"] and "changed: num_generations: 4 -> 6)" in str(err.value)
    assert RunDir(tmp_path, {"num_samples": 4, "beta": 0.1}, kind="test").fingerprint == fingerprint(
        {"num_samples": 4, "beta": 0.1}
    )  # the recorded settings and their fingerprint are unchanged


def test_other_kind_is_refused(tmp_path):
    RunDir(tmp_path, SETTINGS, kind="demo")
    with pytest.raises(RunSettingsChanged, match='changed: kind: "demo" -> "compare"'):
        RunDir(tmp_path, SETTINGS, kind="compare")


def test_many_changes_are_summarised(tmp_path):
    RunDir(tmp_path, {f"k{i}": i for i in range(8)}, kind="test")
    with pytest.raises(RunSettingsChanged, match=r"k4: 4 -> 5, and 3 more\)") as err:
        RunDir(tmp_path, {f"k{i}": i + 1 for i in range(8)}, kind="test")
    assert len(err.value.keys) == 8


def test_force_clears_markers(tmp_path):
    run = RunDir(tmp_path, SETTINGS, kind="test")
    run.mark_done("train", {"loss": 0.5})
    run.mark_done("dpo/seed-0")
    forced = RunDir(tmp_path, SETTINGS, kind="test", force=True)
    assert not forced.done("train") and not forced.done("dpo/seed-0")

    forced.mark_done("train")
    changed = {**SETTINGS, "steps": 20}
    new = RunDir(tmp_path, changed, kind="test", force=True)
    assert not new.done("train")
    assert json.loads((tmp_path / "run.json").read_text())["settings"] == changed
    assert not RunDir(tmp_path, changed, kind="test").done("train")  # the new settings are the run's now


def test_interrupted_marker_write_leaves_stage_not_done(tmp_path, monkeypatch):
    run = RunDir(tmp_path, SETTINGS, kind="test")

    def killed(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        run.mark_done("train", {"loss": 0.5})
    monkeypatch.undo()
    assert not run.done("train") and run.result("train") is None
    assert not RunDir(tmp_path, SETTINGS, kind="test").done("train")
    assert list((tmp_path / "stages").iterdir()) == []  # no half-written temporary file is left


def test_stage_names_and_dirs(tmp_path):
    run = RunDir(tmp_path, SETTINGS, kind="test")
    assert run.stage_dir("task_00") == tmp_path / "task_00" and (tmp_path / "task_00").is_dir()
    for bad in ("", "../x", "a//b", "/abs"):
        with pytest.raises(ValueError, match="invalid stage name"):
            run.done(bad)


def test_changed_keys():
    assert changed_keys({}, {}) == []
    assert changed_keys({"a": 1}, {"a": 1}) == []
    assert changed_keys({"a": 1}, {"a": 1, "b": None}) == ["b"]  # added, even as None
    assert changed_keys({"a": 1, "b": 2}, {"a": 1}) == ["b"]  # removed
    assert changed_keys({"x": {"y": {"z": 1}, "w": 2}}, {"x": {"y": {"z": 2}, "w": 2}}) == ["x.y.z"]
    assert changed_keys({"a": [1, 2]}, {"a": [1, 3]}) == ["a"]  # lists compare whole
    assert changed_keys({"a": [{"b": 1}]}, {"a": [{"b": 1}]}) == []
    assert changed_keys({"a": {"b": 1}}, {"a": 5}) == ["a"]
    assert changed_keys({"b": 1, "a": {"c": 1, "d": 1}}, {"b": 2, "a": {"c": 2, "d": 1}}) == ["a.c", "b"]
    assert changed_keys({"a": 1}, {"a": 2}, prefix="cfg") == ["cfg.a"]


def test_fingerprint_is_independent_of_key_order():
    a = {"x": 1, "y": {"p": [1, 2], "q": "s"}}
    b = {"y": {"q": "s", "p": [1, 2]}, "x": 1}
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint({**a, "x": 2})
    assert fingerprint({"t": (1, 2)}) == fingerprint({"t": [1, 2]})  # JSON-normalised


def test_stages_dir_places_the_markers(tmp_path):
    results = RunDir(tmp_path / "a", SETTINGS, kind="test", run_file="recipe.json", stages_dir="results")
    results.mark_done("dpo/seed-0", {"win": 1.0})
    assert json.loads((tmp_path / "a" / "results" / "dpo" / "seed-0.json").read_text()) == {"win": 1.0}
    assert (tmp_path / "a" / "recipe.json").exists() and not (tmp_path / "a" / "run.json").exists()

    beside = RunDir(tmp_path / "b", SETTINGS, kind="test", stages_dir=".")
    beside.mark_done("task_00/result", {"task": 0})
    assert beside.marker("task_00/result") == tmp_path / "b" / "task_00" / "result.json"
    with pytest.raises(ValueError, match="force=True needs a stages_dir inside"):
        RunDir(tmp_path / "b", SETTINGS, kind="test", stages_dir=".", force=True)
    assert RunDir(tmp_path / "b", SETTINGS, kind="test", stages_dir=".").done("task_00/result")


def test_run_file_without_kind_is_accepted_when_the_fingerprint_matches(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"fingerprint": fingerprint(SETTINGS), "recipe": SETTINGS}))
    RunDir(tmp_path, SETTINGS, kind="test")
    assert json.loads((tmp_path / "run.json").read_text())["kind"] == "test"  # rewritten in the current format
    with pytest.raises(RunSettingsChanged, match=r"changed: steps: 10 -> 11\)"):
        RunDir(tmp_path, {**SETTINGS, "steps": 11}, kind="test")
