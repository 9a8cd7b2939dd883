"""Assembly: the dataset written from the cache's records, stage by stage, in index order (preference-swap noise,
output format and the seeded train/test split applied here), streamed into split files (``arrow_stage``). A stage
depends only on the plan and the cache, so a sharded run's workers can write whole stages in any order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_ext.datagen.cache import SampleCache
from rlhf_ext.datagen.dataset import SPLITS, swap_decision, test_mask, write_continual_dataset
from rlhf_ext.datagen.drift import derive_seed
from rlhf_ext.datagen.plan import GenerationPlan

#: writes the stages ``[(stage position, directory), ...]`` and returns each one's :func:`write_stage` result
StageWriter = Callable[[list[tuple[int, Path]]], list[dict[str, Any]]]


def write_stage(plan: GenerationPlan, cache: SampleCache, i: int, directory: Path) -> dict[str, Any]:
    """Write stage ``plan.stages[i]``'s ok records into ``directory`` (``train/``, ``test/``, ``dataset_dict.json``);
    returns its ``train`` and ``test`` sizes, ``source_counts`` and the backend ``models`` its records name."""
    from rlhf_ext.datagen.arrow_stage import SplitWriter, write_dataset_dict

    config, stage = plan.config, plan.stages[i]
    swap_p = config.generation.preference_swap
    where, ok = cache.locate(plan.stage_keys(stage))
    positions = where[ok]
    is_test = test_mask(len(positions), stage.test_ratio, derive_seed("split", stage.seed))
    writers = [SplitWriter(directory / split, config.output.format) for split in SPLITS]
    sources: Counter = Counter()
    models: set[str] = set()
    for position, test in zip(positions.tolist(), is_test.tolist()):
        record = cache.read(position)
        row = dict(record["sample"])
        if record.get("info", {}).get("model"):
            models.add(record["info"]["model"])
        row["sample_id"] = record["key"]
        row["swapped"] = swap_decision(record["key"], swap_p, config.seed)
        if row["swapped"]:
            row["chosen"], row["rejected"] = row["rejected"], row["chosen"]
        writers[test].add(row)
        sources[row["source_task"]] += 1
    write_dataset_dict(directory, SPLITS)
    train, test = (w.close() for w in writers)
    return {"train": train, "test": test, "source_counts": dict(sorted(sources.items())), "models": sorted(models)}


def write_dataset(
    plan: GenerationPlan, cache: SampleCache, path: Path, write_stages: StageWriter | None = None
) -> dict[str, Any]:
    """Write the dataset from cached records; returns the metadata. ``write_stages`` writes the stage directories
    (default: :func:`write_stage` one after the other in this process). Depends only on the plan and the cache (never
    on the current run), so a rerun that generates nothing rewrites the same bytes."""
    from rlhf_ext import __version__

    config = plan.config
    infos = []
    totals: Counter = Counter()
    for stage in plan.stages:
        where, ok = cache.locate(plan.stage_keys(stage))
        skipped = Counter(cache.read(p)["reason"] for p in where[(where >= 0) & ~ok])
        info = stage.to_dict()
        info.update(generated=int(ok.sum()), skipped=dict(sorted(skipped.items())), missing=int((where < 0).sum()))
        infos.append(info)
        totals.update(generated=info["generated"], missing=info["missing"], skipped=sum(skipped.values()))
    metadata = {
        "name": config.name,
        "format": config.output.format,
        "seed": config.seed,
        "config": config.to_dict(),
        "drift": plan.drift,
        "tasks": {
            name: {"style": t.style, "objective_kind": t.objective_kind, "fingerprint": t.fingerprint}
            for name, t in plan.tasks.items()
        },
        "stages": infos,
        "stats": {"planned": plan.num_jobs, **dict(sorted(totals.items()))},
        "generator": {
            "backend": config.generation.backend,
            "models": [],  # as the backend reported them (e.g. resolved from the server's /models)
            "rlhf_ext_version": __version__,
        },
    }

    def write_all(directories: list[Path]) -> list[tuple[int, int]]:
        jobs = list(enumerate(directories))
        results = write_stages(jobs) if write_stages is not None else [write_stage(plan, cache, i, d) for i, d in jobs]
        models: set[str] = set()
        for info, result in zip(infos, results):
            info["source_counts"] = result["source_counts"]
            models.update(result["models"])
        metadata["generator"]["models"] = sorted(models)
        return [(r["train"], r["test"]) for r in results]

    return write_continual_dataset(path, metadata, write_all)
