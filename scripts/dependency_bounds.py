"""Pip constraints for testing rlhf-ext's declared dependency bounds (``make test-floors`` / ``make test-newest``).

    python scripts/dependency_bounds.py floors   EXTRAS...  # NAME==FLOOR for every lower bound (>= X) declared
    python scripts/dependency_bounds.py newest   EXTRAS...  # only torch==TORCH_VERSION: pip picks the newest others
    python scripts/dependency_bounds.py versions EXTRAS...  # NAME==VERSION installed, for each direct dependency

Reads ``pyproject.toml``: ``[project] dependencies`` and the optional-dependency groups named by EXTRAS. torch is
always pinned to ``$TORCH_VERSION`` (default 2.13.0): the one CPU build this project's machines install without
downloading a multi-GB CUDA build. Prints the constraints, one per line.
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import tomllib
from packaging.requirements import Requirement


def declared(extras: list[str]) -> list[Requirement]:
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + [r for extra in extras for r in project["optional-dependencies"][extra]]
    return [Requirement(line) for line in lines]


def installed(extras: list[str]) -> list[str]:
    out = {}
    for req in declared(extras):
        try:
            out[req.name] = f"{req.name}=={version(req.name)}"
        except PackageNotFoundError:
            out[req.name] = f"{req.name} (not installed)"
    return sorted(out.values())


def constraints(mode: str, extras: list[str]) -> list[str]:
    if mode == "versions":
        return installed(extras)
    torch = os.environ.get("TORCH_VERSION", "2.13.0")
    out = {"torch": f"torch=={torch}"}
    if mode == "floors":
        for req in declared(extras):
            floors = [s.version for s in req.specifier if s.operator == ">="]
            if req.name != "torch" and floors:
                out.setdefault(req.name, f"{req.name}=={floors[0]}")
    elif mode != "newest":
        raise SystemExit(f"mode must be 'floors', 'newest' or 'versions', got {mode!r}")
    return sorted(out.values())


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    print("\n".join(constraints(sys.argv[1], sys.argv[2:])))
