"""The append-only sample cache that makes generation resumable (one JSON line per finished sample).

Every finished sample (or a sample whose answer cannot be used) is one line of
``<output>/.cache/samples.jsonl``, keyed by a hash of the task, the sample index and the seed (plus the generation
settings that change a sample's text). The line is written with a single ``write`` on an ``O_APPEND`` descriptor as
soon as the sample is done, so a ``kill -9`` loses only the requests in flight: the kernel keeps what was written.
``fsync`` runs at most every ``fsync_interval`` seconds and when the cache closes, which bounds what a power cut can
lose. On open, a torn last line (a process killed in the middle of a write) is cut off, and duplicate keys keep their
first record, so a rerun resumes without duplicates. An exclusive non-blocking lock stops two runs from writing one
cache at once. A failed request is never a record; records that older versions wrote for HTTP 4xx answers (``skipped``
/ ``request_rejected``) are ignored on open, so those samples are generated again.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

CACHE_DIR = ".cache"
SAMPLES_FILE = "samples.jsonl"
RUNS_FILE = "runs.jsonl"
LOCK_FILE = "lock"
#: skip reasons that are not final answers (written by older versions for failed requests): ignored when loading
NOT_FINAL_REASONS = frozenset({"request_rejected"})


class CacheLockedError(RuntimeError):
    """Another process is generating into the same output directory."""


class SampleCache:
    """Append-only JSONL of finished samples; use as a context manager (``with SampleCache(dir) as cache``)."""

    def __init__(self, directory: str | Path, fsync_interval: float = 0.5):
        self.directory = Path(directory)
        self.path = self.directory / SAMPLES_FILE
        self.fsync_interval = fsync_interval
        self.records: dict[str, dict[str, Any]] = {}
        self.repaired_bytes = 0
        self.corrupt_lines = 0
        self.ignored_records = 0
        self._fd: int | None = None
        self._lock_fd: int | None = None
        self._last_sync = 0.0
        self._dirty = False

    # ------------------------------------------------------------------------------------------------ lifecycle
    def open(self) -> SampleCache:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise CacheLockedError(
                f"another generation run is writing {self.directory.parent}; wait for it to finish or choose another "
                "output directory"
            ) from None
        self._load_and_repair()
        self._fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
        self._last_sync = time.monotonic()
        return self

    def close(self) -> None:
        if self._fd is not None:
            self.sync()
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> SampleCache:
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ read/write
    def _load_and_repair(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a torn final line: the writer died mid-write
            self.repaired_bytes = len(data) - end
            with open(self.path, "r+b") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        kept = []
        for line in data[:end].splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                key = record["key"]
            except (ValueError, KeyError, TypeError):
                self.corrupt_lines += 1
                kept.append(line)
                continue
            if record.get("status") == "skipped" and record.get("reason") in NOT_FINAL_REASONS:
                self.ignored_records += 1
                continue
            kept.append(line)
            self.records.setdefault(key, record)
        if self.ignored_records:  # drop them from the file too (their details may quote what a server echoed back)
            self._rewrite(b"".join(line + b"\n" for line in kept))

    def _rewrite(self, data: bytes) -> None:
        """Replace the samples file atomically with ``data`` (the permissions ``open`` would give it)."""
        from rlhf_ext.runtime.io import atomic_write_bytes

        atomic_write_bytes(self.path, data)

    def __contains__(self, key: str) -> bool:
        return key in self.records

    def get(self, key: str) -> dict[str, Any] | None:
        return self.records.get(key)

    def append(self, record: dict[str, Any]) -> None:
        """Write one record as one line (no-op if its key is already cached)."""
        if self._fd is None:
            raise RuntimeError("SampleCache is not open")
        key = record["key"]
        if key in self.records:
            return
        line = (json.dumps(record, sort_keys=True, ensure_ascii=False) + "\n").encode()
        view = memoryview(line)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self.records[key] = record
        self._dirty = True
        if time.monotonic() - self._last_sync >= self.fsync_interval:
            self.sync()

    def sync(self) -> None:
        if self._fd is not None and self._dirty:
            os.fsync(self._fd)
            self._dirty = False
        self._last_sync = time.monotonic()

    def log_run(self, summary: dict[str, Any]) -> None:
        """Append a run summary (timings, counts) to ``runs.jsonl`` next to the samples (not part of the dataset)."""
        with open(self.directory / RUNS_FILE, "a") as f:
            f.write(json.dumps(summary, sort_keys=True) + "\n")
