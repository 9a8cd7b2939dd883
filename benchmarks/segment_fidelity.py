"""Paper 003's ablations in the simulator: Table 1 (action granularity), Table 2 (normalizers), Table 3
(interpolation), each over several seeds. Prints markdown tables (mean +- s.e.) and writes JSON; never in the tests.

The task is the demo's: stage 0 of the offline continual dataset (paper 000), a tiny SFT model, preference labels
from the simulated annotator pool with 25% flips (paper 002). For each seed:

* reward models with entropy cutoff inf (bandit), 0 (token) and 2.0 (segment); their held-out accuracy;
* PPO runs from the SFT model (``recipes/demo.yaml`` settings), evaluated against the SFT model on held-out prompts:
  win rate (annotator pool, no noise), gold reward, response length (characters), KL to SFT.

Every run is written to ``OUT/runs/<name>-seed<k>.json`` when it finishes and skipped when it exists (resumable).

    python benchmarks/segment_fidelity.py [--out runs/fidelity] [--seeds 0 1 2] [--tables 1 2 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

from rlhf_ext.runtime.io import atomic_write_json, atomic_write_text

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

RM_CUTOFFS = {"bandit": "inf", "token": "0.0", "segment": "2.0"}
# name -> (reward model kind, PPO overrides)
TABLE1 = {
    "bandit": ("bandit", ["segment.granularity=bandit", "segment.normalizer_kind=last", "ppo.value_clip=0.2"]),
    "token": ("token", ["segment.granularity=token", "segment.normalizer_kind=regression"]),
    "segment": ("segment", ["segment.granularity=segment", "segment.normalizer_kind=regression"]),
    "bandit_as_segment": ("bandit", ["segment.granularity=bandit_as_segment", "segment.entropy_cutoff=2.0",
                                     "segment.normalizer_kind=regression"]),
    "segment_as_bandit": ("segment", ["segment.granularity=segment_as_bandit", "segment.normalizer_kind=last"]),
}  # fmt: skip
TABLE2 = {k: ("segment", ["segment.granularity=segment", f"segment.normalizer_kind={k}"])
          for k in ("none", "global", "last")}  # fmt: skip
TABLE2["regression"] = TABLE1["segment"]  # the paper's setting: the same runs as Table 1's segment row
TABLE3 = {k: ("segment", ["segment.granularity=segment", "segment.normalizer_kind=regression",
                          f"segment.interpolation={k}"]) for k in ("segment_end", "repeat")}  # fmt: skip
TABLE3["even_split"] = TABLE1["segment"]


def run_one(pipeline, shared, out: Path, name: str, seed: int, rm_kind: str, overrides: list[str]) -> dict:
    """Train (or reuse) the reward model and the PPO policy of one setting and seed, then evaluate it.

    Runs are keyed by their reward-model kind and PPO overrides, so identical settings of different tables share one
    run."""
    from rlhf_ext.runtime.io import stable_hash

    key = f"{rm_kind}-{stable_hash(overrides, length=8)}"
    from rlhf_ext.pipelines.segment_ppo import run_segment_ppo
    from rlhf_ext.pipelines.segment_rm import run_segment_rm
    from rlhf_ext.sim import AnnotatorPool, win_rate

    result_file = out / "runs" / f"{key}-seed{seed}.json"
    if result_file.exists():
        return {**json.loads(result_file.read_text()), "name": name}
    rm_dir = out / "rm" / f"{rm_kind}-seed{seed}"
    rm_file = rm_dir / "metrics.json"
    if not rm_file.exists():
        rm_recipe = pipeline.rm_recipe(shared, rm_dir, f"segment.entropy_cutoff={RM_CUTOFFS[rm_kind]}",
                                       f"train.seed={seed}")  # fmt: skip
        run_segment_rm(rm_recipe)
    rm_eval = json.loads(rm_file.read_text())["eval"]
    ppo_dir = out / "ppo" / f"{key}-seed{seed}"
    recipe = pipeline.ppo_recipe(shared, ppo_dir, str(rm_dir), None, *overrides, f"train.seed={seed}")
    curve = run_segment_ppo(recipe)["curve"]
    _, _, test = pipeline._stage_split()
    test = test.select(range(min(pipeline.recipe.data.eval_prompts, len(test))))
    ev = win_rate(
        str(ppo_dir), shared["sft"]["path"], list(test["prompt"]), styles=list(test["style"]),
        judge=AnnotatorPool.default(seed=0), seed=seed, max_new_tokens=pipeline.recipe.data.max_completion_length,
    )  # fmt: skip
    result = {"name": name, "seed": seed, "rm": rm_kind, "overrides": overrides,
              "rm_accuracy": rm_eval.get("eval_accuracy"), "eval": asdict(ev), "curve": curve}  # fmt: skip
    atomic_write_json(result_file, result)
    return result


def mean_se(values: list[float]) -> str:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "n/a"
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {se:.3f}"


def table(title: str, names: list[str], results: list[dict], with_rm: bool) -> str:
    head = "| setting | " + ("RM acc. | " if with_rm else "") + "win rate vs SFT | gold reward | length (chars) | KL |"
    lines = [f"### {title}", "", head, "|" + "---|" * (head.count("|") - 1)]
    for name in names:
        rows = [r for r in results if r["name"] == name]
        cells = [mean_se([r["eval"][k] for r in rows]) for k in ("win_rate", "gold_mean", "avg_length_chars", "kl")]
        if with_rm:
            cells.insert(0, mean_se([r["rm_accuracy"] for r in rows]))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/fidelity")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tables", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--results", default="benchmarks/results/segment_fidelity")
    args = parser.parse_args()

    from rlhf_ext.config import load_recipe
    from rlhf_ext.demo import DemoPipeline, DemoRecipe
    from rlhf_ext.recipes import recipe_path

    out = Path(args.out)
    recipe = load_recipe(DemoRecipe, recipe_path("demo"), [f"out={out}"])
    pipeline = DemoPipeline(recipe, echo=lambda m: print(m, file=sys.stderr, flush=True))
    shared = {}
    for stage in ("data", "sft", "labels"):
        shared[stage] = pipeline._done(stage) or getattr(pipeline, f"stage_{stage}")(shared)

        atomic_write_json(pipeline.markers / f"{stage}.json", shared[stage])
    tables = {1: ("Table 1: action granularity", TABLE1, True), 2: ("Table 2: reward normalizer", TABLE2, False),
              3: ("Table 3: within-segment interpolation", TABLE3, False)}  # fmt: skip
    results, report = [], []
    for t in args.tables:
        title, configs, with_rm = tables[t]
        for name, (rm_kind, overrides) in configs.items():
            for seed in args.seeds:
                print(f"{title}: {name} seed {seed}", file=sys.stderr, flush=True)
                results.append({**run_one(pipeline, shared, out, name, seed, rm_kind, overrides), "table": t})
        report.append(table(title, list(configs), [r for r in results if r["table"] == t], with_rm))
    text = f"Seeds {args.seeds}; {recipe.data.eval_prompts} held-out prompts per evaluation.\n\n" + "\n".join(report)
    print(text)
    base = Path(args.results)
    atomic_write_text(base.with_suffix(".md"), text)
    atomic_write_json(base.with_suffix(".json"), results)


if __name__ == "__main__":
    main()
