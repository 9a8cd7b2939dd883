"""Segment-level reward model training on OpenRLHF 0.11.2 (paper 003, section 2.2), through its own ``train_rm``.

:func:`install` swaps the subclasses below in on OpenRLHF's source modules and :func:`run_train_rm` runs the
*unmodified* ``openrlhf.cli.train_rm`` with our ``--ext.*`` flags attached as ``args.ext``::

    deepspeed --module rlhf_ext.openrlhf.train_rm \\
        --model.model_name_or_path SFT --data.dataset prefs.jsonl --data.prompt_key prompt ... \\
        --ext.entropy_cutoff 2.0 --ext.aggregation softmax --ext.tau 0.5

OpenRLHF's ``fit`` loop hands only ids and masks to ``concatenated_forward``, so the collator returns a *role mask* in
place of the attention mask (:func:`encode_role_mask`), from which :class:`SegmentRewardModelTrainer` computes the
sequence evaluation e_phi (:func:`rlhf_ext.segment.evaluate_sequences`) for the BT loss of paper 003 Eq. 3.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from rlhf_ext.algos.knobs import knob, knob_specs
from rlhf_ext.algos.names import knob_defaults
from rlhf_ext.algos.segment_reward import SegmentRewardKnobs, check_aggregation, evaluate_sequences
from rlhf_ext.openrlhf.cli_runner import ExtArgsError, flag_value, run_cli_module, split_ext_args
from rlhf_ext.openrlhf.compat import check_version, import_shims, patch_for_cpu
from rlhf_ext.runtime.segment_data import (
    ENTROPY_COLUMNS,
    TOKENIZED_COLUMNS,
    collate_segment_pairs,
    prepare_segment_dataset,
)
from rlhf_ext.runtime.token_scores import TokenScoreCapture

with import_shims():
    from openrlhf.datasets.reward_dataset import RewardDataset
    from openrlhf.trainer.rm_trainer import RewardModelTrainer


@dataclass
class RMExtFlags(SegmentRewardKnobs):
    """The ``--ext.*`` options of ``rlhf_ext.openrlhf.train_rm``: paper 003's knobs plus ``sft_model`` (default:
    ``--model.model_name_or_path``), the entropy pass's batch size, the prompt budget and the data cache."""

    sft_model: str | None = None
    entropy_batch_size: int = knob(8, ge=1)
    max_prompt_length: int | None = knob(None, ge=1)
    cache_dir: str | None = None


#: ``--ext.*`` options and their defaults.
EXT_DEFAULTS: dict[str, Any] = knob_defaults(RMExtFlags)


