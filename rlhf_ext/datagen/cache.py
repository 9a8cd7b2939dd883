"""The append-only sample cache that makes generation resumable (one JSON line per finished sample).

Every finished (or unusable) sample is one line of ``<output>/.cache/samples.jsonl`` (worker ``k > 0`` of a sharded
run: ``samples-<k>.jsonl``), keyed by a hash of the task, sample index, seed and text-changing generation settings,
written with one ``write`` on an ``O_APPEND`` descriptor (a ``kill -9`` loses only requests in flight; ``fsync`` at
most every ``fsync_interval`` s). On open a torn last line is cut off and duplicate keys keep their first record. In
memory the cache is an index (file, offset, length, status per key in sorted arrays, ~40 bytes per sample). A
non-blocking ``filelock`` stops two runs writing one cache. Failed requests are never records; older versions'
``request_rejected`` records are dropped on open, so those samples are generated again.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from filelock import FileLock

CACHE_DIR = ".cache"
SAMPLES_FILE = "samples.jsonl"
RUNS_FILE = "runs.jsonl"
#: the samples file of sharded-run worker ``k > 0``: ``SHARD_FILE.format(k)``
SHARD_FILE = "samples-{}.jsonl"
LOCK_FILE = "lock"
#: skip reasons that are not final answers (written by older versions for failed requests): ignored when loading
NOT_FINAL_REASONS = frozenset({"request_rejected"})


class CacheLockedError(RuntimeError):
    """Another process is generating into the same output directory."""


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS: glibc keeps the pages of large freed numpy temporaries (the index merge's
    copies) in the process, so its peak RSS would otherwise stay for the rest of the run."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class SampleAppender:
    """Append records to one samples file, one ``write`` per line, ``fsync`` at most every ``fsync_interval`` s."""

    def __init__(self, path: str | Path, fsync_interval: float = 0.5):
        self.path = Path(path)
        self.fsync_interval = fsync_interval
        self._fd: int | None = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
        self._last_sync = time.monotonic()
        self._dirty = False

    def append(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            raise RuntimeError("SampleCache is not open")
        line = (json.dumps(record, sort_keys=True, ensure_ascii=False) + "\n").encode()
        view = memoryview(line)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self._dirty = True
        if time.monotonic() - self._last_sync >= self.fsync_interval:
            self.sync()

    def sync(self) -> None:
        if self._fd is not None and self._dirty:
            os.fsync(self._fd)
            self._dirty = False
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._fd is not None:
            self.sync()
            os.close(self._fd)
            self._fd = None


class SampleCache:
    """Append-only JSONL of finished samples; use as a context manager (``with SampleCache(dir) as cache``).

    ``key in cache``, :meth:`get` and :meth:`locate` see the records present when the cache was opened or last
    :meth:`refresh`-ed (records appended since, by this process or by workers, appear after ``refresh``).
    """

    def __init__(self, directory: str | Path, fsync_interval: float = 0.5):
        self.directory = Path(directory)
        self.path = self.directory / SAMPLES_FILE
        self.fsync_interval = fsync_interval
        self.repaired_bytes = 0
        self._appender: SampleAppender | None = None
        self._lock: FileLock | None = None
        self._files: list[Path]  # index i of _file refers to _files[i]
        self._scanned: dict[Path, int]  # bytes of each file already in the index
        self._drop_index()
        self._readers: dict[int, int] = {}

    def _drop_index(self) -> None:
        """An empty index (on creation, and on close: its memory is freed even while the object lives on)."""
        self._files, self._scanned = [], {}
        self._keys = np.zeros(0, dtype="S1")  # sorted; the arrays below in the same order
        self._file = np.zeros(0, dtype=np.int16)
        self._off = np.zeros(0, dtype=np.int64)
        self._len = np.zeros(0, dtype=np.int32)
        self._ok = np.zeros(0, dtype=bool)
        release_freed_memory()

    # ------------------------------------------------------------------------------------------------ lifecycle
    def open(self) -> SampleCache:
        self.directory.mkdir(parents=True, exist_ok=True)
        from filelock import FileLock, Timeout

        # held from open() to close(), and a second cache on the same directory -- in this thread too -- is another run
        # (CacheLockedError), so not runtime.io.file_lock: a context manager whose same-thread re-entry is a bug report
        lock = FileLock(str(self.directory / LOCK_FILE))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise CacheLockedError(
                f"another generation run is writing {self.directory.parent}; wait for it to finish or choose another "
                "output directory"
            ) from None
        self._lock = lock
        self.refresh()
        self._appender = SampleAppender(self.path, self.fsync_interval)
        return self

    def close(self) -> None:
        if self._appender is not None:
            self._appender.close()
            self._appender = None
        for fd in self._readers.values():
            os.close(fd)
        self._readers.clear()
        self._drop_index()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> SampleCache:
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def shard_path(self, worker: int) -> Path:
        """The samples file worker ``worker`` of a sharded run appends to (worker 0: :data:`SAMPLES_FILE`)."""
        return self.path if worker == 0 else self.directory / SHARD_FILE.format(worker)

    # ------------------------------------------------------------------------------------------------ index
    def refresh(self) -> None:
        """Add the records appended to the samples files since the last scan to the index (torn last lines cut off,
        duplicate keys keep their first record, records of :data:`NOT_FINAL_REASONS` dropped from the file)."""
        chunks = []
        shards = sorted(self.directory.glob(SHARD_FILE.format("*")), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        for path in [self.path, *shards]:
            if not path.exists():
                continue
            if path not in self._scanned:
                self._files.append(path)
                self._scanned[path] = 0
            self._repair_tail(path)
            scanned = scan_records(path, self._scanned[path])
            if scanned is None:  # records to drop: rewrite the file without them and index it again
                self._drop_not_final(path)
                scanned = scan_records(path, self._scanned[path])
            chunks.append(self._with_file(path, scanned))
            self._scanned[path] = path.stat().st_size
        if chunks:
            self._merge(chunks)

    def _repair_tail(self, path: Path) -> None:
        size = path.stat().st_size
        with open(path, "r+b") as f:
            end = size
            while end > self._scanned.get(path, 0):  # find the last newline, reading backwards
                start = max(end - (1 << 16), 0)
                f.seek(start)
                block = f.read(end - start)
                i = block.rfind(b"\n")
                if i >= 0:
                    end = start + i + 1
                    break
                end = start
            if end < size:  # a torn final line: the writer died mid-write
                self.repaired_bytes += size - end
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())

    def _drop_not_final(self, path: Path) -> None:
        """Rewrite ``path`` without the records of :data:`NOT_FINAL_REASONS` (their details may quote what a server
        echoed back). Only caches written by older versions hold them."""
        from rlhf_ext.runtime.io import atomic_write_bytes

        kept = []
        with open(path, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                    drop = record.get("status") == "skipped" and record.get("reason") in NOT_FINAL_REASONS
                except (ValueError, AttributeError):
                    drop = False
                if not drop:
                    kept.append(line)
        atomic_write_bytes(path, b"".join(kept))

    def _with_file(self, path: Path, entries: tuple) -> tuple:
        keys, offs, lens, ok = entries
        return keys, np.full(len(keys), self._files.index(path), dtype=np.int16), offs, lens, ok

    def add_records(self, path: Path, start: int, end: int, entries: tuple) -> None:
        """Index the records another process appended to ``path`` between bytes ``start`` and ``end`` (``entries``:
        its :func:`scan_records` of them), without reading the file again (a sharded run's workers scan their own
        files in parallel)."""
        path = Path(path)
        if path not in self._scanned:
            self._files.append(path)
            self._scanned[path] = 0
        if self._scanned[path] != start:
            raise RuntimeError(f"{path}: records from byte {start} given, but the index covers {self._scanned[path]}")
        self._merge([self._with_file(path, entries)])
        self._scanned[path] = end

    def index_state(self) -> dict[str, Any]:
        """The index (its arrays and files): :meth:`from_index_state` rebuilds a read-only cache in another process."""
        arrays = {name: getattr(self, f"_{name}") for name in ("keys", "file", "off", "len", "ok")}
        return {"files": [str(f) for f in self._files], **arrays}

    @classmethod
    def from_index_state(cls, directory: str | Path, state: dict[str, Any]) -> SampleCache:
        """A read-only view (:meth:`locate`, :meth:`read`) of the cache whose :meth:`index_state` is ``state``; it
        takes no lock (the process that owns the cache holds it)."""
        cache = cls(directory)
        cache._files = [Path(f) for f in state["files"]]
        for name in ("keys", "file", "off", "len", "ok"):
            setattr(cache, f"_{name}", state[name])
        return cache

    def _merge(self, chunks: list[tuple]) -> None:
        """Merge new entries into the sorted index; an existing key (or the earlier of two new ones) wins."""
        parts = [(self._keys, self._file, self._off, self._len, self._ok), *chunks]
        keys, file, off, length, ok = (np.concatenate([p[i] for p in parts]) for i in range(5))
        chunks.clear()  # the caller's list: its arrays are freed with the copies below
        order = np.argsort(keys, kind="stable")  # stable: the first record of a key comes first
        keys = keys[order]
        first = np.ones(len(keys), dtype=bool)
        first[1:] = keys[1:] != keys[:-1]
        order = order[first]
        self._keys = keys[first]
        self._file, self._off, self._len, self._ok = (a[order] for a in (file, off, length, ok))
        del parts, keys, file, off, length, ok, order, first
        release_freed_memory()

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> list[str]:
        return [k.decode() for k in self._keys]

    def locate(self, keys: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """For each of ``keys``: its position in the index (``-1``: not cached) and whether its record is ``ok``."""
        wanted = np.array([k.encode() for k in keys], dtype=bytes) if len(keys) else np.zeros(0, dtype="S1")
        pos = np.searchsorted(self._keys, wanted)
        pos = np.minimum(pos, max(len(self._keys) - 1, 0))
        hit = (self._keys[pos] == wanted) if len(self._keys) else np.zeros(len(wanted), dtype=bool)
        where = np.where(hit, pos, -1)
        return where, hit & self._ok[pos] if len(self._keys) else hit

    def read(self, position: int) -> dict[str, Any]:
        """The record at index ``position`` (from :meth:`locate`), read back from its file."""
        file_no = int(self._file[position])
        fd = self._readers.get(file_no)
        if fd is None:
            fd = self._readers[file_no] = os.open(self._files[file_no], os.O_RDONLY)
        return json.loads(os.pread(fd, int(self._len[position]), int(self._off[position])))

    # ------------------------------------------------------------------------------------------------ read/write
    def __contains__(self, key: str) -> bool:
        return bool(self.locate([key])[0][0] >= 0)

    def get(self, key: str) -> dict[str, Any] | None:
        position = int(self.locate([key])[0][0])
        return None if position < 0 else self.read(position)

    def append(self, record: dict[str, Any]) -> None:
        """Write one record as one line (no-op if its key is in the index)."""
        if self._appender is None:
            raise RuntimeError("SampleCache is not open")
        if record["key"] in self:
            return
        self._appender.append(record)

    def sync(self) -> None:
        if self._appender is not None:
            self._appender.sync()

    def log_run(self, summary: dict[str, Any]) -> None:
        """Append a run summary (timings, counts) to ``runs.jsonl`` next to the samples (not part of the dataset)."""
        with open(self.directory / RUNS_FILE, "a") as f:
            f.write(json.dumps(summary, sort_keys=True) + "\n")


def scan_records(path: Path, start: int = 0) -> tuple | None:
    """Index entries ``(keys, offsets, lengths, ok)`` of the records of ``path`` from byte ``start`` (a corrupt line is
    skipped); ``None`` when it holds records of :data:`NOT_FINAL_REASONS`."""
    chunks: list[tuple] = []
    keys, offs, lens, oks = [], [], [], []

    def flush() -> None:  # lists of Python objects cost ~100 bytes an entry: into arrays every 2**16 records
        chunks.append((np.array(keys, dtype=bytes), np.array(offs, dtype=np.int64),
                       np.array(lens, dtype=np.int32), np.array(oks, dtype=bool)))  # fmt: skip
        for column in (keys, offs, lens, oks):
            column.clear()

    with open(path, "rb") as f:
        f.seek(start)
        off = start
        for line in f:
            n = len(line)
            if line.strip():
                try:
                    record = json.loads(line)
                    key = record["key"]
                except (ValueError, KeyError, TypeError):
                    key = None
                if key is not None:
                    if record.get("status") == "skipped" and record.get("reason") in NOT_FINAL_REASONS:
                        return None
                    keys.append(str(key).encode())
                    offs.append(off)
                    lens.append(n)
                    oks.append(record.get("status") == "ok")
                    if len(keys) == 1 << 16:
                        flush()
            off += n
    flush()  # at least one chunk, empty arrays for no records
    return tuple(np.concatenate([c[i] for c in chunks]) for i in range(4))
