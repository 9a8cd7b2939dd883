"""Run the ``rlhf-ext`` command line as if some packages were not installed.

    python -m tests.helpers.without_packages trl,tensorboard -- train segment-rm --config segment_rm_tiny ...

For each named top-level module, ``import`` raises ``ModuleNotFoundError`` (with ``name`` set, as for a package that
is really missing) and ``importlib.util.find_spec`` returns ``None``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys


class PackageBlocker(importlib.abc.MetaPathFinder):
    """A meta-path finder, first in line, that makes the named top-level modules unimportable."""

    def __init__(self, names: set[str]) -> None:
        self.names = frozenset(names)

    def blocks(self, fullname: str) -> bool:
        return fullname.split(".")[0] in self.names

    def find_spec(self, fullname, path=None, target=None):
        if self.blocks(fullname):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def block_packages(names: set[str]) -> PackageBlocker:
    """Install a :class:`PackageBlocker` for ``names`` and make ``find_spec`` report them as absent."""
    blocker = PackageBlocker(names)
    for loaded in [m for m in sys.modules if blocker.blocks(m)]:
        del sys.modules[loaded]
    sys.meta_path.insert(0, blocker)
    real_find_spec = importlib.util.find_spec

    def find_spec(name, package=None):
        return None if blocker.blocks(name) else real_find_spec(name, package)

    importlib.util.find_spec = find_spec
    return blocker


if __name__ == "__main__":
    names, separator, *args = sys.argv[1:]
    assert separator == "--", "usage: python -m tests.helpers.without_packages MOD[,MOD...] -- ARGS..."
    block_packages({n for n in names.split(",") if n})
    from rlhf_ext.cli import main

    main(args, prog_name="rlhf-ext")
