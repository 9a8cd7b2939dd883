"""Is the simulator's SFT-vs-SFT win rate 1/2? The evaluation's null check, over many sampling seeds.

``sim compare`` reports the SFT model against itself (policy samples with seed ``20000 + s``, reference samples with
``30000 + s``, judged by the pool of seed ``s``). By symmetry its expectation is exactly 1/2: the pool decides a pair
from a digest of the unordered pair (no position), both sides sample at the same temperature from the same model.
This script measures it over ``--draws`` independent draws of both sides, on the evaluation prompts of a finished
comparison, and reports the mean, its standard error and the per-draw spread (one draw's standard error is what a
single seed's row in the comparison table carries).

    python benchmarks/sim_sft_bias.py --from runs/sim_compare --draws 30
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", default="runs/sim_compare", help="a finished comparison directory")
    parser.add_argument("--draws", type=int, default=30)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sim_sft_bias.json"))
    args = parser.parse_args()

    import torch

    from rlhf_ext.config import from_dict
    from rlhf_ext.sim.compare import SimRun
    from rlhf_ext.sim.evaluate import win_rate
    from rlhf_ext.sim.recipe import SimCompareRecipe

    torch.set_num_threads(1)
    source = Path(args.source)
    settings = json.loads((source / "recipe.json").read_text())["settings"]
    run = SimRun(from_dict(SimCompareRecipe, {**settings, "output_dir": str(source)}))
    ev = run.recipe.eval
    sft = run.policy(run.sft_model(), temperature=ev.temperature)
    prompts, styles = run.eval_prompts(), list(run.eval_split()["style"])
    rows = []
    for draw in range(args.draws):
        r = win_rate(
            sft, sft, prompts, styles=styles, judge=run.pool(draw), gold=run.gold,
            samples_per_prompt=ev.samples_per_prompt, seed=50_000 + 2 * draw, compute_kl=False,
            reference_samples=sft.sample(prompts, ev.samples_per_prompt, seed=50_001 + 2 * draw),
        )  # fmt: skip
        rows.append({"draw": draw, "win_rate": r.win_rate, "stderr": r.stderr, "lc_win_rate": r.lc_win_rate})
        print(f"draw {draw}: win rate {r.win_rate:.3f} ± {r.stderr:.3f}, LC {r.lc_win_rate:.3f}", flush=True)
    wins = [r["win_rate"] for r in rows]
    summary = {
        "draws": args.draws,
        "comparisons_per_draw": len(prompts) * ev.samples_per_prompt,
        "mean_win_rate": statistics.fmean(wins),
        "stderr_of_mean": statistics.stdev(wins) / math.sqrt(len(wins)),
        "sd_across_draws": statistics.stdev(wins),
        "mean_within_draw_stderr": statistics.fmean(r["stderr"] for r in rows),
        "mean_lc_win_rate": statistics.fmean(r["lc_win_rate"] for r in rows),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"SFT vs SFT over {args.draws} draws: {summary['mean_win_rate']:.4f} ± {summary['stderr_of_mean']:.4f} "
        f"(sd across draws {summary['sd_across_draws']:.3f}; one draw's s.e. {summary['mean_within_draw_stderr']:.3f})"
    )


if __name__ == "__main__":
    main()
