"""Small engine-free helpers: atomic file and directory writes (and the recovery of a killed one), a cross-process
file lock with one owner, directories built once by whoever asks first, stable hashing, a thread lock that survives
pickling, and the fault-injection hook of the kill-recovery tests."""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """Where built models and preprocessing caches live: ``$RLHF_EXT_CACHE`` or ``~/.cache/rlhf_ext``."""
    return Path(os.environ.get("RLHF_EXT_CACHE", Path.home() / ".cache" / "rlhf_ext"))


def current_umask() -> int:
    """The process umask (read without changing it for longer than the call)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the complete new one. The file gets the
    permissions ``open`` would give it (``0o666`` minus the umask), not ``mkstemp``'s private ``0o600``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` encoded as UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


#: The environment variable of :func:`fault_point` (a test hook: kill-recovery tests set it; nothing else should).
FAULT_ENV = "RLHF_EXT_FAULT_AT"

# the hidden siblings ``.<name>.<kind>-*`` of a directory being written: an unfinished temporary copy, a complete new
# version waiting to be swapped in, and the old version set aside during the swap
_TMP, _NEW, _OLD = "tmp", "new", "old"


def fault_point(point: str) -> None:
    """Test hook: kill this process with SIGKILL here when ``$RLHF_EXT_FAULT_AT`` (an ``fnmatch`` pattern, e.g.
    ``committed:policy_*``) matches ``point``; unset, it does nothing. :func:`atomic_directory` passes
    ``written:<name>`` (the new version complete), ``swapping:<name>`` (the old one set aside; only when replacing)
    and ``committed:<name>`` (the new one in place, the old one not deleted yet); :func:`commit_directory` the last two.
    """
    pattern = os.environ.get(FAULT_ENV)
    if pattern and fnmatch.fnmatchcase(point, pattern):
        os.kill(os.getpid(), signal.SIGKILL)


def _sibling(path: Path, kind: str) -> Path:
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _siblings(path: Path, kind: str) -> list[Path]:
    """The hidden ``.<name>.<kind>-*`` siblings of ``path``, oldest first."""
    found = path.parent.glob(f".{glob.escape(path.name)}.{kind}-*")
    return sorted(found, key=lambda p: p.lstat().st_mtime_ns)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _swap_in(ready: Path, path: Path) -> None:
    """Rename the complete directory ``ready`` to ``path``; an existing ``path`` is renamed aside first and deleted
    once the new version is in place (rename-aside, rename, delete-aside)."""
    aside = None
    if os.path.lexists(path):
        aside = _sibling(path, _OLD)
        os.replace(path, aside)
        fault_point(f"swapping:{path.name}")
    try:
        os.replace(ready, path)
    except BaseException:
        if aside is not None:
            os.replace(aside, path)  # the old version back where it was
        _remove(ready)
        raise
    fault_point(f"committed:{path.name}")
    if aside is not None:
        _remove(aside)


def commit_directory(src: str | Path, path: str | Path) -> None:
    """Make the complete directory ``src`` (on ``path``'s filesystem) visible as ``path``, replacing any directory
    there: ``src`` is renamed to ``.<name>.new-*`` (complete from then on), an existing ``path`` aside to
    ``.<name>.old-*``, the new version into place, and the old one deleted. Readers see the old or the new version;
    a kill at any point leaves a state that :func:`recover_directory` finishes."""
    path = Path(path)
    ready = _sibling(path, _NEW)
    os.replace(src, ready)
    _swap_in(ready, path)


def recover_directory(path: str | Path) -> bool:
    """Finish what a killed :func:`atomic_directory` / :func:`commit_directory` left next to ``path``: a waiting new
    version (``.<name>.new-*``) is swapped in; an old version set aside (``.<name>.old-*``) is deleted, or put back
    when ``path`` is missing and no new version waits; temporary copies (``.<name>.tmp-*``) are deleted. Only where no
    other process writes ``path`` (a live writer's copy looks like a dead one's). Returns whether anything was left."""
    path = Path(path)
    if not path.parent.is_dir():
        return False
    stale, ready, aside = _siblings(path, _TMP), _siblings(path, _NEW), _siblings(path, _OLD)
    for leftover in stale:
        _remove(leftover)
    if ready:  # killed during the swap (or just before it): the new version is complete, so it goes in
        *outdated, newest = ready
        for leftover in outdated:
            _remove(leftover)
        _swap_in(newest, path)
    elif aside and not os.path.lexists(path):  # an old version set aside and nothing to replace it: put it back
        *aside, newest = aside
        os.replace(newest, path)
    for leftover in aside:
        _remove(leftover)
    return bool(stale or ready or aside)


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary directory next to ``path`` (``.<name>.tmp-*``, mode ``0o777`` minus the umask); when the
    block finishes, it replaces ``path`` (:func:`commit_directory`); a failed block deletes it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.{_TMP}-", dir=path.parent))
    try:
        tmp.chmod(0o777 & ~current_umask())
        yield tmp
        fault_point(f"written:{path.name}")
        commit_directory(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def temporary_sibling(path: str | Path, suffix: str = "") -> Path:
    """A fixed-name temporary path next to ``path`` (``.<name>.tmp-<suffix>``), for writers whose processes must agree
    on one name (every rank of a distributed save)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{_TMP}-{suffix}")


#: the lock files each thread holds (``file_lock`` refuses to take one of them again)
_held_locks = threading.local()


@contextlib.contextmanager
def file_lock(path: str | Path, timeout: float = -1) -> Iterator[None]:
    """An exclusive lock on ``path`` (created if missing), shared across processes, ranks and threads (``filelock``).
    ``timeout``: seconds to wait (``-1``: forever); ``filelock.Timeout`` when it runs out. A thread asking again for a
    lock it holds gets a ``RuntimeError`` at once, whatever the filelock version (3.x would wait for itself forever)."""
    from filelock import FileLock

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(path)
    held: set[str] = _held_locks.__dict__.setdefault("paths", set())
    if key in held:
        raise RuntimeError(
            f"the lock {path} is already held by this thread: the code that holds it called code that asks for it "
            "again (a bug in rlhf-ext: one owner per lock; please report it)"
        )
    held.add(key)
    try:
        with FileLock(str(path), timeout=timeout):
            yield
    finally:
        held.discard(key)


def build_once(path: str | Path, build: Callable[[Path], Any], done: str) -> Path:
    """Make the directory ``path`` exactly once, however many threads and processes ask and wherever one is killed;
    returns ``path``. ``build(path)`` writes it atomically (:func:`atomic_directory`) and ``path / done`` marks it
    complete; otherwise a caller takes ``<path>.lock`` (``build`` must not ask for ``path`` again), recovers what a
    killed builder left (:func:`recover_directory`) and builds unless that completed it; others wait and reuse it."""
    from filelock import Timeout

    path = Path(path)
    if (path / done).exists():
        return path
    lock = path.with_name(path.name + ".lock")
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(file_lock(lock, timeout=0))
        except Timeout:
            logger.info("waiting for %s: another process or thread is building it", path)
            held.enter_context(file_lock(lock))
        recover_directory(path)
        if not (path / done).exists():
            logger.info("building %s (once; later calls reuse it)", path)
            build(path)
    return path


class PicklableLock:
    """A ``threading.Lock`` that pickles as a new, free lock, so that an object holding one (a reward model's tokenizer
    lock) can be sent to another process (``generator_process``); objects sharing one lock share its copy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.acquire, self.release = self._lock.acquire, self._lock.release

    def __enter__(self) -> bool:
        return self._lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._lock.__exit__(*exc)

    def __reduce__(self) -> tuple[type, tuple]:
        return type(self), ()


def weights_problem(model_dir: str | Path) -> str | None:
    """Why the ``.safetensors`` weights in ``model_dir`` cannot be loaded (a file shorter than its header says, or no
    readable header: truncated by a full disk or a copy that stopped), or None. Reads only the headers."""
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        size = file.stat().st_size
        try:
            with open(file, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(header_len)) if 8 + header_len <= size else None
        except (OSError, ValueError):
            header = None
        if not isinstance(header, dict):
            return f"{file.name} has no readable header"
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + header_len + end > size:
            return f"{file.name} has {size} of {8 + header_len + end} bytes"
    return None


def stable_hash(*parts: Any, length: int = 16) -> str:
    """A short hex digest of JSON-serialisable ``parts`` (stable across processes, unlike ``hash``)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(json.dumps(part, sort_keys=True, default=str).encode())
        h.update(b"\0")
    return h.hexdigest()[:length]


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Any, Any]:
    """Module-level ``__getattr__`` and ``__dir__`` for a package whose public names (``exports``: name -> module)
    are imported on first access and cached: ``__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)``."""
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


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's name (Linux: ``cpuinfo``'s first ``model name``; else :func:`platform.processor`): results of
    the same seeded run differ between CPUs by floating-point rounding, so a result names the CPU it ran on."""
    with contextlib.suppress(OSError):
        lines = cpuinfo.read_text().splitlines()
        names = (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        if name := next(names, None):
            return name
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """What a benchmark result needs to be read against: CPU model and count, torch threads, 1/5/15-minute load
    average, versions."""
    import torch

    return {
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "cuda": torch.cuda.is_available(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
