"""The demo's ``report.html`` / ``metrics.json`` (rlhf_ext.pipelines.reports) from a small fixture of stage results,
without running the demo: labelled and formatted numbers, one colour scale for SFT and PPO samples, provenance, and
the page as a real headless Chromium renders it."""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from rlhf_ext.demo import DemoRecipe
from rlhf_ext.pipelines.reports import (
    collect_provenance,
    colour_scale,
    metric_rows,
    moving_average,
    parameter_count,
    report_metrics,
    segment_colour,
    write_report,
)
from rlhf_ext.runtime.token_scores import SegmentView
from rlhf_ext.sim import win_rate
from tests.helpers.fixed_policy import FixedPolicy

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
)  # fmt: skip
STAGE_SECONDS = {"data": 2.9, "sft": 26.1, "labels": 0.4, "rm": 6.2, "normalizer": 1.0, "ppo": 9.3, "eval": 4.6}


def fixture_results() -> dict:
    """Stage results shaped like the demo's (64 comparisons: 38 wins, 2 ties, 24 losses -> 39 / 64)."""
    curve = [{"step": s, "reward": float(s % 3), "segment/kl": 0.25 * s} for s in range(1, 9)]
    return {
        "labels": {"agreement_with_generator_label": 0.758, "seconds": 0.4},
        "normalizer": {"kind": "regression", "w_mu": 0.5, "b_mu": -0.1, "w_sigma": 0.0, "b_sigma": 0.0,
                       "r2_mean": 0.8136, "seconds": 1.0},
        "ppo": {"path": "runs/demo/ppo", "curve": curve, "seconds": 9.3},
        "eval": {
            "ppo_vs_sft": {"win_rate": 39 / 64, "stderr": 0.061, "wins": 38, "ties": 2, "losses": 24,
                           "num_comparisons": 64, "judge": "pool", "gold_mean": 0.547, "gold_stderr": 0.052,
                           "ref_gold_mean": 0.156, "avg_length_tokens": 80.4, "ref_avg_length_tokens": 85.5,
                           "avg_length_chars": 322.906, "ref_avg_length_chars": 340.734, "truncated_fraction": 0.125,
                           "kl": 2.708, "kl_stderr": 0.21, "kl_method": "sequence_log_ratio"},
            "rm": {"eval_accuracy": 0.973, "eval_segments_per_response": 14.741},
            "seconds": 4.6,
        },
    }  # fmt: skip


def fixture_samples() -> dict[str, list[SegmentView]]:
    """Two prompts; the largest |segment reward| is 2.0 (a green one in PPO, a red one in SFT)."""
    prompts = ["Continue the story about the harbour.", "Write a verse about the city."]
    return {
        "SFT": [
            SegmentView(prompts[0], [" Prithee hear", " the plea of common folk."], [-2.0, 0.5], [3.1, 2.4], -0.9),
            SegmentView(prompts[1], [" The city sleeps."], [-0.5], [2.2], -0.5),
        ],
        "PPO": [
            SegmentView(prompts[0], [" The crowd goes wild", " when the verse hits."], [2.0, 1.0], [3.0, 2.6], 1.6),
            SegmentView(prompts[1], [" Lights", " everywhere tonight."], [0.25, -0.5], [2.9, 2.1], -0.1),
        ],
    }


def fixture_provenance(data_dir: Path | None = None) -> dict:
    stage_seconds = {**STAGE_SECONDS, "report": 3.5}
    parameters = {"policy": 1_234_567, "reward model": 1_180_000}
    if data_dir is None:
        data_dir = Path(__file__).parent / "data_fixture"
    return collect_provenance(asdict(DemoRecipe()), 0, parameters, stage_seconds, data_dir)


def test_moving_average_is_the_mean_of_the_last_window_points():
    assert moving_average([1.0, 3.0, 2.0, 6.0], window=3) == pytest.approx([1.0, 2.0, 2.0, 11 / 3])
    assert moving_average([4.0, 2.0], window=1) == [4.0, 2.0]
    with pytest.raises(ValueError, match="window must be >= 1"):
        moving_average([1.0], window=0)


