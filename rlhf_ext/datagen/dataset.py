"""``ContinualDataset``: one HF ``DatasetDict`` (train/test) per time step, plus metadata; saving, loading,
exporting and the transforms of the ``data`` CLI (paper Appendix D: preference_swap, split, sample, merge).

On disk (``ContinualDataset.save``)::

    OUT/continual_dataset.json     metadata: config, seeds, drift (type, modes, schedule), per-stage counts
    OUT/stages/000-<name>/         DatasetDict.save_to_disk (train/ and test/), one per stage, in order
    OUT/.cache/                    generation cache (only for generated datasets; see rlhf_ext.datagen.cache)
    OUT/.continual_dataset.lock    held while the dataset is saved (and while a killed save is cleaned up)

A save swaps in a new ``stages/`` (carrying ``stages/.continual_dataset.json``), then publishes the metadata, so a
kill leaves the old or the new dataset once the next save or load has finished what was interrupted.

Columns (every stage, both splits): ``prompt``, ``chosen``, ``rejected`` (plain strings, or ``conversational``
message lists), ``source_task``, ``style`` (phrase-bank style, "" when unknown), ``seed_words``, ``sample_id`` (the
cache key) and ``swapped`` (preference-swap noise). TRL and OpenRLHF read the first three; each stage directory loads
as-is with ``datasets.load_from_disk`` and OpenRLHF's ``--data.dataset PATH``.
"""

from __future__ import annotations

import collections.abc
import contextlib
import copy
import errno
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from rlhf_ext.datagen.drift import derive_seed, overall_mode, stage_dirname
from rlhf_ext.runtime.io import atomic_directory, atomic_write_json, file_lock, recover_directory
from rlhf_ext.runtime.log import quiet_datasets

METADATA_FILE = "continual_dataset.json"
STAGES_DIR = "stages"
LOCK_FILE = ".continual_dataset.lock"
#: the metadata of a save whose ``stages/`` is in place but whose top-level metadata may not be yet
PENDING_METADATA = f"{STAGES_DIR}/.{METADATA_FILE}"
EXPORT_FORMATS = ("jsonl", "parquet", "aif-gen")
FORMAT_VERSION = 1
SPLITS = ("train", "test")


def features(fmt: str):
    """The ``datasets.Features`` of a stage split in format ``plain`` or ``conversational``."""
    from datasets import Features

    from rlhf_ext.datagen.arrow_stage import feature_dict

    return Features.from_dict(feature_dict(fmt))


def swap_decision(sample_id: str, p: float, seed: int) -> bool:
    """Whether preference-swap noise with probability ``p`` flips the sample ``sample_id`` (seeded, order-free)."""
    if p <= 0.0:
        return False
    if p >= 1.0:
        return True
    return random.Random(derive_seed("swap", seed, sample_id)).random() < p


def test_mask(n: int, test_ratio: float, seed: int) -> np.ndarray:
    """Seeded train/test split of ``n`` rows as a ``[n]`` bool mask (True: test): ``round(n * test_ratio)`` test
    rows (at most ``n - 1``)."""
    if not 0.0 <= test_ratio < 1.0:
        raise ValueError(f"test_ratio must be in [0, 1), got {test_ratio}")
    mask = np.zeros(n, dtype=bool)
    mask[random.Random(seed).sample(range(n), min(round(n * test_ratio), max(n - 1, 0)))] = True
    return mask


