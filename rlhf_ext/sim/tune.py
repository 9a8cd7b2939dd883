"""``rlhf-ext sim tune``: the same small tuning grid for every method, picked on validation prompts (paper 002).

:func:`run_tuning` gives every method of the recipe's ``tuning`` section the same grid (or the method's own in
``tuning.method_grids``), trains each point on ``tuning.seeds``, evaluates it as ``sim compare`` does on the
*validation* prompts and picks per method the point with the best mean length-controlled win rate (raw win rates
reward length): what a comparison recipe's ``method_overrides`` should hold (report on other seeds).

Each (method, point) is a comparison directory under ``OUTPUT_DIR/tuning/`` that links the main directory's shared
artefacts (task splits, base and SFT models, each seed's feedback and reward models), so every point trains from the
same SFT model on the same feedback.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_ext.config import apply_overrides, from_dict, to_dict
from rlhf_ext.runtime.async_runner import torch_threads
from rlhf_ext.runtime.io import atomic_write_json, atomic_write_text
from rlhf_ext.sim.compare import SimRun, run_jobs
from rlhf_ext.sim.recipe import SimCompareRecipe
from rlhf_ext.sim.report import RM_KINDS, fmt, mean_se, result_path

#: The artefacts a tuning point shares with the main comparison directory (links), at the top and per seed.
SHARED = ("data", "base", "sft")
SHARED_PER_SEED = ("feedback", *(f"rm_{kind}" for kind in RM_KINDS))


def grid_points(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """The product of ``grid``'s values, in key order then value order: ``{"a": [1, 2], "b": [3]}`` ->
    ``[{"a": 1, "b": 3}, {"a": 2, "b": 3}]`` (one empty point for an empty grid)."""
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def point_name(point: dict[str, Any]) -> str:
    """A directory name for a grid point: ``lr=0.001,kl=0.05`` style, from the keys' last parts."""
    return ",".join(f"{k.split('.')[-1]}={v}" for k, v in point.items()) or "default"


def point_recipe(recipe: SimCompareRecipe, method: str, point: dict[str, Any], seed: int) -> SimCompareRecipe:
    """The comparison recipe of one tuning run: ``method`` alone on ``seed``, at ``point`` (the recipe's own
    ``method_overrides`` are dropped: the grid replaces them), evaluated on the validation prompts."""
    data = {**to_dict(recipe), "method_overrides": {}}
    root = Path(recipe.output_dir) / "tuning" / method / point_name(point)
    overrides = [
        f"output_dir={root}",
        f"methods=[{method}]",
        f"seeds=[{seed}]",
        "workers=1",
        "eval.split=validation",
        *(f"{k}={json.dumps(v)}" for k, v in point.items()),
    ]
    return from_dict(SimCompareRecipe, apply_overrides(data, overrides))


def link_shared(main: Path, sub: Path, seed: int) -> None:
    """Link the main directory's shared artefacts (and ``seed``'s) into the tuning directory ``sub``."""
    for src, dest in [
        *((main / n, sub / n) for n in SHARED),
        *((main / f"seed-{seed}" / n, sub / f"seed-{seed}" / n) for n in SHARED_PER_SEED),
    ]:
        if src.exists() and not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.symlink_to(src.resolve(), target_is_directory=True)


def shared_run(recipe: SimCompareRecipe, progress: Callable[[str], None] | None = None) -> SimRun:
    """The main directory's run that builds what every tuning point shares; it runs no method, so tuning again after
    ``sim compare --tuning`` reuses the directory (its methods' ``method_overrides`` are not checked)."""
    return SimRun(from_dict(SimCompareRecipe, {**to_dict(recipe), "seeds": recipe.tuning.seeds, "methods": ["sft"]}),
                  progress)  # fmt: skip