def test_metric_rows_have_human_labels_units_and_formatted_numbers():
    rows = {row.label: row for row in metric_rows(report_metrics(fixture_results()))}
    win = rows["Win rate against SFT"]
    assert (win.ppo, win.sft, win.unit) == ("60.9% ± 6.1%", "50% (reference)", "% of comparisons")
    assert win.note.startswith("64 comparisons on held-out prompts: 38 wins, 2 ties, 24 losses")
    # 39/64 ± 0.061: 95% interval 0.609 ± 1.96 x 0.061 = 48.98% .. 72.89%, which holds 50%
    assert win.note.endswith(
        "; 95% interval 49.0% to 72.9%: 50% lies inside the 95% interval: not significant at the 5% level"
    )
    assert (rows["Gold reward"].ppo, rows["Gold reward"].sft) == ("+0.547 ± 0.052", "+0.156")
    length = rows["Response length"]
    assert (length.ppo, length.sft, length.unit) == ("80.4", "85.5", "tokens")
    chars = rows["Response length (characters)"]
    assert (chars.ppo, chars.sft) == ("323", "341")
    assert rows["Responses cut at the token limit"].ppo == "12.5%"
    kl = rows["KL to the SFT model"]
    assert (kl.ppo, kl.unit) == ("2.708 ± 0.210", "nats per response")
    shared = {label: (row.ppo, row.sft) for label, row in rows.items() if row.sft is None}
    assert shared == {
        "Reward-model held-out accuracy": ("97.3%", None),
        "Segments per response": ("14.7", None),
        "Annotator agreement": ("75.8%", None),
        "Normalizer fit (R² of the mean)": ("0.814", None),
    }


def test_an_eval_stage_from_before_sft_token_lengths_shows_a_dash():
    results = fixture_results()
    del results["eval"]["ppo_vs_sft"]["ref_avg_length_tokens"]
    rows = {row.label: row for row in metric_rows(report_metrics(results))}
    assert (rows["Response length"].ppo, rows["Response length"].sft) == ("80.4", "—")


def test_win_rate_measures_the_reference_length_in_tokens():
    policy = FixedPolicy(["a b", "c"], num_tokens=[4, 6])
    reference = FixedPolicy(["x", "y z"], num_tokens=[3, 9])
    res = win_rate(policy, reference, ["p1", "p2"], judge="gold", compute_kl=False)
    assert (res.avg_length_tokens, res.ref_avg_length_tokens) == (5.0, 6.0)


def test_sft_and_ppo_samples_share_one_colour_scale():
    samples = fixture_samples()
    assert colour_scale(samples) == 2.0  # the SFT's -2.0 and the PPO's +2.0
    assert colour_scale({"PPO": samples["PPO"]}) == 2.0
    assert segment_colour(2.0, 2.0) == "rgba(22,163,74,0.75)"
    assert segment_colour(-2.0, 2.0) == "rgba(220,38,38,0.75)"
    assert segment_colour(-0.5, 2.0) == "rgba(220,38,38,0.19)"  # 0.25 * 0.75
    assert segment_colour(5.0, 2.0) == "rgba(22,163,74,0.75)"  # saturates


