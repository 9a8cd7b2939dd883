"""The command line as users meet it: recipes, training, the segment view, light imports."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import chdir

import pytest
from click.testing import CliRunner

from rlhf_ext.cli import main


def test_import_rlhf_ext_is_light():
    code = (
        "import sys, rlhf_ext, rlhf_ext.segment, rlhf_ext.config, rlhf_ext.cli;"
        "heavy = [m for m in ('trl', 'openrlhf', 'deepspeed', 'ray', 'vllm', 'transformers') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_recipe_list_and_copy(tmp_path):
    runner = CliRunner()
    listed = runner.invoke(main, ["recipe", "list"])
    assert listed.exit_code == 0 and "segment_rm_tiny" in listed.output
    copied = runner.invoke(main, ["recipe", "copy", "segment_rm_tiny", str(tmp_path)])
    assert copied.exit_code == 0
    assert (tmp_path / "segment_rm_tiny.yaml").read_text().startswith("# Segment reward model")
    again = runner.invoke(main, ["recipe", "copy", "segment_rm_tiny", str(tmp_path)])
    assert again.exit_code != 0 and "exists" in again.output
    missing = runner.invoke(main, ["recipe", "copy", "nope", str(tmp_path)])
    assert missing.exit_code == 2 and "packaged recipes: " in missing.output
    here = tmp_path / "here"
    here.mkdir()
    with chdir(here):  # no DEST: ./NAME.yaml (it used to be a usage error)
        default = runner.invoke(main, ["recipe", "copy", "online_dpo_tiny"])
    assert default.exit_code == 0, default.output
    assert [p.name for p in here.iterdir()] == [
        "online_dpo_tiny.yaml"
    ] and default.output.strip() == "online_dpo_tiny.yaml"


def test_bad_override_names_the_key():
    result = CliRunner().invoke(main, ["train", "segment-rm", "--config", "segment_rm_tiny", "segment.cutof=1"])
    assert result.exit_code == 2
    assert "unknown key 'segment.cutof' (did you mean 'segment.entropy_cutoff'?)" in result.output


@pytest.fixture(scope="module")
def trained_rm(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("cli_rm")
    result = CliRunner().invoke(
        main,
        [
            "train", "segment-rm", "--config", "segment_rm_tiny",
            f"train.output_dir={out}", "data.max_train_samples=128", "data.max_eval_samples=32",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return out, result.output


def test_train_segment_rm_cli_writes_checkpoint_metrics_and_report(trained_rm):
    out, output = trained_rm
    assert "segment reward model trained" in output and str(out) in output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["engine"] == "trl"
    # the trainer's held-out accuracy and margin are those of the saved model's sequence evaluations e_phi on the 32
    # eval pairs, recomputed through the inference scorer (separate tokenisation, entropies and forward passes)
    from rlhf_ext.runtime.rewards import SegmentSequenceReward
    from rlhf_ext.zoo.builtins import resolve_dataset

    pairs = resolve_dataset("builtin:toy-keyphrase")["test"].select(range(32))
    e_phi, prompts = SegmentSequenceReward(str(out)), list(pairs["prompt"])
    chosen, rejected = e_phi(prompts, list(pairs["chosen"])), e_phi(prompts, list(pairs["rejected"]))
    assert metrics["eval"]["eval_accuracy"] == pytest.approx((chosen > rejected).double().mean().item(), abs=1e-6)
    assert metrics["eval"]["eval_margin"] == pytest.approx((chosen - rejected).double().mean().item(), rel=1e-4)
    html = (out / "segment_report.html").read_text()
    assert html.count('class="seg"') > 8 and "reward" in html
    assert (out / "segment_config.json").exists() and (out / "model.safetensors").exists()


def test_segment_show_prints_segments_and_writes_html(trained_rm, tmp_path):
    out, _ = trained_rm
    html = tmp_path / "view.html"
    response = " Many people wonder about this. The facts about tides are backed by peer-reviewed evidence."
    result = CliRunner().invoke(
        main,
        ["segment", "show", "--model", str(out), "--prompt", "Question: What should I know about tides?\nAnswer:",
         "--response", response, "--html", str(html), "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    view = json.loads(result.stdout)
    assert "".join(view["segments"]).replace("<|endoftext|>", "") == response
    assert len(view["segments"]) == len(view["rewards"]) >= 3
    assert html.read_text().count('class="seg"') == len(view["segments"])
    # a cutoff of infinity gives the bandit view: one segment
    bandit = CliRunner().invoke(
        main, ["segment", "show", "--model", str(out), "--response", response, "--entropy-cutoff", "inf"]
    )
    assert bandit.exit_code == 0 and "(1 segments)" in bandit.output


def test_segment_show_on_a_model_without_settings_is_clear(tmp_path, tiny_sft_path):
    result = CliRunner().invoke(main, ["segment", "show", "--model", tiny_sft_path, "--response", "x"])
    assert result.exit_code == 2 and "segment_config.json" in result.output


@pytest.mark.real_model
def test_smollm2_entropy_segments_real_english(cache_dir):
    """The behaviour paper 003 relies on, with a real 135M model: entropy segments look like phrases."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_ext.pipelines.builtins import resolve_model
    from rlhf_ext.runtime.segment_data import sft_token_entropy
    from rlhf_ext.segment import segment_boundaries, segment_ids

    path = resolve_model("builtin:smollm2", cache_dir)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the mitochondria?"}], tokenize=False,
                                     add_generation_prompt=True)  # fmt: skip
    text = "The mitochondria is the powerhouse of the cell, producing energy through cellular respiration."
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    r = tok(text, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p + r])
    action = torch.zeros_like(ids, dtype=torch.bool)
    action[0, len(p) :] = True
    ent = sft_token_entropy(model, ids, torch.ones_like(ids))
    seg = segment_ids(segment_boundaries(ent, action, 2.0), action)
    n = int(seg.counts[0])
    assert 3 <= n < len(r)  # phrases: more than one segment, fewer than one per token
    pieces = [tok.decode(ids[0][seg.ids[0] == s]) for s in range(n)]
    assert "".join(pieces) == tok.decode(r)
