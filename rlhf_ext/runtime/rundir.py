"""One resumable run directory: a settings fingerprint, atomic "stage finished" markers, ``force`` to redo.

A pipeline that can be killed and rerun keeps its outputs in a :class:`RunDir`::

    run = RunDir(out, settings, kind="demo", force=force)   # refuses `out` if it was started with other settings
    for stage in ("data", "train", "eval"):
        if run.done(stage):
            continue                                       # finished by an earlier run: skip it
        result = train(run.stage_dir(stage))
        run.mark_done(stage, result)                       # written last, atomically

Layout under ``root``: the run file (``run.json``: ``kind``, ``fingerprint``, ``settings``, ``created``,
``rlhf_ext_version``) and ``stages/<stage>.json`` (one per finished stage, holding its result; ``"dpo/seed-0"`` is
``stages/dpo/seed-0.json``). Settings are compared after JSON normalisation (tuples are lists, paths strings).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rlhf_ext.runtime.io import atomic_write_json, stable_hash

STAGES_DIR = "stages"
#: How many changed keys the message of :class:`RunSettingsChanged` spells out with their old and new values.
MAX_SHOWN_CHANGES = 5
_MISSING = object()


class RunSettingsChanged(ValueError):
    """A run directory was started with other settings; its finished stages would not match a rerun. Attributes:
    ``root``, ``keys`` (the changed dotted keys, sorted), ``old`` / ``new`` (the normalised settings, with ``kind``)."""

    def __init__(
        self, root: Path, keys: list[str], old: Mapping[str, Any], new: Mapping[str, Any], redo: str | None = None
    ):
        self.root, self.keys, self.old, self.new = root, keys, old, new
        fix = f"{redo} to redo its stages with the new settings, or choose" if redo else "delete it or choose"
        super().__init__(
            f"{root} was started with different settings (changed: {self.changes}); {fix} a new output directory"
        )

    @property
    def changes(self) -> str:
        """The changed keys with their old and new values, ``a.b: 1 -> 2, c: "x" -> "y"`` (see
        :func:`describe_changes`), for callers that word the error their own way."""
        return describe_changes(self.keys, self.old, self.new)


def _normalise(settings: Any) -> Any:
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def changed_keys(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted paths of the keys whose values differ between ``old`` and ``new`` (added and removed keys
    included), recursing into nested mappings; lists and other values are compared whole, as the fingerprint sees
    them (their JSON text: ``1`` and ``1.0`` differ). Sorted."""
    out: list[str] = []
    for key in set(old) | set(new):
        a, b = old.get(key, _MISSING), new.get(key, _MISSING)
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += changed_keys(a, b, path)
        elif a is _MISSING or b is _MISSING or json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):
            out.append(path)
    return sorted(out)


def _lookup(settings: Mapping[str, Any], dotted: str) -> Any:
    value: Any = settings
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _show(value: Any, width: int = 40) -> str:
    text = "(unset)" if value is _MISSING else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= width else text[: width - 3] + "..."


