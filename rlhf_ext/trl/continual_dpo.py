"""Continual DPO on TRL: ``ContinualDPOConfig`` + ``ContinualDPOTrainer`` (paper 000, section 4, Eq. 6-7)::

    loss = DPO loss (paper 000 Eq. 6, reference = SFT model)  +  c * kl_to_previous(logp, prev_logp, completion mask)

``logp``: the policy's per-token log-probs of the stock forward pass (captured, not recomputed); ``prev_logp``: one
no-grad forward of the frozen previous-task model (prepared as TRL prepares the reference). With ``c = 0`` or no
previous-task model the loss *is* ``DPOTrainer``'s. The unweighted KL is logged as ``continual/kl_to_previous``; on
offline pairs k1/k2/k3 are penalties on the dataset's tokens, not unbiased KL estimates
(:mod:`rlhf_ext.algos.continual_kl`).

Example::

    from rlhf_ext.trl import ContinualDPOConfig, ContinualDPOTrainer

    trainer = ContinualDPOTrainer(
        model="runs/seq/task_00/policy",          # start task 1 from the task-0 snapshot
        ref_model=sft_model,                      # DPO reference: the SFT model (paper 000 Eq. 6)
        prev_model="runs/seq/task_00/policy",     # frozen pi_{t-1} for the KL term (paper 000 Eq. 7)
        args=ContinualDPOConfig(output_dir="out", continual_kl_coef=1.0, continual_kl_estimator="k3"),
        train_dataset=task1["train"], processing_class=tokenizer,
    )
    trainer.train()
    trainer.implicit_reward_accuracy(task0["test"])   # forgetting of task 0
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from trl import DPOConfig, DPOTrainer
from trl.models import prepare_deepspeed, prepare_fsdp
from trl.trainer.utils import add_fused_lm_head, create_model_from_path, disable_dropout_in_model

from rlhf_ext.algos.continual_kl import ContinualKnobs, kl_to_previous
from rlhf_ext.trl.args import HardwareBF16Default

#: Batch keys that are not model inputs (same set as TRL's ``DPOTrainer._compute_loss``).
_NON_MODEL_KEYS = frozenset({"completion_mask", "ref_chosen_logps", "ref_rejected_logps"})
KL_METRIC = "continual/kl_to_previous"


@dataclass
class ContinualDPOConfig(ContinualKnobs, HardwareBF16Default, DPOConfig):
    """``DPOConfig`` plus paper 000's knobs (:class:`~rlhf_ext.algos.continual_kl.ContinualKnobs`:
    ``continual_kl_coef`` 1.0 = Eq. 7's unit weight, 0 = plain DPO; ``continual_kl_estimator`` k3)."""


class _FirstForwardLogProbs:
    """Forward hook that keeps ``log_probs`` of the first fused-head forward pass after :meth:`armed` (the policy's
    own pass inside ``DPOTrainer._compute_loss``; later passes, e.g. a PEFT reference pass, are ignored)."""

    def __init__(self, module: torch.nn.Module):
        self._armed = False
        self._log_probs: torch.Tensor | None = None
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        if self._armed:
            self._log_probs = getattr(output, "log_probs", None)
            self._armed = False

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        self._armed, self._log_probs = True, None
        try:
            yield
        finally:
            self._armed = False

    def pop(self) -> torch.Tensor:
        if self._log_probs is None:
            raise RuntimeError(
                "the policy forward pass returned no per-token log_probs; ContinualDPOTrainer needs TRL's fused LM "
                "head (trl==1.16), which DPOTrainer installs on the policy"
            )
        out, self._log_probs = self._log_probs, None
        return out


