"""benchmarks/README.md lists every benchmark script with a command that names it, and each script's ``--help`` runs
from the repository (imports resolve, arguments parse): a benchmark is never run by the tests, but a broken one is
found here, not by the next person who needs its figure."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.readme import ROOT, readme_commands

SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))  # _x.py: shared code
COMMANDS = readme_commands(ROOT / "benchmarks" / "README.md")


def test_every_benchmark_script_is_listed_once_and_every_listed_script_exists():
    listed = [c.split()[1].removeprefix("benchmarks/") for c in COMMANDS]
    assert all(c.startswith(".venv/bin/python benchmarks/") for c in COMMANDS), COMMANDS
    assert sorted(set(listed)) == SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_runs(script):
    done = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr[-2000:]