def run_tuning(recipe: SimCompareRecipe, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run every (method, grid point, tuning seed) of ``recipe.tuning`` that has no result yet, pick each method's
    best point and write ``OUTPUT_DIR/tuning/tuning.json`` and ``tuning.md``; returns the summary."""
    tuning = recipe.tuning
    if not tuning.methods or not all(tuning.grid_of(m) for m in tuning.methods):
        raise ValueError("the recipe's tuning section needs methods and a grid for each (tuning.methods, tuning.grid "
                         "or tuning.method_grids)")  # fmt: skip
    main = Path(recipe.output_dir)
    shared = shared_run(recipe, progress)
    shared.check_directory()
    with torch_threads(recipe.threads):
        shared.sft_model()
        for seed in tuning.seeds:  # the artefacts every point shares, built once here
            for kind in RM_KINDS:
                shared.reward_model(seed, kind)
    jobs = []
    for method in tuning.methods:
        for point in grid_points(tuning.grid_of(method)):
            for seed in tuning.seeds:
                sub = point_recipe(recipe, method, point, seed)
                link_shared(main, Path(sub.output_dir), seed)
                jobs.append((f"{method} {point_name(point)} seed {seed}", sub))
    run_jobs(jobs, recipe.workers, recipe.threads, progress)
    summary = summarise_tuning(recipe)
    root = main / "tuning"
    atomic_write_json(root / "tuning.json", summary)
    atomic_write_text(root / "tuning.md", tuning_markdown(summary) + "\n")
    return summary


def apply_tuning(recipe: SimCompareRecipe, tuning_dir: str | Path) -> SimCompareRecipe:
    """``recipe`` with the ``method_overrides`` of every method ``sim tune`` picked a point for replaced by that point
    (read from ``TUNING_DIR/tuning/tuning.json``, the output directory of a ``sim tune`` run)."""
    from rlhf_ext.config import RecipeError

    path = Path(tuning_dir) / "tuning" / "tuning.json"
    if not path.is_file():
        raise RecipeError(f"--tuning: {path} does not exist; run `rlhf-ext sim tune --out {tuning_dir}` first")
    picked = {m: e["overrides"] for m, e in json.loads(path.read_text())["methods"].items() if e["picked"] is not None}
    data = to_dict(recipe)
    data["method_overrides"] = {**data["method_overrides"], **picked}
    return from_dict(SimCompareRecipe, data)


def summarise_tuning(recipe: SimCompareRecipe) -> dict[str, Any]:
    """Per method: every grid point's mean (± s.e. over tuning seeds) validation win rate, LC win rate, gold, KL and
    length, and the picked point (best mean LC win rate; ties go to the earlier point)."""
    methods = {}
    for method in recipe.tuning.methods:
        rows = []
        for point in grid_points(recipe.tuning.grid_of(method)):
            root = Path(point_recipe(recipe, method, point, recipe.tuning.seeds[0]).output_dir)
            paths = [result_path(root, method, seed) for seed in recipe.tuning.seeds]
            results = [json.loads(p.read_text()) for p in paths if p.exists()]
            if not results:
                continue
            row: dict[str, Any] = {"point": point, "seeds": [r["seed"] for r in results]}
            for key in ("lc_win_rate", "win_rate", "gold_mean", "kl", "avg_length_chars", "segments_per_response"):
                row[key], row[f"{key}_se"] = mean_se([r.get(key) for r in results])
            rows.append(row)
        finite = [r for r in rows if not math.isnan(r["lc_win_rate"])]
        picked = max(finite, key=lambda r: r["lc_win_rate"]) if finite else None
        methods[method] = {
            "points": rows,
            "picked": picked["point"] if picked else None,
            "overrides": [f"{k}={v}" for k, v in picked["point"].items()] if picked else [],
        }
    tuning = recipe.tuning
    return {"seeds": tuning.seeds, "grid": tuning.grid, "method_grids": tuning.method_grids,
            "criterion": "lc_win_rate", "methods": methods}  # fmt: skip


def tuning_markdown(summary: dict[str, Any]) -> str:
    """The tuning results: one row per (method, point), the picked point marked."""
    lines = [
        f"Tuning on validation prompts, seeds {summary['seeds']}; picked by the mean length-controlled win rate.",
        "",
        "| method | point | LC win rate | win rate | gold | KL | length (chars) | segments / response | picked |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, entry in summary["methods"].items():
        for r in entry["points"]:
            lines.append(
                f"| {method} | {point_name(r['point'])} | {fmt(r['lc_win_rate'], r['lc_win_rate_se'])} | "
                f"{fmt(r['win_rate'], r['win_rate_se'])} | {fmt(r['gold_mean'], r['gold_mean_se'], 2, True)} | "
                f"{fmt(r['kl'], r['kl_se'], 1)} | {fmt(r['avg_length_chars'], r['avg_length_chars_se'], 0)} | "
                f"{fmt(r['segments_per_response'], r['segments_per_response_se'], 1)} | "
                f"{'yes' if r['point'] == entry['picked'] else ''} |"
            )
    lines += ["", "method_overrides for the comparison recipe:"]
    lines += [f"  {method}: [{', '.join(entry['overrides'])}]" for method, entry in summary["methods"].items()]
    return "\n".join(lines)
