"""How far the simulator's verdicts can be trusted: its ranking of methods against the published ones.

Two checks on the per-seed results of ``rlhf-ext sim compare`` (``sim_compare.json``), each on the length-controlled
win rate (``lc_win_rate``, AlpacaEval 2.0's GLM read off at zero length difference; the primary metric) and on the
raw win rate:

1. AlpacaFarm (paper 002, section 4.2) reports that its simulated ranking of methods matches the human one with a
   Spearman correlation of 0.98. Here: Spearman's rho and Kendall's tau-b between our win rates against the SFT model
   and AlpacaFarm's simulated win rates against Davinci003 (paper 002, Table 2, left column) over the methods both
   have (our ``bandit_ppo`` is AlpacaFarm's PPO), with a bootstrap over seeds (each method's seeds resampled with
   replacement, fixed RNG seed): the 2.5/97.5 percentiles and the fraction of resamples with a positive correlation.
2. Paper 003's Table 1 order of PPO action spaces (AlpacaEval 2.0 LC win rate: segment > token > bandit) under the
   comparison's protocol (each variant at the settings ``sim tune`` picked), once with the paper's segment mode
   (``segment_ppo``) and once with the robust one (``chunk_ppo``): mean ± s.e. over seeds, and whether our order
   agrees.

Usage::

    python benchmarks/sim_fidelity.py [--results benchmarks/results/sim_compare.json] [--out benchmarks/results]
    python benchmarks/sim_fidelity.py --run [--config sim_compare] [--budget full] [--methods sft,dpo] [--seeds 0,1,2]
    python benchmarks/sim_fidelity.py --before benchmarks/results/sim_compare_before.json   # before -> after table

The default reads an existing results file (no training). ``--run`` first trains and evaluates the comparison with
:func:`rlhf_ext.sim.compare.run_compare` (the function behind ``rlhf-ext sim compare``; finished (method, seed)
results in the recipe's ``output_dir`` are reused), then analyses its summary; ``--budget full`` runs the recipe's
night-long budget (its ``budgets: full`` overrides). ``--before`` adds the correlations of an earlier results file
(e.g. before a change to the simulator) next to the current ones.

Writes ``OUT/sim_fidelity.json`` and ``OUT/sim_fidelity.md`` and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from rlhf_ext.sim.fidelity import (  # noqa: E402
    PAPER003_TABLE1_ALPACAEVAL_LC,
    bootstrap_rank_correlation,
    kendall_tau_b,
    mean_and_stderr,
    ordering_agrees,
    spearman_rho,
)

#: AlpacaFarm's reported Spearman correlation between simulated and human rankings (paper 002, section 4.2).
ALPACAFARM_REPORTED_SPEARMAN = 0.98
#: Paper 003's Table 1 order of the PPO action spaces, best first.
PAPER003_ORDER = tuple(sorted(PAPER003_TABLE1_ALPACAEVAL_LC, key=PAPER003_TABLE1_ALPACAEVAL_LC.get, reverse=True))


#: The metrics analysed, primary first.
METRICS = ("lc_win_rate", "win_rate")
#: Our two segment-level modes, each put in paper 003's "segment" row in turn.
SEGMENT_MODES = ("segment_ppo", "chunk_ppo")


def per_seed_win_rates(summary: dict[str, Any], metric: str = "lc_win_rate") -> dict[str, list[float]]:
    """Each method's per-seed ``metric`` against the SFT model, from a ``sim_compare.json`` summary (methods whose
    results predate the metric are left out)."""
    out = {}
    for row in summary["methods"]:
        values = [r.get(metric) for r in row["per_seed"]]
        if values and all(v is not None for v in values):
            out[row["method"]] = [float(v) for v in values]
    return out


def alpacafarm_table(
    win_rates: dict[str, list[float]], reference: dict[str, float], num_resamples: int, seed: int
) -> dict[str, Any]:
    """Rank correlations (point estimate on the seed means, bootstrap over seeds) with AlpacaFarm's Table 2."""
    shared = [m for m in reference if m in win_rates]
    ours = [mean_and_stderr(win_rates[m])[0] for m in shared]
    theirs = [reference[m] for m in shared]
    per_seed = [win_rates[m] for m in shared]
    statistics = {}
    for name, statistic, function in (
        ("spearman", "spearman", spearman_rho),
        ("kendall_tau_b", "kendall", kendall_tau_b),
    ):
        interval = bootstrap_rank_correlation(per_seed, theirs, statistic, num_resamples, seed)
        statistics[name] = {
            "value": function(ours, theirs),
            "bootstrap_2.5": interval.low,
            "bootstrap_97.5": interval.high,
            "fraction_positive": interval.fraction_positive,
            "undefined_resamples": interval.num_undefined,
        }
    return {
        "methods": [
            {
                "method": m,
                "win_rate_vs_sft": mean_and_stderr(win_rates[m])[0],
                "win_rate_vs_sft_se": mean_and_stderr(win_rates[m])[1],
                "seeds": len(win_rates[m]),
                "alpacafarm_sim_winrate_vs_davinci003": reference[m],
            }
            for m in shared
        ],
        "missing": [m for m in reference if m not in win_rates],
        "statistics": statistics,
        "bootstrap": {"resamples": num_resamples, "rng_seed": seed, "unit": "seeds, per method, with replacement"},
        "alpacafarm_reported_spearman_sim_vs_human": ALPACAFARM_REPORTED_SPEARMAN,
    }


