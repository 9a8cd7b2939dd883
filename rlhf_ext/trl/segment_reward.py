"""Segment-level reward model training on TRL: ``SegmentRewardConfig`` + ``SegmentRewardTrainer`` (paper 003, 2.2).

TRL's ``RewardTrainer`` on a dataset carrying the frozen SFT model's entropy of every response token
(:func:`rlhf_ext.runtime.segment_data.prepare_segment_dataset`; pairs without a preference dropped), with a loss that
reads the score head at every position, splits responses at tokens whose SFT entropy exceeds ``entropy_cutoff``,
aggregates segment rewards by the soft-max of paper 003 Eq. 4 and applies the Bradley-Terry loss of Eq. 3
(``entropy_cutoff=inf``: the stock bandit loss).

Example::

    from rlhf_ext.trl import SegmentRewardConfig, SegmentRewardTrainer

    trainer = SegmentRewardTrainer(
        model="my-sft-checkpoint",            # the reward model starts from the SFT model, which also segments the data
        args=SegmentRewardConfig(output_dir="rm", entropy_cutoff=2.0, tau=0.5),
        train_dataset=dataset,                # prompt / chosen / rejected
        processing_class=tokenizer,
    )
    trainer.train()
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from trl import RewardConfig, RewardTrainer

from rlhf_ext.algos.knobs import knob
from rlhf_ext.algos.segment_reward import SegmentRewardKnobs, evaluate_sequences, segment_bt_loss
from rlhf_ext.runtime.segment_data import (
    ENTROPY_COLUMNS,
    TOKENIZED_COLUMNS,
    DatasetFormatError,
    collate_segment_pairs,
    prepare_segment_dataset,
    save_segment_settings,
)
from rlhf_ext.runtime.token_scores import TokenScoreCapture
from rlhf_ext.trl.args import CheckpointRecords, HardwareBF16Default

logger = logging.getLogger(__name__)

#: Why :func:`pair_defect` finds a pair useless, as the warning and the error word it.
PAIR_DEFECTS = {
    "empty": "an empty chosen or rejected response",
    "no_room": "no response token left after a prompt that used up max_length (raise data.max_length or set a smaller "
    "data.max_prompt_length)",
    "identical": "identical chosen and rejected responses",
}


@dataclass
class SegmentRewardConfig(SegmentRewardKnobs, HardwareBF16Default, RewardConfig):
    """``RewardConfig`` plus paper 003's knobs (:class:`~rlhf_ext.algos.segment_reward.SegmentRewardKnobs`) and:

    Args:
        sft_model_name_or_path: the SFT checkpoint used for segmentation (default: ``model`` when it is a path).
        segment_cache_dir: where to cache the segmented dataset (``None``: no cache).
    """

    sft_model_name_or_path: str | None = field(default=None, metadata={"help": "SFT model used for segmentation."})
    entropy_batch_size: int = knob(8, ge=1, help="Batch size of the entropy preprocessing pass.")
    segment_cache_dir: str | None = field(default=None, metadata={"help": "Cache directory for segmented data."})

    def segment_settings(self) -> dict[str, Any]:
        """What PPO needs to reuse this reward model's segmentation (saved as ``segment_config.json``)."""
        keys = ("entropy_cutoff", "aggregation", "tau", "sft_model_name_or_path")
        return {k: getattr(self, k) for k in keys}


def pair_defect(
    chosen_ids: list[int],
    rejected_ids: list[int],
    prompt_len: int,
    eos_token_id: int | None,
    max_length: int | None = None,
) -> str | None:
    """Why a tokenised preference pair carries no preference: ``"no_room"`` (a response cut to its closing EOS
    because the prompt filled ``max_length``), ``"empty"`` (a response with no token besides its closing EOS),
    ``"identical"`` (the same token ids on both sides), or ``None`` for a usable pair."""
    for ids in (chosen_ids, rejected_ids):
        response = ids[prompt_len:]
        if response and response[-1] == eos_token_id:
            response = response[:-1]
        if not response:
            return "no_room" if max_length is not None and prompt_len >= max_length - 1 else "empty"
    return "identical" if chosen_ids == rejected_ids else None