def write_continual_dataset(
    path: str | Path, metadata: dict[str, Any], write_stages: Callable[[list[Path]], list[tuple[int, int]]]
) -> dict[str, Any]:
    """Write a dataset directory under its lock: ``write_stages(directories)`` writes the stages of
    ``metadata["stages"]`` (returning their train and test sizes) into a temporary ``stages/`` swapped in as a whole,
    then the metadata (completed in place) is written. What a killed earlier write left is finished or deleted first."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    metadata["format_version"] = FORMAT_VERSION
    with file_lock(path / LOCK_FILE):
        _recover(path)
        with atomic_directory(path / STAGES_DIR) as tmp:
            for info in metadata["stages"]:
                info["dir"] = f"{STAGES_DIR}/{_stage_dirname(info)}"
            sizes = write_stages([tmp / _stage_dirname(info) for info in metadata["stages"]])
            for info, (train, test) in zip(metadata["stages"], sizes):
                info["train"], info["test"] = train, test
            atomic_write_json(tmp / Path(PENDING_METADATA).name, metadata)
        _publish_metadata(path)
    return metadata


class ContinualDataset(collections.abc.Sequence):
    """A sequence of ``DatasetDict`` (one per time step, in order) with ``metadata``.

    ``len(ds)``, ``ds[i]`` (or ``ds["stage name"]``) and iteration give the stages' ``DatasetDict``s; ``ds.names``
    their names; ``ds.metadata`` the config, seeds, drift and counts.
    """

    def __init__(self, stages: list, metadata: dict[str, Any]):
        #: counts and timing of the generation run that produced this object (``generate_dataset`` only)
        self.run_stats: dict[str, Any] | None = None
        #: the directory this dataset was loaded from or saved to (``None``: only in memory)
        self.path: Path | None = None
        if len(stages) != len(metadata.get("stages", [])):
            raise ValueError(f"{len(stages)} stages but metadata describes {len(metadata.get('stages', []))}")
        self.stages = list(stages)
        self.metadata = metadata

    # ------------------------------------------------------------------------------------------------ sequence
    def __len__(self) -> int:
        return len(self.stages)

    def __getitem__(self, key):
        if isinstance(key, str):
            names = self.names
            if key not in names:
                raise KeyError(f"no stage named {key!r}; stages: {', '.join(names)}")
            return self.stages[names.index(key)]
        return self.stages[key]

    def __repr__(self) -> str:
        counts = ", ".join(f"{n}: {len(d['train'])}/{len(d['test'])}" for n, d in zip(self.names, self.stages))
        return f"ContinualDataset({len(self)} stages, train/test = {counts})"

    @property
    def names(self) -> list[str]:
        return [s["name"] for s in self.metadata["stages"]]

    @property
    def format(self) -> str:
        return self.metadata.get("format", "plain")

    # ------------------------------------------------------------------------------------------------ disk
    def save(self, path: str | Path) -> Path:
        """Write ``stages/`` (atomically replaced as a whole), then ``continual_dataset.json``
        (:func:`write_continual_dataset`)."""
        path = Path(path)

        def write_stages(directories: list[Path]) -> list[tuple[int, int]]:
            for dd, directory in zip(self.stages, directories):
                # one shard per split: datasets writes no shard for an empty split unless asked, and cannot load it
                dd.save_to_disk(str(directory), num_shards={k: 1 for k in dd})
            return [(len(dd["train"]), len(dd["test"])) for dd in self.stages]

        with quiet_datasets():
            self.metadata = write_continual_dataset(path, copy.deepcopy(self.metadata), write_stages)
        self.path = path
        return path

    @classmethod
    def load(cls, path: str | Path) -> ContinualDataset:
        from datasets import load_from_disk

        path = Path(path)
        # finish what a killed save left (hidden siblings of stages/, metadata not yet in place) when the lock is free
        # at once (a save in progress finishes it itself; a read-only copy is read as it is)
        if (path / PENDING_METADATA).is_file() or (path.is_dir() and any(path.glob(f".{STAGES_DIR}.*-*"))):
            from filelock import Timeout

            with contextlib.suppress(Timeout, OSError), file_lock(path / LOCK_FILE, timeout=0):
                _recover(path)
        # a save that is finishing (or a killed one this process could not finish): the metadata of its stages
        meta_path = path / PENDING_METADATA
        if not meta_path.is_file():
            meta_path = path / METADATA_FILE
        if not meta_path.is_file():
            hint = ""
            if path.is_file():
                hint = " (it is a file, a continual dataset is a directory; to read AIF-Gen's dataset JSON: "
                hint += f"`rlhf-ext data import {path} -o DIR`)"
            if (path / ".cache").is_dir():
                hint = " (a generation cache exists: the run did not finish; rerun `rlhf-ext data generate` to resume)"
            raise FileNotFoundError(f"{path} is not a continual dataset: {METADATA_FILE} is missing{hint}")
        meta = _read_metadata(meta_path)
        stages = []
        for info in meta["stages"]:
            stage_dir = path / info["dir"]
            if not stage_dir.is_dir():
                raise FileNotFoundError(
                    f"{path}: stage {info['name']!r} is missing ({stage_dir}); the dataset was modified or its last "
                    "write was interrupted: regenerate or restore it"
                )
            stages.append(load_from_disk(str(stage_dir)))
        ds = cls(stages, meta)
        ds.path = path
        return ds

    def export(self, out_dir: str | Path, fmt: str = "jsonl", overwrite: bool = False) -> Path:
        """Write ``<out_dir>/<stage dir>/{train,test}.<jsonl|parquet>`` and ``<out_dir>/continual_dataset.json``, or
        for ``fmt="aif-gen"`` only ``<out_dir>/data.json`` (:meth:`to_aif_gen`).

        A new or empty ``out_dir`` appears complete or not at all; a non-empty one is refused unless ``overwrite``,
        which replaces only the files the export writes (each atomically, the metadata last) and deletes nothing.

        Raises:
            ExportDestinationError: ``out_dir`` is not empty (without ``overwrite``), is not a directory, or is or
                contains the dataset being exported.
            ValueError: ``aif-gen`` only: a stage AIF-Gen's format cannot hold (see :meth:`to_aif_gen`).
        """
        if fmt not in EXPORT_FORMATS:
            raise ValueError(f"unknown export format {fmt!r}; choose {' or '.join(EXPORT_FORMATS)}")
        out_dir = Path(out_dir)
        if out_dir.is_symlink():  # write into the directory it points to (the final rename would replace the link)
            out_dir = out_dir.resolve()
        self._check_export_destination(out_dir, overwrite)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.export-", dir=out_dir.parent))
        try:
            written = self._write_export(staging, fmt)
            try:
                os.replace(staging, out_dir)  # new or empty: the whole export at once (refused by the OS if not empty)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                if not overwrite:
                    raise ExportDestinationError(
                        f"{out_dir} stopped being empty while the export was written; nothing was changed there"
                    ) from None
                for rel in written:  # the metadata is last in `written`: a complete export shows it
                    (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(staging / rel, out_dir / rel)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return out_dir

    def export_files(self, fmt: str = "jsonl") -> list[str]:
        """The paths, relative to the export directory, of the files :meth:`export` writes (the metadata last)."""
        if fmt == "aif-gen":
            from rlhf_ext.datagen.aif_gen import EXPORT_FILE

            return [EXPORT_FILE]
        rels = [f"{_stage_dirname(info)}/{split}.{fmt}" for info in self.metadata["stages"] for split in SPLITS]
        return [*rels, METADATA_FILE]

    def _write_export(self, root: Path, fmt: str) -> list[str]:
        """Write the export's files into the empty directory ``root``; returns them (:meth:`export_files`)."""
        if fmt == "aif-gen":
            self.to_aif_gen(root / self.export_files(fmt)[0])
            return self.export_files(fmt)
        with quiet_datasets():
            for info, dd in zip(self.metadata["stages"], self.stages):
                (root / _stage_dirname(info)).mkdir(parents=True)
                for split in SPLITS:
                    target = root / _stage_dirname(info) / f"{split}.{fmt}"
                    if fmt == "jsonl":
                        dd[split].to_json(str(target), lines=True, force_ascii=False)
                    else:
                        dd[split].to_parquet(str(target))
        atomic_write_json(root / METADATA_FILE, self.metadata)
        return self.export_files(fmt)

    def _check_export_destination(self, out_dir: Path, overwrite: bool) -> None:
        """Raise :class:`ExportDestinationError` for a destination the export could lose data in."""
        if self.path is not None:
            from rlhf_ext.runtime.rundir import check_output_dir

            try:
                check_output_dir(out_dir, {"DATASET": self.path}, "export directory")
            except ValueError as e:
                raise ExportDestinationError(str(e)) from None
        if out_dir.exists() and not out_dir.is_dir():
            raise ExportDestinationError(f"{out_dir} exists and is not a directory; export to a directory")
        if out_dir.is_dir() and not overwrite:
            entries = sorted(p.name for p in out_dir.iterdir())
            if entries:
                shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
                raise ExportDestinationError(
                    f"{out_dir} is not empty ({shown}); export to a new or empty directory, or pass --overwrite "
                    "(Python: overwrite=True) to replace only the files the export writes"
                )

    @classmethod
    def from_aif_gen(cls, source: str | Path | dict[str, Any], name: str | None = None) -> ContinualDataset:
        """A dataset from AIF-Gen's dataset JSON (a file path or its loaded value): one stage per entry of its
        ``datasets`` (:mod:`rlhf_ext.datagen.aif_gen`); ``ValueError`` naming the offending key otherwise."""
        from rlhf_ext.datagen.aif_gen import dataset_from_aif_gen, read_json

        if isinstance(source, dict):
            return dataset_from_aif_gen(source, name or "aif-gen")
        data = read_json(source)
        try:
            return dataset_from_aif_gen(data, name or Path(source).stem, source=str(source))
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def to_aif_gen(self, path: str | Path) -> Path:
        """Write the dataset as AIF-Gen's dataset JSON file ``path`` (what ``ContinualAlignmentDataset.from_json``
        reads), one entry per stage; ``ValueError`` for a stage that mixes tasks, is empty or has no task in the
        metadata."""
        from rlhf_ext.datagen.aif_gen import write_aif_gen_json

        return write_aif_gen_json(self, path)

    def to_jsonl(self, out_dir: str | Path, overwrite: bool = False) -> Path:
        return self.export(out_dir, "jsonl", overwrite)

    def to_parquet(self, out_dir: str | Path, overwrite: bool = False) -> Path:
        return self.export(out_dir, "parquet", overwrite)

    def push_to_hub(self, repo_id: str, token: str | None = None, private: bool = True) -> None:
        """Upload every stage as a config of ``repo_id`` (config name = stage directory) plus the metadata file; the
        token comes from ``token`` or ``$HF_TOKEN`` (without one this raises before any network access)."""
        token = token or os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
        if not token:
            raise RuntimeError("push_to_hub needs a Hugging Face token: set HF_TOKEN or pass token=")
        from huggingface_hub import HfApi

        for info, dd in zip(self.metadata["stages"], self.stages):
            dd.push_to_hub(repo_id, config_name=_stage_dirname(info), token=token, private=private)
        body = json.dumps(self.metadata, indent=2, sort_keys=True).encode()
        HfApi(token=token).upload_file(
            path_or_fileobj=body, path_in_repo=METADATA_FILE, repo_id=repo_id, repo_type="dataset"
        )

    # ------------------------------------------------------------------------------------------------ helpers
    def with_stages(self, stages: list, transform: dict[str, Any] | None = None) -> ContinualDataset:
        """A copy with new stage data (same stage list) and ``transform`` appended to ``metadata["transforms"]``."""
        meta = copy.deepcopy(self.metadata)
        if transform is not None:
            meta.setdefault("transforms", []).append(transform)
        for info, dd in zip(meta["stages"], stages):
            info["train"], info["test"] = len(dd["train"]), len(dd["test"])
        return ContinualDataset(stages, meta)


