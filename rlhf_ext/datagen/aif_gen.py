"""AIF-Gen's continual dataset JSON, converted to and from :class:`~rlhf_ext.datagen.dataset.ContinualDataset` (paper
000, AIF-GEN; the reference implementation is github.com/amgadelgamal/AIF-Gen); its task configs, mapped onto
:class:`~rlhf_ext.datagen.schema.DatagenConfig`: :mod:`rlhf_ext.datagen.aif_gen_config`.

**Dataset JSON** (``ContinualAlignmentDataset.to_json``; AIF-Gen's published continual datasets are such files)::

    {"datasets": [{"task": {"domain": {"education": {"name": "education", "seed_words": [...], "weight": 1.0}},
                            "objective": "...", "preference": "..."},
                   "train": [{"prompt": "...", "chosen": "...", "rejected": "..."}, ...],
                   "test": [...]},
                  ...]}

:func:`dataset_from_aif_gen` turns each entry into one stage (``train`` / ``test`` as its splits) and keeps its
``task`` verbatim in the metadata, which :func:`dataset_to_aif_gen` writes back, so import -> export reproduces the
file's JSON value. A single ``AlignmentDataset`` (``{"task", "train", "test"}``) imports as one stage. Imported rows
get ``seed_words`` = [], ``swapped`` = False and a ``sample_id`` hashed from stage, split, position and text.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rlhf_ext.config import RecipeError
from rlhf_ext.datagen.aif_gen_config import _check_keys, _mapping, config_to_rlhf_ext

if TYPE_CHECKING:
    from rlhf_ext.datagen.dataset import ContinualDataset
    from rlhf_ext.datagen.phrasebank import PhraseBank

#: The file ``rlhf-ext data export --format aif-gen`` writes (AIF-Gen's ``generate`` writes ``data.json`` too).
EXPORT_FILE = "data.json"
_SAMPLE_KEYS = ("prompt", "chosen", "rejected")
_ENTRY_KEYS = ("task", "train", "test")


# ----------------------------------------------------------------------------------------------------- datasets
def is_aif_gen_dataset(data: Any) -> bool:
    """Whether a loaded JSON value is an AIF-Gen dataset: ``{"datasets": [...]}`` (continual) or
    ``{"task", "train", "test"}`` (one ``AlignmentDataset``)."""
    if not isinstance(data, dict):
        return False
    return (set(data) == {"datasets"} and isinstance(data["datasets"], list)) or set(data) == set(_ENTRY_KEYS)


def _entry_samples(entry: dict[str, Any], where: str) -> dict[str, list[dict[str, str]]]:
    out = {}
    for split in ("train", "test"):
        rows = entry[split]
        if not isinstance(rows, list):
            raise ValueError(f"{where}.{split}: expected a list of samples, got {type(rows).__name__}")
        for k, row in enumerate(rows):
            rwhere = f"{where}.{split}[{k}]"
            if not isinstance(row, dict) or set(row) != set(_SAMPLE_KEYS):
                got = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"{rwhere}: expected the keys prompt, chosen, rejected; got {got}")
            for key in _SAMPLE_KEYS:
                if not isinstance(row[key], str):
                    raise ValueError(f"{rwhere}.{key}: expected text, got {type(row[key]).__name__}")
        out[split] = rows
    return out


def dataset_from_aif_gen(
    data: dict[str, Any], name: str = "aif-gen", source: str | None = None, bank: PhraseBank | None = None
) -> ContinualDataset:
    """An AIF-Gen dataset JSON value (see :func:`is_aif_gen_dataset`) as a ``plain``-format ``ContinualDataset``, one
    stage per entry of ``datasets``; ``ValueError`` naming the offending key path otherwise."""
    from rlhf_ext.config import from_dict
    from rlhf_ext.datagen.dataset import ContinualDataset
    from rlhf_ext.datagen.drift import drift_summary, stage_dirname
    from rlhf_ext.datagen.schema import DatagenConfig
    from rlhf_ext.runtime.io import stable_hash

    if not is_aif_gen_dataset(data):
        raise ValueError('not an AIF-Gen dataset: expected {"datasets": [...]} or {"task", "train", "test"}')
    entries = data.get("datasets", [data])
    prefix = "datasets" if "datasets" in data else "dataset"
    if not entries:
        raise ValueError("datasets: the AIF-Gen dataset has no datasets")
    samples, specs = [], []
    for i, entry in enumerate(entries):
        where = f"{prefix}[{i}]" if "datasets" in data else prefix
        entry = _mapping(entry, where, "a mapping with task, train, test")
        _check_keys(entry, where, _ENTRY_KEYS)
        samples.append(_entry_samples(entry, where))
        n = len(samples[-1]["train"]) + len(samples[-1]["test"])
        specs.append({"num_samples": max(n, 1), "alignment_task": entry["task"]})
    try:
        config_dict = config_to_rlhf_ext({"task_specs": specs, "name": name}, name, bank)
        config = from_dict(DatagenConfig, config_dict)
    except RecipeError as e:
        raise ValueError(f"the tasks of the AIF-Gen dataset: {str(e).replace('task_specs', prefix)}") from None
    stages, infos, tasks = [], [], {}
    for i, (entry, split_rows, task) in enumerate(zip(entries, samples, config.tasks)):
        rows = {
            split: [
                {
                    **{key: row[key] for key in _SAMPLE_KEYS},
                    "source_task": task.name,
                    "style": task.style or "",
                    "seed_words": [],
                    "sample_id": stable_hash("aif-gen", i, split, k, *(row[key] for key in _SAMPLE_KEYS), length=20),
                    "swapped": False,
                }
                for k, row in enumerate(split_rows[split])
            ]
            for split in ("train", "test")
        }
        stages.append(_stage(rows))
        n_test = len(rows["test"])
        n = len(rows["train"]) + n_test
        infos.append(
            {
                "index": i,
                "name": task.name,
                "dir": stage_dirname(i, task.name),
                "weights": {task.name: 1.0},
                "num_samples": n,
                "test_ratio": n_test / n if n else 0.0,
                "seed": None,
                "generated": n,
                "skipped": {},
                "missing": 0,
                "source_counts": {task.name: n},
            }
        )
        tasks[task.name] = {"style": task.style, "objective_kind": None, "aif_gen_task": copy.deepcopy(entry["task"])}
    total = sum(info["generated"] for info in infos)
    metadata = {
        "name": name,
        "format": "plain",
        "seed": None,
        "config": config.to_dict(),
        "drift": drift_summary(config),
        "tasks": tasks,
        "stages": infos,
        "stats": {"planned": total, "generated": total, "missing": 0, "skipped": 0},
        "imported_from": {"format": "aif-gen", "source": source},
    }
    return ContinualDataset(stages, metadata)


def _stage(rows: dict[str, list[dict[str, Any]]]):
    """A plain-format ``DatasetDict`` with the given train and test rows, in order."""
    from datasets import Dataset, DatasetDict

    from rlhf_ext.datagen.dataset import features

    feats = features("plain")
    return DatasetDict(
        {s: Dataset.from_dict({k: [r[k] for r in part] for k in feats}, features=feats) for s, part in rows.items()}
    )


def _find_task(metadata: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The AIF-Gen task of rlhf-ext task ``name``: the verbatim imported one, else built from the config's task; the
    metadata of merged datasets is searched in merge order."""
    verbatim = (metadata.get("tasks") or {}).get(name, {}).get("aif_gen_task")
    if verbatim is not None:
        return copy.deepcopy(verbatim)
    for task in (metadata.get("config") or {}).get("tasks") or []:
        if task.get("name") == name:
            domain = {
                comp: {"name": comp, "seed_words": list(spec["seed_words"]), "weight": spec["weight"]}
                for comp, spec in task["domain"].items()
            }
            return {"domain": domain, "objective": task["objective"], "preference": task["preference"]}
    for inner in metadata.get("merged_from") or []:
        found = _find_task(inner, name)
        if found is not None:
            return found
    return None