class ContinualDPOTrainer(DPOTrainer):
    """TRL ``DPOTrainer`` + ``c * KL(pi_theta || pi_{t-1})`` on the batch (see the module docstring).

    Args:
        model, ref_model, args, ...: as for ``DPOTrainer`` (pass ``ref_model`` explicitly: the SFT model).
        prev_model: the frozen policy from the end of the previous task, a model or a checkpoint path; ``None`` for
            the first task (the trainer is then exactly ``DPOTrainer``).
    """

    _tag_names = ["trl", "dpo", "rlhf-ext", "continual-dpo"]

    def __init__(self, model, ref_model=None, args: ContinualDPOConfig | None = None, *rest, prev_model=None, **kwargs):
        if args is None:
            args = ContinualDPOConfig(output_dir="continual-dpo")
        if not isinstance(args, ContinualDPOConfig):
            raise TypeError(f"args must be a ContinualDPOConfig, got {type(args).__name__}")
        super().__init__(model, ref_model, args, *rest, **kwargs)
        self.prev_model = self._prepare_frozen(prev_model) if prev_model is not None else None
        self._policy_log_probs = _FirstForwardLogProbs(self.accelerator.unwrap_model(self.model))

    @property
    def continual_kl_active(self) -> bool:
        """True when the KL-to-previous-task term is computed (a previous model and ``c > 0``)."""
        return self.prev_model is not None and self.args.continual_kl_coef > 0

    def _prepare_frozen(self, prev_model):
        """Load (if a path), freeze and prepare the previous-task model the way TRL prepares its reference model."""
        if isinstance(prev_model, str | os.PathLike):
            prev_model = create_model_from_path(
                str(prev_model),
                dtype=self.model.dtype,
                attn_implementation=self.model.config._attn_implementation,
                trust_remote_code=self.args.trust_remote_code,
            )
        if prev_model is self.model or prev_model is self.ref_model:
            raise ValueError("prev_model must be its own frozen copy, not the policy or the reference model object")
        if self.args.disable_dropout:
            disable_dropout_in_model(prev_model)
        add_fused_lm_head(prev_model)
        prev_model.requires_grad_(False)
        prev_model.eval()
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(prev_model, self.accelerator)
        if self.is_fsdp_enabled:
            return prepare_fsdp(prev_model, self.accelerator)
        return self.accelerator.prepare_model(prev_model, evaluation_mode=True)

    @torch.no_grad()
    def previous_task_log_probs(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[2B, T-1]`` log pi_{t-1} of the batch's tokens (chosen rows then rejected rows; label-aligned: column
        ``i`` scores token ``i + 1``; zero outside the completion), from one frozen forward pass."""
        model_kwargs = {k: v for k, v in inputs.items() if k not in _NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        out = self.prev_model(**model_kwargs, labels=labels, fused_lm_head=True).log_probs
        return out[:, -(inputs["completion_mask"].size(1) - 1) :]

    def _compute_loss(self, model, inputs, return_outputs):
        if not self.continual_kl_active:
            return super()._compute_loss(model, inputs, return_outputs)
        with self._policy_log_probs.armed():
            result = super()._compute_loss(model, inputs, return_outputs)
        loss, outputs = result if return_outputs else (result, None)
        mask = inputs["completion_mask"][:, 1:].bool()
        logp = self._policy_log_probs.pop()[:, -mask.size(1) :]
        kl = kl_to_previous(logp, self.previous_task_log_probs(inputs), mask, self.args.continual_kl_estimator)
        loss = loss + self.args.continual_kl_coef * kl
        mode = "train" if self.model.training else "eval"
        self._metrics[mode][KL_METRIC].append(self.accelerator.gather_for_metrics(kl.detach()).mean().item())
        return (loss, outputs) if return_outputs else loss

    @torch.no_grad()
    def implicit_reward_accuracy(self, dataset, name: str = "eval") -> dict[str, float]:
        """Fraction of ``dataset``'s pairs whose implicit DPO reward ranks chosen above rejected (paper 000, section
        7): ``log pi(y_c)/pi_ref(y_c) > log pi(y_r)/pi_ref(y_r)``. Returns ``{"accuracy", "margin" (mean beta-scaled
        reward margin), "num_pairs"}``."""
        if self.ref_model is None:
            raise ValueError("implicit_reward_accuracy needs an explicit ref_model (the SFT model)")
        prepared = self._prepare_dataset(dataset, self.processing_class, self.args, name)
        was_training = self.model.training
        self.model.eval()
        margins = []
        try:
            for batch in self.get_eval_dataloader(prepared):
                inputs = self._prepare_inputs(batch)
                chosen, rejected = self.compute_ref_log_probs(self.model, inputs)
                ref_chosen, ref_rejected = self.compute_ref_log_probs(self.ref_model, inputs)
                margin = (chosen - ref_chosen) - (rejected - ref_rejected)
                margins.append(self.accelerator.gather_for_metrics(margin.float()))
        finally:
            self.model.train(was_training)
        m = torch.cat(margins)
        accuracy, margin = (m > 0).float().mean().item(), (self.beta * m).mean().item()
        return {"accuracy": accuracy, "margin": margin, "num_pairs": int(m.numel())}
