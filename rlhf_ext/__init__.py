"""rlhf-ext: methods of recent RLHF papers for OpenRLHF and TRL.

``import rlhf_ext`` is light: sub-packages load on first attribute access, and the engine adapters
(``rlhf_ext.trl``, ``rlhf_ext.openrlhf``) import trl / openrlhf / deepspeed / ray / vllm only when used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0.dev0"

_SUBMODULES = {
    "algos", "runtime", "trl", "openrlhf", "pipelines", "zoo", "sim", "datagen", "recipes", "config", "cli",
    "segment", "online", "continual",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"rlhf_ext.{name}")
    raise AttributeError(f"module 'rlhf_ext' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_SUBMODULES))
