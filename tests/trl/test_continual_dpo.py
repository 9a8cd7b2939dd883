"""ContinualDPOTrainer: equals DPOTrainer at c = 0, adds exactly c * KL otherwise, and a short training run."""

from __future__ import annotations

import pytest
import torch

from rlhf_ext.continual import kl_to_previous
from rlhf_ext.trl.args import CPU_RUN

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _perturbed(path: str, seed: int, scale: float = 0.05):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def _args(cls, tmp_path, **kw):
    return cls(
        output_dir=str(tmp_path / cls.__name__),
        per_device_train_batch_size=4,
        max_length=96,
        **CPU_RUN,
        seed=3,
        **kw,
    )


def _hf_token_logps(model, inputs):
    """Independent oracle: per-token log-probs from the full logits of a plain HF forward pass."""
    with torch.no_grad():
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    return logits[:, :-1].log_softmax(-1).gather(-1, inputs["input_ids"][:, 1:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def setup(tiny_sft_path, toy_tok, toy_data, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from rlhf_ext.trl import ContinualDPOConfig, ContinualDPOTrainer

    tmp = tmp_path_factory.mktemp("cdpo")
    train = toy_data["train"].select(range(8))

    def build(cls, args_cls, model=None, extra=None, **kw):
        return cls(
            model=model if model is not None else _perturbed(tiny_sft_path, seed=1),
            ref_model=AutoModelForCausalLM.from_pretrained(tiny_sft_path, dtype=torch.float32),
            args=_args(args_cls, tmp, **kw),
            train_dataset=train,
            processing_class=toy_tok,
            **(extra or {}),
        )

    def continual(prev_model, **kw):
        return build(ContinualDPOTrainer, ContinualDPOConfig, extra={"prev_model": prev_model}, **kw)

    plain = build(DPOTrainer, DPOConfig)
    inputs = plain._prepare_inputs(next(iter(plain.get_train_dataloader())))
    return {"continual": continual, "plain": plain, "inputs": inputs}


def test_weight_zero_or_no_previous_model_reproduces_dpo_exactly(setup, tiny_sft_path):
    s = setup
    expected = s["plain"].compute_loss(s["plain"].model, s["inputs"])
    for trainer in (
        s["continual"](_perturbed(tiny_sft_path, seed=2), continual_kl_coef=0.0),
        s["continual"](None, continual_kl_coef=1.0),
    ):
        assert not trainer.continual_kl_active
        got = trainer.compute_loss(trainer.model, s["inputs"])
        assert torch.equal(got, expected), (got.item(), expected.item())


@pytest.mark.parametrize("estimator", ["k3", "k2"])
def test_adds_exactly_c_times_kl_to_the_previous_model(setup, tiny_sft_path, estimator):
    from rlhf_ext.trl.continual_dpo import KL_METRIC

    s, c = setup, 0.7
    prev = _perturbed(tiny_sft_path, seed=2)
    trainer = s["continual"](prev, continual_kl_coef=c, continual_kl_estimator=estimator)
    assert trainer.continual_kl_active and not trainer.prev_model.training
    assert not any(p.requires_grad for p in trainer.prev_model.parameters())
    dpo = s["plain"].compute_loss(s["plain"].model, s["inputs"])
    loss = trainer.compute_loss(trainer.model, s["inputs"])

    inputs = s["inputs"]
    mask = inputs["completion_mask"][:, 1:].bool()
    expected_kl = kl_to_previous(
        _hf_token_logps(trainer.model, inputs), _hf_token_logps(prev, inputs), mask, estimator
    ).item()
    assert expected_kl > 1e-3  # the two perturbed models really differ
    assert (loss - dpo).item() == pytest.approx(c * expected_kl, rel=1e-4, abs=1e-6)
    mode = "train" if trainer.model.training else "eval"
    assert trainer._metrics[mode][KL_METRIC][-1] == pytest.approx(expected_kl, rel=1e-4)

    loss.backward()  # the KL term is differentiable w.r.t. the policy only
    assert any(p.grad is not None for p in trainer.model.parameters())
    assert all(p.grad is None for p in trainer.prev_model.parameters())


def test_previous_model_from_a_checkpoint_path_equals_the_same_model_object(setup, tiny_sft_path, tmp_path):
    s = setup
    prev = _perturbed(tiny_sft_path, seed=2)
    prev.save_pretrained(tmp_path / "prev")
    a = s["continual"](prev, continual_kl_coef=1.0)
    b = s["continual"](str(tmp_path / "prev"), continual_kl_coef=1.0)
    assert torch.equal(a.compute_loss(a.model, s["inputs"]), b.compute_loss(b.model, s["inputs"]))


def test_config_validation():
    from rlhf_ext.trl import ContinualDPOConfig

    common = dict(output_dir="x", bf16=False, use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="continual_kl_coef must be a number >= 0; got -0.1"):
        ContinualDPOConfig(continual_kl_coef=-0.1, **common)
    with pytest.raises(ValueError, match="KL estimator must be one of"):
        ContinualDPOConfig(continual_kl_estimator="kl", **common)


def test_training_keeps_the_policy_closer_to_the_previous_one_and_logs_the_kl(setup, tiny_sft_path):
    """Starting from the previous-task model, a large KL weight keeps the trained policy near it, c = 0 does not."""
    from rlhf_ext.trl.continual_dpo import KL_METRIC

    s = setup
    mask = s["inputs"]["completion_mask"][:, 1:].bool()

    def train(coef):
        t = s["continual"](
            _perturbed(tiny_sft_path, seed=2),
            model=_perturbed(tiny_sft_path, seed=2),
            continual_kl_coef=coef,
            max_steps=4,
            learning_rate=5e-3,
            logging_steps=1,
        )
        t.train()
        logp, prev = _hf_token_logps(t.model, s["inputs"]), _hf_token_logps(t.prev_model, s["inputs"])
        return t, kl_to_previous(logp, prev, mask).item()

    _, kl_free = train(0.0)
    held, kl_held = train(50.0)
    assert kl_held < 0.5 * kl_free
    logged = [h[KL_METRIC] for h in held.state.log_history if KL_METRIC in h]
    assert len(logged) == 4 and logged[0] == pytest.approx(0.0, abs=1e-6)  # step 1: policy == previous model
