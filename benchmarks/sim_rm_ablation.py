"""Why the segment reward model is less accurate than the bandit one in the simulator: the same reward models of a
finished comparison, retrained under changed settings.

``rlhf-ext sim compare`` trains three surrogate reward models per seed from the SFT model on the same simulated
feedback: ``bandit`` (entropy cutoff inf), ``segment`` (the recipe's cutoff, 2.0) and ``token`` (cutoff 0). Paper 003
(Table 1) finds the segment model at least as accurate as the bandit one on held-out preferences. This benchmark
retrains one kind for each seed of a finished comparison with ``reward_model.*`` overrides (aggregation, tau, cutoff,
epochs, learning rate) and reports the held-out accuracy on the comparison's gold-ordered SFT-sample pairs (the
``eval_accuracy`` the comparison reports, :func:`rlhf_ext.runtime.token_scores.preference_accuracy`: the fraction of
pairs whose chosen response gets the higher aggregated score). Each variant reuses the comparison's task splits, SFT
model and feedback of that seed (copied into ``--work``/NAME); the comparison's own reward models are the baseline
rows.

Usage::

    python benchmarks/sim_rm_ablation.py --from runs/sim_compare --seeds 1,2,3 \\
        --variant "segment softmax: segment reward_model.aggregation=softmax" \\
        --variant "segment 3 epochs: segment reward_model.train.num_train_epochs=3"

Each ``--variant`` is ``"NAME: KIND OVERRIDE..."`` (KIND: bandit, segment or token). Writes
``OUT/sim_rm_ablation.json`` / ``.md`` (per row: accuracy mean ± s.e. over seeds, and each seed's) and
prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from sim_ppo_ablation import prepare, variant_run

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def accuracy(rm_dir: Path) -> float:
    """The held-out accuracy a finished reward model's ``metrics.json`` records."""
    return json.loads((rm_dir / "metrics.json").read_text())["eval"]["eval_accuracy"]


def run_variant(source: Path, work: Path, seeds: list[int], name: str, kind: str, overrides: list[str]) -> dict:
    """Retrain reward model ``kind`` of every seed with ``overrides`` in ``work``/NAME (reused when finished)."""
    run = variant_run(source, work, name, overrides)
    per_seed = {}
    for seed in seeds:
        prepare(source, Path(run.recipe.output_dir), seed, per_seed=("feedback",))
        per_seed[seed] = accuracy(Path(run.reward_model(seed, kind)))
    return {"variant": name, "kind": kind, "overrides": overrides, "per_seed": per_seed}


def baseline(source: Path, seeds: list[int], kind: str) -> dict[str, Any]:
    """The comparison's own reward model ``kind`` (no retraining)."""
    per_seed = {seed: accuracy(source / f"seed-{seed}" / f"rm_{kind}") for seed in seeds}
    return {"variant": f"{kind} (the comparison's)", "kind": kind, "overrides": [], "per_seed": per_seed}


def markdown(rows: list[dict[str, Any]], source: str) -> str:
    from rlhf_ext.sim.report import mean_se

    lines = ["| reward model | overrides | held-out accuracy | per seed |", "|---|---|---|---|"]
    for r in rows:
        accs = list(r["per_seed"].values())
        mean, se = mean_se(accs)
        seeds = " / ".join(f"{a:.3f}" for a in accs)
        lines.append(f"| {r['variant']} | {' '.join(r['overrides']) or '–'} | {mean:.3f} ± {se:.3f} | {seeds} |")
    seeds = ", ".join(str(s) for s in rows[0]["per_seed"]) if rows else "–"
    lines += ["", f"Seeds {seeds} of {source}; mean ± s.e. over seeds; held-out gold-ordered SFT-sample pairs."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", required=True, help="a finished `sim compare` output directory")
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds of that comparison")
    parser.add_argument("--variant", action="append", default=[], help='"NAME: KIND OVERRIDE..."')
    parser.add_argument("--out", default="benchmarks/results", help="folder of sim_rm_ablation.json / .md")
    parser.add_argument("--work", default="runs/sim_rm_ablation", help="folder of the variants' runs")
    args = parser.parse_args(argv)
    source, seeds = Path(args.source), [int(s) for s in args.seeds.split(",")]
    variants = []
    for spec in args.variant:
        name, _, rest = spec.partition(":")
        kind, *overrides = rest.split()
        variants.append(run_variant(source, Path(args.work), seeds, name.strip(), kind, overrides))
    from rlhf_ext.runtime.io import atomic_write_json, atomic_write_text
    from rlhf_ext.sim.report import RM_KINDS

    rows = [baseline(source, seeds, kind) for kind in RM_KINDS] + variants

    text = markdown(rows, str(source))
    atomic_write_json(Path(args.out) / "sim_rm_ablation.json", {"source": str(source), "rows": rows})
    atomic_write_text(Path(args.out) / "sim_rm_ablation.md", text)
    print(text)
    return rows


if __name__ == "__main__":
    main()
