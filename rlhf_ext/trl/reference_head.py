"""The fused LM head of the frozen models a TRL trainer scores rollouts with (reference / SFT, previous task).

TRL's :func:`trl.trainer.utils.add_fused_lm_head` projects every position (prompt included) in tiles. For no-grad
calls on a plain output head (the rollout's reference forward) :func:`add_reference_head` answers instead with
:func:`~rlhf_ext.runtime.segment_data.head_logprobs_and_entropy`: only labelled positions are projected, log-probs and
entropies in one pass per cache-sized chunk (as OpenRLHF's reference actor does). Calls with gradients, pre-shifted
labels, router logits, soft-capped or scaled logits, and devices where TRL runs its Triton kernel (CUDA, XPU) go to
TRL's head unchanged.
"""

from __future__ import annotations

import functools
import types

import torch

from rlhf_ext.runtime.segment_data import head_logprobs_and_entropy, output_head_is_plain

#: Devices where TRL's fused head runs its Triton kernel (``trl.kernels.chunked_logprob._use_triton``).
TRITON_DEVICES = ("cuda", "xpu")


def add_reference_head(model, temperature: float = 1.0, entropy: bool = False, cast_lm_head_to_fp32: bool = False):
    """Give ``model`` TRL's fused LM head (``model(..., labels=..., fused_lm_head=True)`` returns a
    ``FusedCausalLMOutput`` with ``log_probs`` ``[B, T - 1]`` and, with ``entropy``, ``entropy`` ``[B, T - 1]``:
    position ``t`` scores label ``t + 1``, zeros where the label is -100) and answer its no-grad calls with one pass
    per chunk over the labelled positions' logits."""
    from trl.trainer.utils import FusedCausalLMOutput, add_fused_lm_head

    add_fused_lm_head(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32,
                      outputs=("log_probs", "entropy") if entropy else ("log_probs",))  # fmt: skip
    if not output_head_is_plain(model) or (cast_lm_head_to_fp32 and model.dtype != torch.float32):
        return
    trl_forward = model.forward

    @functools.wraps(type(model).forward)  # generate() validates its kwargs against the signature
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, **kwargs):
        if (not fused_lm_head or torch.is_grad_enabled() or args or shift_labels is not None
                or kwargs.get("output_router_logits") or kwargs.get("num_items_in_batch") is not None
                or self.get_output_embeddings().weight.device.type in TRITON_DEVICES):  # fmt: skip
            return trl_forward(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(**kwargs).last_hidden_state[:, :-1]
        head = self.get_output_embeddings()
        labels = labels[:, 1:].to(head.weight.device)
        mask = labels != -100
        log_probs, ent = head_logprobs_and_entropy(
            head, hidden.to(head.weight.device)[mask], labels[mask], temperature, entropy=entropy
        )
        log_probs, ent = (
            None if x is None else x.new_zeros(mask.shape).masked_scatter_(mask, x) for x in (log_probs, ent)
        )
        loss = -log_probs.sum() / mask.sum().clamp(min=1)
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=ent, label_mask=mask)

    model.forward = types.MethodType(forward, model)
