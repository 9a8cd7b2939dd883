"""One owner per lock, and directories built once: a thread asking again for a lock it holds is refused at once (it
used to wait for itself forever with filelock 3.x, or fail with filelock 4's own message); threads and processes
asking for the same ``builtin:`` model at once share one build; a build killed halfway is redone cleanly."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from filelock import Timeout

from rlhf_ext.runtime.io import atomic_directory, build_once, file_lock
from tests.helpers.kill_points import read_stderr_until, run_cli, start_cli, was_killed

REFUSED = "already held by this thread"


def _try_lock_from_another_thread(path: Path) -> str:
    """``"taken"`` if another thread gets ``path`` at once, ``"busy"`` if it is held."""
    result = []

    def attempt():
        try:
            with file_lock(path, timeout=0):
                result.append("taken")
        except Timeout:
            result.append("busy")

    t = threading.Thread(target=attempt)
    t.start()
    t.join()
    return result[0]


def test_a_thread_asking_again_for_a_lock_it_holds_is_refused_at_once(tmp_path):
    lock = tmp_path / "model.lock"
    with file_lock(lock):
        with pytest.raises(RuntimeError, match=REFUSED), file_lock(tmp_path / "." / "model.lock"):  # the same file
            pass
        assert _try_lock_from_another_thread(lock) == "busy"  # the refusal did not release the owner's lock
    assert _try_lock_from_another_thread(lock) == "taken"
    with file_lock(lock):  # and the owner can take it again once it let go
        pass


def _write(path: Path, text: str = "built") -> None:
    with atomic_directory(path) as tmp:
        (tmp / "done.txt").write_text(text)


def test_a_build_that_asks_for_its_own_directory_again_is_refused_and_leaves_nothing(tmp_path):
    target = tmp_path / "model"

    def build(path: Path) -> None:
        build_once(path, _write, "done.txt")

    with pytest.raises(RuntimeError, match=REFUSED):
        build_once(target, build, "done.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.lock"]
    assert build_once(target, _write, "done.txt") == target and (target / "done.txt").read_text() == "built"


def test_threads_asking_at_once_share_one_build(tmp_path):
    target, calls, results = tmp_path / "model", [], []
    start = threading.Barrier(8)

    def build(path: Path) -> None:
        calls.append(threading.get_ident())
        time.sleep(0.2)  # the others arrive while this one builds
        _write(path)

    def ask():
        start.wait()
        results.append(build_once(target, build, "done.txt"))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and results == [target] * 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.lock"]


@pytest.mark.slow  # three fresh `rlhf-ext` processes
def test_a_build_killed_halfway_is_redone_cleanly_and_two_processes_share_one_build(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_EXT_CACHE", str(tmp_path))
    models = tmp_path / "models"
    killed = run_cli(["zoo", "build", "tiny"], fault_at="written:tiny")  # complete in its temporary directory
    assert was_killed(killed), killed.stderr
    leftovers = [p.name for p in models.iterdir() if p.name.startswith(".tiny.tmp-")]
    assert len(leftovers) == 1 and not (models / "tiny").exists()

    with file_lock(models / "tiny.lock"):  # hold the build back until both processes wait for it
        procs = [start_cli(["zoo", "build", "tiny"]) for _ in range(2)]
        early = [read_stderr_until(p, "waiting for") for p in procs]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert [out.strip().splitlines()[-1] for out, _ in outputs] == [str(models / "tiny")] * 2
    logs = [line for lines in early for line in lines] + [line for _, err in outputs for line in err.splitlines()]
    assert sum(line.startswith("building ") for line in logs) == 1  # one built, the other waited and reused it
    assert sorted(p.name for p in models.iterdir()) == ["tiny", "tiny.lock"]  # the killed build's copy is gone
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(models / "tiny").config.num_hidden_layers == 2
