"""``report.html`` and ``metrics.json`` of the demo pipeline: metrics, reward/KL curves, coloured segment views."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from rlhf_ext.runtime.io import atomic_write_json, atomic_write_text


def curve_png(curve: list[dict[str, Any]]) -> bytes:
    """PNG of the PPO reward (with KL penalty) and KL per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in curve]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    axes[0].plot(steps, [row["reward"] for row in curve], marker="o")
    axes[0].set(title="PPO reward (dense segment reward - KL)", xlabel="step")
    axes[1].plot(steps, [row["segment/kl"] for row in curve], marker="o", color="tab:red")
    axes[1].set(title="KL to the SFT model (per response)", xlabel="step")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def segment_views(rm_dir: str, policy_dir: str, prompts: list[str], max_new_tokens: int, seed: int = 0):
    """Sample one response per prompt from ``policy_dir`` and split it into scored segments with the reward model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_ext.runtime.token_scores import SegmentScorer

    tok = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    scorer = SegmentScorer(rm_dir)
    return [scorer.score(p, t) for p, t in zip(prompts, texts)]


def write_report(out: Path, results: dict[str, Any], view_prompts: list[str], max_new_tokens: int) -> dict[str, str]:
    """Write ``out/report.html`` and ``out/metrics.json``; returns their paths.

    ``view_prompts``: held-out prompts whose PPO responses are shown split into segments coloured by reward.
    """
    from rlhf_ext.runtime.token_scores import render_segments

    ev = results["eval"]["ppo_vs_sft"]
    rm_eval = results["eval"].get("rm", {})
    metrics = {
        "win_rate_ppo_vs_sft": ev["win_rate"],
        "win_rate_stderr": ev["stderr"],
        "comparisons": ev["num_comparisons"],
        "gold_reward_ppo": ev["gold_mean"],
        "gold_reward_sft": ev["ref_gold_mean"],
        "mean_length_chars_ppo": ev["avg_length_chars"],
        "mean_length_chars_sft": ev["ref_avg_length_chars"],
        "kl_ppo_to_sft": ev["kl"],
        "rm_heldout_accuracy": rm_eval.get("eval_accuracy"),
        "rm_segments_per_response": rm_eval.get("eval_segments_per_response"),
        "annotator_label_agreement": results["labels"]["agreement_with_generator_label"],
        "normalizer": {
            k: results["normalizer"].get(k) for k in ("kind", "w_mu", "b_mu", "w_sigma", "b_sigma", "r2_mean")
        },
        "ppo_curve": results["ppo"]["curve"],
        "stage_seconds": {k: v.get("seconds") for k, v in results.items() if isinstance(v, dict) and "seconds" in v},
    }
    metrics_path = out / "metrics.json"
    atomic_write_json(metrics_path, metrics)

    views_html = ""
    if view_prompts:
        views = segment_views(results["rm"]["path"], results["ppo"]["path"], view_prompts, max_new_tokens)
        views_html = "<h2>PPO samples, coloured by segment reward</h2>" + render_segments(views)
    png = base64.b64encode(curve_png(results["ppo"]["curve"])).decode() if results["ppo"]["curve"] else ""
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(_fmt(v))}</td></tr>"
        for k, v in metrics.items()
        if k not in ("ppo_curve", "normalizer", "stage_seconds")
    )
    body = (
        "<h1>rlhf-ext demo</h1><p>Segment-level RLHF (paper 003) on a synthetic preference task (paper 000), "
        "judged by a simulated annotator pool (paper 002).</p>"
        f"<h2>Metrics</h2><table>{rows}</table>"
        + (f'<h2>PPO curves</h2><img src="data:image/png;base64,{png}"/>' if png else "")
        + views_html
    )
    report = out / "report.html"
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>rlhf-ext demo</title></head>"
        f"<body style='font-family:sans-serif;max-width:60rem;margin:auto'>{body}</body></html>"
    )
    atomic_write_text(report, page)
    return {"html": str(report), "metrics": str(metrics_path)}


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)