def parse_ext_args(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Split and validate this module's ``--ext.*`` options (:class:`RMExtFlags`)."""
    return split_ext_args(argv, EXT_DEFAULTS, validate_ext, specs=knob_specs(RMExtFlags))


def validate_ext(ext: dict[str, Any]) -> dict[str, Any]:
    try:
        check_aggregation(ext["aggregation"])
    except ValueError as e:
        raise ExtArgsError(f"--ext.{e}") from None
    return dict(ext)


# ----------------------------------------------------------------------------------------------- the role mask
ROLE_PAD, ROLE_PROMPT = 0.0, -1.0


def encode_role_mask(attention_mask: torch.Tensor, action_mask: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` float64 (the entropy round-trips exactly): 0 = padding, -1 = prompt, ``1 + entropy`` = response."""
    roles = torch.where(attention_mask.bool(), ROLE_PROMPT, ROLE_PAD).double()
    return torch.where(action_mask.bool(), 1.0 + entropy.double(), roles)


def decode_role_mask(roles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`encode_role_mask`: (attention_mask long, action_mask bool, entropy float32)."""
    attention_mask = (roles != ROLE_PAD).long()
    action_mask = roles >= 1.0
    entropy = torch.where(action_mask, roles - 1.0, 0.0).float()
    return attention_mask, action_mask, entropy


# ------------------------------------------------------------------------------------------------ the dataset
class SegmentRewardDataset(RewardDataset):
    """OpenRLHF ``RewardDataset`` over segment-prepared rows (token ids, prompt length, SFT entropies), or raw
    preference rows prepared with ``--ext.sft_model`` and cached in ``--ext.cache_dir`` for all ranks."""

    def __init__(self, dataset, tokenizer, max_length: int, strategy, input_template=None, is_dpo=False, **kwargs):
        if is_dpo:
            raise ValueError("SegmentRewardDataset is for reward-model training, not DPO")
        self.tokenizer, self.strategy, self.max_length = tokenizer, strategy, max_length
        args, ext = strategy.args, strategy.args.ext
        if args.ds.packing_samples:
            raise ValueError("segment reward training does not support --ds.packing_samples; drop the flag")
        if not all(c in dataset.column_names for c in TOKENIZED_COLUMNS + ENTROPY_COLUMNS):
            prompt_key = getattr(args.data, "prompt_key", None)
            if input_template and prompt_key:
                dataset = dataset.map(lambda row: {prompt_key: input_template.format(row[prompt_key])})
            dataset = prepare_segment_dataset(
                dataset,
                tokenizer,
                sft_model_name_or_path=ext.sft_model or args.model.model_name_or_path,
                max_length=max_length,
                max_prompt_length=ext.max_prompt_length,
                prompt_key=prompt_key,
                chosen_key=args.data.chosen_key,
                rejected_key=args.data.rejected_key,
                entropy_batch_size=ext.entropy_batch_size,
                cache_dir=ext.cache_dir,
            )
        too_long = [i for i, n in enumerate(dataset["chosen_ids"]) if len(n) > max_length]
        if too_long:
            raise ValueError(
                f"{len(too_long)} prepared rows exceed --data.max_len {max_length} (e.g. row {too_long[0]}); "
                "prepare the data with the same max length"
            )
        keep = [*TOKENIZED_COLUMNS, *ENTROPY_COLUMNS] + (["margin"] if "margin" in dataset.column_names else [])
        self.rows = dataset.select_columns(keep)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        return self.rows[idx]

    def collate_fn(self, item_list: list[dict[str, Any]]):
        """Left-padded (OpenRLHF's RM convention) chosen and rejected batches with role masks (see module doc)."""
        batch = collate_segment_pairs(item_list, self.tokenizer.pad_token_id, padding_side="left")
        roles = encode_role_mask(batch["attention_mask"], batch["action_mask"], batch["entropy"])
        n = len(item_list)
        margins = batch["margin"].tolist() if "margin" in batch else [0.0] * n
        ids = batch["input_ids"]
        return ids[:n], roles[:n], ids[n:], roles[n:], margins


# ------------------------------------------------------------------------------------------------ the trainer
class SegmentRewardModelTrainer(RewardModelTrainer):
    """OpenRLHF ``RewardModelTrainer`` whose chosen/rejected "rewards" are segment sequence evaluations
    (paper 003 Eq. 4)."""

    def __init__(self, model, strategy, *args, **kwargs):
        super().__init__(model, strategy, *args, **kwargs)
        ext = strategy.args.ext
        self.entropy_cutoff, self.aggregation, self.tau = ext.entropy_cutoff, ext.aggregation, ext.tau
        self._capture = TokenScoreCapture(model)
        self._segment_stats = torch.zeros(3, dtype=torch.float64)  # responses, segments, response tokens

    def concatenated_forward(self, model, chosen_ids, c_mask, reject_ids, r_mask):
        input_ids, roles = self.concatenated_inputs(chosen_ids, c_mask, reject_ids, r_mask)
        attention_mask, action_mask, entropy = decode_role_mask(roles)
        _, output = model(
            input_ids, attention_mask=attention_mask, return_output=True, ring_attn_group=self.strategy.ring_attn_group
        )
        token_scores = self._capture.pop().float()
        ev = evaluate_sequences(token_scores, entropy, action_mask, self.entropy_cutoff, self.aggregation, self.tau)
        with torch.no_grad():
            self._segment_stats += torch.tensor(
                [ev.values.numel(), ev.segments.counts.sum().item(), action_mask.sum().item()], dtype=torch.float64
            )
        n = chosen_ids.shape[0]
        aux_loss = output.aux_loss if "aux_loss" in output else []
        return ev.values[:n], ev.values[n:], aux_loss

    def evaluate(self, eval_dataloader, steps=0):
        """OpenRLHF's evaluation, skipped (with one notice) when the eval set is empty (OpenRLHF's loop would crash)."""
        if len(eval_dataloader) == 0:
            if not getattr(self, "_warned_empty_eval", False):
                self.strategy.print("rlhf-ext: the eval set is empty (pass --eval.dataset); skipping evaluation")
                self._warned_empty_eval = True
            return None
        return super().evaluate(eval_dataloader, steps)

    def save_logs_and_checkpoints(self, args, global_step, step_bar, logs_dict=None, client_states=None):
        if logs_dict is not None and self._segment_stats[0] > 0:
            responses, segments, tokens = self._segment_stats.tolist()
            logs_dict["segments_per_response"] = segments / responses
            logs_dict["mean_segment_length"] = tokens / max(segments, 1.0)
            self._segment_stats.zero_()
        return super().save_logs_and_checkpoints(args, global_step, step_bar, logs_dict, client_states)


# ------------------------------------------------------------------------------------------------- the runner
def install() -> None:
    """Make OpenRLHF's ``train_rm`` build our dataset and trainer (patches its source modules; idempotent)."""
    check_version()
    patch_for_cpu()
    import openrlhf.datasets as datasets_pkg
    import openrlhf.datasets.reward_dataset as reward_dataset_module
    import openrlhf.trainer.rm_trainer as rm_trainer_module

    datasets_pkg.RewardDataset = SegmentRewardDataset
    reward_dataset_module.RewardDataset = SegmentRewardDataset
    rm_trainer_module.RewardModelTrainer = SegmentRewardModelTrainer


def run_train_rm(argv: Sequence[str]) -> None:
    """Run ``openrlhf.cli.train_rm`` with the segment subclasses and ``--ext.*`` options (a bad one raises
    :class:`~rlhf_ext.openrlhf.cli_runner.ExtArgsError` or :class:`~rlhf_ext.algos.knobs.KnobError`)."""
    rest, ext = parse_ext_args(argv)
    install()
    run_cli_module("openrlhf.cli.train_rm", rest, lambda args: setattr(args, "ext", SimpleNamespace(**ext)))
    if int(os.environ.get("RANK", "0")) == 0:
        from rlhf_ext.runtime.segment_data import save_segment_settings

        settings = {k: ext[k] for k in ("entropy_cutoff", "aggregation", "tau")}
        settings["sft_model_name_or_path"] = ext["sft_model"] or flag_value(rest, "--model.model_name_or_path", None)
        save_segment_settings(flag_value(rest, "--ckpt.output_dir", "./ckpt"), settings)
