"""Fit a :class:`LocationNormalizer` on a calibration set (paper 003, section 2.3; Algorithm 1 line 16), save and
load it, or import one of paper 003's released normalizers (its public code's ``param.json``).

The calibration set is the preference data's chosen *and* rejected responses. Each is segmented with the SFT model,
scored by the reward model, and every segment contributes one (location p, reward) point. For the bandit
granularities each response contributes its sequence reward at p = 1, so one function serves every row of Table 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf_ext.algos.location_norm import REFERENCE_MAX_SEGMENTS, LocationNormalizer, NormalizerError
from rlhf_ext.algos.segment_dense import (
    DEFAULT_CHUNK_SIZE,
    Granularity,
    SegmentationRates,
    dense_segment_rewards,
    segmentation_totals,
)
from rlhf_ext.algos.segment_reward import DEFAULT_ENTROPY_CUTOFF, DEFAULT_TAU, Aggregation
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
    basis: str | None = "linear",
    granularity: str = Granularity.SEGMENT,
    entropy_cutoff: float = DEFAULT_ENTROPY_CUTOFF,
    aggregation: str = Aggregation.SOFTMAX,
    tau: float = DEFAULT_TAU,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    reward_model_id: str | None = None,
    max_length: int | None = None,
    batch_size: int = 16,
    max_pairs: int | None = None,
    method: str = "ols",
) -> LocationNormalizer:
    """Fit a normalizer from the reward model's rewards on ``dataset``'s chosen and rejected responses (preference rows
    or a prepared segment dataset), segmented as in PPO (:func:`dense_segment_rewards`). ``reward_model_id`` is
    recorded so PPO can refuse it for another reward model; ``kind``, ``basis``, ``method``:
    :meth:`LocationNormalizer.fit`'s (``method="huber"`` with ``basis=None`` is the public code's fit)."""
    if max_pairs is not None:
        dataset = dataset.select(range(min(max_pairs, len(dataset))))
    prepared = prepare_segment_dataset(dataset, tokenizer, sft_model=sft_model, max_length=max_length)
    reward_model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    locations, rewards = [], []
    totals = torch.zeros(3, dtype=torch.float64)  # segmentation_totals of the calibration responses
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
            chunk_size=chunk_size,
        )
        totals += segmentation_totals(dense.segments.counts, batch["action_mask"], batch["entropy"], entropy_cutoff)
        if Granularity(granularity).is_bandit:
            locations.append(torch.ones(len(rows) * 2))
            rewards.append(dense.raw_seg_rewards[:, 0])
        else:
            locations.append(dense.segments.locations[dense.segments.mask])
            rewards.append(dense.raw_seg_rewards[dense.segments.mask])
    normalizer = LocationNormalizer.fit(
        torch.cat(locations), torch.cat(rewards), kind=kind, basis=basis, reward_model=reward_model_id, method=method
    )
    reference = SegmentationRates.of_totals(totals)  # the monitor's reference: the SFT model on the calibration set
    return dataclasses.replace(normalizer, **reference._asdict())


def run_normalizer(
    args, normalizer: LocationNormalizer | None, calibration_dataset, tokenizer, rm_source: str | None, *,
    span_funcs=None, reward_model=None, sft_model=None, entropy_cutoff: float, aggregation: str, tau: float,
) -> LocationNormalizer:  # fmt: skip
    """The normalizer of a dense PPO run configured by ``args`` (``normalizer_path``, ``normalizer_kind``/``_basis``,
    ``granularity``, ``chunk_size``, ``calibration_max_pairs``): ``normalizer`` as given, else the file
    ``args.normalizer_path`` (refused if fitted for another reward model than ``rm_source``), else fitted on
    ``calibration_dataset`` -- to the spans of the one dense function among ``span_funcs``
    (:func:`~rlhf_ext.runtime.spans.fit_span_normalizer`), or to ``reward_model``'s segment rewards with
    ``sft_model``'s entropies (:func:`fit_normalizer`) -- else none (for segment rewards with a warning: paper 003
    Table 2's 'no normalization' breaks training)."""
    if normalizer is None and args.normalizer_path is not None:
        normalizer = load_normalizer(args.normalizer_path, reward_model=model_id(rm_source) if rm_source else None)
    calibrate = normalizer is None and calibration_dataset is not None and args.normalizer_kind != "none"
    if calibrate and span_funcs is not None:
        from rlhf_ext.runtime.spans import fit_span_normalizer

        normalizer = fit_span_normalizer(
            span_funcs, tokenizer, calibration_dataset, kind=args.normalizer_kind, basis=args.normalizer_basis,
            granularity=args.granularity, aggregation=aggregation, tau=tau, max_pairs=args.calibration_max_pairs,
        )  # fmt: skip
    elif calibrate:
        normalizer = fit_normalizer(
            reward_model, sft_model, tokenizer, calibration_dataset, kind=args.normalizer_kind,
            basis=args.normalizer_basis, granularity=args.granularity, entropy_cutoff=entropy_cutoff,
            aggregation=aggregation, tau=tau, chunk_size=args.chunk_size, reward_model_id=model_id(rm_source),
            max_pairs=args.calibration_max_pairs,
        )  # fmt: skip
    if normalizer is None and args.normalizer_kind != "none" and span_funcs is None:
        warnings.warn(
            "DensePPOTrainer: no normalizer_path and no calibration_dataset, so segment rewards are not "
            "normalized (Table 2's 'no normalization', which the paper found breaks training)",
            stacklevel=3,
        )
    return normalizer or LocationNormalizer(kind="none")