def ppo_table(win_rates: dict[str, list[float]], segment_mode: str = "segment_ppo") -> dict[str, Any]:
    """Paper 003's Table 1 order against ours, over the PPO methods present in the results, with ``segment_mode``
    (``segment_ppo`` or ``chunk_ppo``) in the segment row."""
    rows = []
    means = {}
    stderrs = {}
    for paper_name in PAPER003_ORDER:
        m = segment_mode if paper_name == "segment_ppo" else paper_name
        if m not in win_rates:
            rows.append(
                {"method": m, "present": False, "paper003_alpacaeval_lc": PAPER003_TABLE1_ALPACAEVAL_LC[paper_name]}
            )
            continue
        mean, se = mean_and_stderr(win_rates[m])
        means[m], stderrs[m] = mean, se
        rows.append(
            {
                "method": m,
                "present": True,
                "win_rate_vs_sft": mean,
                "win_rate_vs_sft_se": se,
                "seeds": len(win_rates[m]),
                "paper003_alpacaeval_lc": PAPER003_TABLE1_ALPACAEVAL_LC[paper_name],
            }
        )
    order = [segment_mode if m == "segment_ppo" else m for m in PAPER003_ORDER]
    ours = sorted(means, key=means.get, reverse=True)
    present = [m for m in order if m in means]
    differences = [
        {
            "better_in_paper003": a,
            "worse_in_paper003": b,
            "difference": means[a] - means[b],
            "difference_se": math.sqrt(stderrs[a] ** 2 + stderrs[b] ** 2),
        }
        for a, b in zip(present, present[1:])
    ]
    return {
        "differences": differences,
        "rows": rows,
        "paper003_order": order,
        "our_order": ours,
        "agrees": ordering_agrees(means, order),
    }


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:+.{digits}f}"


def _pm(mean: float, se: float) -> str:
    return f"{mean:.3f}" if math.isnan(se) else f"{mean:.3f} ± {se:.3f}"


METRIC_NAMES = {"lc_win_rate": "length-controlled win rate", "win_rate": "raw win rate"}


def markdown(report: dict[str, Any]) -> str:
    return "\n".join(markdown_metric(report, metric) for metric in METRICS if metric in report["metrics"]) + (
        f"\nSource: {report['source']}\n"
    )


def markdown_metric(report: dict[str, Any], metric: str) -> str:
    af = report["metrics"][metric]["alpacafarm"]
    metric_name = METRIC_NAMES[metric]
    lines = [
        f"## Simulator vs AlpacaFarm on the {metric_name} (paper 002, Table 2: simulated win rate vs Davinci003)",
        "",
        f"| method | our {metric_name} vs SFT | seeds | AlpacaFarm sim. win rate (%) |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['method']} | {_pm(r['win_rate_vs_sft'], r['win_rate_vs_sft_se'])} | {r['seeds']} | "
        f"{r['alpacafarm_sim_winrate_vs_davinci003']:.1f} |"
        for r in af["methods"]
    ]
    b = af["bootstrap"]
    lines += [
        "",
        f"| statistic | value | bootstrap 2.5% | bootstrap 97.5% | P(> 0) over {b['resamples']} resamples |",
        "|---|---|---|---|---|",
    ]
    for name, label in (("spearman", "Spearman rho"), ("kendall_tau_b", "Kendall tau-b")):
        s = af["statistics"][name]
        lines.append(
            f"| {label} | {_fmt(s['value'])} | {_fmt(s['bootstrap_2.5'])} | {_fmt(s['bootstrap_97.5'])} | "
            f"{s['fraction_positive']:.3f} |"
        )
    if "before" in report and metric in report["before"]["metrics"]:
        before = report["before"]["metrics"][metric]["alpacafarm"]["statistics"]
        lines += [
            "",
            f"Before -> after (before: {report['before']['source']}):",
            "",
            "| statistic | before | before 95% bootstrap | after | after 95% bootstrap |",
            "|---|---|---|---|---|",
        ]
        for name, label in (("spearman", "Spearman rho"), ("kendall_tau_b", "Kendall tau-b")):
            x, y = before[name], af["statistics"][name]
            lines.append(
                f"| {label} | {_fmt(x['value'])} | {_fmt(x['bootstrap_2.5'])}..{_fmt(x['bootstrap_97.5'])} | "
                f"{_fmt(y['value'])} | {_fmt(y['bootstrap_2.5'])}..{_fmt(y['bootstrap_97.5'])} |"
            )
    lines += [
        "",
        f"{len(af['methods'])} shared methods (our bandit_ppo = AlpacaFarm's PPO); bootstrap: each method's seeds "
        f"resampled with replacement, RNG seed {b['rng_seed']}. AlpacaFarm reports Spearman "
        f"{af['alpacafarm_reported_spearman_sim_vs_human']} between its simulated and human rankings."
        + (f" Missing from the results: {', '.join(af['missing'])}." if af["missing"] else ""),
    ]
    verdict = {True: "agrees", False: "disagrees", None: "cannot be checked (fewer than two methods present)"}
    for mode, ppo in report["metrics"][metric]["ppo"].items():
        lines += [
            "",
            f"## PPO action spaces on the {metric_name}, segment row = {mode} (paper 003, Table 1: AlpacaEval 2.0 LC)",
            "",
            f"| method | our {metric_name} vs SFT | seeds | paper 003 LC (%) |",
            "|---|---|---|---|",
        ]
        for r in ppo["rows"]:
            ours = _pm(r["win_rate_vs_sft"], r["win_rate_vs_sft_se"]) if r["present"] else "not in the results"
            seeds = r["seeds"] if r["present"] else "–"
            lines.append(f"| {r['method']} | {ours} | {seeds} | {r['paper003_alpacaeval_lc']:.2f} |")
        lines += [
            "",
            f"Paper 003's order: {' > '.join(ppo['paper003_order'])}; ours (present methods): "
            f"{' > '.join(ppo['our_order']) or '–'}; the order {verdict[ppo['agrees']]}."
            + "".join(
                f" {d['better_in_paper003']} − {d['worse_in_paper003']}: {_fmt(d['difference'])} ± "
                f"{d['difference_se']:.3f} (s.e. of the difference of means)."
                for d in ppo["differences"]
            ),
        ]
    return "\n".join(lines) + "\n"


