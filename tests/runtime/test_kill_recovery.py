"""A kill -9 at any point of a write leaves something the next run recovers from: atomic directory swaps (killed for
real, at each of their fault points) and the checkpoint a resumed training starts from."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_ext.runtime.io import FAULT_ENV, atomic_directory, commit_directory, recover_directory
from rlhf_ext.trl.args import CHECKPOINT_RECORD, CheckpointError, checkpoint_problem, last_checkpoint

WRITE_NEW_VERSION = """
import sys
from pathlib import Path
from rlhf_ext.runtime.io import atomic_directory
with atomic_directory(Path(sys.argv[1])) as tmp:
    (tmp / "weights.bin").write_text("new")
"""


def _write_killed_at(point: str, target: Path) -> None:
    """Replace ``target`` with a directory holding ``weights.bin = "new"`` in a subprocess killed at ``point``."""
    env = {**os.environ, FAULT_ENV: point}
    proc = subprocess.run([sys.executable, "-c", WRITE_NEW_VERSION, str(target)], env=env, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()


def _entries(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


@pytest.mark.parametrize(
    ("point", "expected"),
    [
        ("written:model", "old"),  # the new version only in its temporary directory: the old one stays
        ("swapping:model", "new"),  # the old version set aside, the new one complete: the swap is finished
        ("committed:model", "new"),  # the new version in place, the old one not deleted yet: it is deleted
    ],
)
def test_a_directory_swap_killed_at_any_point_is_finished_or_undone_by_the_next_run(tmp_path, point, expected):
    target = tmp_path / "model"
    with atomic_directory(target) as tmp:
        (tmp / "weights.bin").write_text("old")
    _write_killed_at(point, target)
    assert _entries(tmp_path) != ["model"]  # the kill left a hidden sibling (and, mid-swap, no `model` at all)

    assert recover_directory(target) is True
    assert _entries(tmp_path) == ["model"]
    assert (target / "weights.bin").read_text() == expected
    assert recover_directory(target) is False  # nothing left over


def test_recovery_puts_back_an_old_version_set_aside_without_a_new_one(tmp_path):
    """What the atomic_directory before this fix left when killed between its two renames: `model` missing, the old
    version renamed aside and the new one in a temporary directory that may be incomplete."""
    (tmp_path / f".model.old-{os.getpid()}").mkdir()
    (tmp_path / f".model.old-{os.getpid()}" / "weights.bin").write_text("old")
    (tmp_path / ".model.tmp-abc").mkdir()
    assert recover_directory(tmp_path / "model") is True
    assert _entries(tmp_path) == ["model"] and (tmp_path / "model" / "weights.bin").read_text() == "old"


def test_commit_directory_replaces_a_directory_and_keeps_the_old_one_when_the_rename_fails(tmp_path, monkeypatch):
    target, new = tmp_path / "model", tmp_path / "incoming"
    target.mkdir()
    (target / "weights.bin").write_text("old")
    new.mkdir()
    (new / "weights.bin").write_text("new")
    real_replace = os.replace

    def failing_second_rename(src, dst):
        if Path(dst) == target and ".new-" in Path(src).name:
            raise OSError("disk gone")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_second_rename)
    with pytest.raises(OSError, match="disk gone"):
        commit_directory(new, target)
    assert _entries(tmp_path) == ["model"] and (target / "weights.bin").read_text() == "old"
    monkeypatch.undo()
    new.mkdir()
    (new / "weights.bin").write_text("new")
    commit_directory(new, target)
    assert _entries(tmp_path) == ["model"] and (target / "weights.bin").read_text() == "new"


def _checkpoint(root: Path, step: int, state: str | None, record: dict | None = None) -> Path:
    """A ``checkpoint-<step>`` directory with weights, ``trainer_state.json`` = ``state`` unless it is None, and
    rlhf-ext's record unless ``record`` is None (``{}``: written before the save; ``"sizes"``: after it)."""
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"weights")
    if state is not None:
        (path / "trainer_state.json").write_text(state)
    if record is not None:
        sizes = {p.name: p.stat().st_size for p in path.iterdir()} if record == "sizes" else record
        (path / CHECKPOINT_RECORD).write_text(json.dumps({"files": sizes} if record == "sizes" else record))
    return path