def drop_uninformative_pairs(
    dataset, eos_token_id: int | None, name: str = "train_dataset", max_length: int | None = None
):
    """``dataset`` (tokenised: :data:`~rlhf_ext.runtime.segment_data.TOKENIZED_COLUMNS`) without the pairs
    :func:`pair_defect` rejects, with one warning counting them by reason; dropping all raises
    :class:`~rlhf_ext.runtime.segment_data.DatasetFormatError` (``name`` says which dataset)."""
    rows = dataset.select_columns(list(TOKENIZED_COLUMNS))
    defects = [pair_defect(r["chosen_ids"], r["rejected_ids"], r["prompt_len"], eos_token_id, max_length) for r in rows]
    at: dict[str, list[int]] = {}
    for i, d in enumerate(defects):
        if d is not None:
            at.setdefault(d, []).append(i)
    if not at:
        return dataset
    dropped = sum(len(v) for v in at.values())
    reasons = ", ".join(
        f"{len(v)} with {PAIR_DEFECTS[d]}: rows {', '.join(map(str, v[:5]))}{', ...' if len(v) > 5 else ''}"
        for d, v in sorted(at.items())
    )
    if dropped == len(defects):
        raise DatasetFormatError(
            f"{name}: none of its {dropped} preference pairs is usable ({reasons}); check the chosen / rejected "
            "columns (recipe keys data.chosen_key / data.rejected_key) and max_length"
        )
    logger.warning(
        "%s: dropped %d of %d preference pairs that carry no preference (%s)", name, dropped, len(defects), reasons
    )
    return dataset.select([i for i, d in enumerate(defects) if d is None])


class SegmentPreferenceCollator:
    """Pads prepared preference examples (chosen then rejected, right padding) for :class:`SegmentRewardTrainer`."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return collate_segment_pairs(examples, self.pad_token_id, "right", self.pad_to_multiple_of)


#: The model card's "Quick start": a segment reward model's score of a response is its sequence evaluation e_phi
#: (paper 003 Eq. 4, the SFT model segments the response), not a sequence classifier's last-token output.
MODEL_CARD_QUICK_START = """## Quick start

This is an [rlhf-ext](https://pypi.org/project/rlhf-ext/) segment-level reward model (entropy segmentation by the SFT
model named in `segment_config.json`). Score a response by its sequence evaluation e_phi, which is what it was trained
to rank, from a local copy of this directory:

```python
from rlhf_ext.runtime.rewards import SegmentSequenceReward  # pip install rlhf-ext

reward = SegmentSequenceReward("{model}")
print(reward(prompts=["The capital of France is"], completions=[" Paris."]))  # tensor([e_phi])
```

Not `pipeline(model="{model}")(text)[0]["score"]`: that is the score of the last token only. Wherever a reward model
is accepted (`DensePPOTrainer(reward_funcs=...)`, `IterativeDPOTrainer`, `rlhf-ext serve rm`), pass this directory.