def _text(value: Any, where: str) -> str:
    """A plain column value, or the content of a one-message conversational value."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        return value[0]["content"]
    raise ValueError(f"{where}: AIF-Gen's samples are plain text; this value has {len(value)} messages")


def dataset_to_aif_gen(ds: ContinualDataset) -> dict[str, Any]:
    """``ds`` as AIF-Gen's continual dataset JSON value (``{"datasets": [...]}``, one entry per stage); ``ValueError``
    for a stage that mixes tasks (AIF-Gen has one per dataset), is empty or whose task the metadata does not describe.
    """
    datasets = []
    for info, dd in zip(ds.metadata["stages"], ds):
        label = f"stage {info['index']} ({info['name']})"
        weights = info.get("weights") or {}
        if len(weights) != 1:
            mix = ", ".join(f"{k} {w:.2f}" for k, w in weights.items()) or "no task"
            raise ValueError(
                f"{label} mixes {mix}; AIF-Gen's format has one task per dataset: export it as jsonl or parquet"
            )
        (task_name,) = weights
        task = _find_task(ds.metadata, task_name)
        if task is None:
            raise ValueError(f"{label}: the metadata does not describe its task {task_name!r}")
        if len(dd["train"]) + len(dd["test"]) == 0:
            raise ValueError(f"{label} has no samples; AIF-Gen's loader cannot read an empty dataset")
        entry: dict[str, Any] = {"task": task}
        for split in ("train", "test"):
            entry[split] = [
                {key: _text(row[key], f"{label} {split}[{k}].{key}") for key in _SAMPLE_KEYS}
                for k, row in enumerate(dd[split])
            ]
        datasets.append(entry)
    return {"datasets": datasets}


def write_aif_gen_json(ds: ContinualDataset, path: str | Path) -> Path:
    """Write :func:`dataset_to_aif_gen` of ``ds`` to ``path`` (atomically, indented as AIF-Gen's published file)."""
    from rlhf_ext.runtime.io import atomic_write_text

    atomic_write_text(path, json.dumps(dataset_to_aif_gen(ds), indent=2))
    return Path(path)


def read_json(path: str | Path) -> Any:
    """A JSON file's value; ``ValueError`` naming the file and position when it is not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a JSON file (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None


def import_dataset(source: str | Path, fmt: Literal["auto", "aif-gen", "rlhf-ext"] = "auto", name: str | None = None):
    """Read ``source`` as a ``ContinualDataset``: an AIF-Gen dataset JSON file, or an rlhf-ext dataset directory (or
    its ``continual_dataset.json``). ``fmt`` forces one of the two. ``FileNotFoundError`` when ``source`` does not
    exist, ``ValueError`` (one line) when it is neither format (or not ``fmt``)."""
    from rlhf_ext.datagen.dataset import METADATA_FILE, ContinualDataset

    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    neither = (
        f'{path} is neither an AIF-Gen dataset JSON ({{"datasets": [...]}}) nor an rlhf-ext continual dataset '
        f"(a directory with {METADATA_FILE})"
    )
    if path.is_dir():
        if fmt == "aif-gen":
            raise ValueError(f"{path} is a directory; --format aif-gen takes AIF-Gen's dataset JSON file")
        if not (path / METADATA_FILE).is_file():
            raise ValueError(f"{neither}: the directory has no {METADATA_FILE}")
        return ContinualDataset.load(path)
    try:
        data = read_json(path)
    except ValueError as e:
        raise ValueError(f"{neither}: {e}") from None
    if is_aif_gen_dataset(data) and fmt != "rlhf-ext":
        return dataset_from_aif_gen(data, name or path.stem, source=str(path))
    if isinstance(data, dict) and "stages" in data and fmt != "aif-gen":
        return ContinualDataset.load(path.parent)
    if fmt != "auto":
        raise ValueError(f"{path} is not {'an AIF-Gen dataset JSON' if fmt == 'aif-gen' else 'rlhf-ext metadata'}")
    if isinstance(data, dict):
        held = f"the keys {', '.join(sorted(map(str, data))[:6])}" if data else "an empty object"
    else:
        held = f"a JSON {type(data).__name__}"
    raise ValueError(f"{neither}: it holds {held}")
