"""The reference models' fused head (``add_reference_head``): TRL's fused head's answers, from one pass per chunk
over the labelled positions' logits, for the no-grad calls of the rollout; TRL's own head for everything else."""

from __future__ import annotations

import pytest
import torch

from rlhf_ext.algos.segment_reward import logprobs_and_entropy


@pytest.fixture(scope="module")
def heads(tiny_sft_path):
    """The same tiny model three times: plain, with TRL's fused head, with ours (log-probs + entropies)."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from rlhf_ext.trl.reference_head import add_reference_head

    plain, trl, ours = (AutoModelForCausalLM.from_pretrained(tiny_sft_path).eval() for _ in range(3))
    add_fused_lm_head(trl, temperature=0.7, outputs=("log_probs", "entropy"))
    add_reference_head(ours, temperature=0.7, entropy=True)
    return plain, trl, ours


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (3, 12), generator=g)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0  # left padding
    labels = ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-5] = -100  # the 5 completion tokens are scored, as GRPO asks
    labels[2, -1] = -100  # a completion shorter by one (padding)
    return ids, attention_mask, labels


def test_reference_head_answers_like_trls_without_trls_tiles(heads, monkeypatch):
    import trl.kernels.chunked_logprob as kernels

    plain, trl, ours = heads
    ids, attention_mask, labels = _batch(plain.config.vocab_size)
    with torch.no_grad():
        expected = trl(input_ids=ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        logits = plain(input_ids=ids, attention_mask=attention_mask).logits[:, :-1] / 0.7
        calls = []
        monkeypatch.setattr(kernels, "_forward_tile", lambda *a, **k: calls.append(1))
        got = ours(input_ids=ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    assert calls == []  # TRL's tile fold never ran
    mask = labels[:, 1:] != -100
    assert torch.equal(got.label_mask, mask)
    assert (got.log_probs[~mask] == 0).all() and (got.entropy[~mask] == 0).all()
    torch.testing.assert_close(got.log_probs, expected.log_probs, atol=2e-5, rtol=0)
    torch.testing.assert_close(got.entropy, expected.entropy, atol=2e-5, rtol=0)
    lp, ent = logprobs_and_entropy(logits, labels[:, 1:].clamp(min=0))  # the full logits, one pass
    torch.testing.assert_close(got.log_probs, lp * mask, atol=2e-5, rtol=0)
    torch.testing.assert_close(got.entropy, ent * mask, atol=2e-5, rtol=0)
    torch.testing.assert_close(got.loss, expected.loss, atol=2e-5, rtol=0)


def test_calls_with_gradients_and_generation_go_to_trls_head(heads):
    plain, trl, ours = heads
    ids, attention_mask, labels = _batch(plain.config.vocab_size)
    out = ours(input_ids=ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    assert out.log_probs.requires_grad  # TRL's differentiable head
    with torch.no_grad():
        torch.testing.assert_close(
            ours(input_ids=ids, attention_mask=attention_mask).logits,
            plain(input_ids=ids, attention_mask=attention_mask).logits,
        )
