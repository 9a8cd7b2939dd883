"""``report.html`` and ``metrics.json`` of the demo pipeline.

The page is one self-contained HTML file (images inline, no scripts): the PPO-vs-SFT table (:func:`metric_rows`),
the PPO reward and KL curves (a moving average over faint raw points), SFT and PPO samples for the same held-out
prompts split into segments and coloured on one reward scale, and the provenance (:func:`collect_provenance`).
``metrics.json`` holds the same numbers under machine-readable keys, the provenance under ``"provenance"``.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_ext.runtime.io import atomic_write_json, atomic_write_text

if TYPE_CHECKING:
    from rlhf_ext.runtime.token_scores import SegmentView

#: Steps averaged by the smoothed PPO curves (a trailing window: the first points average the steps so far).
SMOOTHING_WINDOW = 5
#: Packages whose versions the provenance records (distribution names), besides Python.
PROVENANCE_PACKAGES = ("rlhf-ext", "torch", "transformers", "trl")
#: Opacity of a segment whose |reward| is the largest shown; smaller rewards fade linearly towards white.
MAX_SEGMENT_ALPHA = 0.75
POSITIVE_RGB = "22,163,74"  # green
NEGATIVE_RGB = "220,38,38"  # red
MISSING = "—"

PAGE_CSS = """
body{font-family:system-ui,sans-serif;max-width:72rem;margin:2rem auto;padding:0 1rem;line-height:1.5;color:#222}
h1{margin-bottom:.2rem}h2{margin-top:2.2rem;border-bottom:1px solid #ddd;padding-bottom:.2rem}
table{border-collapse:collapse;margin:.6rem 0}
th,td{padding:.3rem .7rem;border-bottom:1px solid #e4e4e4;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.num{text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums}
td.shared{text-align:center}#metrics td:first-child{white-space:nowrap}
tr.section td{background:#fafafa;font-weight:600;color:#555}
.note,.meta{color:#666;font-size:.88rem}
.legend{display:flex;align-items:center;gap:.6rem;margin:.6rem 0 .2rem}
.legend .bar{width:22rem;height:1.1rem;border:1px solid #ccc;text-align:center;font-size:.75rem;color:#555}
.pair{border:1px solid #ddd;border-radius:6px;padding:.8rem;margin:1rem 0}
.prompt{color:#555;white-space:pre-wrap;margin-bottom:.5rem}
.columns{display:grid;grid-template-columns:1fr 1fr;gap:1rem}
.sample h3{margin:.2rem 0;font-size:1rem}.resp{line-height:1.8}
.seg{border-right:2px solid #fff;padding:1px 0;white-space:pre-wrap}
pre{background:#f6f6f6;padding:.8rem;overflow-x:auto;font-size:.85rem}
"""


# --------------------------------------------------------------------------------------------------- curves
def moving_average(values: Sequence[float], window: int = SMOOTHING_WINDOW) -> list[float]:
    """Trailing moving average: point ``i`` is the mean of ``values[max(0, i - window + 1) : i + 1]``."""
    if window < 1:
        raise ValueError(f"the moving-average window must be >= 1, got {window}")
    return [sum(values[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in range(len(values))]


def curve_png(curve: list[dict[str, Any]], window: int = SMOOTHING_WINDOW) -> bytes:
    """PNG of the PPO reward (with KL penalty) and KL per step: raw points faint, their moving average bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in curve]
    panels = (
        ("reward", "PPO reward (dense segment reward - KL penalty)", "reward per response", "tab:blue"),
        ("segment/kl", "KL to the SFT model", "KL per response (nats)", "tab:red"),
    )
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, (key, title, ylabel, colour) in zip(axes, panels):
        raw = [row[key] for row in curve]
        ax.plot(steps, raw, marker="o", markersize=3, linewidth=0.8, color=colour, alpha=0.3, label="per step")
        smooth = moving_average(raw, window)
        ax.plot(steps, smooth, linewidth=2.2, color=colour, label=f"moving average ({window} steps)")
        ax.set(title=title, xlabel="PPO step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


# ----------------------------------------------------------------------------------------------- provenance
def package_versions() -> dict[str, str]:
    """Installed versions of :data:`PROVENANCE_PACKAGES` ("not installed" for a missing one) and of Python."""
    versions = {}
    for name in PROVENANCE_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    versions["python"] = platform.python_version()
    return versions


def package_source() -> dict[str, str]:
    """Which rlhf-ext ran: ``{"git_commit": ...}`` (``-dirty`` with uncommitted changes) from a git checkout, else
    the ``wheel_sha256`` pip recorded for the wheel it installed (PEP 610 ``direct_url.json``), else the sha256 of
    the installed distribution's ``RECORD`` (the list of its files with their hashes)."""
    root = Path(__file__).resolve().parents[2]
    if (root / ".git").exists():
        try:
            git = ["git", "-C", str(root)]
            head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10)
            dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                   text=True, timeout=10).stdout.strip()  # fmt: skip
            return {"git_commit": head.stdout.strip() + ("-dirty" if dirty else "")}
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        dist = metadata.distribution("rlhf-ext")
    except metadata.PackageNotFoundError:
        return {}
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    archive = direct.get("archive_info", {})
    sha = (archive.get("hashes") or {}).get("sha256") or archive.get("hash", "").removeprefix("sha256=")
    if sha:
        return {"wheel_sha256": sha}
    record = dist.read_text("RECORD")
    return {"record_sha256": hashlib.sha256(record.encode()).hexdigest()} if record else {}


def directory_sha256(path: str | os.PathLike) -> str:
    """sha256 over the relative paths and contents of every file under ``path`` (sorted): the data a run used."""
    digest = hashlib.sha256()
    root = Path(path)
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(file.relative_to(root).as_posix().encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def parameter_count(model_dir: str | os.PathLike, reward_model: bool = False) -> int:
    """Parameters of the checkpoint in ``model_dir`` (shared / tied weights once), from its config alone: the model
    is built on the meta device, so no weights are read. ``reward_model``: a sequence-classification model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(str(model_dir))
    model_class = AutoModelForSequenceClassification if reward_model else AutoModelForCausalLM
    with torch.device("meta"):
        model = model_class.from_config(config)
    return sum(p.numel() for p in model.parameters())


def collect_provenance(
    recipe: Mapping[str, Any],
    seed: int,
    parameters: Mapping[str, int],
    stage_seconds: Mapping[str, float | None],
    data_dir: str | os.PathLike,
) -> dict[str, Any]:
    """The provenance block of the report and of ``metrics.json``: ``recipe`` as ``dataclasses.asdict`` gives it,
    ``parameters`` per model role, ``stage_seconds`` per stage (``None``: not timed; the total is their sum) and the
    sha256 of ``data_dir`` (:func:`directory_sha256`)."""
    timed = [s for s in stage_seconds.values() if s is not None]
    return {
        "command_line": shlex.join(sys.argv),
        "package": package_source(),
        "data_sha256": directory_sha256(data_dir),
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "seed": seed,
        "host_cpus": os.cpu_count(),
        "versions": package_versions(),
        "parameters": dict(parameters),
        "stage_seconds": dict(stage_seconds),
        "total_seconds": round(sum(timed), 1),
        "recipe": dict(recipe),
    }


# -------------------------------------------------------------------------------------------------- samples
def sample_segment_views(
    reward_model: str, policies: Mapping[str, str], prompts: list[str], max_new_tokens: int, seed: int = 0
) -> dict[str, list[SegmentView]]:
    """For each policy (name -> checkpoint), one sampled response per prompt, split into segments and scored by the
    one reward model ``reward_model``. Policy ``i`` samples with ``seed + i``: independent samples, as
    :func:`rlhf_ext.sim.win_rate` draws them (one seed would give two similar policies the same opening tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_ext.runtime.token_scores import SegmentScorer

    scorer = SegmentScorer(reward_model)
    views = {}
    for offset, (name, policy_dir) in enumerate(policies.items()):
        tok = AutoTokenizer.from_pretrained(policy_dir)
        model = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
        tok.padding_side = "left"
        enc = tok(prompts, return_tensors="pt", padding=True)
        torch.manual_seed(seed + offset)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        views[name] = [scorer.score(p, t) for p, t in zip(prompts, texts)]
    return views


# -------------------------------------------------------------------------------------------------- metrics
def report_metrics(results: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers of ``metrics.json`` (without the provenance) from the demo's stage results."""
    ev = results["eval"]["ppo_vs_sft"]
    rm_eval = results["eval"].get("rm", {})
    interval, verdict = win_rate_verdict(ev["win_rate"], ev["stderr"])
    return {
        "win_rate_ppo_vs_sft": ev["win_rate"],
        "win_rate_stderr": ev["stderr"],
        "win_rate_interval95": interval,
        "win_rate_verdict": verdict,
        "comparisons": ev["num_comparisons"],
        "wins_ties_losses": [ev.get("wins"), ev.get("ties"), ev.get("losses")],
        "judge": ev.get("judge"),
        "gold_reward_ppo": ev["gold_mean"],
        "gold_reward_ppo_stderr": ev.get("gold_stderr"),
        "gold_reward_sft": ev["ref_gold_mean"],
        "mean_length_tokens_ppo": ev.get("avg_length_tokens"),
        "mean_length_tokens_sft": ev.get("ref_avg_length_tokens"),
        "mean_length_chars_ppo": ev["avg_length_chars"],
        "mean_length_chars_sft": ev["ref_avg_length_chars"],
        "truncated_fraction_ppo": ev.get("truncated_fraction"),
        "kl_ppo_to_sft": ev["kl"],
        "kl_stderr": ev.get("kl_stderr"),
        "kl_method": ev.get("kl_method"),
        "rm_heldout_accuracy": rm_eval.get("eval_accuracy"),
        "rm_segments_per_response": rm_eval.get("eval_segments_per_response"),
        "annotator_label_agreement": results["labels"]["agreement_with_generator_label"],
        "normalizer": {
            k: results["normalizer"].get(k) for k in ("kind", "w_mu", "b_mu", "w_sigma", "b_sigma", "r2_mean")
        },
        "ppo_curve": results["ppo"]["curve"],
        "stage_seconds": {k: v.get("seconds") for k, v in results.items() if isinstance(v, dict) and "seconds" in v},
    }


def win_rate_verdict(rate: float, stderr: float) -> tuple[list[float], str]:
    """The win rate's normal 95% interval ``rate ± 1.96 s.e.`` and what it says against 50% (no difference): within
    one standard error, inside the interval (not significant at 5%), or outside it (PPO better / worse than SFT)."""
    lo, hi = rate - 1.96 * stderr, rate + 1.96 * stderr
    if abs(rate - 0.5) <= stderr:
        verdict = "within one standard error of 50%: no evidence of a difference from SFT"
    elif lo <= 0.5 <= hi:
        verdict = "50% lies inside the 95% interval: not significant at the 5% level"
    else:
        verdict = f"50% lies outside the 95% interval: PPO {'beats' if rate > 0.5 else 'loses to'} SFT (5% level)"
    return [lo, hi], verdict


#: What the report says about each KL estimate (``WinRate.kl_method``), ± its standard error over PPO's samples.
KL_DESCRIPTIONS = {
    "exact_token_sum": "exact KL of the next-token distributions, Σ_t KL(π_PPO(·|x, y<t) || π_SFT(·|x, y<t)), summed "
    "along each of PPO's own samples (never negative)",
    "sequence_log_ratio": "mean log-ratio log π_PPO(y|x) - log π_SFT(y|x) over PPO's own samples (unbiased; can be "
    "negative on few samples)",
}


@dataclass
class MetricRow:
    """One row of the metrics table; ``sft is None``: ``ppo`` holds the one value both policies share (the cell
    spans both columns)."""

    label: str
    ppo: str
    sft: str | None
    unit: str
    note: str


def _known(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _num(value: Any, spec: str, stderr: Any = None) -> str:
    """``value`` formatted with ``spec`` (and ``± stderr``), or an em dash when unknown."""
    if not _known(value):
        return MISSING
    text = format(value, spec)
    return f"{text} ± {format(stderr, spec.lstrip('+'))}" if _known(stderr) else text


def _percent(fraction: Any, stderr: Any = None) -> str:
    """A fraction as ``61.0% ± 6.1%`` (or an em dash when unknown)."""
    if not _known(fraction):
        return MISSING
    return f"{100 * fraction:.1f}%" + (f" ± {100 * stderr:.1f}%" if _known(stderr) else "")


def metric_rows(metrics: Mapping[str, Any]) -> list[MetricRow]:
    """The metrics table: PPO and SFT side by side, then the figures both share (``sft is None``)."""
    n = metrics["comparisons"]
    wins, ties, losses = metrics.get("wins_ties_losses") or [None, None, None]
    counts = f": {wins} wins, {ties} ties, {losses} losses" if wins is not None else ""
    norm = metrics.get("normalizer") or {}
    judge = "the gold scorer" if metrics.get("judge") == "gold" else "the simulated annotator pool without label noise"
    lo_hi = metrics.get("win_rate_interval95")
    interval = f"95% interval {_percent(lo_hi[0])} to {_percent(lo_hi[1])}" if lo_hi else "95% interval " + MISSING
    return [
        MetricRow("Win rate against SFT", _percent(metrics["win_rate_ppo_vs_sft"], metrics["win_rate_stderr"]),
                  "50% (reference)", "% of comparisons",
                  f"{n} comparisons on held-out prompts{counts}, judged by {judge}; a tie counts 1/2; ± one "
                  f"standard error (clustered by prompt); {interval}: {metrics.get('win_rate_verdict', MISSING)}"),
        MetricRow("Gold reward", _num(metrics["gold_reward_ppo"], "+.3f", metrics.get("gold_reward_ppo_stderr")),
                  _num(metrics["gold_reward_sft"], "+.3f"), "gold score per response",
                  "mean of the task's hidden gold scorer over the same evaluation responses"),
        MetricRow("Response length", _num(metrics.get("mean_length_tokens_ppo"), ".1f"),
                  _num(metrics.get("mean_length_tokens_sft"), ".1f"), "tokens",
                  "mean generated tokens per response, EOS included"),
        MetricRow("Response length (characters)", _num(metrics["mean_length_chars_ppo"], ".0f"),
                  _num(metrics["mean_length_chars_sft"], ".0f"), "characters", "mean decoded characters per response"),
        MetricRow("Responses cut at the token limit", _percent(metrics.get("truncated_fraction_ppo")), MISSING,
                  "% of responses", "responses that reached max_completion_length without an EOS"),
        MetricRow("KL to the SFT model", _num(metrics["kl_ppo_to_sft"], ".3f", metrics.get("kl_stderr")),
                  "0 (reference)", "nats per response",
                  KL_DESCRIPTIONS.get(metrics.get("kl_method"), KL_DESCRIPTIONS["sequence_log_ratio"])),
        MetricRow("Reward-model held-out accuracy", _percent(metrics.get("rm_heldout_accuracy")), None,
                  "% of held-out pairs", "pairs whose chosen response the segment reward model scores higher"),
        MetricRow("Segments per response", _num(metrics.get("rm_segments_per_response"), ".1f"), None, "segments",
                  "mean number of entropy segments in a held-out response"),
        MetricRow("Annotator agreement", _percent(metrics["annotator_label_agreement"]), None, "% of training pairs",
                  "training labels of the simulated annotator pool (with its label flips) that agree with the "
                  "generator's chosen response"),
        MetricRow("Normalizer fit (R² of the mean)", _num(norm.get("r2_mean"), ".3f"), None, "R²",
                  f"location-aware normalizer, kind {norm.get('kind') or MISSING}: how well a line in the segment "
                  "position explains the mean segment reward"),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------------- page
def _esc(value: Any) -> str:
    return html.escape(str(value))


def _metrics_table(rows: list[MetricRow]) -> str:
    head = "<tr><th>Metric</th><th>PPO</th><th>SFT</th><th>Unit</th><th>How it is measured</th></tr>"
    body = []
    shared_started = False
    for row in rows:
        if row.sft is None and not shared_started:
            body.append('<tr class="section"><td colspan="5">Shared by both policies</td></tr>')
            shared_started = True
        values = (
            f'<td class="num shared" colspan="2">{_esc(row.ppo)}</td>'
            if row.sft is None
            else f'<td class="num">{_esc(row.ppo)}</td><td class="num">{_esc(row.sft)}</td>'
        )
        body.append(
            f"<tr><td>{_esc(row.label)}</td>{values}<td>{_esc(row.unit)}</td>"
            f'<td class="note">{_esc(row.note)}</td></tr>'
        )
    return f'<table id="metrics"><thead>{head}</thead><tbody>{"".join(body)}</tbody></table>'


def segment_colour(reward: float, scale: float) -> str:
    """Background of a segment: green for a positive reward, red for a negative one, more opaque the larger
    ``|reward| / scale`` (saturating at ``scale``)."""
    return _rgba(POSITIVE_RGB if reward >= 0 else NEGATIVE_RGB, min(abs(reward) / scale, 1.0) * MAX_SEGMENT_ALPHA)


def _rgba(rgb: str, alpha: float) -> str:
    return f"rgba({rgb},{alpha:.2f})"


def colour_scale(samples: Mapping[str, list[SegmentView]]) -> float:
    """The reward shown at full colour: the largest ``|segment reward|`` among all samples (at least 1e-6)."""
    rewards = [abs(r) for views in samples.values() for view in views for r in view.rewards]
    return max(rewards, default=0.0) or 1e-6


def _legend(scale: float) -> str:
    """The colour bar of :func:`segment_colour` from ``-scale`` (full red) through 0 (white) to ``+scale`` (full
    green), and what it means."""
    full_red, clear_red = _rgba(NEGATIVE_RGB, MAX_SEGMENT_ALPHA), _rgba(NEGATIVE_RGB, 0)
    clear_green, full_green = _rgba(POSITIVE_RGB, 0), _rgba(POSITIVE_RGB, MAX_SEGMENT_ALPHA)
    gradient = f"linear-gradient(to right,{full_red},{clear_red} 50%,{clear_green} 50%,{full_green})"
    return (
        '<div id="legend"><div class="legend">'
        f'<span>{-scale:+.2f} (red)</span><span class="bar" style="background:{gradient}">0</span>'
        f"<span>{scale:+.2f} (green)</span></div>"
        '<p class="note">Each coloured block is one segment: the span from one high-entropy token of the SFT model '
        "to the next. Its colour is the segment reward, the reward model's raw score at the segment's last token "
        "(before normalisation): <b>green</b> positive, <b>red</b> negative, white near zero; the intensity grows "
        f"linearly with |reward| up to {scale:.2f}, the largest |reward| among the samples below. Both columns use "
        "this one scale. Hover a segment for its reward; e(x, y) is the reward model's score of the whole response "
        "(segment rewards aggregated).</p></div>"
    )


def _sample_cell(policy: str, view: SegmentView, scale: float) -> str:
    spans = "".join(
        f'<span class="seg" style="background:{segment_colour(r, scale)}" '
        f'title="reward {r:+.3f}, start entropy {h:.2f}">{_esc(s)}</span>'
        for s, r, h in zip(view.segments, view.rewards, view.start_entropy)
    )
    return (
        f'<div class="sample" data-policy="{_esc(policy)}"><h3>{_esc(policy)}</h3><div class="resp">{spans}</div>'
        f'<div class="meta">e(x, y) = {view.evaluation:+.3f} &middot; {len(view.segments)} '
        f"segment{'' if len(view.segments) == 1 else 's'}</div></div>"
    )


def _samples_section(samples: Mapping[str, list[SegmentView]]) -> str:
    if not samples or not any(samples.values()):
        return ""
    scale = colour_scale(samples)
    policies = list(samples)
    pairs = []
    for i, first in enumerate(samples[policies[0]]):
        cells = "".join(_sample_cell(p, samples[p][i], scale) for p in policies)
        pairs.append(f'<div class="pair"><div class="prompt">{_esc(first.prompt)}</div><div class="columns">{cells}'
                     "</div></div>")  # fmt: skip
    return (
        f'<section id="samples"><h2>{_esc(" and ".join(policies))} samples on the same held-out prompts</h2>'
        f"<p>One sampled response of each policy per prompt (independent samples), split into segments and "
        f"coloured by the same segment reward model.</p>{_legend(scale)}{''.join(pairs)}</section>"
    )


def _curves_section(curve: list[dict[str, Any]]) -> str:
    if not curve:
        return ""
    png = base64.b64encode(curve_png(curve)).decode()
    return (
        '<section id="curves"><h2>PPO training curves</h2>'
        f'<img alt="PPO reward and KL per step" src="data:image/png;base64,{png}" style="max-width:100%"/>'
        f'<p class="note">Faint points: the value logged at each PPO step (mean over the step\'s batch); bold line: '
        f"their moving average over the last {SMOOTHING_WINDOW} steps.</p></section>"
    )


def _provenance_section(provenance: Mapping[str, Any]) -> str:
    import yaml

    versions = provenance["versions"]
    package = provenance.get("package") or {}
    facts = [
        ("Command line", provenance.get("command_line", MISSING)),
        *((f"rlhf-ext {key.replace('_', ' ')}", value) for key, value in package.items()),
        ("Data sha256", provenance.get("data_sha256", MISSING)),
        ("Date", provenance["date"]),
        ("Seed", provenance["seed"]),
        ("Host CPUs", provenance["host_cpus"]),
        *((f"{name} version", version) for name, version in versions.items()),
        *((f"Parameters: {role}", f"{n:,} ({n / 1e6:.2f} M)") for role, n in provenance["parameters"].items()),
    ]
    fact_rows = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in facts)
    stage_rows = "".join(
        f'<tr><td>{_esc(stage)}</td><td class="num">{_esc(MISSING if s is None else f"{s:.1f} s")}</td></tr>'
        for stage, s in provenance["stage_seconds"].items()
    )
    stage_rows += f'<tr><th>total</th><th class="num">{provenance["total_seconds"]:.1f} s</th></tr>'
    recipe_yaml = yaml.safe_dump(provenance["recipe"], sort_keys=False, default_flow_style=False)
    return (
        '<section id="provenance"><h2>Provenance</h2>'
        f'<table class="facts">{fact_rows}</table>'
        "<h3>Wall time per stage</h3>"
        '<p class="note">A stage reused from an earlier run in the same directory shows the time it took then; the '
        "total is the sum over the stages.</p>"
        f'<table class="stages"><thead><tr><th>Stage</th><th>Wall time</th></tr></thead><tbody>{stage_rows}</tbody>'
        f'</table><h3>Resolved recipe</h3><pre class="recipe">{_esc(recipe_yaml)}</pre></section>'
    )


def render_report(
    metrics: Mapping[str, Any], samples: Mapping[str, list[SegmentView]], provenance: Mapping[str, Any]
) -> str:
    """The HTML page (see the module docstring); ``samples``: policy name -> one :class:`SegmentView` per prompt (the
    same prompts in the same order for every policy)."""
    body = (
        "<h1>rlhf-ext demo</h1><p>Segment-level RLHF (paper 003) on a synthetic preference task (paper 000), judged "
        "by a simulated annotator pool (paper 002): a PPO policy trained from the SFT policy, compared with it.</p>"
        '<section id="results"><h2>PPO against SFT</h2>'
        f"{_metrics_table(metric_rows(metrics))}</section>"
        + _curves_section(metrics.get("ppo_curve") or [])
        + _samples_section(samples)
        + _provenance_section(provenance)
    )
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'><title>rlhf-ext demo report</title>"
        f"<style>{PAGE_CSS}</style></head><body>{body}</body></html>"
    )


def write_report(
    out: Path, results: Mapping[str, Any], samples: Mapping[str, list[SegmentView]], provenance: Mapping[str, Any]
) -> dict[str, str]:
    """Write ``out/report.html`` and ``out/metrics.json`` (with ``"provenance"``) from the demo's stage ``results``
    (``eval``, ``labels``, ``normalizer``, ``ppo`` ...), the ``samples`` of :func:`sample_segment_views` and the
    ``provenance`` of :func:`collect_provenance`; returns their paths."""
    metrics = {**report_metrics(results), "provenance": dict(provenance)}
    metrics_path = out / "metrics.json"
    atomic_write_json(metrics_path, metrics)
    report = out / "report.html"
    atomic_write_text(report, render_report(metrics, samples, provenance))
    return {"html": str(report), "metrics": str(metrics_path)}