"""


class SegmentRewardTrainer(RewardTrainer):
    """TRL ``RewardTrainer`` with the segment-level loss of paper 003 (paper 003 Eq. 3-4). See the module docstring."""

    _tag_names = ["trl", "reward-trainer", "rlhf-ext", "segment-reward"]

    def __init__(
        self,
        model,
        args: SegmentRewardConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        *rest,
        sft_model=None,
        **kwargs,
    ):
        """``RewardTrainer``'s arguments in its order; ``sft_model`` (the segmenting SFT model, default
        ``args.sft_model_name_or_path``) is keyword-only."""
        if args is None:
            args = SegmentRewardConfig(output_dir="segment-reward-model")
        if not isinstance(args, SegmentRewardConfig):
            raise TypeError(f"args must be a SegmentRewardConfig, got {type(args).__name__}")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required (a preference dataset with prompt/chosen/rejected)")
        model_path = model if isinstance(model, str) else None
        if processing_class is None:
            if model_path is None:
                raise ValueError("pass processing_class= (the tokenizer) when the model is already instantiated")
            from transformers import AutoTokenizer

            processing_class = AutoTokenizer.from_pretrained(model_path)
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        if args.sft_model_name_or_path is None:
            args.sft_model_name_or_path = model_path or (
                getattr(getattr(sft_model, "config", None), "_name_or_path", None) if sft_model is not None else None
            )
        prepare = dict(
            tokenizer=processing_class,
            sft_model=sft_model,
            sft_model_name_or_path=args.sft_model_name_or_path if sft_model is None else None,
            max_length=args.max_length,
            entropy_batch_size=args.entropy_batch_size,
            cache_dir=args.segment_cache_dir,
        )
        eos = processing_class.eos_token_id

        def prepared(dataset, name: str):
            return drop_uninformative_pairs(prepare_segment_dataset(dataset, **prepare), eos, name, args.max_length)

        train_dataset = prepared(train_dataset, "train_dataset")
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: prepared(v, f"eval_dataset[{k!r}]") for k, v in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = prepared(eval_dataset, "eval_dataset")
        if data_collator is None:
            data_collator = SegmentPreferenceCollator(processing_class.pad_token_id, args.pad_to_multiple_of)
        super().__init__(model, args, data_collator, train_dataset, eval_dataset, processing_class, *rest, **kwargs)
        self.add_callback(CheckpointRecords())  # rlhf-ext's record in every checkpoint (resume and clean-up)
        self._capture = TokenScoreCapture(self.model)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = [*TOKENIZED_COLUMNS, *ENTROPY_COLUMNS, "margin"]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        action_mask = inputs.pop("action_mask")
        entropy = inputs.pop("entropy")
        margin = inputs.pop("margin", None)
        inputs["use_cache"] = False
        outputs = model(**inputs)
        token_scores = self._capture.pop().float()  # [2B, T]
        ev = evaluate_sequences(
            token_scores, entropy, action_mask, self.args.entropy_cutoff, self.args.aggregation, self.args.tau
        )
        rewards_chosen, rewards_rejected = ev.values.chunk(2)
        loss = segment_bt_loss(rewards_chosen, rewards_rejected, margin)
        if self.args.center_rewards_coefficient is not None:
            loss = loss + self.args.center_rewards_coefficient * torch.mean((rewards_chosen + rewards_rejected) ** 2)

        if mode == "train" and self.args.include_num_input_tokens_seen == "no":
            # counted in the TrainerState (as GRPO does), which a resume restores (TRL's _total_train_tokens restarts)
            num_tokens = self.accelerator.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
            self.state.num_input_tokens_seen += num_tokens // self._tp_size
        self._metrics[mode]["num_tokens"] = [self.state.num_input_tokens_seen]
        with torch.no_grad():
            gather = self.accelerator.gather_for_metrics
            values = gather(ev.values.detach())
            counts = gather(ev.segments.counts.float())
            tokens = gather(action_mask.sum(1).float())
            metrics = self._metrics[mode]
            for stat in ("min", "mean", "max"):
                metrics[f"{stat}_reward"].append(getattr(values, stat)().item())
            metrics["accuracy"].append(gather((rewards_chosen > rewards_rejected).float()).mean().item())
            metrics["margin"].append(gather((rewards_chosen - rewards_rejected).detach()).mean().item())
            metrics["segments_per_response"].append(counts.mean().item())
            metrics["mean_segment_length"].append((tokens.sum() / counts.sum().clamp_min(1)).item())
        if return_outputs:
            # The stock trainer returns the pooled logits; return the sequence evaluations e_phi in their place.
            outputs.logits = ev.values.detach().unsqueeze(-1)
            return loss, outputs
        return loss

    def create_model_card(self, model_name=None, dataset_name=None, tags=None) -> None:
        """TRL's model card, with its "Quick start" (the classifier's last-token score) replaced by
        :data:`MODEL_CARD_QUICK_START` (e_phi)."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        card = Path(self.args.output_dir) / "README.md"
        if self.is_world_process_zero() and card.is_file():
            text = card.read_text(encoding="utf-8")
            start, end = text.find("## Quick start"), text.find("## Training procedure")
            if start >= 0 and end > start:
                name = self.hub_model_id or Path(self.args.output_dir).name
                quick = MODEL_CARD_QUICK_START.replace("{model}", name)
                card.write_text(text[:start] + quick + text[end:], encoding="utf-8")

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        if self.args.should_save:
            save_segment_settings(output_dir, self.args.segment_settings())
