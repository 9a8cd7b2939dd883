"""KLRegularizedSFTTrainer (Quark's KL term): exact per-token KL; the penalty keeps the policy near the reference."""

from __future__ import annotations

import pytest
import torch


def test_token_kl_exact_value():
    from rlhf_ext.trl.kl_sft import token_kl

    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    expected = float((p * (p / q).log()).sum())
    got = token_kl(p.log().view(1, 1, 3) + 3.0, q.log().view(1, 1, 3) - 1.0)  # logits up to a constant
    assert got.shape == (1, 1) and got.item() == pytest.approx(expected, abs=1e-6)
    assert token_kl(p.log().view(1, 1, 3), p.log().view(1, 1, 3)).item() == pytest.approx(0.0, abs=1e-7)


LR, STEPS = 1e-3, 48  # long enough for the penalty to matter: Adam takes ~lr-sized steps whatever the loss scale


def _train(tmp_path, tiny_sft_path, toy_tok, kl_coef: float, rows):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from rlhf_ext.trl import KLRegularizedSFTTrainer, KLSFTConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_sft_path, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(tiny_sft_path, dtype=torch.float32)
    args = KLSFTConfig(
        output_dir=str(tmp_path / f"kl{kl_coef}"), kl_coef=kl_coef, max_steps=STEPS, per_device_train_batch_size=16,
        learning_rate=LR, lr_scheduler_type="constant", completion_only_loss=True, bf16=False, use_cpu=True,
        report_to="none", save_strategy="no", logging_steps=4, gradient_checkpointing=False, disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = KLRegularizedSFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=toy_tok, ref_model=ref
    )
    trainer.train()
    logged = [h["kl_to_ref"] for h in trainer.state.log_history if "kl_to_ref" in h]
    return trainer.model, ref, logged


def _kl_on(model, ref, toy_tok, rows) -> float:
    from rlhf_ext.trl.kl_sft import token_kl

    ids = toy_tok([r["prompt"] + r["completion"] for r in rows], return_tensors="pt", padding=True)
    with torch.no_grad():
        kl = token_kl(model(**ids).logits, ref(**ids).logits)
    return float((kl * ids["attention_mask"]).sum() / ids["attention_mask"].sum())


def test_kl_penalty_keeps_the_policy_near_the_reference(tmp_path, tiny_sft_path, toy_tok, toy_data):
    # fine-tune on the rejected responses only: without a penalty the policy moves far from the SFT model
    rows = [{"prompt": r["prompt"], "completion": r["rejected"]} for r in toy_data["train"].select(range(96))]
    held_out = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in toy_data["test"].select(range(32))]
    free, ref, logged_free = _train(tmp_path, tiny_sft_path, toy_tok, 0.0, rows)
    tied, _, logged_tied = _train(tmp_path, tiny_sft_path, toy_tok, 5.0, rows)
    assert logged_free == [] and len(logged_tied) >= 2  # the KL term runs (and is logged) only when kl_coef > 0
    kl_free, kl_tied = _kl_on(free, ref, toy_tok, held_out), _kl_on(tied, ref, toy_tok, held_out)
    assert kl_free > 0.05 and kl_tied < 0.5 * kl_free


def test_kl_trainer_needs_its_config_and_reference(tmp_path, tiny_sft_path, toy_tok):
    from datasets import Dataset
    from trl import SFTConfig

    from rlhf_ext.trl import KLRegularizedSFTTrainer, KLSFTConfig

    data = Dataset.from_list([{"prompt": "a", "completion": " b"}])
    plain = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False)
    with pytest.raises(TypeError, match="KLSFTConfig"):
        KLRegularizedSFTTrainer(
            model=tiny_sft_path, args=plain, train_dataset=data, processing_class=toy_tok, ref_model=None
        )
    with pytest.raises(ValueError, match="kl_coef"):
        KLSFTConfig(output_dir=str(tmp_path), kl_coef=-1.0, use_cpu=True, bf16=False)


def test_kl_loss_with_an_identical_reference_equals_the_sft_loss(tiny_sft_path, toy_tok, toy_data, tmp_path):
    # one forward computes NLL and KL; with ref == policy the KL is 0 and the NLL must be SFTTrainer's own loss
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from rlhf_ext.trl import KLRegularizedSFTTrainer, KLSFTConfig

    rows = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in toy_data["train"].select(range(8))]
    common = dict(per_device_train_batch_size=8, completion_only_loss=True, bf16=False, use_cpu=True,
                  report_to="none", disable_tqdm=True)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tiny_sft_path, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(tiny_sft_path, dtype=torch.float32)
    data = dict(train_dataset=Dataset.from_list(rows), processing_class=toy_tok)
    sft = SFTTrainer(model=model, args=SFTConfig(output_dir=str(tmp_path / "a"), **common), **data)
    kl_args = KLSFTConfig(output_dir=str(tmp_path / "b"), kl_coef=3.0, **common)
    kl = KLRegularizedSFTTrainer(model=model, args=kl_args, ref_model=ref, **data)
    batch = next(iter(sft.get_train_dataloader()))
    with torch.no_grad():
        expected = sft.compute_loss(model, dict(batch))
        got = kl.compute_loss(model, dict(batch))
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    assert kl._metrics["eval"]["kl_to_ref"][-1] == pytest.approx(0.0, abs=1e-6)  # from_pretrained: eval mode
