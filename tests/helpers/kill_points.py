"""Run the real ``rlhf-ext`` command in a subprocess and kill it (SIGKILL, as ``kill -9``) at an exact point.

Two ways to choose the point:

* ``fault_at="written:stages"``: ``$RLHF_EXT_FAULT_AT``, read by :func:`rlhf_ext.runtime.io.fault_point` (the points
  of every atomic directory write, ``written:`` / ``swapping:`` / ``committed:<name>``, and the writers' own);
* ``truncate_checkpoint=N``: this module as the entry point (``python -m tests.helpers.kill_points N -- ARGS``): it
  makes transformers' ``TrainerState.save_to_json`` write half of ``checkpoint-N/trainer_state.json`` (the file the
  Trainer writes last) and then kill the process, which is what a kill while that checkpoint is written leaves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import rlhf_ext
from rlhf_ext.runtime.io import FAULT_ENV

#: the directory holding the ``rlhf_ext`` (and ``tests``) packages this process imported: the subprocess uses the same
SOURCE_ROOT = Path(rlhf_ext.__file__).resolve().parents[1]


def _cli_env(fault_at: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SOURCE_ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop(FAULT_ENV, None)
    if fault_at is not None:
        env[FAULT_ENV] = fault_at
    return env


def run_cli(
    args: list[str],
    *,
    fault_at: str | None = None,
    truncate_checkpoint: int | None = None,
    cwd: Path | None = None,
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """``rlhf-ext ARGS`` in a fresh interpreter (output captured), killed at ``fault_at`` / ``truncate_checkpoint``."""
    entry = ["-m", "rlhf_ext.cli"]
    if truncate_checkpoint is not None:
        entry = ["-m", "tests.helpers.kill_points", str(truncate_checkpoint), "--"]
    return subprocess.run(
        [sys.executable, *entry, *args],
        cwd=cwd,
        env=_cli_env(fault_at),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_cli(args: list[str], *, fault_at: str | None = None, cwd: Path | None = None) -> subprocess.Popen:
    """``rlhf-ext ARGS`` started in a fresh interpreter (text pipes for stdout and stderr; read them with
    :func:`read_stderr_until` and ``communicate``), killed at ``fault_at``."""
    return subprocess.Popen(
        [sys.executable, "-m", "rlhf_ext.cli", *args],
        cwd=cwd,
        env=_cli_env(fault_at),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_stderr_until(proc: subprocess.Popen, text: str) -> list[str]:
    """The stderr lines of ``proc`` up to the first one containing ``text`` (fails if the process exits first)."""
    lines = []
    while line := proc.stderr.readline():
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"exited ({proc.wait()}) before logging {text!r}:\n{''.join(lines)}")


def was_killed(result: subprocess.CompletedProcess) -> bool:
    """Whether the subprocess died of SIGKILL (and so reached its kill point)."""
    return result.returncode == -signal.SIGKILL


def _kill_while_writing_checkpoint(step: int) -> None:
    from transformers.trainer_callback import TrainerState

    original = TrainerState.save_to_json

    def save_to_json(self, json_path: str) -> None:
        if Path(json_path).parent.name != f"checkpoint-{step}":
            return original(self, json_path)
        original(self, json_path)
        text = Path(json_path).read_text()
        Path(json_path).write_text(text[: len(text) // 2])  # the write was cut halfway
        os.kill(os.getpid(), signal.SIGKILL)

    TrainerState.save_to_json = save_to_json


if __name__ == "__main__":
    step, separator, *cli_args = sys.argv[1:]
    assert separator == "--", "usage: python -m tests.helpers.kill_points STEP -- RLHF_EXT_ARGS..."
    _kill_while_writing_checkpoint(int(step))
    from rlhf_ext.cli import main

    main(cli_args, prog_name="rlhf-ext")
