"""The OpenRLHF path: real OpenRLHF 0.11.2 classes on CPU, equal to the TRL path for identical tensors."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from rlhf_ext.runtime.segment_data import prepare_segment_dataset


@pytest.fixture(scope="module")
def seg_rm():
    import rlhf_ext.openrlhf.segment_rm as seg_rm

    return seg_rm


@pytest.fixture(scope="module")
def prepared(tiny_sft_path, toy_tok, toy_data):
    return prepare_segment_dataset(toy_data["train"].select(range(8)), toy_tok, sft_model_name_or_path=tiny_sft_path)


def test_import_shims_only_stand_in_for_missing_packages():
    import importlib.util

    from rlhf_ext.openrlhf.compat import import_shims, is_shim

    with import_shims():
        import flash_attn.bert_padding as bp
        import vllm

        assert is_shim("flash_attn") and is_shim("vllm")
        import flash_attn.utils.distributed as fd

        with pytest.raises(RuntimeError, match="needs a GPU install .*flash-attn"):
            fd.all_gather(None, None)
        assert bp.pad_input.__module__ == "rlhf_ext.openrlhf.compat"  # pure-torch helpers are real on CPU
        with pytest.raises(RuntimeError, match="vllm"):
            vllm.LLM("model")
        assert vllm.SamplingParams(temperature=0.5).temperature == 0.5  # plain data, built by OpenRLHF's driver
        # transformers still sees flash-attn as absent
        from transformers.utils import is_flash_attn_2_available

        assert not is_flash_attn_2_available()
    # unregistered afterwards: the truth (not installed) is visible again, e.g. to TRL's vLLM check
    assert importlib.util.find_spec("vllm") is None and not is_shim("vllm")


def test_role_mask_round_trip_is_exact(seg_rm):
    torch.manual_seed(0)
    attention = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    action = torch.tensor([[False, False, True, True, True], [False, True, True, False, False]])
    entropy = torch.where(action, torch.rand(2, 5) * 9, torch.zeros(2, 5))
    roles = seg_rm.encode_role_mask(attention, action, entropy)
    a, b, e = seg_rm.decode_role_mask(roles)
    assert torch.equal(a, attention) and torch.equal(b, action) and torch.equal(e, entropy)


def test_parse_ext_args(seg_rm):
    rest, ext = seg_rm.parse_ext_args(
        ["--data.max_len", "64", "--ext.entropy_cutoff", "inf", "--ext.tau=0.3", "--ds.zero_stage", "2"]
    )
    assert rest == ["--data.max_len", "64", "--ds.zero_stage", "2"]
    assert math.isinf(ext["entropy_cutoff"]) and ext["tau"] == 0.3 and ext["aggregation"] == "softmax"
    with pytest.raises(ValueError, match="unknown option --ext.cutof"):
        seg_rm.parse_ext_args(["--ext.cutof", "2"])
    with pytest.raises(ValueError, match=r"--ext.entropy_cutoff must be a number >= 0 \(or inf\); got -3.0"):
        seg_rm.parse_ext_args(["--ext.entropy_cutoff", "-3"])


def _openrlhf_trainer(seg_rm, tokenizer, cutoff):
    """A SegmentRewardModelTrainer holding exactly what concatenated_forward reads (no DeepSpeed engine)."""
    from types import SimpleNamespace

    from openrlhf.models import PairWiseLoss

    trainer = seg_rm.SegmentRewardModelTrainer.__new__(seg_rm.SegmentRewardModelTrainer)
    trainer.strategy = SimpleNamespace(ring_attn_group=None)
    trainer.tokenizer = tokenizer
    trainer.entropy_cutoff, trainer.aggregation, trainer.tau = cutoff, "softmax", 0.5
    trainer._segment_stats = torch.zeros(3, dtype=torch.float64)
    trainer.loss_fn = PairWiseLoss()
    return trainer


@pytest.mark.parametrize("cutoff", [2.0, 0.0, math.inf])
def test_trl_and_openrlhf_paths_give_the_same_loss(seg_rm, tmp_path, tiny_sft_path, toy_tok, prepared, cutoff):
    """Same weights, same pairs: OpenRLHF's left-padded role-mask path = TRL's right-padded path (1e-5)."""
    from openrlhf.models.model import _get_reward_model
    from transformers import AutoConfig, AutoModelForSequenceClassification, LlamaModel, LlamaPreTrainedModel

    from rlhf_ext.runtime.token_scores import TokenScoreCapture
    from rlhf_ext.trl import SegmentPreferenceCollator, SegmentRewardConfig, SegmentRewardTrainer

    torch.manual_seed(0)
    hf_model = AutoModelForSequenceClassification.from_pretrained(tiny_sft_path, num_labels=1).eval()
    config = AutoConfig.from_pretrained(tiny_sft_path)
    config.normalize_reward = False
    ort_model = _get_reward_model(LlamaPreTrainedModel, LlamaModel, "score")(config).eval()
    ort_model.load_state_dict(hf_model.state_dict())

    args = SegmentRewardConfig(
        output_dir=str(tmp_path), entropy_cutoff=cutoff, bf16=False, use_cpu=True, report_to="none"
    )
    trl_trainer = SegmentRewardTrainer(model=hf_model, args=args, train_dataset=prepared, processing_class=toy_tok)
    examples = [prepared[i] for i in range(6)]
    with torch.no_grad():
        trl_loss = trl_trainer.compute_loss(hf_model, SegmentPreferenceCollator(toy_tok.pad_token_id)(examples))

    ort_trainer = _openrlhf_trainer(seg_rm, toy_tok, cutoff)
    ort_trainer._capture = TokenScoreCapture(ort_model)
    dataset = seg_rm.SegmentRewardDataset.__new__(seg_rm.SegmentRewardDataset)
    dataset.tokenizer = toy_tok
    chosen_ids, c_mask, reject_ids, r_mask, margin = dataset.collate_fn(examples)
    assert (c_mask[:, 0] == 0).any(), "OpenRLHF batches are left padded"
    with torch.no_grad():
        chosen, rejected, _ = ort_trainer.concatenated_forward(ort_model, chosen_ids, c_mask, reject_ids, r_mask)
        ort_loss = ort_trainer.loss_fn(chosen, rejected, None)
    assert abs(trl_loss.item() - ort_loss.item()) < 1e-5
    stats = ort_trainer._segment_stats.tolist()
    assert stats[0] == 12 and (stats[1] == 12 if math.isinf(cutoff) else stats[1] > 12)


@pytest.mark.slow
def test_openrlhf_train_rm_runs_end_to_end_on_cpu(tmp_path, tiny_sft_path, prepared, toy_data):
    """OpenRLHF's unmodified train_rm (DeepSpeed ZeRO-2, gloo) with our subclasses, in a fresh process."""
    data_dir = tmp_path / "data"
    prepared.save_to_disk(str(data_dir))
    out = tmp_path / "rm"
    cmd = [
        sys.executable, "-m", "rlhf_ext.openrlhf.train_rm",
        "--model.model_name_or_path", tiny_sft_path,
        "--data.dataset", str(data_dir), "--data.max_len", "128",
        "--train.batch_size", "4", "--train.micro_batch_size", "4", "--train.max_epochs", "1",
        "--ckpt.output_dir", str(out), "--ckpt.path", str(tmp_path / "ckpt"),
        "--ds.param_dtype", "bf16", "--ds.attn_implementation", "sdpa", "--ds.zero_stage", "2",
        "--adam.lr", "1e-3",
        "--ext.entropy_cutoff", "2.0", "--ext.tau", "0.5",
    ]  # fmt: skip
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "acc=" in proc.stderr + proc.stdout
    from rlhf_ext.runtime.segment_data import load_segment_settings
    from rlhf_ext.runtime.token_scores import SegmentScorer, preference_accuracy

    settings = load_segment_settings(out)
    assert settings["entropy_cutoff"] == 2.0 and settings["sft_model_name_or_path"] == tiny_sft_path
    metrics = preference_accuracy(str(out), prepared, 2.0)
    # the same 8 pairs scored one response at a time through the segment viewer (its own tokenisation, SFT
    # entropies and forward passes; the settings recorded with the checkpoint): e_phi and the segment counts agree
    scorer = SegmentScorer(str(out))
    rows = toy_data["train"].select(range(8))
    views = [[scorer.score(row["prompt"], row[k]) for k in ("chosen", "rejected")] for row in rows]
    assert metrics["eval_accuracy"] == pytest.approx(sum(c.evaluation > r.evaluation for c, r in views) / 8)
    segments = sum(len(v.segments) for pair in views for v in pair) / 16
    assert metrics["eval_segments_per_response"] == pytest.approx(segments) and segments > 1


def test_a_step_limit_is_refused_on_the_openrlhf_engine_not_ignored(tmp_path):
    """OpenRLHF's ``train_rm`` has no step limit, so ``train.max_steps`` on ``engine: openrlhf`` trained whole epochs
    as if the key were absent (the TRL engine stops at it). Now it is one error naming the fix, before anything runs."""
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.segment_rm import SegmentRMRecipe, train_with_openrlhf
    from rlhf_ext.recipes import recipe_path

    out = tmp_path / "rm"
    recipe = load_recipe(SegmentRMRecipe, recipe_path("segment_rm_tiny"),
                         ["engine=openrlhf", "train.max_steps=4", f"train.output_dir={out}"])  # fmt: skip
    with pytest.raises(
        ValueError, match=r"remove train\.max_steps and set train\.num_train_epochs, or use --engine trl"
    ):
        train_with_openrlhf(recipe)
    assert not out.exists()