def test_parameter_count_reads_the_config_only(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    sizes = {"vocab_size": 10, "hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 1}
    config = LlamaConfig(**sizes, num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True, num_labels=1)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "policy")
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    # embeddings 10*4; one layer: q, k, v, o 4*4 each, gate/up/down 4*8 each, two norms 4 each; final norm 4;
    # the LM head is tied to the embeddings; the reward model's score head is 4*1 and it has no LM head
    layer = 4 * 16 + 3 * 32 + 2 * 4
    assert parameter_count(tmp_path / "policy") == 40 + layer + 4 == 212
    assert parameter_count(tmp_path / "rm", reward_model=True) == 40 + layer + 4 + 4 == 216


@pytest.mark.parametrize(
    ("rate", "stderr", "verdict"),
    [
        (36 / 64, 0.0625, "within one standard error of 50%: no evidence of a difference from SFT"),  # the run
        (0.62, 0.0625, "50% lies inside the 95% interval: not significant at the 5% level"),
        (0.75, 0.05, "50% lies outside the 95% interval: PPO beats SFT (5% level)"),
        (0.30, 0.05, "50% lies outside the 95% interval: PPO loses to SFT (5% level)"),
    ],
)
def test_win_rate_verdict_says_what_the_interval_says_about_50_percent(rate, stderr, verdict):
    from rlhf_ext.pipelines.reports import win_rate_verdict

    interval, text = win_rate_verdict(rate, stderr)
    assert interval == pytest.approx([rate - 1.96 * stderr, rate + 1.96 * stderr], abs=1e-12) and text == verdict


def test_provenance_names_the_command_line_the_package_and_the_data(tmp_path, monkeypatch):
    import hashlib
    import subprocess
    import sys

    from rlhf_ext.pipelines.reports import directory_sha256

    data = tmp_path / "data"
    (data / "stage_0").mkdir(parents=True)
    (data / "stage_0" / "train.jsonl").write_text('{"prompt": "p"}\n')
    (data / "meta.json").write_text("{}")
    expected = hashlib.sha256(b"meta.json\0{}" + b'stage_0/train.jsonl\0{"prompt": "p"}\n').hexdigest()
    assert directory_sha256(data) == expected
    monkeypatch.setattr(sys, "argv", ["/venv/bin/rlhf-ext", "demo", "--out", "runs/my demo"])
    provenance = fixture_provenance(data)
    assert provenance["command_line"] == "/venv/bin/rlhf-ext demo --out 'runs/my demo'"
    assert provenance["data_sha256"] == expected
    root = Path(__file__).resolve().parents[2]
    if (root / ".git").exists():  # this checkout: the commit it runs
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        assert provenance["package"]["git_commit"].removesuffix("-dirty") == head.strip()
    html = (Path(write_report(tmp_path / "out", fixture_results(), fixture_samples(), provenance)["html"])).read_text()
    assert "/venv/bin/rlhf-ext demo --out &#x27;runs/my demo&#x27;" in html and expected in html
    assert "rlhf-ext git commit" in html or "rlhf-ext wheel sha256" in html or "rlhf-ext record sha256" in html


def test_metrics_json_records_the_provenance(tmp_path):
    paths = write_report(tmp_path, fixture_results(), fixture_samples(), fixture_provenance())
    assert paths == {"html": str(tmp_path / "report.html"), "metrics": str(tmp_path / "metrics.json")}
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["win_rate_ppo_vs_sft"] == 39 / 64 and metrics["mean_length_tokens_sft"] == 85.5
    provenance = metrics["provenance"]
    assert provenance["versions"]["torch"] == torch.__version__
    assert set(provenance["versions"]) == {"rlhf-ext", "torch", "transformers", "trl", "python"}
    assert provenance["parameters"] == {"policy": 1_234_567, "reward model": 1_180_000}
    assert provenance["stage_seconds"]["report"] == 3.5
    assert provenance["total_seconds"] == 54.0  # 2.9 + 26.1 + 0.4 + 6.2 + 1.0 + 9.3 + 4.6 + 3.5
    assert provenance["recipe"]["seed"] == 0 and provenance["seed"] == 0
    assert provenance["host_cpus"] >= 1 and provenance["date"][:2] == "20"


class Elements(HTMLParser):
    """Every element of a page as ``(tag, attributes, text inside it)``, in document order."""

    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self, page: str):
        super().__init__()
        self.found: list[tuple[str, dict[str, str], list[str]]] = []
        self.open: list[list[str]] = []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        element = (tag, dict(attrs), [])
        self.found.append(element)
        if tag not in self.VOID:
            self.open.append(element[2])

    def handle_endtag(self, tag):
        if tag not in self.VOID and self.open:
            self.open.pop()

    def handle_data(self, data):
        for text in self.open:
            text.append(data)

    def select(self, tag: str, **attrs: str) -> list[tuple[dict[str, str], str]]:
        """``(attributes, text)`` of the elements with this tag whose attributes include ``attrs``."""
        return [
            (a, "".join(t).strip())
            for name, a, t in self.found
            if name == tag and all(a.get(k.rstrip("_")) == v for k, v in attrs.items())
        ]