COMPLETE = json.dumps({"global_step": 4, "log_history": []})


def test_last_checkpoint_resumes_from_the_newest_complete_checkpoint_and_removes_only_its_own_interrupted_write(
    tmp_path,
):
    _checkpoint(tmp_path, 2, None, {})  # incomplete, but older than a complete one: not the interrupted write; kept
    _checkpoint(tmp_path, 4, COMPLETE, "sizes")
    _checkpoint(tmp_path, 6, COMPLETE[: len(COMPLETE) // 2], {})  # trainer_state.json cut halfway
    _checkpoint(tmp_path, 10, None, {})  # killed before trainer_state.json was written
    (tmp_path / "checkpoint-12").mkdir()  # killed right after creating the directory
    assert last_checkpoint(tmp_path, resume=False) is None
    assert _entries(tmp_path) == ["checkpoint-10", "checkpoint-12", "checkpoint-2", "checkpoint-4", "checkpoint-6"]

    assert last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-4")
    assert _entries(tmp_path) == ["checkpoint-2", "checkpoint-4"]


def test_last_checkpoint_starts_fresh_when_no_checkpoint_is_complete(tmp_path):
    _checkpoint(tmp_path, 1, "", {})
    _checkpoint(tmp_path, 2, "[]", {})  # JSON, but not a trainer state
    assert last_checkpoint(tmp_path) is None
    assert _entries(tmp_path) == []
    assert last_checkpoint(tmp_path / "missing") is None


def test_a_checkpoint_directory_the_run_did_not_write_is_never_deleted(tmp_path, caplog):
    """Issue 23 item 2: a ``checkpoint-N`` without rlhf-ext's record (the user's, another tool's) used to be deleted
    with a warning that "its write was interrupted"."""
    _checkpoint(tmp_path, 4, COMPLETE, "sizes")
    foreign = _checkpoint(tmp_path, 9, None)
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError) as info:
        last_checkpoint(tmp_path)
    assert str(info.value) == (
        f"{foreign} holds no complete checkpoint (no trainer_state.json) and was not written by rlhf-ext (no "
        f"{CHECKPOINT_RECORD}); rlhf-ext deletes only what it wrote: move it out of {tmp_path} or choose another "
        "output directory"
    )
    assert (foreign / "notes.txt").read_text() == "mine" and (foreign / "model.safetensors").exists()
    assert _entries(tmp_path) == ["checkpoint-4", "checkpoint-9"]


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_that_loads_and_says_so(tmp_path, caplog):
    """Issue 23 item 9: a truncated ``model.safetensors`` in the newest checkpoint (``trainer_state.json`` intact)
    made every rerun fail while loading it."""
    _checkpoint(tmp_path, 4, COMPLETE, "sizes")
    newest = _checkpoint(tmp_path, 8, COMPLETE, "sizes")
    (newest / "model.safetensors").write_bytes(b"wei")  # truncated after the save
    with caplog.at_level("WARNING", logger="rlhf_ext.trl.args"):
        assert last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-4")
    assert (
        f"{newest} cannot be resumed from (model.safetensors has 3 of the 7 bytes written); it is kept" in caplog.text
    )
    assert f"resuming from {tmp_path / 'checkpoint-4'}, the newest checkpoint that loads" in caplog.text
    assert _entries(tmp_path) == ["checkpoint-4", "checkpoint-8"]  # the damaged one is kept


def test_a_truncated_safetensors_file_is_found_in_a_checkpoint_without_a_record(tmp_path):
    import torch
    from safetensors.torch import save_file

    ok = _checkpoint(tmp_path, 1, COMPLETE)
    save_file({"w": torch.zeros(64)}, str(ok / "model.safetensors"))
    assert checkpoint_problem(ok) is None
    data = (ok / "model.safetensors").read_bytes()
    (ok / "model.safetensors").write_bytes(data[:-10])
    assert checkpoint_problem(ok) == f"model.safetensors has {len(data) - 10} of {len(data)} bytes"