def save_normalizer(normalizer: LocationNormalizer, path: str | Path) -> None:
    """Write ``normalizer`` as JSON (atomically), with the reward model it was fitted for, its point count and R^2."""
    atomic_write_json(path, normalizer.to_dict())


def load_normalizer(path: str | Path, reward_model: str | None = None) -> LocationNormalizer:
    """Read a saved normalizer; refuse one fitted for a different ``reward_model`` (when both are known)."""
    path = Path(path)
    if not path.is_file():
        raise NormalizerError(
            f"normalizer file {path} does not exist; set the recipe's model.normalizer to an existing file (`rlhf-ext "
            "train segment-ppo` saves the one it fits as OUTPUT_DIR/normalizer.json), or to null to fit it on "
            "data.calibration"
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


# ----------------------------------------------------------------------------------- released normalizers (param.json)
#: The nesting of paper 003's released ``denserlhf/trainer/ppo_utils/param.json``, outermost first; its PPO looks
#: an entry up by ``--model_type``, ``--reward_fit_dataset``, ``--segment_method``, ``--agg_func`` and
#: ``--entropy_threshold``.
REFERENCE_KEY_LEVELS: tuple[str, ...] = ("model_type", "dataset", "method", "aggregation", "cutoff")


@dataclass(frozen=True)
class ReferenceEntry:
    """One fitted normalizer of a ``param.json``: its five keys as written and its ``[a, b, c, d]``."""

    model_type: str
    dataset: str
    method: str
    aggregation: str
    cutoff: str
    params: tuple[float, ...]

    @property
    def name(self) -> str:
        """``model_type/dataset/method/aggregation/cutoff``."""
        return "/".join((self.model_type, self.dataset, self.method, self.aggregation, self.cutoff))


def read_reference_params(path: str | Path) -> list[ReferenceEntry]:
    """Every entry of a released ``param.json``, in file order (:class:`NormalizerError`: the file is missing, not
    JSON, not nested as :data:`REFERENCE_KEY_LEVELS`, or has a cutoff key that is not a number)."""
    path = Path(path)
    if not path.is_file():
        raise NormalizerError(f"param.json file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise NormalizerError(f"{path} is not JSON: {e}") from e
    entries: list[ReferenceEntry] = []

    def walk(node, keys: tuple[str, ...]) -> None:
        if len(keys) == len(REFERENCE_KEY_LEVELS):
            if not isinstance(node, list):
                raise NormalizerError(f"{path}: entry {'/'.join(keys)} must be a list [a, b, c, d]; got {node!r}")
            entries.append(ReferenceEntry(*keys, params=tuple(node)))
            return
        level = REFERENCE_KEY_LEVELS[len(keys)]
        if not isinstance(node, dict):
            where = "/".join(keys) or "the top level"
            raise NormalizerError(
                f"{path}: {where} must map {level} keys to entries (nesting: {' -> '.join(REFERENCE_KEY_LEVELS)})"
            )
        for key, child in node.items():
            if level == "cutoff":
                try:
                    float(key)
                except ValueError:
                    raise NormalizerError(f"{path}: cutoff key {key!r} of {'/'.join(keys)} is not a number") from None
            walk(child, (*keys, key))

    walk(data, ())
    return entries


def import_reference_normalizer(
    path: str | Path,
    model_type: str,
    dataset: str,
    method: str,
    aggregation: str,
    cutoff: float,
    *,
    reward_model: str | None = None,
    std_floor: float | None = None,
    max_segments: int = REFERENCE_MAX_SEGMENTS,
) -> LocationNormalizer:
    """The released normalizer ``model_type/dataset/method/aggregation/cutoff`` of a ``param.json`` (paper 003's
    public code), as a :class:`LocationNormalizer` (``Mean(p) = a ln p + c``, ``Std(p) = b ln p + d``; the other
    arguments: :meth:`LocationNormalizer.from_reference_params`). The cutoff matches numerically (``2`` finds
    ``"2.0"``). Unlike the public code (silently no normalization), a missing entry is a :class:`NormalizerError`
    listing the file's entries, as are several matches, a malformed file and a Std not positive on
    ``[1 / max_segments, 1]`` without ``std_floor``."""
    path = Path(path)
    entries = read_reference_params(path)
    wanted = (model_type, dataset, method, aggregation)
    # the cutoff key as a number (the public code converts numeric keys to float before its look-up)
    matches = [
        e
        for e in entries
        if (e.model_type, e.dataset, e.method, e.aggregation) == wanted and math.isclose(float(e.cutoff), cutoff)
    ]
    requested = "/".join((*wanted, f"{cutoff:g}"))
    if not matches:
        raise NormalizerError(
            f"{path} has no entry {requested}; its entries ({'/'.join(REFERENCE_KEY_LEVELS)}): "
            + ", ".join(e.name for e in entries)
        )
    if len(matches) > 1:
        names = ", ".join(e.name for e in matches)
        raise NormalizerError(f"{path} has {len(matches)} entries for {requested}: {names}")
    return LocationNormalizer.from_reference_params(
        matches[0].params,
        source=f"{path.name} entry {matches[0].name}",
        reward_model=reward_model,
        std_floor=std_floor,
        max_segments=max_segments,
    )
