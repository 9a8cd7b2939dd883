#!/usr/bin/env python
"""Continual RLHF benchmarks (paper 000): step cost and forgetting. Prints tables and writes JSON; not a test.

1. ``step-cost``: wall time of one continual DPO step (DPO + KL to the previous task's policy: one extra frozen
   forward pass) against one plain TRL ``DPOTrainer`` step on the same batch and model, measured side by side in one
   process with the two interleaved (so machine load hits both alike). A step is ``training_step`` (forward +
   backward) plus the optimizer step. Target: ratio <= 1.35.
2. ``forgetting``: sequential DPO (c = 0) vs continual DPO (c > 0) over task sequences and several seeds with the
   task-sequence runner: final average performance, normalised backward transfer, forgetting, and the newest task's
   performance (the cost of the KL term to plasticity).

    python benchmarks/continual.py step-cost [--models tiny-sft small smollm2] [--reps 12] [--threads 1]
    python benchmarks/continual.py forgetting [--seeds 0 1 2] [--coefs 0 1] [--tasks builtin:toy-continual-domains]
    python benchmarks/continual.py forgetting --tasks builtin:continual-piecewise-preference \
        builtin:continual-lipschitz --seeds 0 data.num_tasks=null data.max_train_samples=null \
        data.max_test_samples=null data.max_length=320          # the dataset generator's sequences

Run it with the package importable (``pip install -e .`` or ``PYTHONPATH=.``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rlhf_ext.runtime.io import machine_info

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------------------------------------- step cost
def _models(name: str):
    """(policy, reference, previous-task model, tokenizer) for a benchmark model name."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_ext.pipelines.builtins import resolve_model

    if name == "small":  # 4 layers, hidden 256: the tiny tokenizer, a model where compute dominates overhead
        from rlhf_ext.zoo.models import tiny_causal_lm

        path = resolve_model("builtin:tiny")
        tok = AutoTokenizer.from_pretrained(path)

        def build(seed):
            kw = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8)
            return tiny_causal_lm(tok, seed=seed, num_key_value_heads=4, **kw)

        return build(0), build(1), build(2), tok
    path = resolve_model({"tiny-sft": "builtin:tiny-sft", "smollm2": "builtin:smollm2"}[name])
    tok = AutoTokenizer.from_pretrained(path)

    def load():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    prev = load()
    with torch.no_grad():  # a previous-task model that differs from the policy
        for p in prev.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return load(), load(), prev, tok


