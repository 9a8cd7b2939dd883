"""Nothing lost: ``data export`` never deletes what it did not write (and never the dataset itself), and a dataset
save killed at any point is finished or cleaned up by the next save or load, identical to an uninterrupted one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlhf_ext.cli import main
from rlhf_ext.datagen import ContinualDataset, load_continual_dataset
from rlhf_ext.datagen.cache import CACHE_DIR
from tests.helpers.kill_points import run_cli, was_killed

CONFIG = "continual-piecewise-preference"
GENERATE = ["data", "generate", CONFIG, "--num-samples", "6", "--no-progress"]


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "ds"
    result = CliRunner().invoke(main, [*GENERATE, "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


def _export(dataset: Path, out: Path, *flags: str):
    return CliRunner().invoke(main, ["data", "export", str(dataset), "-o", str(out), *flags])


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (hidden ones included) with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _error_line(output: str) -> str:
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output
    return errors[0]


def test_export_refuses_a_non_empty_directory_and_deletes_nothing(dataset_dir, tmp_path):
    out = tmp_path / "mine"
    (out / "notes").mkdir(parents=True)
    (out / "notes" / "todo.txt").write_text("keep me")
    (out / ".hidden").write_text("me too")
    before = _snapshot(out)

    result = _export(dataset_dir, out)
    assert result.exit_code == 2
    assert _error_line(result.output) == (
        f"error: {out} is not empty (.hidden, notes); export to a new or empty directory, or pass --overwrite "
        "(Python: overwrite=True) to replace only the files the export writes"
    )
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temporary directory left next to it


def test_export_with_overwrite_replaces_only_the_files_it_writes(dataset_dir, tmp_path):
    ds = load_continual_dataset(dataset_dir)
    out = tmp_path / "mine"
    (out / "notes").mkdir(parents=True)
    (out / "notes" / "todo.txt").write_text("keep me")
    stale = out / ds.export_files()[0]
    stale.parent.mkdir()
    stale.write_text("an older export\n")
    (stale.parent / "extra.txt").write_text("keep me too")

    result = _export(dataset_dir, out, "--overwrite")
    assert result.exit_code == 0, result.output
    fresh = tmp_path / "fresh"
    assert _export(dataset_dir, fresh).exit_code == 0  # a new directory: the export alone
    assert sorted(_snapshot(fresh)) == sorted(ds.export_files())
    after = _snapshot(out)
    assert {k: after[k] for k in ds.export_files()} == _snapshot(fresh)  # every exported file is the new one
    assert after["notes/todo.txt"] == b"keep me" and after[f"{stale.parent.name}/extra.txt"] == b"keep me too"
    assert sorted(after) == sorted([*ds.export_files(), "notes/todo.txt", f"{stale.parent.name}/extra.txt"])
    rows = [json.loads(line) for line in stale.read_text().splitlines()]
    assert [r["sample_id"] for r in rows] == list(ds[0]["train"]["sample_id"])


@pytest.mark.parametrize("where", ["itself", "its parent"])
def test_export_refuses_the_dataset_directory_and_keeps_the_dataset_and_its_cache(dataset_dir, where):
    out = dataset_dir if where == "itself" else dataset_dir.parent
    before = _snapshot(dataset_dir)
    assert any(k.startswith(f"{CACHE_DIR}/") for k in before)

    for flags in ((), ("--overwrite",)):
        result = _export(dataset_dir, out, *flags)
        assert result.exit_code == 2
        verb = "is" if where == "itself" else "holds"
        assert _error_line(result.output) == (
            f"error: export directory {out} {verb} the input DATASET ({dataset_dir}): the run would write over it; "
            "choose an output directory that holds none of the run's inputs"
        )
    assert _snapshot(dataset_dir) == before
    assert len(load_continual_dataset(dataset_dir)) == 9  # every stage still loads


def test_export_into_an_empty_directory(dataset_dir, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    result = _export(dataset_dir, out, "--format", "parquet")
    assert result.exit_code == 0, result.output
    ds = load_continual_dataset(dataset_dir)
    assert sorted(_snapshot(out)) == sorted(ds.export_files("parquet"))
    assert json.loads((out / "continual_dataset.json").read_text()) == ds.metadata


def _dataset_state(path: Path) -> tuple[dict, list]:
    ds = ContinualDataset.load(path)
    return ds.metadata, [{split: dd[split].to_list() for split in dd} for dd in ds]


@pytest.mark.parametrize(
    ("point", "replacing"),
    [
        ("written:stages", False),  # the stages complete in a temporary directory (the 24 MB `.stages.tmp-*`)
        ("swapping:stages", True),  # the old stages set aside, the new ones not in place: no `stages/` at all
        ("committed:stages", True),  # the new stages in place, the top-level metadata not written yet
    ],
)
def test_a_dataset_save_killed_at_any_point_is_recovered(dataset_dir, tmp_path, point, replacing):
    out = tmp_path / "ds"
    if replacing:  # a finished dataset (with its generation cache) that the killed run saves again
        shutil.copytree(dataset_dir, out)
    killed = run_cli([*GENERATE, "-o", str(out)], fault_at=point)
    assert was_killed(killed), killed.stderr
    assert [p.name for p in out.iterdir() if p.name.startswith(".stages.")]  # what the kill left

    if replacing:  # a finished dataset is read as it is: the load finishes the interrupted save
        assert _dataset_state(out) == _dataset_state(dataset_dir)
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in dataset_dir.iterdir())
    rerun = run_cli([*GENERATE, "-o", str(out)])
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in dataset_dir.iterdir())
    assert sorted(p.name for p in (out / "stages").iterdir()) == sorted(
        p.name for p in (dataset_dir / "stages").iterdir()
    )
    assert _dataset_state(out) == _dataset_state(dataset_dir)  # the same dataset as an uninterrupted run
