"""Supervised fine-tuning with a KL penalty to a frozen reference model (Quark's KL term; paper 002, App. A.2/B.2).

Quark (Lu et al., 2022) fine-tunes on the model's own best-scoring samples while "minimizing the KL divergence
between the trained model and the SFT initialization" (AlpacaFarm: coefficient 0.05, Appendix B.2).
:class:`KLRegularizedSFTTrainer` is TRL's ``SFTTrainer`` with that term added to its loss::

    loss = NLL(completion tokens) + kl_coef * mean_t KL( pi_theta(. | y_<t) || pi_ref(. | y_<t) )

over the completion tokens the NLL uses, the KL exact over the vocabulary. With ``kl_coef = 0`` it is ``SFTTrainer``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl import SFTConfig, SFTTrainer

from rlhf_ext.algos.knobs import check_knobs, knob
from rlhf_ext.trl.args import HardwareBF16Default


@dataclass
class KLSFTConfig(HardwareBF16Default, SFTConfig):
    """``SFTConfig`` plus ``kl_coef`` (AlpacaFarm's Quark: 0.05)."""

    kl_coef: float = knob(0.05, ge=0, help="Weight of KL(pi || pi_ref) per completion token.")

    def __post_init__(self):
        super().__post_init__()
        check_knobs(self)


def token_kl(logits, ref_logits) -> torch.Tensor:
    """``[B, T]`` exact ``KL(softmax(logits) || softmax(ref_logits))`` at each position (``[B, T, V]`` inputs;
    log-probabilities work as logits)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ref_logp = torch.log_softmax(ref_logits.float(), dim=-1)
    return (logp.exp() * (logp - ref_logp)).sum(-1)


class KLRegularizedSFTTrainer(SFTTrainer):
    """``SFTTrainer`` whose loss adds ``kl_coef`` x the per-token KL to ``ref_model`` on completion tokens."""

    _tag_names = ["trl", "sft", "rlhf-ext", "kl-regularized"]

    def __init__(self, model, args: KLSFTConfig, *rest, ref_model=None, **kwargs):
        if not isinstance(args, KLSFTConfig):
            raise TypeError(f"args must be a KLSFTConfig (it carries kl_coef), got {type(args).__name__}")
        if ref_model is None:
            raise ValueError("KLRegularizedSFTTrainer needs ref_model= (the frozen SFT initialization)")
        super().__init__(model, args, *rest, **kwargs)
        self.ref_model = self.accelerator.prepare_model(ref_model.eval(), evaluation_mode=True)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """``kl_coef = 0``: ``SFTTrainer``'s loss; else the NLL and the KL from one policy forward (with logits)."""
        if self.args.kl_coef == 0:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        forward = {k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids") if k in inputs}
        outputs = model(**forward, use_cache=False)
        logp = torch.log_softmax(outputs.logits[:, :-1].float(), dim=-1)  # logits at t predict token t + 1
        labels = inputs["labels"][:, 1:]
        mask = labels != -100
        nll = -logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        # SFTTrainer's normalisation: tokens of the whole (accumulated, all-rank) batch when the Trainer passes it
        num_tokens = mask.sum() if num_items_in_batch is None else num_items_in_batch
        loss = (nll * mask).sum() / torch.as_tensor(num_tokens).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes
        with torch.no_grad():
            ref_logits = self.ref_model(**forward, use_cache=False).logits[:, :-1]
        kl = (token_kl(logp, ref_logits) * mask).sum() / mask.sum().clamp_min(1)
        mode = "train" if model.training else "eval"
        self._metrics[mode]["kl_to_ref"].append(self.accelerator.gather(kl.detach()).mean().item())
        loss = loss + self.args.kl_coef * kl
        return (loss, outputs) if return_outputs else loss