def _stage_dirname(info: dict[str, Any]) -> str:
    return stage_dirname(info["index"], info["name"])


class ExportDestinationError(ValueError):
    """An export destination that would lose data: not empty (without ``overwrite``), not a directory, or the dataset
    itself (or a directory containing it)."""


def _read_metadata(meta_path: Path) -> dict[str, Any]:
    """The metadata in ``meta_path``; ``ValueError`` (one line) when it is not JSON or not rlhf-ext metadata, with the
    import command when it is AIF-Gen's dataset JSON."""
    from rlhf_ext.datagen.aif_gen import is_aif_gen_dataset, read_json

    meta = read_json(meta_path)
    if isinstance(meta, dict) and isinstance(meta.get("stages"), list):
        return meta
    if is_aif_gen_dataset(meta):
        raise ValueError(
            f"{meta_path} is AIF-Gen's dataset JSON, not rlhf-ext metadata: import it with "
            f"`rlhf-ext data import {meta_path} -o DIR`"
        )
    raise ValueError(f"{meta_path} is not rlhf-ext continual-dataset metadata (it has no 'stages' list)")


def _publish_metadata(path: Path) -> None:
    """Put the metadata that came with the new ``stages/`` in place (the last step of a save)."""
    pending = path / PENDING_METADATA
    atomic_write_json(path / METADATA_FILE, json.loads(pending.read_text()))
    pending.unlink()


