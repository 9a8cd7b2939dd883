"""Regenerate every fidelity result from the code as it is: ``make fidelity`` (results of record) or
``make fidelity BUDGET=smoke`` (a check that every step runs, minutes).

Steps, each a command users run, in one output directory per budget (finished work is reused on rerun):

1. ``rlhf-ext sim tune``: the PPO variants' shared grid and DPO's own on the tuning seed, picked on validation prompts;
2. ``rlhf-ext sim compare --tuning OUT``: every method on the reporting seeds, the tuned ones at their picks;
3. the same comparison of SFT and the PPO variants on another task stage (``task.stage=1``), at the picks of stage 0:
   settings chosen on one stage and seed, checked on others;
4. ``benchmarks/sim_fidelity.py`` on both (rank correlation with AlpacaFarm, paper 003's order, LC and raw);
5. ``benchmarks/online_dpo_sim.py`` (papers 004 and 001) with the comparison's SFT model, feedback and reward models
   (``--from``: linked, since its gold-judged evaluation is a setting of its own directory);
6. ``benchmarks/continual.py forgetting --recipe continual_ppo_tiny`` from the comparison's SFT model (paper 000);
7. ``fidelity.md``: one row per paper claim -- the claim, ours, seeds and standard errors -- from the files above.

    python benchmarks/fidelity.py [--budget default|smoke|full] [--results benchmarks/results] [--out DIR]
        [--skip STEP ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

REPO = Path(__file__).resolve().parent.parent
STEPS = ("tune", "compare", "stage", "fidelity", "online_dpo", "continual", "claims")
#: Per budget: the sim recipe budget (None = the packaged settings), the other benchmarks' small settings.
BUDGETS: dict[str, dict[str, Any]] = {
    "default": {"sim": None, "out": "runs/fidelity", "seeds": [1, 2, 3], "online_dpo": [], "continual": []},
    "full": {"sim": "full", "out": "runs/fidelity_full", "seeds": [1, 2, 3, 4, 5], "online_dpo": [], "continual": []},
    "smoke": {
        "sim": "smoke",
        "out": "runs/fidelity_smoke",
        "seeds": [1],
        "tune": [
            "tuning.grid={ppo.learning_rate: [3.0e-4, 1.0e-3]}",
            "tuning.method_grids={dpo: {dpo.train.learning_rate: [3.0e-4, 1.0e-3]}}",
        ],
        "online_dpo": ["online_dpo.num_iterations=3", "online_dpo.prompts_per_iteration=4"],
        "continual": ["ppo.max_steps=1", "data.num_tasks=2", "--seeds", "0"],
    },
}
STAGE_METHODS = "[sft,bandit_ppo,segment_ppo,chunk_ppo,token_ppo]"


def run(command: list[str]) -> None:
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlhf_ext.cli", *args]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default="default", choices=sorted(BUDGETS))
    parser.add_argument("--results", default=str(REPO / "benchmarks" / "results"), help="where result files go")
    parser.add_argument("--out", default=None, help="the runs' directory (default: the budget's, under runs/)")
    parser.add_argument("--skip", nargs="*", default=[], choices=STEPS)
    args = parser.parse_args(argv)
    b = BUDGETS[args.budget]
    out = args.out or b["out"]
    stage_out = out + "_stage1"
    budget = ["--budget", b["sim"]] if b["sim"] else []
    results = Path(args.results)
    suffix = "" if args.budget == "default" else f"_{args.budget}"
    start = time.time()
    if "tune" not in args.skip:
        run(cli("sim", "tune", "--config", "sim_compare", *budget, "--out", out, *b.get("tune", [])))
    if "compare" not in args.skip:
        run(cli("sim", "compare", "--config", "sim_compare", *budget, "--out", out, "--tuning", out))
    if "stage" not in args.skip:
        run(cli("sim", "compare", "--config", "sim_compare", *budget, "--out", stage_out, "--tuning", out,
                "task.stage=1", f"methods={STAGE_METHODS}"))  # fmt: skip
    if "fidelity" not in args.skip:
        for name, source in (("sim_fidelity", out), ("sim_fidelity_stage1", stage_out)):
            run([sys.executable, "benchmarks/sim_fidelity.py", "--results", f"{source}/sim_compare.json",
                 "--out", str(results), "--name", name + suffix])  # fmt: skip
    if "online_dpo" not in args.skip:
        run([sys.executable, "benchmarks/online_dpo_sim.py", "--config", "sim_compare", "--out",
             f"{out}/online_dpo_sim", "--from", out, "--seeds",
             *map(str, b["seeds"]), "--json", str(results / f"online_dpo_sim{suffix}.json"), *budget_overrides(b),
             *b["online_dpo"]])  # fmt: skip
    if "continual" not in args.skip:
        run([sys.executable, "benchmarks/continual.py", "forgetting", "--recipe", "continual_ppo_tiny",
             "--tasks", "builtin:continual-piecewise-preference", "builtin:continual-lipschitz",
             "--coefs", "0", "1", "10", "--out", str(results / f"continual_forgetting_ppo{suffix}.json"),
             "--runs", f"{out}/continual_ppo",
             f"model.sft_model={out}/sft", "ppo.max_steps=24", "data.num_tasks=3", *b["continual"]])  # fmt: skip
    if "claims" not in args.skip:
        ran = [s for s in STEPS if s not in args.skip]
        text = claims_markdown(results, suffix, args.budget, time.time() - start, ran)
        (results / f"fidelity{suffix}.md").write_text(text)
        print(text)


def budget_overrides(b: dict[str, Any]) -> list[str]:
    """The sim recipe budget's overrides, for a benchmark that takes recipe overrides instead of ``--budget``."""
    if not b["sim"]:
        return []
    from rlhf_ext.recipes import recipe_path
    from rlhf_ext.sim.recipe import load_compare_recipe

    overrides = load_compare_recipe(recipe_path("sim_compare")).budgets[b["sim"]]
    return [o for o in overrides if not o.startswith("output_dir=")]


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _pm(mean: float, se: float, digits: int = 3) -> str:
    return f"{mean:.{digits}f}" if se is None or math.isnan(se) else f"{mean:.{digits}f} ± {se:.{digits}f}"


