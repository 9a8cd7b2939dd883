"""Atomic writers: readers see the old or the complete new file, with the permissions the umask gives (not mkstemp's
private 0600 / mkdtemp's 0700, which lock collaborators on a shared filesystem out of reports and checkpoints); and
the machine a result names."""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import stat
import time

import pytest

from rlhf_ext.runtime.io import (
    atomic_directory,
    atomic_write_json,
    atomic_write_text,
    cpu_model,
    file_lock,
    machine_info,
)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_files_and_directories_get_the_umask_modes(tmp_path, umask_022):
    atomic_write_text(tmp_path / "report.txt", "x")
    atomic_write_json(tmp_path / "metrics.json", {"a": 1})
    with atomic_directory(tmp_path / "model") as tmp:
        (tmp / "config.json").write_text("{}")
    assert _mode(tmp_path / "report.txt") == 0o644 and _mode(tmp_path / "metrics.json") == 0o644
    assert _mode(tmp_path / "model") == 0o755
    os.umask(0o077)
    atomic_write_text(tmp_path / "private.txt", "x")
    assert _mode(tmp_path / "private.txt") == 0o600  # a private umask is respected too


def test_a_failed_atomic_write_leaves_the_old_file(tmp_path):
    atomic_write_text(tmp_path / "f.txt", "old")
    with pytest.raises(TypeError):
        atomic_write_json(tmp_path / "f.txt", {"bad": object()})
    assert (tmp_path / "f.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]  # no temporary file left behind


def _hold(path, seconds, out):
    with file_lock(path):
        out.put(("in", time.monotonic()))
        time.sleep(seconds)
        out.put(("out", time.monotonic()))


def test_file_lock_excludes_other_processes(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_hold, args=(tmp_path / "x.lock", 0.5, q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    events = sorted((q.get(timeout=5) for _ in range(4)), key=lambda e: e[1])
    assert [e[0] for e in events] == ["in", "out", "in", "out"]  # never two holders at once


def test_machine_info_names_the_cpu_from_cpuinfo_and_falls_back_to_platform(tmp_path):
    """Seeded results differ between CPUs by rounding, so every result file names its CPU (``machine_info``)."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: X\nmodel\t\t: 1\nmodel name\t: Example CPU 9000 @ 2.0GHz\nflags\t: a b\n" * 2
    )
    assert cpu_model(cpuinfo) == "Example CPU 9000 @ 2.0GHz"
    fallback = platform.processor() or platform.machine()
    assert cpu_model(tmp_path / "missing") == fallback
    (tmp_path / "arm").write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\n")  # no model name
    assert cpu_model(tmp_path / "arm") == fallback
    assert machine_info()["cpu_model"] == cpu_model()
