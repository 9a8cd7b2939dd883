"""Benchmarks for online DPO (papers 004 and 001). Prints tables and writes JSON; never part of the test run.

    python benchmarks/async.py [--out benchmarks/results/async.json] [--updates 16] [--reps 3]
    python benchmarks/async.py --render benchmarks/results/async.json      # re-print a result's tables
    python benchmarks/async.py --quick      # 8 updates of 16 pairs, 32 tokens, 2 reps, no margin table -> *_quick.json

1. **Sync vs one-step async** (paper 001, section 3.5 / Appendix D): the same number of DPO updates with
   ``IterativeDPOTrainer``'s online mode, ``async_generation`` false then true, each role held to one CPU thread in
   both modes, with the generator in a thread (the paper's design) and in a separate process. Generation (sampling
   K responses + segment-reward scoring, the generator side as in section 4.2) and training (one DPO step) are
   made comparable by calibrating the response length on a short synchronous run. Per-update steady-state time
   comes from the runner's publish times (the first ``--warmup`` updates, which include building the trainer, are
   excluded). The ideal speedup is ``(G + T) / max(G, T)`` with G and T the per-batch generation and training times
   of the synchronous run, where the roles do not compete. Modes alternate (sync, async, sync, async ...) so load
   drift from other processes hits both.
2. **Pairs per second and reward margin vs n** (paper 004 best/worst-of-n; paper 001 section 4.2 reports the
   chosen-rejected margin about 2x larger at K = 4 than at K = 2): the tiny SFT policy, a segment reward model
   trained on the toy task (built once with the ``segment_rm_tiny`` recipe), 64 prompts.

The machine's load average is recorded around every measurement, since other processes may share the cores.
The summary rows (``make bench``'s table, one per generator design) give, per repetition, the achieved speedup as a
fraction of its ceiling ``min(ideal, machine parallelism)`` (the parallelism probed just before that repetition):
median [p25-p75] over the repetitions, target >= 0.95 in every one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _timing import machine_parallelism, machine_probe, spread, summary_row

from rlhf_ext.runtime.io import atomic_write_json, atomic_write_text, machine_info

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the generator process, once joined)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def reward_model(root: Path) -> str:
    """A segment reward model for the toy task (trained once with the packaged segment_rm_tiny recipe)."""
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.segment_rm import SegmentRMRecipe, run_segment_rm
    from rlhf_ext.recipes import recipe_path

    out = root / "segment_rm"
    if not (out / "segment_config.json").exists():
        recipe = load_recipe(SegmentRMRecipe, recipe_path("segment_rm_tiny"), [f"train.output_dir={out}"])
        run_segment_rm(recipe)
    return str(out)


def online_run(
    sft: str,
    prompts,
    reward,
    out: Path,
    asynchronous: bool,
    k: int,
    updates: int,
    seed: int,
    process: bool = False,
    max_new_tokens: int = 72,
    pairs: int = 8,
) -> dict:
    import shutil

    from rlhf_ext.trl import IterativeDPOConfig, IterativeDPOTrainer
    from rlhf_ext.trl.args import CPU_RUN

    shutil.rmtree(out, ignore_errors=True)
    args = IterativeDPOConfig(
        output_dir=str(out),
        online_mode="online",
        async_generation=asynchronous,
        generator_process=process,
        max_steps=updates,
        num_generations=k,
        temperatures=[0.7, 1.0],
        max_completion_length=max_new_tokens,
        per_device_train_batch_size=pairs,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        beta=0.1,
        max_length=160,
        **CPU_RUN,
        logging_steps=10_000,
        eval_num_prompts=1,
        eval_samples_per_prompt=1,
        generation_threads=1,
        training_threads=1,
        seed=seed,
    )
    load_before, cpu_before, t0 = load(), cpu_seconds(), time.perf_counter()
    trainer = IterativeDPOTrainer(sft, reward, args=args, train_dataset=prompts)
    trainer.train()
    summary = trainer.summary
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu_before
    shutil.rmtree(out, ignore_errors=True)
    return {**summary["runner"], "load_before": load_before, "load_after": load(), "cpu_per_wall": cpu / wall}


def steady(stats: dict, warmup: int) -> dict:
    pub = stats["publish_seconds"]
    n = len(pub) - warmup
    return {
        "per_update": (pub[-1] - pub[warmup - 1]) / n,
        "G": statistics.median(stats["generate_seconds"][warmup:]),
        "T": statistics.median(stats["train_seconds"][warmup:]),
        "staleness": stats["staleness"],
        "load": stats["load_before"] + stats["load_after"],
        "cpu_per_wall": stats["cpu_per_wall"],
    }


def calibrate(sft, prompts, reward, root: Path, k: int, pairs: int, warmup: int) -> tuple[int, dict]:
    """A response length at which generation (G) and training (T) take about the same time per batch."""
    mnt = 72
    for _ in range(2):
        run = online_run(sft, prompts, reward, root / "calibrate", False, k, warmup + 4, 0, False, mnt, pairs)
        stats = steady(run, warmup)
        print(f"  calibration: {mnt} new tokens -> G {stats['G']:.3f} s, T {stats['T']:.3f} s", flush=True)
        mnt = max(16, min(96, round(mnt * stats["T"] / stats["G"])))
    return mnt, stats


def speedup_table(sft, prompts, reward, root: Path, k: int, mnt: int, pairs: int, updates: int, reps: int, warmup: int):
    rows = []
    for backend in ("thread", "process"):
        runs: dict[str, list] = {"sync": [], "async": []}
        probes = []
        for rep in range(reps):
            probes.append(machine_parallelism())
            print(f"  {backend} rep {rep}: two processes side by side finish {probes[-1]:.2f}x faster", flush=True)
            for mode in ("sync", "async"):
                out = root / f"run_{mode}"
                stats = online_run(
                    sft, prompts, reward, out, mode == "async", k, updates, rep, backend == "process", mnt, pairs
                )
                runs[mode].append(steady(stats, warmup))
                print(f"  {backend} rep {rep} {mode:5s}: {runs[mode][-1]['per_update']:.3f} s/update", flush=True)
        sync_u = statistics.median(r["per_update"] for r in runs["sync"])
        async_u = statistics.median(r["per_update"] for r in runs["async"])
        g = statistics.median(r["G"] for r in runs["sync"])
        t = statistics.median(r["T"] for r in runs["sync"])
        ideal = (g + t) / max(g, t)
        rows.append(
            {
                "generator": backend,
                "machine_parallelism": statistics.median(probes),
                "machine_parallelism_per_rep": probes,
                "K": k,
                "max_new_tokens": mnt,
                "G_sync": g,
                "T_sync": t,
                "G_async": statistics.median(r["G"] for r in runs["async"]),
                "T_async": statistics.median(r["T"] for r in runs["async"]),
                "sync_s_per_update": sync_u,
                "async_s_per_update": async_u,
                "ideal_speedup": ideal,
                "achieved_speedup": sync_u / async_u,
                "efficiency": (sync_u / async_u) / ideal,
                # how well the runner overlaps the per-role times it actually got, and how much each role slowed
                # down while running next to the other (cores shared with other processes, interpreter lock)
                "overlap": max(
                    statistics.median(r["G"] for r in runs["async"]), statistics.median(r["T"] for r in runs["async"])
                )
                / async_u,
                "cpu_per_wall_sync": statistics.median(r["cpu_per_wall"] for r in runs["sync"]),
                "cpu_per_wall_async": statistics.median(r["cpu_per_wall"] for r in runs["async"]),
                "staleness_sync": runs["sync"][0]["staleness"],
                "staleness_async": runs["async"][0]["staleness"],
                "runs": runs,
            }
        )
    return rows


def margin_table(sft, tokenizer, prompts, reward, ns: list[int], seed: int = 0) -> list[dict]:
    from rlhf_ext.online import select_pairs, torch_threads
    from rlhf_ext.runtime.rewards import score
    from rlhf_ext.runtime.sampling import HFSampler

    sampler = HFSampler(sft, tokenizer, max_new_tokens=72, temperatures=[0.7, 1.0], batch_size=64)
    rows = []
    for n in ns:
        load_before = load()
        t0 = time.perf_counter()
        with torch_threads(1):
            samples = sampler.sample(prompts, n, seed=seed)
            t_gen = time.perf_counter() - t0
            rewards = score(reward, [p for p in prompts for _ in range(n)], samples.flat()).view(len(prompts), n)
            sel = select_pairs(rewards, texts=samples.texts)
        seconds = time.perf_counter() - t0
        gap = rewards.max(1).values - rewards.min(1).values
        rows.append(
            {
                "n": n,
                "prompts": len(prompts),
                "pairs": len(sel),
                "dropped": sel.dropped,
                "seconds": seconds,
                "generate_seconds": t_gen,
                "pairs_per_second": len(sel) / seconds,
                "mean_margin": float(sel.reward_margin.mean()),
                "mean_max_min_gap": float(gap.mean()),
                "reward_std": float(rewards.std()),
                "load": load_before + load(),
            }
        )
        print(f"  n={n}: {rows[-1]['pairs_per_second']:.1f} pairs/s, margin {rows[-1]['mean_margin']:.3f}", flush=True)
    base = rows[0]["mean_margin"]
    for r in rows:
        r["margin_vs_n2"] = r["mean_margin"] / base if base else float("nan")
    return rows


def summary_rows(result: dict, probe: dict) -> list[dict]:
    """``make bench``'s rows, one per generator design: each repetition's achieved speedup as a fraction of its
    ceiling ``min(ideal, machine parallelism)``, median [p25-p75] over the repetitions (target >= 0.95 in each)."""
    from rlhf_ext.runtime.pair_collection import wants_generator_process

    # generator_process=None (the default) picks per run: a process for async HF generation without CUDA
    default = "process" if wants_generator_process(None, True, "auto", None) else "thread"
    args = result["args"]
    rows = []
    for r in result["speedup"]:
        probes = r["machine_parallelism_per_rep"]
        fractions = []
        for sync, asynchronous, parallelism in zip(r["runs"]["sync"], r["runs"]["async"], probes, strict=True):
            ideal = (sync["G"] + sync["T"]) / max(sync["G"], sync["T"])
            speedup = sync["per_update"] / asynchronous["per_update"]
            fractions.append(speedup / min(ideal, max(parallelism, 1.0)))
        rows.append(
            summary_row(
                f"one-step async vs sync, generator in a {r['generator']}"
                + (" (the default)" if r["generator"] == default else ""),
                f"async {r['async_s_per_update']:.3f} s/update, {r['achieved_speedup']:.2f}x sync (ideal "
                f"{r['ideal_speedup']:.2f}x); worst rep {min(fractions):.2f}",
                f"sync {r['sync_s_per_update']:.3f} s/update (G {r['G_sync']:.3f} s, T {r['T_sync']:.3f} s; "
                f"{args['updates']} updates of {args['pairs']} pairs, K={r['K']})",
                spread(fractions),
                ">= 0.95 in every rep",
                {**probe, "parallelism": statistics.median(probes), "parallelism_min": min(probes)},
                unit="of min(ideal, parallelism)",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="default benchmarks/results/async.json (--quick: async_quick.json)")
    parser.add_argument("--work", default="runs/bench_async", help="scratch directory (reward model, runs)")
    parser.add_argument("--updates", type=int, default=16, help="DPO updates per run")
    parser.add_argument("--warmup", type=int, default=3, help="updates excluded from the steady-state time")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each (sync, async) pair")
    parser.add_argument("--k", type=int, default=2, help="samples per prompt in the timing runs (paper 001: 2)")
    parser.add_argument("--pairs", type=int, default=64, help="pairs per DPO update in the timing runs")
    parser.add_argument("--ns", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--render", default=None, help="re-print the tables of a results JSON and exit")
    parser.add_argument("--quick", action="store_true", help="8 updates of 16 pairs, 32 tokens, 2 reps, no margins")
    args = parser.parse_args(argv)
    if args.quick:
        args.updates, args.warmup, args.reps, args.pairs, args.ns = 8, 2, 2, 16, []
    args.out = args.out or f"benchmarks/results/async{'_quick' if args.quick else ''}.json"
    if args.render:
        result = json.loads(Path(args.render).read_text())
        print(render(result))
        return result

    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from rlhf_ext.pipelines.builtins import resolve_model
    from rlhf_ext.runtime.rewards import SegmentSequenceReward
    from rlhf_ext.zoo.toy import toy_preference_rows

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    root = Path(args.work)
    machine = {**machine_info(), "load_at_start": load()}
    sft = resolve_model("builtin:tiny-sft")
    tokenizer = AutoTokenizer.from_pretrained(sft)
    print("reward model ...", flush=True)
    reward = SegmentSequenceReward(reward_model(root), batch_size=64, device="cpu")
    train_prompts = [r["prompt"] for r in toy_preference_rows(2048, seed=3)]
    eval_prompts = [r["prompt"] for r in toy_preference_rows(64, seed=4)]

    print("pairs per second and margin vs n ...", flush=True)
    margins = margin_table(sft, tokenizer, eval_prompts, reward, args.ns) if args.ns else []
    print("sync vs one-step async ...", flush=True)
    # --quick: a fixed response length instead of the calibration runs (the ceiling uses each run's own G and T)
    mnt, calibration = (32, {}) if args.quick else calibrate(sft, train_prompts, reward, root, args.k, args.pairs,
                                                             args.warmup)  # fmt: skip
    speed = speedup_table(
        sft, train_prompts, reward, root, args.k, mnt, args.pairs, args.updates, args.reps, args.warmup
    )
    machine["load_at_end"] = load()
    result = {
        "machine": machine,
        "calibration": {"max_new_tokens": mnt, **calibration},
        "speedup": speed,
        "margin_vs_n": margins,
        "args": vars(args),
        "num_eval_prompts": len(eval_prompts),
    }
    result["summary"] = summary_rows(result, machine_probe())
    result["table"] = render(result)
    print("\n" + result["table"])
    out = Path(args.out)
    atomic_write_json(out, result)
    atomic_write_text(out.with_suffix(".txt"), result["table"] + "\n")
    print(f"\nwrote {out} and {out.with_suffix('.txt')}")
    return result


def _hist(h: dict) -> dict[int, int]:
    return {int(k): int(v) for k, v in h.items()}  # JSON turns the integer keys into strings


def render(result: dict) -> str:
    """The printed tables of a result (``python benchmarks/async.py --render results.json`` re-prints them)."""
    machine, args, mnt = result["machine"], result["args"], result["calibration"]["max_new_tokens"]
    lines = [
        f"machine: {machine['cpus']} CPUs, load average (1/5/15 min) at start {machine['load_at_start']}, "
        f"at end {machine['load_at_end']}",
        "",
        f"Sync vs one-step async online DPO: {args['updates']} updates, K={args['k']}, {mnt} new tokens, "
        f"{args['pairs']} pairs/update,",
        "1 torch thread per role in both modes; steady state (medians of the repetitions)",
        f"{'generator':>9} {'G s':>7} {'T s':>7} {'sync s/upd':>11} {'async s/upd':>12} {'ideal':>6} {'achieved':>9} "
        f"{'% ideal':>8} {'% ceiling':>10}  staleness async | sync",
    ]
    for r in result["speedup"]:
        ceiling = min(r["ideal_speedup"], max(r["machine_parallelism"], 1.0))
        lines.append(
            f"{r['generator']:>9} {r['G_sync']:>7.3f} {r['T_sync']:>7.3f} {r['sync_s_per_update']:>11.3f} "
            f"{r['async_s_per_update']:>12.3f} {r['ideal_speedup']:>6.2f} {r['achieved_speedup']:>9.2f} "
            f"{100 * r['efficiency']:>7.0f}% {100 * r['achieved_speedup'] / ceiling:>9.0f}%  "
            f"{_hist(r['staleness_async'])} | {_hist(r['staleness_sync'])}"
        )
    lines += [
        "",
        "ceiling = min(ideal, machine): machine = speedup of two single-threaded processes side by side vs one after",
        "the other, measured before each repetition (2.00 on two idle cores; ~1.0 when other jobs hold the cores).",
        "Where the async time goes: per-role times while overlapped, overlap = max(G, T) / async time per update,",
        "CPU seconds per wall second over the whole run, this process and its generator child (2.0 = both cores)",
        f"{'generator':>9} {'G async':>8} {'T async':>8} {'overlap':>8} {'CPU/wall sync':>14} {'CPU/wall async':>15} "
        f"{'machine':>8}",
    ]
    for r in result["speedup"]:
        lines.append(
            f"{r['generator']:>9} {r['G_async']:>8.3f} {r['T_async']:>8.3f} {100 * r['overlap']:>7.0f}% "
            f"{r['cpu_per_wall_sync']:>14.2f} {r['cpu_per_wall_async']:>15.2f} {r['machine_parallelism']:>8.2f}"
        )
    if not result["margin_vs_n"]:
        return "\n".join(lines)
    lines += [
        "",
        f"Best/worst-of-n on {result.get('num_eval_prompts', 64)} prompts (tiny SFT policy, segment RM; "
        "generate + score + select)",
        f"{'n':>3} {'pairs':>6} {'dropped':>8} {'seconds':>8} {'pairs/s':>8} {'margin':>8} {'vs n=2':>7} "
        f"{'max-min':>8}",
    ]
    for r in result["margin_vs_n"]:
        lines.append(
            f"{r['n']:>3} {r['pairs']:>6} {r['dropped']:>8} {r['seconds']:>8.2f} {r['pairs_per_second']:>8.1f} "
            f"{r['mean_margin']:>8.3f} {r['margin_vs_n2']:>7.2f} {r['mean_max_min_gap']:>8.3f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