def step_cost(models: list[str], reps: int, batch_size: int, max_length: int, out: Path) -> dict:
    from trl import DPOConfig, DPOTrainer

    from rlhf_ext.trl import ContinualDPOConfig, ContinualDPOTrainer
    from rlhf_ext.trl.args import CPU_RUN
    from rlhf_ext.zoo.toy import toy_preference_dataset

    data = toy_preference_dataset(n_train=batch_size, n_test=1, seed=7)["train"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            policy, ref, prev, tok = _models(name)
            common = dict(
                output_dir=tmp,
                per_device_train_batch_size=batch_size,
                max_length=max_length,
                learning_rate=0.0,  # weights stay fixed: every repetition runs the same computation
                **CPU_RUN,
            )
            import copy

            plain = DPOTrainer(
                model=copy.deepcopy(policy),
                ref_model=copy.deepcopy(ref),
                args=DPOConfig(**common),
                train_dataset=data,
                processing_class=tok,
            )
            cont = ContinualDPOTrainer(
                model=policy,
                ref_model=ref,
                prev_model=prev,
                args=ContinualDPOConfig(**common, continual_kl_coef=1.0),
                train_dataset=data,
                processing_class=tok,
            )
            inputs = plain._prepare_inputs(next(iter(plain.get_train_dataloader())))
            tokens = int(inputs["attention_mask"].sum())

            def step(trainer, inputs=inputs):
                trainer.model.train()
                start = time.perf_counter()
                trainer.training_step(trainer.model, inputs)
                trainer.optimizer.step()
                trainer.optimizer.zero_grad(set_to_none=True)
                return time.perf_counter() - start

            for t in (plain, cont):
                t.create_optimizer()
                t.current_gradient_accumulation_steps = 1  # set by Trainer.train's loop otherwise
                step(t)  # warm-up
                step(t)
            times = {"plain": [], "continual": []}
            load_before = os.getloadavg()[0]
            for _ in range(reps):  # interleaved, so load changes affect both alike
                times["plain"].append(step(plain))
                times["continual"].append(step(cont))
            med = {k: statistics.median(v) for k, v in times.items()}
            best = {k: min(v) for k, v in times.items()}
            ratios = sorted(c / p for c, p in zip(times["continual"], times["plain"]))
            rows.append(
                {
                    "model": name,
                    "params_M": round(sum(p.numel() for p in policy.parameters()) / 1e6, 2),
                    "batch_pairs": batch_size,
                    "tokens": tokens,
                    "plain_median_s": round(med["plain"], 4),
                    "continual_median_s": round(med["continual"], 4),
                    "ratio_of_medians": round(med["continual"] / med["plain"], 3),
                    "plain_min_s": round(best["plain"], 4),
                    "continual_min_s": round(best["continual"], 4),
                    "ratio_of_minimums": round(best["continual"] / best["plain"], 3),
                    "paired_ratio_median": round(statistics.median(ratios), 3),
                    "paired_ratio_min_max": [round(ratios[0], 3), round(ratios[-1], 3)],
                    "reps": reps,
                    "loadavg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                    "times_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
                }
            )
            del plain, cont
    result = {"benchmark": "continual DPO step vs plain DPO step", "target_ratio": 1.35, "machine": machine_info()}
    result["rows"] = rows
    print("\nstep cost: continual DPO (c=1, k3) vs TRL DPOTrainer, same batch, interleaved; target <= 1.35x")
    header = f"{'model':10} {'params':>8} {'pairs':>6} {'tokens':>7} {'plain s':>9} {'cont. s':>9} {'ratio':>7}"
    print(header + f" {'min-time ratio':>15} {'paired ratio (min..max)':>26} {'load':>11}")
    print(" " * 36 + "(medians)")
    for r in rows:
        lo, hi = r["paired_ratio_min_max"]
        load = "{}->{}".format(*r["loadavg_1min_before_after"])
        print(
            f"{r['model']:10} {r['params_M']:>7}M {r['batch_pairs']:>6} {r['tokens']:>7} {r['plain_median_s']:>9.4f} "
            f"{r['continual_median_s']:>9.4f} {r['ratio_of_medians']:>6.3f}x {r['ratio_of_minimums']:>14.3f}x "
            f"{r['paired_ratio_median']:>8.3f} ({lo:.3f}..{hi:.3f})  {load:>11}"
        )
    _write(out, result)
    return result


# -------------------------------------------------------------------------------------------------------- forgetting
def forgetting(
    tasks: list[str],
    seeds: list[int],
    coefs: list[float],
    overrides: list[str],
    out: Path,
    recipe: str,
    work: Path | None = None,
) -> dict:
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.continual import run_continual
    from rlhf_ext.pipelines.continual_recipe import ContinualRecipe
    from rlhf_ext.recipes import recipe_path

    runs = []
    # each sequence runs in WORK/<tasks>_c<coef>_seed<seed> (WORK default runs/benchmarks/<result name>): a rerun
    # resumes it at its last finished task, with other --coefs or --seeds too
    work = work or Path("runs") / "benchmarks" / out.stem
    for source in tasks:
        for coef in coefs:
            for seed in seeds:
                start = time.time()
                config = load_recipe(
                    ContinualRecipe,
                    recipe_path(recipe),
                    [
                        f"data.tasks={source}",
                        f"data.seed={seed}",
                        f"seed={seed}",
                        f"continual.continual_kl_coef={coef}",
                        f"output_dir={work}/{sequence_name(source)}_c{coef:g}_seed{seed}",
                        "plots=false",
                        *overrides,
                    ],
                )
                summary = run_continual(config)
                m = summary["metrics"]
                runs.append(
                    {
                        "tasks": source,
                        "kl_coef": coef,
                        "seed": seed,
                        "matrix": summary["performance_matrix"],
                        "average_performance": m["average_performance"],
                        "backward_transfer": m["backward_transfer"],
                        "backward_transfer_absolute": m["backward_transfer_absolute"],
                        "forgetting": m["forgetting"],
                        "newest_task": m["newest_task_performance"],
                        "plasticity": sum(row[k] for k, row in enumerate(summary["performance_matrix"]))
                        / len(summary["performance_matrix"]),
                        "seconds": round(time.time() - start, 1),
                    }
                )
                print(f"  {source} c={coef} seed={seed}: {json.dumps({k: runs[-1][k] for k in list(runs[-1])[3:]})}")
                sys.stdout.flush()
    metric = summary["metric"] if runs else ""
    keys = ("average_performance", "backward_transfer", "backward_transfer_absolute", "forgetting", "newest_task",
            "plasticity")  # fmt: skip
    table = []
    for source in tasks:
        for coef in coefs:
            group = [r for r in runs if r["tasks"] == source and r["kl_coef"] == coef]
            row = {"tasks": source, "kl_coef": coef, "n": len(group)}
            for k in keys:
                vals = [r[k] for r in group if r[k] is not None]
                if not vals:  # e.g. the normalised transfer of reward-model scores that can be <= 0
                    row[k] = [float("nan"), float("nan")]
                    continue
                row[k] = [round(statistics.mean(vals), 4), round(statistics.stdev(vals), 4) if len(vals) > 1 else 0.0]
            table.append(row)
    print(f"\nforgetting ({recipe}): sequential (c=0) vs continual (c>0); mean +- std over seeds; R = {metric}")
    print(f"{'tasks':42} {'c':>5} {'n':>2}  " + "  ".join(f"{k:>20}" for k in keys))
    for row in table:
        cells = "  ".join(f"{row[k][0]:>+10.3f} +- {row[k][1]:<6.3f}" for k in keys)
        print(f"{row['tasks']:42} {row['kl_coef']:>5g} {row['n']:>2}  {cells}")
    result = {
        "benchmark": f"continual forgetting ({recipe})",
        "metric": metric,
        "definitions": {
            "average_performance": "mean_k R[k, K-1]",
            "backward_transfer": "mean_{k<K-1} (R[k, K-1] - R[k, k]) / R[k, k] (None if some R[k, k] <= 0)",
            "backward_transfer_absolute": "mean_{k<K-1} R[k, K-1] - R[k, k]",
            "forgetting": "mean_{k<K-1} max_{k<=t<K-1} R[k, t] - R[k, K-1]",
            "newest_task": "R[K-1, K-1]",
            "plasticity": "mean_k R[k, k] (each task right after training on it)",
        },
        "overrides": overrides,
        "machine": machine_info(),
        "markdown": forgetting_markdown(table),
        "table": table,
        "runs": runs,
    }
    _write(out, result)
    return result


def sequence_name(source: str) -> str:
    """A task sequence's short name: ``builtin:continual-lipschitz`` or ``path/to/continual-lipschitz`` ->
    ``continual-lipschitz``."""
    return Path(source).name.removeprefix("builtin:")


def forgetting_markdown(table: list[dict]) -> str:
    """The forgetting table as the README prints it: one row per (task sequence, c), mean ± std over seeds."""
    columns = {"average_performance": "final avg. performance",
               "backward_transfer_absolute": "backward transfer (abs.)", "forgetting": "forgetting",
               "newest_task": "newest task", "plasticity": "plasticity"}  # fmt: skip
    lines = ["| sequence | c | " + " | ".join(columns.values()) + " |", "|---" * (len(columns) + 2) + "|"]
    shown = None
    for row in table:
        name = sequence_name(row["tasks"])
        cells = [f"{row[k][0]:+.3f} ± {row[k][1]:.3f}" for k in columns]
        lines.append(f"| {name if name != shown else ''} | {row['kl_coef']:g} | " + " | ".join(cells) + " |")
        shown = name
    return "\n".join(lines)


def _write(path: Path, obj: dict) -> None:
    from rlhf_ext.runtime.io import atomic_write_json

    atomic_write_json(path, obj)
    print(f"\nwrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("step-cost")
    p.add_argument("--models", nargs="+", default=["tiny-sft", "small"], choices=["tiny-sft", "small", "smollm2"])
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=RESULTS / "continual_step_cost.json")
    f = sub.add_parser("forgetting")
    f.add_argument(
        "--tasks",
        nargs="+",
        default=["builtin:toy-continual-preference-shift", "builtin:toy-continual-domains"],
        help="builtin toy sequences or dataset-generator directories",
    )
    f.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    f.add_argument("--coefs", nargs="+", type=float, default=[0.0, 1.0])
    f.add_argument("--out", type=Path, default=RESULTS / "continual_forgetting.json")
    f.add_argument("--recipe", default="continual_dpo_tiny", help="continual_dpo_tiny or continual_ppo_tiny (CPPO)")
    f.add_argument("--runs", type=Path, default=None, help="the runs' directory (default runs/benchmarks/<--out name>)")
    f.add_argument("overrides", nargs="*", help="recipe overrides, e.g. train.learning_rate=5e-4")
    args = parser.parse_args(argv)
    if args.what == "step-cost":
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        step_cost(args.models, args.reps, args.batch_size, args.max_length, args.out)
    else:
        forgetting(args.tasks, args.seeds, args.coefs, args.overrides, args.out, args.recipe, args.runs)


if __name__ == "__main__":
    main()