def _chromium(tmp_path: Path, page: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    cmd = [str(CHROMIUM), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, page.resolve().as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=True)


def _pixels_near(image, rgb: tuple[int, int, int], tolerance: int = 3) -> int:
    return sum(
        count
        for count, colour in image.getcolors(maxcolors=1 << 24)
        if all(abs(c - t) <= tolerance for c, t in zip(colour, rgb))
    )


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no Chromium at {CHROMIUM} (CI installs Debian's chromium)")
def test_report_renders_in_headless_chromium(tmp_path):
    from PIL import Image

    write_report(tmp_path, fixture_results(), fixture_samples(), fixture_provenance())
    page = tmp_path / "report.html"
    shot = tmp_path / "report.png"
    _chromium(tmp_path, page, f"--screenshot={shot}", "--window-size=1200,2400")
    dom = Elements(_chromium(tmp_path, page, "--dump-dom").stdout)

    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 2400)
    assert len(image.getcolors(maxcolors=1 << 24)) > 100  # text, table rules, curves, coloured segments
    # a segment at full intensity (|reward| = the scale, alpha 0.75 over white), green in PPO and red in SFT
    assert _pixels_near(image, (80, 186, 119)) > 500
    assert _pixels_near(image, (229, 92, 92)) > 500

    headers = [text for _, text in dom.select("th")][:5]
    assert headers == ["Metric", "PPO", "SFT", "Unit", "How it is measured"]
    assert len(dom.select("table", id="metrics")) == 1
    labels = [text for attrs, text in dom.select("td") if not attrs]
    for label in ("Win rate against SFT", "Gold reward", "Response length", "KL to the SFT model",
                  "Reward-model held-out accuracy", "Annotator agreement"):  # fmt: skip
        assert label in labels
    assert "60.9% ± 6.1%" in [text for _, text in dom.select("td", class_="num")]
    page_text = " ".join(text for _, text in dom.select("body"))
    assert "win_rate_ppo_vs_sft" not in page_text and "rm_heldout_accuracy" not in page_text

    ((_, legend),) = dom.select("div", id="legend")
    assert legend.startswith("-2.00 (red)0+2.00 (green)") and "linearly with |reward| up to 2.00" in legend
    sft, ppo = dom.select("div", class_="sample", **{"data-policy": "SFT"}), dom.select("div", **{"data-policy": "PPO"})
    assert [text.split("e(x, y)")[0] for _, text in sft] == ["SFT Prithee hear the plea of common folk.",
                                                             "SFT The city sleeps."]  # fmt: skip
    assert sft[1][1].endswith("e(x, y) = -0.500 · 1 segment") and ppo[0][1].endswith("e(x, y) = +1.600 · 2 segments")
    assert [text.split("e(x, y)")[0] for _, text in ppo] == ["PPO The crowd goes wild when the verse hits.",
                                                             "PPO Lights everywhere tonight."]  # fmt: skip

    ((_, provenance),) = dom.select("section", id="provenance")
    assert f"torch version{torch.__version__}" in provenance
    assert "Parameters: policy1,234,567 (1.23 M)" in provenance and "total54.0 s" in provenance
    assert "max_completion_length: 112" in provenance  # the recipe, as YAML
    sources = [attrs["src"] for attrs, _ in dom.select("img")]
    assert len(sources) == 1 and sources[0].startswith("data:image/png;base64,")  # self-contained


def test_the_demo_reports_the_kl_with_its_interval_and_estimator():
    """Issue 23 item 16: the demo printed ``KL(PPO || SFT): -0.257 nats``, a bare log-ratio mean."""
    from rlhf_ext.cli import format_kl
    from rlhf_ext.pipelines.reports import KL_DESCRIPTIONS

    ev = {"kl": 0.02064, "kl_stderr": 0.00625, "kl_method": "exact_token_sum", "num_comparisons": 64}
    assert format_kl(ev) == "0.021 ± 0.006 nats (exact per-token KL summed per response, 64 PPO samples)"
    old = {"kl": -0.257, "kl_stderr": 0.19, "num_comparisons": 64}  # a finished eval stage of an older demo
    assert format_kl(old) == "-0.257 ± 0.190 nats (log-ratio estimate, can be negative, 64 PPO samples)"
    assert "never negative" in KL_DESCRIPTIONS["exact_token_sum"]