def _difference(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of ``a`` minus mean of ``b`` and the standard error of that difference (independent seeds)."""
    se = [statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else math.nan for v in (a, b)]
    return statistics.fmean(a) - statistics.fmean(b), math.hypot(*se)


def _verdict(se: float, holds: bool, yes: str, no: str) -> str:
    """``yes``/``no`` by ``holds``; "–" where one seed gives no standard error to judge by."""
    return "–" if math.isnan(se) else yes if holds else no


def online_dpo_claims(data: dict[str, Any] | None) -> list[tuple[str, str, str, str]]:
    """Papers 004 and 001 from ``online_dpo_sim.json``: online beats offline DPO on the same labels (by more than two
    standard errors of the difference), and one-step async is level with sync (within two)."""
    if not data:
        return []
    seeds, k = data["results"], data["iterations"]
    online = [r["online"][-1]["win_rate"] for r in seeds]
    offline = [r["offline"][-1]["win_rate"] for r in seeds]
    gap, se = _difference(online, offline)
    rows = [("004", f"iterative online DPO beats offline DPO on the same labels ({k} iterations, gold judge)",
             f"online {statistics.fmean(online):.3f}, offline {statistics.fmean(offline):.3f}: {_pm(gap, se)}",
             _verdict(se, gap > 2 * se, "holds", "does not hold"))]  # fmt: skip
    asynchronous, sync = [r["async"]["win_rate"] for r in seeds], [r["sync"]["win_rate"] for r in seeds]
    gap, se = _difference(asynchronous, sync)
    rows.append(("001", "one-step off-policy (async) online DPO is level with on-policy (sync)",
                 f"async {statistics.fmean(asynchronous):.3f}, sync {statistics.fmean(sync):.3f}: {_pm(gap, se)}",
                 _verdict(se, abs(gap) <= 2 * se, "holds: not separated (2 s.e.)", "does not hold")))  # fmt: skip
    return rows


def continual_claims(data: dict[str, Any] | None) -> list[tuple[str, str, str, str]]:
    """Paper 000 from ``continual_forgetting_ppo.json``: per task sequence, the KL to the previous task's policy
    (c = 1) forgets less than sequential PPO (c = 0), by more than two standard errors of the difference."""
    from continual import sequence_name  # benchmarks/continual.py, beside this script

    if not data:
        return []
    rows = []
    for source in dict.fromkeys(r["tasks"] for r in data["runs"]):
        per = {c: [r["forgetting"] for r in data["runs"] if r["tasks"] == source and r["kl_coef"] == c] for c in (0, 1)}
        if not all(per.values()):
            continue
        gap, se = _difference(per[0], per[1])
        name = sequence_name(source)
        rows.append(("000", f"CPPO's KL to the previous policy reduces forgetting ({name}, c = 1 vs 0)",
                     f"forgetting {statistics.fmean(per[0]):+.3f} -> {statistics.fmean(per[1]):+.3f}: "
                     f"{_pm(gap, se)} less", _verdict(se, gap > 2 * se, "holds", "not shown")))  # fmt: skip
    return rows


def claims_markdown(results: Path, suffix: str, budget: str, seconds: float, ran: list[str]) -> str:
    """One row per paper claim the simulator can check: the claim, our figure (mean ± s.e. over seeds) and verdict."""
    rows = []
    fid = _load(results / f"sim_fidelity{suffix}.json")
    stage = _load(results / f"sim_fidelity_stage1{suffix}.json")
    if fid:
        lc = fid["metrics"]["lc_win_rate"]
        s = lc["alpacafarm"]["statistics"]["spearman"]
        rows.append((
            "002", "simulated ranking agrees with AlpacaFarm's (its sim vs human: Spearman 0.98)",
            f"Spearman {s['value']:+.3f} [{s['bootstrap_2.5']:+.3f}, {s['bootstrap_97.5']:+.3f}] on LC win rate, "
            f"{len(lc['alpacafarm']['methods'])} methods", "holds" if s["value"] >= 0.9 else "below 0.9",
        ))  # fmt: skip
        for label, source in (("stage 0", fid), ("stage 1", stage)):
            if not source:
                continue
            for mode, ppo in source["metrics"]["lc_win_rate"]["ppo"].items():
                present = [r for r in ppo["rows"] if r["present"]]
                figures = ", ".join(
                    f"{r['method']} {_pm(r['win_rate_vs_sft'], r['win_rate_vs_sft_se'])}" for r in present
                )
                rows.append((
                    "003", f"segment > token > bandit PPO on LC win rate ({label}, segment = {mode})", figures,
                    {True: "holds", False: "does not hold", None: "–"}[ppo["agrees"]],
                ))  # fmt: skip
    rows += online_dpo_claims(_load(results / f"online_dpo_sim{suffix}.json"))
    rows += continual_claims(_load(results / f"continual_forgetting_ppo{suffix}.json"))
    lines = [
        f"# Fidelity of the simulator: paper claims vs ours ({budget} budget)",
        "",
        f"Steps run by this `benchmarks/fidelity.py` call: {', '.join(ran)} ({seconds / 60:.0f} min); "
        + ("every step ran." if len(ran) == len(STEPS) else "the other steps' results are reused from earlier runs."),
        "",
        "| paper | claim | ours (mean ± s.e. over seeds) | verdict |",
        "|---|---|---|---|",
        *(f"| {p} | {c} | {o} | {v} |" for p, c, o, v in rows),
    ]
    for name in (f"online_dpo_sim{suffix}.json", f"continual_forgetting_ppo{suffix}.json"):
        data = _load(results / name)
        if data and "markdown" in data:
            lines += ["", data["markdown"]]
        elif data and "table" in data:
            lines += ["", f"`{name}`: see the file (table of {len(data['table'])} rows)"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
