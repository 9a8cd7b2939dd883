"""Segment PPO on OpenRLHF's real Ray PPO loop (CPU, HF rollout engine). Prints tables and writes JSON; never part
of the tests.

1. Step cost: the same OpenRLHF PPO run (same tiny models, prompts, batch, seeds, GAE critic) with dense segment
   rewards (``--ext.granularity segment``) and as stock OpenRLHF with its scalar reward (only the CPU pieces
   installed). Runs alternate (stock, segment, stock, ...); per run, the per-step timings OpenRLHF logs
   (``timing/make_experience`` — the reward, reference, critic and actor forwards plus the reward shaping — and
   ``timing/step_total``) of steps 2.. (step 1 warms up). Target: segment / stock <= 1.05 (the entropies come from
   the reference forward PPO runs anyway).
2. Wall-clock of a whole 4-step tiny run (``segment_ppo_tiny`` recipe, ``train.max_steps=4``) on each engine:
   ``python launch/train_segment_ppo.py --engine openrlhf ...`` (Ray + DeepSpeed + HF rollouts) and the TRL engine,
   interleaved, including process start, Ray start-up, normalizer fitting and saving.

    python benchmarks/openrlhf_ppo.py [--repeats 3] [--models tiny|smollm2] [--skip-engines]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def step_cost(root: Path, sft: str, rm: str, prompts: str, repeats: int, episodes: int) -> dict:
    from tests.helpers.openrlhf_runs import run_train_ppo_ray, tiny_ppo_argv

    flags = {"stock": ["--ext.granularity", "bandit"], "segment": ["--ext.granularity", "segment"]}
    timings: dict[str, dict[str, list[float]]] = {k: {"make_experience": [], "step_total": []} for k in flags}
    walls: dict[str, list[float]] = {k: [] for k in flags}
    for r in range(repeats):
        for name in ("stock", "segment") if r % 2 == 0 else ("segment", "stock"):
            out = root / f"{name}{r}"
            argv = tiny_ppo_argv(sft, rm, prompts, out, episodes) + ["--algo.advantage.estimator", "gae"] + flags[name]
            steps, wall = run_train_ppo_ray(argv, root / f"{name}{r}.log", methods=name != "stock")
            walls[name].append(wall)
            for step in sorted(steps)[1:]:
                for key in timings[name]:
                    timings[name][key].append(steps[step][f"timing/{key}"])
            print(f"  {name} run {r}: {len(steps)} steps, {wall:.1f} s", flush=True)
    result = {name: {k: summary(v) for k, v in t.items()} for name, t in timings.items()}
    for key in ("make_experience", "step_total"):
        result[f"ratio_{key}"] = result["segment"][key]["median"] / result["stock"][key]["median"]
    result["run_wall_s"] = {k: summary(v) for k, v in walls.items()}
    return result


def engine_runs(root: Path, repeats: int) -> dict:
    overrides = ["segment.granularity=segment",  # paper mode, as the recorded results were measured
                 "train.max_steps=4", "train.batch_size=8", "train.micro_batch_size=4", "train.bf16=true"]  # fmt: skip
    walls: dict[str, list[float]] = {"openrlhf": [], "trl": []}
    for r in range(repeats):
        for engine in ("openrlhf", "trl") if r % 2 == 0 else ("trl", "openrlhf"):
            out = root / f"recipe_{engine}{r}"
            cmd = [sys.executable, str(ROOT / "launch" / "train_segment_ppo.py"), "--engine", engine,
                   "--config", "segment_ppo_tiny", f"train.output_dir={out}", *overrides]  # fmt: skip
            if engine == "trl":
                cmd[-1] = "train.bf16=false"  # TRL on CPU trains in fp32 (the recipe's default)
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "RAY_DEDUP_LOGS": "0"})
            wall = time.perf_counter() - start
            (root / f"recipe_{engine}{r}.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                raise RuntimeError(f"{engine} run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
            walls[engine].append(wall)
            print(f"  {engine} 4-step recipe run {r}: {wall:.1f} s", flush=True)
    return {k: summary(v) for k, v in walls.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--episodes", type=int, default=5, help="PPO steps per step-cost run (8 prompts each)")
    parser.add_argument(
        "--models",
        choices=["tiny", "smollm2"],
        default="tiny",
        help="tiny: builtin tiny-sft + tiny-segment-rm (vocab 512); smollm2: SmolLM2-135M-Instruct as "
        "policy, reference, reward model and critic (vocab 49k, score head untrained) for part 1",
    )
    parser.add_argument("--skip-engines", action="store_true", help="only part 1")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/openrlhf_ppo[_smollm2].json")
    args = parser.parse_args()
    suffix = "" if args.models == "tiny" else f"_{args.models}"
    args.out = args.out or str(ROOT / "benchmarks" / "results" / f"openrlhf_ppo{suffix}.json")

    from rlhf_ext.pipelines.builtins import resolve_model
    from rlhf_ext.runtime.io import atomic_write_json, machine_info
    from rlhf_ext.zoo.toy import toy_preference_dataset

    if args.models == "tiny":
        sft, rm = resolve_model("builtin:tiny-sft"), resolve_model("builtin:tiny-segment-rm")
    else:
        sft = rm = resolve_model("builtin:smollm2")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prompts = root / "prompts.jsonl"
        rows = toy_preference_dataset(n_train=8, n_test=4, seed=0)["train"]["prompt"]
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
        print("1. OpenRLHF PPO step: segment rewards vs stock scalar rewards", flush=True)
        cost = step_cost(root, sft, rm, str(prompts), args.repeats, args.episodes)
        runs = {}
        if not args.skip_engines:
            print("2. 4-step segment_ppo_tiny runs, OpenRLHF vs TRL engine", flush=True)
            runs = engine_runs(root, args.repeats)
    results = {"models": args.models, "step_cost": cost, "recipe_runs": runs, "machine": machine_info(),
               "repeats": args.repeats, "steps_per_run": args.episodes}  # fmt: skip

    def fmt(s: dict) -> str:
        return f"{s['median']:.3f} [{s['min']:.3f}, {s['max']:.3f}] (n={s['n']})"

    print("\n| per PPO step (s), median [min, max] | stock OpenRLHF | segment | ratio (target <= 1.05) |")
    print("|---|---|---|---|")
    for key in ("make_experience", "step_total"):
        print(f"| {key} | {fmt(cost['stock'][key])} | {fmt(cost['segment'][key])} | {cost[f'ratio_{key}']:.3f} |")
    print(f"\nwhole runs ({args.episodes} steps, incl. Ray start): stock {fmt(cost['run_wall_s']['stock'])} s, "
          f"segment {fmt(cost['run_wall_s']['segment'])} s")  # fmt: skip
    if runs:
        print("\n| 4-step segment_ppo_tiny run, wall s | median [min, max] |\n|---|---|")
        for engine, s in runs.items():
            print(f"| {engine} | {fmt(s)} |")
    atomic_write_json(args.out, results)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