def analyse(summary: dict[str, Any], resamples: int, bootstrap_seed: int) -> dict[str, Any]:
    """Per metric (:data:`METRICS` present in the results): the AlpacaFarm correlations and the PPO order tables."""
    from rlhf_ext.sim.report import ALPACAFARM_SIM_WINRATE

    out = {}
    for metric in METRICS:
        win_rates = per_seed_win_rates(summary, metric)
        if not win_rates:
            continue
        out[metric] = {
            "alpacafarm": alpacafarm_table(win_rates, ALPACAFARM_SIM_WINRATE, resamples, bootstrap_seed),
            "ppo": {mode: ppo_table(win_rates, mode) for mode in SEGMENT_MODES},
        }
    return out


def run_comparison(
    config: str, methods: str | None, seeds: str | None, overrides: list[str], budget: str | None = None
) -> dict[str, Any]:
    """Train and evaluate the comparison (:func:`rlhf_ext.sim.compare.run_compare`) and return its summary."""
    from rlhf_ext.recipes import recipe_path
    from rlhf_ext.sim.compare import run_compare
    from rlhf_ext.sim.recipe import load_compare_recipe

    extra = list(overrides)
    if methods is not None:
        extra.append(f"methods=[{methods}]")
    if seeds is not None:
        extra.append(f"seeds=[{seeds}]")
    recipe = load_compare_recipe(recipe_path(config), extra, budget)
    return run_compare(recipe, progress=lambda m: print(m, file=sys.stderr))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/results/sim_compare.json", help="sim_compare.json to read")
    parser.add_argument("--out", default="benchmarks/results", help="folder of NAME.json / .md")
    parser.add_argument("--name", default="sim_fidelity", help="file name of the report (without extension)")
    parser.add_argument("--run", action="store_true", help="run the comparison first (trains every method)")
    parser.add_argument("--config", default="sim_compare", help="with --run: recipe YAML or packaged recipe name")
    parser.add_argument("--methods", default=None, help="with --run: comma-separated subset of the methods")
    parser.add_argument("--seeds", default=None, help="with --run: comma-separated seeds")
    parser.add_argument("--budget", default=None, help="with --run: a named budget of the recipe (e.g. full)")
    parser.add_argument("--before", default=None, help="an earlier sim_compare.json to compare correlations with")
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    parser.add_argument("--bootstrap-seed", type=int, default=0, help="RNG seed of the bootstrap")
    parser.add_argument("overrides", nargs="*", help="with --run: recipe overrides key=value")
    args = parser.parse_args(argv)
    if args.overrides and not args.run:
        parser.error("recipe overrides apply only with --run")

    if args.run:
        summary = run_comparison(args.config, args.methods, args.seeds, args.overrides, args.budget)
        source = f"rlhf_ext.sim.compare.run_compare, recipe {args.config}" + (
            f", budget {args.budget}" * bool(args.budget)
        )
    else:
        summary = json.loads(Path(args.results).read_text())
        source = args.results
    report = {"source": source, "metrics": analyse(summary, args.resamples, args.bootstrap_seed)}
    if args.before:
        before = json.loads(Path(args.before).read_text())
        report["before"] = {"source": args.before, "metrics": analyse(before, args.resamples, args.bootstrap_seed)}
    from rlhf_ext.runtime.io import atomic_write_json, atomic_write_text

    text = markdown(report)
    out = Path(args.out)
    atomic_write_json(out / f"{args.name}.json", report)
    atomic_write_text(out / f"{args.name}.md", text)
    print(text)
    return report


if __name__ == "__main__":
    main()
