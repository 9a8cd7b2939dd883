"""Fit a :class:`LocationNormalizer` on a calibration set (paper 003, section 2.3; Algorithm 1 line 16).

The calibration set is the preference data's chosen *and* rejected responses. Each is segmented with the SFT model,
scored by the reward model, and every segment contributes one (location p, reward) point. For the bandit
granularities each response contributes its sequence reward at p = 1, so one function serves every row of Table 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlhf_ext.algos.location_norm import LocationNormalizer, NormalizerError
from rlhf_ext.algos.segment_dense import dense_segment_rewards
from rlhf_ext.runtime.io import atomic_write_json
from rlhf_ext.runtime.segment_data import collate_segment_pairs, prepare_segment_dataset
from rlhf_ext.runtime.token_scores import token_scores


def model_id(name_or_path: str) -> str:
    """A stable identifier of a checkpoint: its absolute path if it is a local directory, else the name."""
    p = Path(name_or_path)
    return str(p.resolve()) if p.exists() else str(name_or_path)


@torch.no_grad()
def fit_normalizer(
    reward_model,
    sft_model,
    tokenizer,
    dataset,
    kind: str = "regression",
    basis: str = "linear",
    granularity: str = "segment",
    entropy_cutoff: float = 2.0,
    aggregation: str = "softmax",
    tau: float = 0.5,
    reward_model_id: str | None = None,
    max_length: int | None = None,
    batch_size: int = 16,
    max_pairs: int | None = None,
) -> LocationNormalizer:
    """Fit a normalizer from the reward model's rewards on ``dataset``'s chosen and rejected responses.

    Args:
        reward_model: sequence-classification reward model (instance).
        sft_model: the SFT causal LM used for segmentation (instance).
        dataset: preference rows (prompt/chosen/rejected) or a prepared segment dataset.
        granularity, entropy_cutoff, aggregation, tau: as used in PPO (:func:`dense_segment_rewards`).
        reward_model_id: recorded in the normalizer so PPO can refuse it for another reward model.
    """
    if max_pairs is not None:
        dataset = dataset.select(range(min(max_pairs, len(dataset))))
    prepared = prepare_segment_dataset(dataset, tokenizer, sft_model=sft_model, max_length=max_length)
    reward_model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    locations, rewards = [], []
    for start in range(0, len(prepared), batch_size):
        rows = list(prepared.select(range(start, min(start + batch_size, len(prepared)))))
        batch = collate_segment_pairs(rows, pad)
        device = next(reward_model.parameters()).device
        scores = token_scores(reward_model, batch["input_ids"].to(device), batch["attention_mask"].to(device)).cpu()
        dense = dense_segment_rewards(
            scores,
            batch["action_mask"],
            batch["entropy"],
            granularity=granularity,
            entropy_cutoff=entropy_cutoff,
            aggregation=aggregation,
            tau=tau,
        )
        if granularity in ("bandit", "segment_as_bandit"):
            locations.append(torch.ones(len(rows) * 2))
            rewards.append(dense.raw_seg_rewards[:, 0])
        else:
            locations.append(dense.segments.locations[dense.segments.mask])
            rewards.append(dense.raw_seg_rewards[dense.segments.mask])
    return LocationNormalizer.fit(
        torch.cat(locations), torch.cat(rewards), kind=kind, basis=basis, reward_model=reward_model_id
    )


def save_normalizer(normalizer: LocationNormalizer, path: str | Path) -> None:
    """Write ``normalizer`` as JSON (atomically), with the reward model it was fitted for, its point count and R^2."""
    atomic_write_json(path, normalizer.to_dict())


def load_normalizer(path: str | Path, reward_model: str | None = None) -> LocationNormalizer:
    """Read a saved normalizer; refuse one fitted for a different ``reward_model`` (when both are known)."""
    path = Path(path)
    if not path.is_file():
        raise NormalizerError(
            f"normalizer file {path} does not exist; fit one with `rlhf-ext segment fit-normalizer` or set "
            "the recipe's normalizer.path to null to fit it on the calibration data"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise NormalizerError(f"{path} is not a LocationNormalizer file: {e}") from e
    norm = LocationNormalizer.from_dict(data, source=str(path))
    if reward_model is not None and norm.reward_model is not None and norm.reward_model != reward_model:
        raise NormalizerError(
            f"{path} was fitted for reward model {norm.reward_model!r}, not {reward_model!r}; segment reward "
            "statistics differ between reward models, so refit it on this model's calibration rewards"
        )
    return norm
