"""``logprobs_and_entropy``: the log-probs and entropies both engines' reference forwards take from one pass over the
logits, against the formula ``token_entropy`` used before (kept here as the reference) and the engines' own
log-prob functions."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_ext.algos.segment_reward import logprobs_and_entropy, token_entropy


def reference_entropy(logits: torch.Tensor) -> torch.Tensor:
    """``token_entropy(shift=False)`` as it was before the fused pass (rlhf-ext 0.x): normalise, mask ``0 * -inf``."""
    z = logits if logits.dtype == torch.float64 else logits.float()
    logz = torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.exp(z - logz)
    return (logz.squeeze(-1) - torch.where(p > 0, p * z, torch.zeros_like(z)).sum(-1)).clamp_min(0.0)


def fp32_tolerance(logits: torch.Tensor) -> float:
    """fp32 rounding of ``H = lse - sum_v p_v z_v``: a few ulps of the largest logit (the size of both terms) per
    level of the summation tree over the vocabulary (log2 V levels)."""
    finite = logits.float()[torch.isfinite(logits.float())]
    levels = math.log2(logits.shape[-1])
    return 8 * torch.finfo(torch.float32).eps * (1.0 + float(finite.abs().max())) * levels


def _logits(shape, seed, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("scale", [0.1, 3.0, 30.0])
def test_entropy_equals_the_old_formula_within_fp32_rounding(seed, scale):
    logits = _logits((3, 17, 301), seed, scale)
    _, ent = logprobs_and_entropy(logits, chunk_size=7)  # chunks that cut batch rows
    torch.testing.assert_close(ent, reference_entropy(logits), atol=fp32_tolerance(logits), rtol=0)
    exact = reference_entropy(logits.double())  # and as close to the fp64 value as the old formula was
    old_err = float((reference_entropy(logits) - exact).abs().max())
    assert float((ent - exact).abs().max()) <= 2 * old_err + 1e-6, (float((ent - exact).abs().max()), old_err)


def test_minus_inf_logits_contribute_nothing_like_before():
    logits = _logits((2, 9, 64), 1)
    g = torch.Generator().manual_seed(2)
    logits[torch.rand(logits.shape, generator=g) < 0.4] = -torch.inf  # masked vocabulary entries
    logits[0, 3, :] = -torch.inf
    logits[0, 3, 5] = 1.0  # one allowed token: entropy exactly 0
    logits[1, 4, :] = -torch.inf  # nothing allowed: what the old formula returned (0)
    labels = torch.zeros(2, 9, dtype=torch.long)
    labels[0, 3] = 5
    lp, ent = logprobs_and_entropy(logits, labels, chunk_size=4)
    expected = reference_entropy(logits)
    assert torch.isfinite(ent).all()
    torch.testing.assert_close(ent, expected, atol=fp32_tolerance(logits), rtol=0)
    assert ent[0, 3] == 0 and ent[1, 4] == expected[1, 4] == 0 and lp[0, 3] == 0


def test_nan_logits_give_nan_like_before():
    logits = _logits((1, 4, 32), 3)
    logits[0, 2, 7] = torch.nan
    ent = logprobs_and_entropy(logits)[1]
    assert ent[0, 2].isnan() and reference_entropy(logits)[0, 2].isnan() and torch.isfinite(ent[0, [0, 1, 3]]).all()


def test_all_equal_logits_give_log_v():
    v = 1000
    logits = torch.full((2, 3, v), 4.25)
    logits[1] = -7.0
    lp, ent = logprobs_and_entropy(logits, torch.zeros(2, 3, dtype=torch.long))
    log_v = torch.log(torch.tensor(float(v)))
    torch.testing.assert_close(ent, torch.full((2, 3), float(log_v)), atol=4e-6, rtol=0)
    torch.testing.assert_close(lp, torch.full((2, 3), -float(log_v)), atol=4e-6, rtol=0)


def test_bf16_input_is_computed_in_fp32():
    logits = _logits((2, 11, 257), 4, dtype=torch.bfloat16)
    labels = torch.randint(0, 257, (2, 11), generator=torch.Generator().manual_seed(0))
    lp, ent = logprobs_and_entropy(logits, labels)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(ent, reference_entropy(logits), atol=fp32_tolerance(logits), rtol=0)
    expected = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(lp, expected, atol=fp32_tolerance(logits), rtol=0)


def test_full_size_case_and_a_slice_read_in_place():
    """[4, 24, 49152] (SmolLM2's vocabulary, a PPO batch of 4 x 24 action tokens), read as a slice of longer logits."""
    full = _logits((4, 30, 49152), 5)
    logits = full[:, 5:29]  # not viewable as [96, V]: read per batch row, not copied
    labels = torch.randint(0, 49152, (4, 24), generator=torch.Generator().manual_seed(1))
    lp, ent = logprobs_and_entropy(logits, labels)
    torch.testing.assert_close(ent, reference_entropy(logits), atol=fp32_tolerance(logits), rtol=0)
    expected = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(lp, expected, atol=fp32_tolerance(logits), rtol=0)
    lp2, ent2 = logprobs_and_entropy(logits.contiguous(), labels)  # 96 rows in other chunks than 4 x 24
    assert torch.equal(lp2, lp) and torch.equal(ent2, ent)


@pytest.mark.parametrize("v", [50, 49152])
@pytest.mark.parametrize("chunk_size", [None, 1, 2, 5, 7])
def test_log_probs_are_openrlhfs_and_trls_bit_for_bit(v, chunk_size):
    from trl.trainer.utils import selective_log_softmax

    from rlhf_ext.openrlhf.compat import import_shims

    with import_shims():
        from openrlhf.models.utils import log_probs_from_logits

    logits = _logits((3, 8, v), 6)
    labels = torch.randint(0, v, (3, 8), generator=torch.Generator().manual_seed(2))
    lp, _ = logprobs_and_entropy(logits, labels, chunk_size=chunk_size)  # 24 rows: chunks of 5 leave a last row
    assert torch.equal(lp, log_probs_from_logits(logits.clone(), labels))
    assert torch.equal(lp, selective_log_softmax(logits, labels))


def test_token_entropy_is_the_fused_entropy_shifted():
    logits = _logits((2, 6, 40), 7)
    ent = logprobs_and_entropy(logits)[1]
    assert torch.equal(token_entropy(logits, shift=False), ent)
    assert torch.equal(token_entropy(logits)[:, 1:], ent[:, :-1]) and (token_entropy(logits)[:, 0] == 0).all()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="labels"):
        logprobs_and_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        logprobs_and_entropy(torch.zeros(5))
