"""The results of ``rlhf-ext sim compare`` (paper 002; its Table 2 for reference): where each finished (method, seed)
is stored, their summary over seeds (mean ± standard error) and its reports: ``sim_compare.json``, the Markdown table
``sim_compare.md`` and the win-rate and win-rate/KL plots. The runs themselves are :mod:`rlhf_ext.sim.compare`'s.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rlhf_ext.algos.segment_dense import Granularity
from rlhf_ext.config import to_dict
from rlhf_ext.runtime.io import atomic_write_json, atomic_write_text, machine_info
from rlhf_ext.sim.fidelity import mean_and_stderr
from rlhf_ext.sim.recipe import METHODS, SimCompareRecipe

#: AlpacaFarm's Table 2 (simulated win rate % against Davinci003, training and evaluation in simulation) for the
#: methods that have a counterpart here; SFT 10k is the SFT model all methods start from.
ALPACAFARM_SIM_WINRATE: dict[str, float] = {
    "sft": 36.7,
    "best_of_n": 45.0,
    "expert_iteration": 41.9,
    "feedme": 36.6,
    "reward_conditioning": 32.4,
    "quark": 35.6,
    "dpo": 46.8,
    "bandit_ppo": 46.8,
}
#: The surrogate reward models a seed can have (``segment`` at the recipe's cutoff).
RM_KINDS = tuple(g.value for g in (Granularity.BANDIT, Granularity.SEGMENT, Granularity.TOKEN))
#: The folder of the finished (method, seed) results: the markers of the comparison's run directory.
RESULTS_DIR = "results"


def result_stage(method: str, seed: int) -> str:
    """The run-directory stage of one (method, seed); its marker is :func:`result_path`."""
    return f"{method}/seed-{seed}"


def result_path(root: Path, method: str, seed: int) -> Path:
    return root / RESULTS_DIR / f"{result_stage(method, seed)}.json"


def unparseable_text(counts: dict[str, dict[str, Any]], what: str, settled: str) -> str:
    """``"; unparseable answers: llm0 3 of 40 (7.5%), ... settled by a coin"`` for the annotators that gave any
    (``counts``: :meth:`~rlhf_ext.sim.annotators.AnnotatorPool.label_counts`); empty when none did."""
    bad = {k: v for k, v in counts.items() if v["unparseable"]}
    if not bad:
        return ""
    parts = [f"{k} {v['unparseable']} of {v['labels']} ({v['rate']:.1%})" for k, v in bad.items()]
    return f"; unparseable {what}: {', '.join(parts)}, settled by {settled}"


def summed_counts(counts: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """:meth:`~rlhf_ext.sim.annotators.AnnotatorPool.label_counts` results added up (over seeds)."""
    out: dict[str, dict[str, Any]] = {}
    for c in counts:
        for name, v in c.items():
            total = out.setdefault(name, {"labels": 0, "unparseable": 0})
            total["labels"] += v["labels"]
            total["unparseable"] += v["unparseable"]
    for v in out.values():
        v["rate"] = v["unparseable"] / v["labels"] if v["labels"] else 0.0
    return out


def mean_se(values: list[float | None]) -> tuple[float, float]:
    """:func:`~rlhf_ext.sim.fidelity.mean_and_stderr` of the known ``values`` (None and NaN left out; none: NaN)."""
    known = [v for v in values if v is not None and not math.isnan(v)]
    return mean_and_stderr(known) if known else (float("nan"), float("nan"))


#: Per-seed result keys averaged over seeds in the summary (mean ± s.e.).
SUMMARY_KEYS = (
    "win_rate", "lc_win_rate", "gold_mean", "kl", "avg_length_chars", "segments_per_response", "tokens_per_response",
    "above_cutoff_share", "train_seconds", "eval_seconds",
)  # fmt: skip


def summarise(recipe: SimCompareRecipe, wall_seconds: float | None = None) -> dict[str, Any]:
    """Mean ± standard error over seeds of every method's finished results (methods in :data:`METHODS` order)."""
    root = Path(recipe.output_dir)
    rows = []
    for method in [m for m in METHODS if m in recipe.methods]:
        paths = [result_path(root, method, seed) for seed in recipe.seeds]
        per_seed = [json.loads(path.read_text()) for path in paths if path.exists()]
        if not per_seed:
            continue
        row: dict[str, Any] = {"method": method, "seeds": [r["seed"] for r in per_seed]}
        for key in SUMMARY_KEYS:
            row[key], row[f"{key}_se"] = mean_se([r.get(key) for r in per_seed])
        row["per_seed"] = [
            {k: r.get(k) for k in ("seed", "stderr", "lc_stderr", "num_comparisons", *SUMMARY_KEYS)}
            | ({"curve": r["info"]["curve"]} if "curve" in r.get("info", {}) else {})
            for r in per_seed
        ]
        row["labels"] = per_seed[0].get("labels")
        row["unparseable"] = summed_counts([r.get("unparseable") or {} for r in per_seed])
        row["samples"] = per_seed[0].get("samples")
        row["alpacafarm_sim_winrate"] = ALPACAFARM_SIM_WINRATE.get(method)
        rows.append(row)
    first = next((json.loads(p.read_text()) for p in sorted((root / RESULTS_DIR).rglob("seed-*.json"))), None)
    feedback, rms = {}, {}
    for seed in recipe.seeds:
        path = root / f"seed-{seed}" / "feedback" / "agreement.json"
        if path.exists():
            feedback[str(seed)] = json.loads(path.read_text())
        for kind in RM_KINDS:
            path = root / f"seed-{seed}" / f"rm_{kind}" / "metrics.json"
            if path.exists():
                rms.setdefault(kind, {})[str(seed)] = json.loads(path.read_text()).get("eval", {}).get("eval_accuracy")
    return {
        "recipe": to_dict(recipe),
        "methods": rows,
        "sample_sizes": {
            "eval_prompts": first["num_prompts"] if first else None,
            "samples_per_prompt": first["samples_per_prompt"] if first else None,
            "comparisons_per_seed": first["num_comparisons"] if first else None,
        },
        "reward_model_heldout_accuracy": rms,
        "feedback": feedback,
        "wall_seconds": wall_seconds,
        "machine": machine_info(),
    }


