"""Paper 004 / paper 001 in the simulator: the fidelity figures of iterative online DPO and one-step async training.

Runs on the ``sim compare`` task and settings (``recipes/sim_compare.yaml``: tiny SFT model, simulated feedback from
the annotator pool with 25% flips, bandit surrogate reward model trained on it) with evaluation judged by the gold
scorer, and reports, for each seed:

1. **Iterative online DPO vs offline DPO on the same budget.** Online DPO runs ``ITERATIONS`` iterations of
   ``online_dpo.prompts_per_iteration`` prompts (best vs worst of ``num_generations`` under the surrogate RM, trained on
   the accumulated pairs for ``online_dpo.train.num_train_epochs`` epochs from the previous iterate). After
   iteration k it has used ``k * P`` preference pairs and ``epochs * P * k(k+1)/2`` pair-gradient passes. Offline DPO
   at budget k is TRL's ``DPOTrainer`` from the SFT model on the first ``k * P`` simulated (pool-labelled) pairs for
   ``epochs * (k+1)/2`` epochs: the same number of labels and pair passes. Both are scored after every k.
2. **Async vs sync.** ``online_dpo_async`` (one-step off-policy) vs ``online_dpo_sync`` (the same loop on-policy):
   final gold reward, win rate and the spread over seeds.
3. **Length penalty.** Iterative online DPO ranking by ``r - lambda * len`` (paper 004, Eq. 9) vs ``lambda = 0``:
   mean response length and gold reward.

Each evaluation is the gold-judged win rate against the SFT model on the held-out prompts (ties count 1/2), the
mean gold reward and the mean length. Every finished run/evaluation is kept under ``--out`` and skipped on rerun.

    python benchmarks/online_dpo_sim.py [--out runs/online_dpo_sim] [--from runs/sim_compare] [--seeds 0 1 2]
        [--length-penalty 0.001 0.005]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

ITERATIONS = 3


def mean_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return mean, se


def fmt(values: list[float], digits: int = 3) -> str:
    mean, se = mean_se(values)
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


def evaluate_cached(run, seed: int, name: str, path: str) -> dict[str, Any]:
    """Gold-judged win rate of the checkpoint at ``path`` against SFT (written once to ``results/<name>``)."""
    from rlhf_ext.runtime.io import atomic_write_json
    from rlhf_ext.sim.methods import PolicySpec

    out = run.root / "results" / name / f"seed-{seed}.json"
    if not out.exists():
        t0 = time.time()
        metrics = run.evaluate(seed, PolicySpec(path))
        atomic_write_json(out, {**metrics, "policy_path": path, "eval_seconds": time.time() - t0})
    return json.loads(out.read_text())


def run_seed(run, seed: int, length_penalties: list[float]) -> dict[str, Any]:
    from rlhf_ext.sim.methods import dpo, sim_online_dpo

    r = run.recipe
    per_iter = r.online_dpo.prompts_per_iteration
    epochs = r.online_dpo.train.num_train_epochs
    result: dict[str, Any] = {"seed": seed, "online": [], "offline": []}

    online = sim_online_dpo(run, seed, "iterative")
    for k in range(1, ITERATIONS + 1):
        result["online"].append(evaluate_cached(run, seed, f"online_dpo_iter{k}", online.info["policies"][k]))
        budget = replace(
            r.dpo, max_pairs=k * per_iter, train=replace(r.dpo.train, num_train_epochs=epochs * (k + 1) / 2)
        )
        offline = dpo(run, seed, cfg=budget, name=f"dpo_pairs{k * per_iter}")
        result["offline"].append(evaluate_cached(run, seed, f"dpo_pairs{k * per_iter}", offline.path))

    for mode in ("async", "sync"):
        spec = sim_online_dpo(run, seed, mode)
        result[mode] = evaluate_cached(run, seed, f"online_dpo_{mode}", spec.path)

    result["length_penalty"] = {}
    for lam in length_penalties:
        name = f"online_dpo_lp{lam:g}"
        penalised = sim_online_dpo(run, seed, "iterative", cfg=replace(r.online_dpo, length_penalty=lam), name=name)
        result["length_penalty"][f"{lam:g}"] = evaluate_cached(run, seed, name, penalised.path)
    return result


def tables(results: list[dict[str, Any]], recipe, length_penalties: list[float]) -> str:
    per_iter = recipe.online_dpo.prompts_per_iteration
    seeds = ", ".join(str(r["seed"]) for r in results)
    lines = [
        f"### Iterative online DPO vs offline DPO on the same budget (seeds {seeds}; mean ± s.e.)",
        "",
        "| iteration | pairs | online DPO gold win rate | online gold | online length | offline DPO gold win rate "
        "| offline gold | offline length |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k in range(ITERATIONS):
        on = [r["online"][k] for r in results]
        off = [r["offline"][k] for r in results]
        lines.append(
            f"| {k + 1} | {(k + 1) * per_iter} | {fmt([m['win_rate'] for m in on])} | "
            f"{fmt([m['gold_mean'] for m in on], 2)} | {fmt([m['avg_length_chars'] for m in on], 0)} | "
            f"{fmt([m['win_rate'] for m in off])} | {fmt([m['gold_mean'] for m in off], 2)} | "
            f"{fmt([m['avg_length_chars'] for m in off], 0)} |"
        )
    lines += [
        "",
        "### One-step async vs synchronous online DPO (same updates, same settings)",
        "",
        "| mode | gold win rate | final gold reward | per-seed gold | length | KL to SFT |",
        "|---|---|---|---|---|---|",
    ]
    for mode in ("sync", "async"):
        ms = [r[mode] for r in results]
        per_seed = ", ".join(f"{m['gold_mean']:+.2f}" for m in ms)
        lines.append(
            f"| {mode} | {fmt([m['win_rate'] for m in ms])} | {fmt([m['gold_mean'] for m in ms], 2)} | {per_seed} | "
            f"{fmt([m['avg_length_chars'] for m in ms], 0)} | {fmt([m['kl'] for m in ms], 2)} |"
        )
    lines += [
        "",
        f"### Length penalty (iterative online DPO after {ITERATIONS} iterations; lambda per character)",
        "",
        "| lambda | mean length (chars) | gold win rate | gold reward |",
        "|---|---|---|---|",
    ]
    rows = [(0.0, [r["online"][-1] for r in results])]
    rows += [(lam, [r["length_penalty"][f"{lam:g}"] for r in results]) for lam in length_penalties]
    for lam, ms in rows:
        lines.append(
            f"| {lam:g} | {fmt([m['avg_length_chars'] for m in ms], 0)} | {fmt([m['win_rate'] for m in ms])} | "
            f"{fmt([m['gold_mean'] for m in ms], 2)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="sim_compare", help="sim compare recipe (file or packaged name)")
    parser.add_argument("--out", default="runs/online_dpo_sim")
    parser.add_argument(
        "--from", dest="comparison", default=None,
        help="a `sim compare` directory of the same recipe and budget: its task splits, SFT model, feedback and reward "
        "models are linked into --out instead of built again",
    )  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--length-penalty", type=float, nargs="+", default=[0.001, 0.005], help="lambdas of Eq. 9, per character"
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("overrides", nargs="*", help="recipe overrides key=value")
    args = parser.parse_args(argv)

    from rlhf_ext.config import load_recipe
    from rlhf_ext.recipes import recipe_path
    from rlhf_ext.runtime.async_runner import torch_threads
    from rlhf_ext.runtime.io import atomic_write_json, machine_info
    from rlhf_ext.sim.compare import SimRun
    from rlhf_ext.sim.recipe import SimCompareRecipe

    recipe = load_recipe(
        SimCompareRecipe,
        recipe_path(args.config),
        [f"output_dir={args.out}", "eval.judge=gold", f"online_dpo.num_iterations={ITERATIONS}", *args.overrides],
    )
    run = SimRun(recipe, progress=lambda m: print(m, file=sys.stderr, flush=True))
    run.check_directory()
    if args.comparison:
        from rlhf_ext.sim.tune import link_shared

        for seed in args.seeds:
            link_shared(Path(args.comparison), Path(args.out), seed)
    start = time.time()
    with torch_threads(recipe.threads):
        results = [run_seed(run, seed, args.length_penalty) for seed in args.seeds]
    table = tables(results, recipe, args.length_penalty)
    print(table)
    payload = {
        "results": results,
        "length_penalties": args.length_penalty,
        "iterations": ITERATIONS,
        "wall_seconds": time.time() - start,
        "machine": machine_info(),
        "markdown": table,
    }
    atomic_write_json(Path(args.out) / "online_dpo_sim.json", payload)
    if args.json:
        atomic_write_json(Path(args.json), payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