def _recover(path: Path) -> None:
    """Finish or clean up what a killed save left in ``path`` (call under the dataset's lock)."""
    recover_directory(path / STAGES_DIR)
    if (path / PENDING_METADATA).is_file():
        _publish_metadata(path)


# ---------------------------------------------------------------------------------------------------- transforms
def preference_swap(ds: ContinualDataset, p: float = 1.0, seed: int = 0) -> ContinualDataset:
    """Swap chosen and rejected of each sample with probability ``p`` (seeded per ``sample_id``); ``swapped`` is
    toggled so the noise stays visible to analysis (paper Appendix D, ``transform preference_swap``)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")

    def flip(row):
        if swap_decision(row["sample_id"], p, seed):
            row["chosen"], row["rejected"] = row["rejected"], row["chosen"]
            row["swapped"] = not row["swapped"]
        return row

    with quiet_datasets():
        stages = [type(dd)({k: dd[k].map(flip) for k in dd}) for dd in ds]
    return ds.with_stages(stages, {"type": "preference_swap", "p": p, "seed": seed})


def resplit(ds: ContinualDataset, test_ratio: float = 0.15, seed: int = 0) -> ContinualDataset:
    """Re-split every stage: train and test are pooled in stream order (train first) and split again."""
    from datasets import DatasetDict, concatenate_datasets

    stages = []
    for i, dd in enumerate(ds):
        pooled = concatenate_datasets([dd["train"], dd["test"]])
        is_test = test_mask(len(pooled), test_ratio, seed + i)
        train_idx, test_idx = np.flatnonzero(~is_test).tolist(), np.flatnonzero(is_test).tolist()
        stages.append(DatasetDict(train=pooled.select(train_idx), test=pooled.select(test_idx)))
    out = ds.with_stages(stages, {"type": "split", "test_ratio": test_ratio, "seed": seed})
    for info in out.metadata["stages"]:
        info["test_ratio"] = test_ratio
    return out


def subsample(
    ds: ContinualDataset,
    keep_ratio_train: float | None = None,
    keep_ratio_test: float | None = None,
    keep_train: int | None = None,
    keep_test: int | None = None,
    seed: int = 0,
) -> ContinualDataset:
    """Down-sample each stage's splits by ratio or absolute count (seeded; kept rows stay in stream order)."""
    from datasets import DatasetDict

    def keep(n: int, ratio: float | None, amount: int | None) -> int:
        if ratio is not None and amount is not None:
            raise ValueError("give a keep ratio or a keep amount for a split, not both")
        if ratio is not None:
            if not 0.0 <= ratio <= 1.0:
                raise ValueError(f"keep ratios must be in [0, 1], got {ratio}")
            return round(n * ratio)
        if amount is not None:
            if amount < 0:
                raise ValueError(f"keep amounts must be >= 0, got {amount}")
            return min(n, amount)
        return n

    stages = []
    specs = (("train", keep_ratio_train, keep_train), ("test", keep_ratio_test, keep_test))
    for i, dd in enumerate(ds):
        parts = {}
        for j, (split, ratio, amount) in enumerate(specs):
            n = len(dd[split])
            idx = sorted(random.Random(seed * 7919 + 2 * i + j).sample(range(n), keep(n, ratio, amount)))
            parts[split] = dd[split].select(idx)
        stages.append(DatasetDict(parts))
    spec = {"keep_ratio_train": keep_ratio_train, "keep_ratio_test": keep_ratio_test}
    spec.update(keep_train=keep_train, keep_test=keep_test, seed=seed)
    return ds.with_stages(stages, {"type": "sample", **spec})


def merge(datasets: Iterable[ContinualDataset]) -> ContinualDataset:
    """Concatenate continual datasets in time: the stages of the first, then of the second, ... (same format)."""
    datasets = list(datasets)
    if not datasets:
        raise ValueError("merge needs at least one dataset")
    formats = {d.format for d in datasets}
    if len(formats) > 1:
        raise ValueError(f"cannot merge datasets of different formats ({', '.join(sorted(formats))})")
    stages, infos = [], []
    for k, d in enumerate(datasets):
        for info, dd in zip(d.metadata["stages"], d):
            info = copy.deepcopy(info)
            info.update(index=len(stages), source_dataset=k)
            infos.append(info)
            stages.append(dd)
    modes = {d.metadata.get("drift", {}).get("mode", "none") for d in datasets}
    meta = {
        "name": "+".join(str(d.metadata.get("name", f"dataset{k}")) for k, d in enumerate(datasets)),
        "format": formats.pop(),
        "stages": infos,
        "merged_from": [copy.deepcopy(d.metadata) for d in datasets],
        "drift": {"type": "merged", "mode": overall_mode(modes)},
    }
    return ContinualDataset(stages, meta)