def fmt(mean: float, se: float, digits: int = 3, signed: bool = False) -> str:
    if mean is None or math.isnan(mean):
        return "–"
    m = f"{mean:+.{digits}f}" if signed else f"{mean:.{digits}f}"
    return m if se is None or math.isnan(se) else f"{m} ± {se:.{digits}f}"


def _count(value: int | None) -> str:
    return "–" if value is None else str(value)


def markdown_table(summary: dict[str, Any]) -> str:
    """The comparison as a Markdown table (mean ± s.e. over seeds)."""
    lines = [
        "| method | win rate vs SFT | LC win rate | gold reward | KL to SFT (nats) | length (chars) | segments / "
        "response | tokens / response | seeds | labels | samples | train s | AlpacaFarm sim. win rate vs Davinci003 "
        "(%) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["methods"]:
        af = r["alpacafarm_sim_winrate"]
        lines.append(
            f"| {r['method']} | {fmt(r['win_rate'], r['win_rate_se'])} | "
            f"{fmt(r.get('lc_win_rate'), r.get('lc_win_rate_se'))} | "
            f"{fmt(r['gold_mean'], r['gold_mean_se'], 2, signed=True)} | {fmt(r['kl'], r['kl_se'], 2)} | "
            f"{fmt(r['avg_length_chars'], r['avg_length_chars_se'], 0)} | "
            f"{fmt(r.get('segments_per_response'), r.get('segments_per_response_se'), 1)} | "
            f"{fmt(r.get('tokens_per_response'), r.get('tokens_per_response_se'), 1)} | {len(r['seeds'])} | "
            f"{_count(r.get('labels'))} | {_count(r.get('samples'))} | {r['train_seconds']:.0f} | "
            f"{'–' if af is None else f'{af:.1f}'} |"
        )
    s = summary["sample_sizes"]
    lines += [
        "",
        f"Win rate: fraction of {s['comparisons_per_seed']} comparisons per seed ({s['eval_prompts']} held-out "
        f"prompts x {s['samples_per_prompt']} samples) in which the evaluation annotators prefer the method's "
        "response to the SFT model's (ties 1/2); mean ± standard error over seeds. LC win rate: length-controlled "
        "(AlpacaEval 2.0's GLM on the length difference, read off at zero difference). Segments / response: how the "
        "SFT model's entropies segment the method's evaluation responses at the segment reward model's cutoff "
        "(the reward-hacking monitor's view); tokens / response: their length in tokens. Budget beyond the shared SFT "
        "model: labels = simulated preference labels used (directly or through a surrogate reward model), samples = "
        "responses generated while training, train s = wall-clock seconds.",
    ]
    for r in summary["methods"]:
        if text := unparseable_text(r.get("unparseable") or {}, "evaluation comparisons", "a coin"):
            lines.append(f"\n{r['method']}{text}.")
    lines += feedback_lines(summary)
    return "\n".join(lines)


def feedback_lines(summary: dict[str, Any]) -> list[str]:
    """The feedback's quality in words: gold tie rates of the pairs, label agreement with gold, and the surrogate
    reward models' held-out accuracy (mean over seeds)."""

    def mean(values: list[float]) -> float:
        return mean_se(values)[0]

    fb = [f["labels"] for f in summary.get("feedback", {}).values() if "labels" in f]
    if not fb:
        return []
    pairs = summary["recipe"]["feedback"]["pairs"]
    kind = "two SFT samples per prompt" if pairs == "sft_samples" else "the dataset's pairs"
    out = [
        "",
        f"Feedback ({kind}, {len(fb)} seed(s)): {fb[0]['pairs']} labelled pairs; gold ties "
        f"{mean([f['gold_tied_fraction'] for f in fb]):.1%} of training pairs and "
        f"{mean([f.get('heldout_gold_tied_fraction') for f in fb]):.1%} of held-out pairs; training labels agree "
        f"with gold on {mean([f['labels_agreeing_with_gold'] for f in fb]):.1%} of untied pairs.",
    ]
    counts = summed_counts([f.get("unparseable") or {} for f in fb])
    policy = fb[0].get("unparseable_policy", "coin")
    settled = "a coin (pool.unparseable: drop leaves them out, as AlpacaEval)" if policy == "coin" else "dropping rows"
    total = sum(v["unparseable"] for v in counts.values())
    if counts:  # (results written before the count have none)
        out.append(
            f"Unparseable annotator answers in the training labels: {total} of "
            f"{sum(v['labels'] for v in counts.values())}"
            + (unparseable_text(counts, "per annotator", settled) if total else "")
            + "."
        )
    accs = summary.get("reward_model_heldout_accuracy", {})
    if accs:
        parts = [f"{k} {mean(list(v.values())):.3f}" for k, v in accs.items()]
        out.append(
            f"Surrogate reward models, accuracy on held-out gold-ordered pairs of the same kind (gold ties dropped): "
            f"{', '.join(parts)}."
        )
    return out


def write_reports(summary: dict[str, Any], root: Path) -> dict[str, str]:
    """Write ``sim_compare.json``, ``sim_compare.md`` and the PNG plots into ``root``; returns their paths."""
    paths = {"json": str(root / "sim_compare.json"), "markdown": str(root / "sim_compare.md")}
    atomic_write_json(paths["json"], summary)
    atomic_write_text(paths["markdown"], markdown_table(summary) + "\n")
    try:
        paths.update(plot(summary, root))
    except ImportError:  # matplotlib is optional; the table and JSON are complete without it
        paths["plots"] = "not written: matplotlib is not installed (pip install 'rlhf-ext[plots]')"
    return paths


def plot(summary: dict[str, Any], root: Path) -> dict[str, str]:
    """Two PNGs: win rate per method (mean ± s.e., seeds as dots) and the win rate / KL trade-off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["methods"]
    if not rows:
        return {}
    out = {}

    def save(fig, name: str) -> None:
        fig.tight_layout()
        out[f"{name}_png"] = str(root / f"sim_compare_{name}.png")
        fig.savefig(out[f"{name}_png"], dpi=120)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(rows)), 4))
    x = range(len(rows))
    errs = [0 if math.isnan(r["win_rate_se"]) else r["win_rate_se"] for r in rows]
    ax.bar(x, [r["win_rate"] for r in rows], yerr=errs, color="#4c78a8", capsize=3)
    for i, r in enumerate(rows):
        ax.scatter([i] * len(r["per_seed"]), [p["win_rate"] for p in r["per_seed"]], color="k", s=8, zorder=3)
    ax.axhline(0.5, color="grey", ls="--", lw=1)
    ax.set_xticks(list(x), [r["method"] for r in rows], rotation=35, ha="right")
    ax.set_ylabel("win rate vs SFT (p_eval)")
    ax.set_ylim(0, 1)
    ax.set_title("Simulated win rate against the SFT model (mean ± s.e. over seeds)")
    save(fig, "winrate")

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for r in rows:
        ax.errorbar(
            r["kl"], r["win_rate"], xerr=0 if math.isnan(r["kl_se"]) else r["kl_se"],
            yerr=0 if math.isnan(r["win_rate_se"]) else r["win_rate_se"], fmt="o", capsize=2,
        )  # fmt: skip
        ax.annotate(r["method"], (r["kl"], r["win_rate"]), fontsize=8, xytext=(3, 3), textcoords="offset points")
    ax.axhline(0.5, color="grey", ls="--", lw=1)
    ax.set_xlabel("KL(policy || SFT), nats")
    ax.set_ylabel("win rate vs SFT")
    ax.set_title("Win rate vs KL to the SFT model")
    save(fig, "tradeoff")
    return out
