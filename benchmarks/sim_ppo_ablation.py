"""Why a PPO variant misses its paper-003 rank in the simulator: the same PPO run under changed settings.

``rlhf-ext sim compare`` gives bandit, segment and token PPO one ``ppo:`` setting (the same budget). When a variant
falls behind (segment PPO does at the packaged setting: its segments multiply and its summed dense reward grows with
them), this benchmark re-runs that method for one seed of a finished comparison with other settings — an ablation
that explains the rank, not a setting tuned into the recipe. Each variant reuses the comparison's task splits, SFT
model, simulated feedback and reward models of that seed (copied into ``--out``) and is evaluated exactly as in the
comparison (win rate against the SFT model, judged by the pool without flips).

Usage::

    python benchmarks/sim_ppo_ablation.py --from runs/sim_compare --seed 0 \\
        --variant "segment_ppo lr 5e-5: segment_ppo ppo.learning_rate=5e-5" \\
        --variant "segment_ppo kl 0.5: segment_ppo ppo.kl_coef=0.5"

Each ``--variant`` is ``"NAME: METHOD OVERRIDE..."``; its run goes to ``--work``/NAME. Writes
``OUT/sim_ppo_ablation.json`` / ``.md`` (per variant: win rate ± s.e., gold, KL, length, and the PPO curve's first and
last segments per response, response length, dense score and KL) and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

#: The artefacts of a comparison directory a method of one seed needs (shared, then per seed).
SHARED = ("data", "base", "sft")
PER_SEED = ("feedback", "rm_bandit", "rm_segment", "rm_token", "reference_samples.json")
CURVE = ("segment/segments_per_response", "segment/response_length", "segment/score", "segment/kl")


def prepare(source: Path, dest: Path, seed: int, per_seed: tuple[str, ...] = PER_SEED) -> None:
    """Copy the shared and the seed's artefacts (``per_seed``) of the comparison at ``source`` into ``dest`` (once)."""
    for name in SHARED:
        if not (dest / name).exists():
            shutil.copytree(source / name, dest / name)
    for name in per_seed:
        src, out = source / f"seed-{seed}" / name, dest / f"seed-{seed}" / name
        if src.exists() and not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if src.is_dir() else shutil.copy)(src, out)


def variant_run(source: Path, work: Path, name: str, overrides: list[str]):
    """A :class:`~rlhf_ext.sim.compare.SimRun` of the comparison at ``source`` with ``overrides``, in ``work``/NAME."""
    from rlhf_ext.config import apply_overrides, from_dict, normalize_overrides
    from rlhf_ext.sim.compare import SimRun
    from rlhf_ext.sim.recipe import SimCompareRecipe

    dest = work / "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    settings = json.loads((source / "recipe.json").read_text())["settings"]  # the comparison's exact settings
    data = apply_overrides(settings, normalize_overrides([f"output_dir={dest}", *overrides]))
    return SimRun(from_dict(SimCompareRecipe, data), progress=print)


def run_variant(source: Path, out: Path, seed: int, name: str, method: str, overrides: list[str]) -> dict[str, Any]:
    from rlhf_ext.sim.methods import METHOD_FUNCTIONS

    run = variant_run(source, out, name, overrides)
    prepare(source, Path(run.recipe.output_dir), seed)
    start = time.time()
    spec = METHOD_FUNCTIONS[method](run, seed)
    metrics = run.evaluate(seed, spec)
    curve = spec.info.get("curve", [])
    return {
        "variant": name,
        "method": method,
        "overrides": overrides,
        "seed": seed,
        "seconds": time.time() - start,
        **{k: metrics[k] for k in ("win_rate", "stderr", "gold_mean", "kl", "avg_length_chars")},
        "curve_first": {k: curve[0].get(k) for k in CURVE} if curve else {},
        "curve_last": {k: curve[-1].get(k) for k in CURVE} if curve else {},
        "curve": curve,
    }


def markdown(rows: list[dict[str, Any]], source: str) -> str:
    def pair(r: dict[str, Any], key: str) -> str:
        a, b = r["curve_first"].get(key), r["curve_last"].get(key)
        return "–" if a is None else f"{a:.1f} -> {b:.1f}"

    lines = [
        "| variant | win rate vs SFT | gold | KL (nats) | length (chars) | segments/response | response tokens | "
        "dense score | PPO KL |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['win_rate']:.3f} ± {r['stderr']:.3f} | {r['gold_mean']:+.2f} | {r['kl']:.1f} | "
            f"{r['avg_length_chars']:.0f} | {pair(r, CURVE[0])} | {pair(r, CURVE[1])} | {pair(r, CURVE[2])} | "
            f"{pair(r, CURVE[3])} |"
        )
    lines += ["", f"Seed {rows[0]['seed'] if rows else '–'} of {source}; curve columns: first -> last logged PPO step."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", required=True, help="a finished `sim compare` output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", action="append", required=True, help='"NAME: METHOD OVERRIDE..."')
    parser.add_argument("--out", default="benchmarks/results", help="folder of sim_ppo_ablation.json / .md")
    parser.add_argument("--work", default="runs/sim_ppo_ablation", help="folder of the variants' runs (checkpoints)")
    args = parser.parse_args(argv)
    source, out = Path(args.source), Path(args.out)
    rows = []
    for spec in args.variant:
        name, _, rest = spec.partition(":")
        method, *overrides = rest.split()
        rows.append(run_variant(source, Path(args.work), args.seed, name.strip(), method, overrides))
    from rlhf_ext.runtime.io import atomic_write_json, atomic_write_text

    text = markdown(rows, str(source))
    atomic_write_json(out / "sim_ppo_ablation.json", {"source": str(source), "rows": rows})
    atomic_write_text(out / "sim_ppo_ablation.md", text)
    print(text)
    return rows


if __name__ == "__main__":
    main()