def describe_changes(keys: list[str], old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """``a.b: 1 -> 2, c: "x" -> "y"`` for up to :data:`MAX_SHOWN_CHANGES` keys, then ``and N more``."""
    shown = [f"{k}: {_show(_lookup(old, k))} -> {_show(_lookup(new, k))}" for k in keys[:MAX_SHOWN_CHANGES]]
    if len(keys) > MAX_SHOWN_CHANGES:
        shown.append(f"and {len(keys) - MAX_SHOWN_CHANGES} more")
    return ", ".join(shown)


def fingerprint(settings: Mapping[str, Any]) -> str:
    """A short, process-stable hash of the JSON-normalised ``settings`` (independent of key order)."""
    return stable_hash(_normalise(settings))


class RunDir:
    """A run directory that remembers the settings it was started with and which stages have finished.

    Args:
        settings: everything that makes finished stages valid; a rerun with other settings (or ``kind``) is refused.
        force: redo everything: forget the finished stages (their markers) and record the new settings.
        stages_dir: the folder of the markers, relative to ``root``; ``"."`` puts them next to the stages' outputs,
            but then ``force`` is refused (the markers cannot be told from other files there).
        redo: how the user redoes the stages with new settings (``"rerun with --force"``), named in
            :class:`RunSettingsChanged`; ``None``: the error says to delete the directory or choose a new one.
        recorded_names: ``{setting's name: its key in settings}`` for settings recorded under an older name (the
            fingerprint of earlier runs holds; :class:`RunSettingsChanged` uses the current name).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        settings: Mapping[str, Any],
        *,
        kind: str,
        run_file: str = "run.json",
        force: bool = False,
        stages_dir: str = STAGES_DIR,
        redo: str | None = None,
        recorded_names: Mapping[str, str] | None = None,
    ) -> None:
        self.root = Path(root)
        self.stages = self.root / stages_dir
        if force and self.stages.resolve() == self.root.resolve():
            raise ValueError(f"force=True needs a stages_dir inside {self.root}, not the directory itself")
        self.kind = kind
        self.settings: dict[str, Any] = _normalise(dict(settings))
        self.fingerprint = fingerprint(self.settings)
        self.run_file = self.root / run_file
        self.root.mkdir(parents=True, exist_ok=True)
        old = json.loads(self.run_file.read_text()) if self.run_file.exists() else None
        same = old is not None and old.get("fingerprint") == self.fingerprint and old.get("kind", kind) == kind
        if old is not None and not same and not force:
            old_settings = old.get("settings") if isinstance(old.get("settings"), Mapping) else {}
            current = {recorded: name for name, recorded in (recorded_names or {}).items()}
            was = {"kind": old.get("kind", kind), **{current.get(k, k): v for k, v in old_settings.items()}}
            now = {"kind": kind, **{current.get(k, k): v for k, v in self.settings.items()}}
            raise RunSettingsChanged(self.root, changed_keys(was, now) or ["fingerprint"], was, now, redo)
        if force:
            shutil.rmtree(self.stages, ignore_errors=True)
        if force or not same or "kind" not in old:  # (a run file from before `kind` is rewritten)
            from rlhf_ext import __version__

            atomic_write_json(
                self.run_file,
                {
                    "kind": kind,
                    "fingerprint": self.fingerprint,
                    "settings": self.settings,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "rlhf_ext_version": __version__,
                },
            )

    def marker(self, stage: str) -> Path:
        """The marker file of ``stage`` (``<stages_dir>/<stage>.json``; it exists once the stage finished)."""
        parts = stage.split("/")
        if not stage or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"invalid stage name {stage!r}: use non-empty names, optionally grouped with '/'")
        return self.stages.joinpath(*parts[:-1], f"{parts[-1]}.json")

    def done(self, stage: str) -> bool:
        """Whether ``stage`` finished (its marker exists)."""
        return self.marker(stage).exists()

    def mark_done(self, stage: str, result: Mapping[str, Any] | None = None) -> None:
        """Record ``stage`` as finished with ``result`` (atomically: the marker exists complete or not at all)."""
        atomic_write_json(self.marker(stage), dict(result or {}))

    def result(self, stage: str) -> dict[str, Any] | None:
        """The result ``stage`` was marked done with, or None when it has not finished."""
        path = self.marker(stage)
        return json.loads(path.read_text()) if path.exists() else None

    def stage_dir(self, stage: str) -> Path:
        """The directory for ``stage``'s outputs, ``root/<stage>`` (created)."""
        self.marker(stage)  # validates the name
        path = self.root / stage
        path.mkdir(parents=True, exist_ok=True)
        return path


class OutputDirError(ValueError):
    """An output directory cannot be used: it is (or holds) one of the run's inputs, or another run is writing it."""


def check_output_dir(output_dir: str | os.PathLike, inputs: Mapping[str, Any], key: str = "output_dir") -> None:
    """Refuse (:class:`OutputDirError`) an output directory that is, or contains, one of ``inputs`` (``{recipe key:
    path}``; paths compared after ``os.path.realpath``, values that are no existing local path skipped): training
    into the SFT model's own directory would overwrite the model it reads."""
    out = Path(os.path.realpath(os.path.expanduser(str(output_dir))))
    for name, value in inputs.items():
        if not isinstance(value, str | os.PathLike) or not str(value) or not os.path.exists(os.path.expanduser(value)):
            continue
        real = Path(os.path.realpath(os.path.expanduser(str(value))))
        if real == out or out in real.parents:
            raise OutputDirError(
                f"{key} {output_dir} {'is' if real == out else 'holds'} the input {name} ({value}): the run would "
                f"write over it; choose an output directory that holds none of the run's inputs"
            )


@contextlib.contextmanager
def claim_output_dir(
    output_dir: str | os.PathLike, inputs: Mapping[str, Any] = {}, key: str = "output_dir"
) -> Iterator[None]:
    """Check ``output_dir`` against the run's ``inputs`` (:func:`check_output_dir`) and hold its lock (``.<name>.lock``
    next to it, one per rank) while the run writes it: a second run is refused at once (:class:`OutputDirError`)."""
    from filelock import FileLock, Timeout

    check_output_dir(output_dir, inputs, key)
    out = Path(os.path.realpath(os.path.expanduser(str(output_dir))))
    rank = os.environ.get("RANK", "0") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    path = out.with_name(f".{out.name}.lock" + (f"-rank{rank}" if rank is not None else ""))
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise OutputDirError(
            f"another run is writing {output_dir} (it holds {path}); wait for it to finish or choose another {key}"
        ) from None
    try:
        yield
    finally:
        lock.release()
