"""Small engine-free helpers: atomic file writes, a cross-process file lock, stable hashing."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def default_cache_dir() -> Path:
    """Where built models and preprocessing caches live: ``$RLHF_EXT_CACHE`` or ``~/.cache/rlhf_ext``."""
    return Path(os.environ.get("RLHF_EXT_CACHE", Path.home() / ".cache" / "rlhf_ext"))


def current_umask() -> int:
    """The process umask (read without changing it for longer than the call)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see either the old file or the complete new one. The file gets the
    permissions ``open`` would give it (``0o666`` minus the umask), not ``mkstemp``'s private ``0o600``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary directory next to ``path``; on success it is renamed to ``path`` (replacing it). The
    directory gets ``0o777`` minus the umask (``mkdtemp`` makes it private, ``0o700``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        tmp.chmod(0o777 & ~current_umask())
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def file_lock(path: str | Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created if missing), shared across processes and ranks (``filelock``)."""
    from filelock import FileLock

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path)):
        yield


def stable_hash(*parts: Any, length: int = 16) -> str:
    """A short hex digest of JSON-serialisable ``parts`` (stable across processes, unlike ``hash``)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(json.dumps(part, sort_keys=True, default=str).encode())
        h.update(b"\0")
    return h.hexdigest()[:length]


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Any, Any]:
    """Module-level ``__getattr__`` and ``__dir__`` for a package whose public names live in submodules.

    ``exports`` maps each public name to the module defining it; the module is imported on first access and the
    value cached in the package, so ``import package`` stays light. Use as
    ``__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)``.
    """
    import importlib
    import sys

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            setattr(sys.modules[package], name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__


def machine_info() -> dict[str, Any]:
    """What a benchmark result needs to be read against: CPUs, torch threads, 1/5/15-minute load average, versions."""
    import platform

    import torch

    return {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "cuda": torch.cuda.is_available(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
