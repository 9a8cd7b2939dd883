"""Preference data for segment reward models: tokenisation, one-time SFT entropy preprocessing, caching, collation.

Segmentation is a one-time preprocessing step with the frozen SFT model (paper 003, section 2.2 and Algorithm 1). The
SFT *entropy* of every response token is stored rather than the boundaries, so the cutoff stays a training-time
setting (Table 1's models and Figure 4's cutoff sweep reuse one cache). Both engines read the same columns:

========================  =====================================================================================
column                    meaning
========================  =====================================================================================
``chosen_ids``            prompt + chosen response token ids (response ends with EOS)
``rejected_ids``          prompt + rejected response token ids
``prompt_len``            number of prompt tokens at the start of both sequences
``chosen_entropy``        entropy of the SFT distribution each chosen-response token was sampled from (nats)
``rejected_entropy``      same for the rejected response
``margin`` (optional)     passed through (margin BT loss)
========================  =====================================================================================

Truncation follows the paper (Appendix C): prompts are truncated on the left, responses on the right, and a response
whose EOS was cut off gets its last kept token replaced by EOS.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlhf_ext.algos.segment_dense import Granularity
from rlhf_ext.algos.segment_reward import (
    DEFAULT_ENTROPY_CUTOFF,
    DEFAULT_TAU,
    Aggregation,
    logprobs_and_entropy,
    token_entropy,
)
from rlhf_ext.runtime.io import atomic_directory, atomic_write_text, build_once, stable_hash
from rlhf_ext.runtime.sampling import is_conversation as _is_conversation

logger = logging.getLogger(__name__)

ENTROPY_COLUMNS = ("chosen_entropy", "rejected_entropy")
TOKENIZED_COLUMNS = ("chosen_ids", "rejected_ids", "prompt_len")


class DatasetFormatError(ValueError):
    """The preference dataset is missing a column or holds a value of the wrong type."""


def check_preference_columns(column_names: Sequence[str], chosen_key: str, rejected_key: str, where: str) -> None:
    missing = [c for c in (chosen_key, rejected_key) if c not in column_names]
    if missing:
        raise DatasetFormatError(
            f"{where}: preference dataset has no column {', '.join(repr(c) for c in missing)} "
            f"(columns: {', '.join(column_names) or 'none'}); rename your columns or set data.chosen_key / "
            "data.rejected_key (and data.prompt_key) in the recipe"
        )


def _split_prompt_response(example: dict, tokenizer, prompt_key: str | None, key: str) -> tuple[str, str, bool]:
    """Return (prompt_text, response_text, is_chat) for one side of a preference example."""
    response = example[key]
    prompt = example.get(prompt_key) if prompt_key else None
    if _is_conversation(response) or _is_conversation(prompt):
        if tokenizer.chat_template is None:
            raise DatasetFormatError(
                f"column '{key}' holds chat messages but the tokenizer has no chat template; set one or use plain text"
            )
        if prompt is None:  # implicit prompt: everything but the final assistant turn
            if not response or response[-1].get("role") != "assistant":
                raise DatasetFormatError(f"column '{key}': a conversation must end with an assistant message")
            prompt, response = response[:-1], response[-1:]
        prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        full_text = tokenizer.apply_chat_template(list(prompt) + list(response), tokenize=False)
        if not full_text.startswith(prompt_text):
            raise DatasetFormatError(
                "the chat template renders the prompt differently inside the full conversation; cannot locate the "
                f"response in column '{key}'"
            )
        return prompt_text, full_text[len(prompt_text) :], True
    if not isinstance(response, str):
        raise DatasetFormatError(f"column '{key}' must hold text or chat messages, got {type(response).__name__}")
    if prompt is not None and not isinstance(prompt, str):
        raise DatasetFormatError(f"column '{prompt_key}' must hold text, got {type(prompt).__name__}")
    return prompt or "", response, False


def tokenize_pair(
    example: dict,
    tokenizer,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
    prompt_key: str | None = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    chosen_offsets: bool = False,
) -> dict[str, Any]:
    """Tokenise one preference example into ``chosen_ids``, ``rejected_ids`` and ``prompt_len``: prompt and responses
    separately (an exact boundary), responses with EOS. With ``max_length`` the prompt is cut from the left to
    ``max_prompt_length`` (default ``max_length - 1``), then responses from the right with their last kept token set to
    EOS. ``chosen_offsets``: also ``chosen_text`` (as rendered), ``is_chat`` and ``chosen_tokens``: ``(ids, offsets)``
    of that text's own tokens (before EOS and the cut; ``offsets`` from a fast tokenizer, None from a slow one)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DatasetFormatError("the tokenizer has no EOS token; set tokenizer.eos_token")
    prompt_text, chosen_text, is_chat = _split_prompt_response(example, tokenizer, prompt_key, chosen_key)
    if example[rejected_key] is example[chosen_key]:  # one response on its own (the reward server): render it once
        rejected_text = chosen_text
    else:
        _, rejected_text, _ = _split_prompt_response(example, tokenizer, prompt_key, rejected_key)
    # Plain-text prompts get the tokenizer's special tokens (e.g. BOS); a chat template already renders them.
    prompt_ids = tokenizer(prompt_text, add_special_tokens=not is_chat)["input_ids"] if prompt_text else []

    def response_ids(text: str, offsets: bool = False) -> tuple[list[int], list[int], list[tuple[int, int]] | None]:
        """``text``'s ids with EOS, its own ids, and their offsets if asked (of a fast tokenizer): one call."""
        offsets = offsets and getattr(tokenizer, "is_fast", False)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=offsets) if text else \
            {"input_ids": [], "offset_mapping": []}  # fmt: skip
        own = encoded["input_ids"]
        mapping = [tuple(o) for o in encoded["offset_mapping"]] if offsets else None
        return (own if own and own[-1] == eos else own + [eos]), own, mapping

    chosen_ids, own, mapping = response_ids(chosen_text, chosen_offsets)
    responses = [chosen_ids, chosen_ids if rejected_text == chosen_text else response_ids(rejected_text)[0]]
    if max_length is not None:
        if max_length < 2:
            raise DatasetFormatError(f"max_length must be >= 2 (one prompt and one response token), got {max_length}")
        limit = min(max_prompt_length if max_prompt_length is not None else max_length - 1, max_length - 1)
        prompt_ids = prompt_ids[max(len(prompt_ids) - limit, 0) :]
        room = max_length - len(prompt_ids)
        responses = [ids if len(ids) <= room else ids[: room - 1] + [eos] for ids in responses]
    out = {
        "chosen_ids": prompt_ids + responses[0],
        "rejected_ids": prompt_ids + responses[1],
        "prompt_len": len(prompt_ids),
    }
    if "margin" in example and example["margin"] is not None:
        out["margin"] = float(example["margin"])
    if chosen_offsets:
        out.update(chosen_text=chosen_text, is_chat=is_chat, chosen_tokens=(own, mapping))
    return out


def tokenize_preference_dataset(
    dataset,
    tokenizer,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
    prompt_key: str | None = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    num_proc: int | None = None,
):
    """Map :func:`tokenize_pair` over a ``datasets.Dataset``; idempotent on an already tokenised dataset."""
    if all(c in dataset.column_names for c in TOKENIZED_COLUMNS):
        return dataset
    check_preference_columns(dataset.column_names, chosen_key, rejected_key, "tokenize_preference_dataset")
    if prompt_key and prompt_key not in dataset.column_names:
        prompt_key = None
    logger.info("tokenizing %d preference pairs", len(dataset))
    return dataset.map(
        _tokenize_row,
        with_indices=True,
        fn_kwargs=dict(
            tokenizer=tokenizer,
            max_length=max_length,
            max_prompt_length=max_prompt_length,
            prompt_key=prompt_key,
            chosen_key=chosen_key,
            rejected_key=rejected_key,
        ),
        remove_columns=[c for c in dataset.column_names if c != "margin"],
        num_proc=num_proc,
        desc="Tokenizing preference pairs",
    )


def _tokenize_row(example: dict, index: int, **kwargs: Any) -> dict[str, Any]:
    """:func:`tokenize_pair`, its :class:`DatasetFormatError` naming the row (0-based, in the order read)."""
    try:
        return tokenize_pair(example, **kwargs)
    except DatasetFormatError as e:
        raise DatasetFormatError(f"row {index} of the preference data: {e}") from None


#: Config fields by which a model's logits are more than ``lm_head(hidden)`` (soft-capping, scales; as TRL reads them).
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_scaling",
)


def output_head_is_plain(model) -> bool:
    """Whether ``model``'s logits are its output embedding applied to its base model's last hidden state."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return config is model.config and not any(getattr(config, name, None) for name in _LOGIT_TRANSFORMS)


@torch.no_grad()
def head_logprobs_and_entropy(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor | None,
    temperature: float = 1.0,
    entropy: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """:func:`~rlhf_ext.algos.segment_reward.logprobs_and_entropy` of ``head(hidden) / temperature`` without the
    ``[N, V]`` logits at once: ``hidden`` ``[N, H]`` is projected 16M logits at a time (big enough for an efficient
    matmul), each block passed through the one-pass log-softmax + entropy. ``labels`` ``[N]`` or None."""
    rows = max(2, (1 << 24) // head.out_features)
    n = hidden.shape[0]
    out = [torch.empty(n, dtype=torch.float32, device=hidden.device) if want else None
           for want in (labels is not None, entropy)]  # fmt: skip
    for start in range(0, n, rows):
        logits = head(hidden[start : start + rows])
        if temperature != 1.0:
            logits = logits.div_(temperature)
        part = logprobs_and_entropy(logits, None if labels is None else labels[start : start + rows], entropy=entropy)
        for dest, values in zip(out, part):
            if dest is not None:
                dest[start : start + rows] = values
    return out[0], out[1]


@torch.no_grad()
def sft_token_entropy(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` entropy of the causal LM's distribution each token was sampled from (``token_entropy`` shift=True),
    without the ``[B, T, V]`` logits at once where they are a plain linear map of the last hidden state
    (:func:`head_logprobs_and_entropy`; models with logit soft-capping or scaling run their full forward)."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    head = model.get_output_embeddings()
    base = getattr(model, "model", None) or getattr(model, "transformer", None)
    if head is None or base is None or not output_head_is_plain(model):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        return token_entropy(logits, shift=True)
    hidden = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    b, t, _ = hidden.shape
    ent = head_logprobs_and_entropy(head, hidden.reshape(b * t, -1), None)[1].view(b, t)
    return torch.cat([ent.new_zeros(b, 1), ent[:, :-1]], dim=1)


def pad_sequences(
    seqs: Sequence[Sequence[float]], value: float, side: str, dtype: torch.dtype, multiple_of: int | None = None
) -> torch.Tensor:
    """Pad 1-D sequences into a ``[N, W]`` tensor on ``side`` ('left'/'right'); W = max length rounded up to
    ``multiple_of``."""
    if side not in ("left", "right"):
        raise ValueError(f"padding side must be 'left' or 'right', got {side!r}")
    width = max((len(s) for s in seqs), default=0)
    if multiple_of:
        width = -(-width // multiple_of) * multiple_of
    out = torch.full((len(seqs), width), value, dtype=dtype)
    for i, s in enumerate(seqs):
        if len(s):
            cols = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
            out[i, cols] = torch.as_tensor(s, dtype=dtype)
    return out


def pad_responses(
    seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int], pad_id: int, device=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, response_mask)`` ``[B, T]`` of prompt + response token ``seqs``, right-padded;
    ``response_mask`` is true from ``prompt_lens[i]`` on."""
    ids = pad_sequences(seqs, pad_id, "right", torch.long).to(device)
    positions = torch.arange(ids.shape[1], device=ids.device)
    lengths = torch.tensor([len(s) for s in seqs], device=ids.device)
    starts = torch.tensor(list(prompt_lens), device=ids.device)
    attention_mask = (positions < lengths[:, None]).long()
    return ids, attention_mask, (positions >= starts[:, None]) & attention_mask.bool()


def add_entropy_columns(dataset, sft_model, batch_size: int = 8, pad_token_id: int = 0, desc: str = "Segmenting"):
    """Add ``chosen_entropy``/``rejected_entropy`` computed by the frozen ``sft_model`` (one forward per sequence)."""
    from rlhf_ext.runtime.log import ProgressLines, stderr_is_terminal

    device = next(sft_model.parameters()).device
    was_training = sft_model.training
    sft_model.eval()
    lines = None if stderr_is_terminal() else ProgressLines(len(dataset), desc=desc, unit="pairs")  # piped: lines

    def batch_fn(batch: dict[str, list]) -> dict[str, list]:
        if lines is not None:
            lines.update(len(batch["prompt_len"]))
        out: dict[str, list] = {}
        for side in ("chosen", "rejected"):
            seqs = batch[f"{side}_ids"]
            ids, mask, _ = pad_responses(seqs, [0] * len(seqs), pad_token_id, device)
            ent = sft_token_entropy(sft_model, ids, mask).cpu()
            out[f"{side}_entropy"] = [
                ent[i, p : len(s)].tolist() for i, (s, p) in enumerate(zip(seqs, batch["prompt_len"]))
            ]
        return out

    try:
        return dataset.map(batch_fn, batched=True, batch_size=batch_size, desc=desc, load_from_cache_file=False)
    finally:
        sft_model.train(was_training)
        if lines is not None:
            lines.close()


def model_identity(name_or_path: str) -> dict[str, Any]:
    """What identifies a checkpoint for caching: its path plus the size and mtime of its weight files."""
    path = Path(name_or_path)
    if not path.is_dir():
        return {"name": str(name_or_path)}
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".json"))
    return {"path": str(path.resolve()), "files": [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in files]}


def prepare_segment_dataset(
    dataset,
    tokenizer,
    sft_model=None,
    sft_model_name_or_path: str | None = None,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
    prompt_key: str | None = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    entropy_batch_size: int = 8,
    cache_dir: str | Path | None = None,
):
    """Tokenise a preference dataset and add SFT entropies: the dataset with :data:`TOKENIZED_COLUMNS` and
    :data:`ENTROPY_COLUMNS` (plus ``margin`` if present); a dataset that has them already is returned unchanged.
    ``sft_model``: the frozen SFT causal LM (loaded from ``sft_model_name_or_path`` when None). ``cache_dir``: where
    to cache the result (keyed by the dataset fingerprint, the SFT checkpoint and the settings; built once).
    """
    from datasets import load_from_disk

    if all(c in dataset.column_names for c in TOKENIZED_COLUMNS + ENTROPY_COLUMNS):
        return dataset
    if sft_model is None and sft_model_name_or_path is None:
        raise ValueError(
            "segmentation needs the SFT model the reward model starts from: pass sft_model= or "
            "sft_model_name_or_path= (recipe key model.sft_model)"
        )
    settings = dict(
        max_length=max_length,
        max_prompt_length=max_prompt_length,
        prompt_key=prompt_key,
        chosen_key=chosen_key,
        rejected_key=rejected_key,
    )
    cache_path = None
    if cache_dir is not None and sft_model_name_or_path is not None:
        identity = model_identity(sft_model_name_or_path)
        key = stable_hash(dataset._fingerprint, identity, settings, tokenizer.name_or_path, len(tokenizer))
        cache_path = Path(cache_dir) / f"segment-entropy-{key}"

    def compute():
        tokenized = tokenize_preference_dataset(dataset, tokenizer, **settings)
        model = sft_model
        if model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(sft_model_name_or_path, dtype=torch.float32)
        return add_entropy_columns(tokenized, model, entropy_batch_size, tokenizer.pad_token_id or 0)

    if cache_path is None:
        return compute()

    def build(path: Path) -> None:
        result = compute()
        with atomic_directory(path) as tmp:
            result.save_to_disk(str(tmp))

    return load_from_disk(str(build_once(cache_path, build, "dataset_info.json")))


def collate_segment_pairs(
    examples: Sequence[dict[str, Any]],
    pad_token_id: int,
    padding_side: str = "right",
    pad_to_multiple_of: int | None = None,
) -> dict[str, torch.Tensor]:
    """Stack chosen then rejected sequences of prepared examples (TRL's convention): ``[2B, T]`` ``input_ids``,
    ``attention_mask`` (long), ``action_mask`` (bool, response tokens), ``entropy`` (float32, aligned to the sampled
    token, 0 outside the response) and, if every example has one, ``margin`` ``[B]``."""
    seqs, prompt_lens, entropies = [], [], []
    for side in ("chosen", "rejected"):
        for ex in examples:
            seqs.append(ex[f"{side}_ids"])
            prompt_lens.append(ex["prompt_len"])
            entropies.append(ex[f"{side}_entropy"])
    pad = dict(side=padding_side, multiple_of=pad_to_multiple_of)
    input_ids = pad_sequences(seqs, pad_token_id, dtype=torch.long, **pad)
    attention_mask = pad_sequences([[1] * len(s) for s in seqs], 0, dtype=torch.long, **pad)
    action = [[0] * p + [1] * (len(s) - p) for s, p in zip(seqs, prompt_lens)]
    action_mask = pad_sequences(action, 0, dtype=torch.long, **pad).bool()
    if any(len(e) != len(s) - p for e, s, p in zip(entropies, seqs, prompt_lens)):
        raise DatasetFormatError(
            "the entropy columns do not match the token ids (a stale segment cache?); delete the cache directory "
            "and rerun the preprocessing"
        )
    full_entropy = [[0.0] * p + list(e) for e, p in zip(entropies, prompt_lens)]
    entropy = pad_sequences(full_entropy, 0.0, dtype=torch.float32, **pad)
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "action_mask": action_mask, "entropy": entropy}
    if examples and all(ex.get("margin") is not None for ex in examples):
        out["margin"] = torch.tensor([float(ex["margin"]) for ex in examples], dtype=torch.float32)
    return out


SEGMENT_CONFIG_NAME = "segment_config.json"


def save_segment_settings(model_dir: str | Path, settings: dict[str, Any]) -> None:
    """Record next to a reward-model checkpoint how it segments text (cutoff, aggregation, tau, SFT model)."""
    settings = dict(settings)
    if isinstance(settings.get("entropy_cutoff"), float) and math.isinf(settings["entropy_cutoff"]):
        settings["entropy_cutoff"] = "inf"  # JSON has no infinity
    sft = settings.get("sft_model_name_or_path")
    if sft and Path(sft).exists():  # a local SFT checkpoint: absolute (any working directory) and relative to the RM
        settings["sft_model_name_or_path"] = str(Path(sft).resolve())  # directory (the two moved or copied together)
        settings["sft_model_relative_path"] = os.path.relpath(Path(sft).resolve(), Path(model_dir).resolve())
    atomic_write_text(Path(model_dir) / SEGMENT_CONFIG_NAME, json.dumps(settings, indent=2, sort_keys=True) + "\n")


def load_segment_settings(model_dir: str | Path) -> dict[str, Any]:
    """Read the settings a segment reward model was trained with (see :func:`save_segment_settings`)."""
    path = Path(model_dir) / SEGMENT_CONFIG_NAME
    if not path.exists():
        raise FileNotFoundError(
            f"{model_dir} has no {SEGMENT_CONFIG_NAME}, so it was not trained by rlhf-ext's segment reward trainer; "
            "pass the entropy cutoff, aggregation and SFT model explicitly"
        )
    settings = json.loads(path.read_text())
    settings["entropy_cutoff"] = float(settings["entropy_cutoff"])
    sft, relative = settings.get("sft_model_name_or_path"), settings.pop("sft_model_relative_path", None)
    if sft and relative and not Path(sft).exists() and (Path(model_dir) / relative).exists():
        settings["sft_model_name_or_path"] = str((Path(model_dir) / relative).resolve())  # moved together
    return settings


def resolve_segment_settings(
    reward_model: str | Path | None, entropy_cutoff: float | None = None, aggregation: str | None = None,
    tau: float | None = None, warn_unrecorded: bool = False, stacklevel: int = 3,
) -> tuple[float, str, float]:  # fmt: skip
    """``(entropy_cutoff, aggregation, tau)`` of a PPO run: each knob as given, else the value recorded next to the
    ``reward_model`` directory (:func:`load_segment_settings`), else the paper's default (2.0, softmax, 0.5), with a
    warning (attributed ``stacklevel`` frames up) if ``warn_unrecorded`` and the directory records none."""
    recorded: dict[str, Any] = {}
    if reward_model and (Path(reward_model) / SEGMENT_CONFIG_NAME).exists():
        recorded = load_segment_settings(reward_model)
    elif reward_model and warn_unrecorded:
        warnings.warn(
            f"{reward_model} records no segment settings; using cutoff/aggregation/tau defaults 2.0/softmax/0.5",
            stacklevel=stacklevel,
        )
    return (
        entropy_cutoff if entropy_cutoff is not None else recorded.get("entropy_cutoff", DEFAULT_ENTROPY_CUTOFF),
        aggregation or recorded.get("aggregation", Aggregation.SOFTMAX.value),
        tau if tau is not None else recorded.get("tau", DEFAULT_TAU),
    )


def segment_model_dir(model: Any) -> Path | None:
    """The directory of an rlhf-ext segment reward model (one holding :data:`SEGMENT_CONFIG_NAME`): ``model`` given
    as that path, or a model loaded from it (its ``config._name_or_path``); ``None`` for anything else."""
    if isinstance(model, str | Path):
        path = Path(model)
    else:
        path = Path(str(getattr(getattr(model, "config", None), "_name_or_path", "") or "/nonexistent"))
    return path if (path / SEGMENT_CONFIG_NAME).is_file() else None


def check_shared_vocabulary(reward_model, policy) -> None:
    """Refuse a reward model whose vocabulary differs from the ``policy``'s: segment rewards are read per token."""
    vocab, policy_vocab = getattr(reward_model.config, "vocab_size", None), policy.config.vocab_size
    if vocab is not None and vocab != policy_vocab:
        raise ValueError(
            f"the reward model's vocabulary ({vocab}) differs from the policy's ({policy_vocab}); segment rewards "
            "are read per token, so the reward model must share the policy's tokenizer (train it from the same "
            "SFT model)"
        )


def check_bandit_reward_model(
    granularity: str, reward_model: Any, where: str, granularity_flag: str = "granularity"
) -> None:
    """Refuse the ``bandit`` granularity (the reward model's score at the last token) on a segment reward model trained
    with a finite entropy cutoff: its sequence score is e_phi (paper 003 Eq. 4), not its last-token output. A bandit
    reward model (cutoff inf) has one segment per response, so there the two are the same number. ``where`` and
    ``granularity_flag``: the user's names of the reward model and the granularity setting, for the message."""
    path = segment_model_dir(reward_model)
    if granularity != "bandit" or path is None:
        return
    cutoff = load_segment_settings(path)["entropy_cutoff"]
    if math.isfinite(cutoff):
        raise ValueError(
            f"{where} {path} is a segment reward model (entropy cutoff {cutoff:g}): {granularity_flag} 'bandit' would "
            f"train on its last-token score, which it was not trained to give; use {granularity_flag} "
            "'segment_as_bandit' (its sequence score e_phi as one reward per response) or 'segment' (dense segment "
            "rewards)"
        )


def reward_model_source(args: Any, reward_model) -> str | None:
    """Where the segment ``reward_model`` came from (the normalizer's record, the critic's default initialisation);
    ``None`` without one. Refuses a segment reward model under ``granularity="bandit"``."""
    if reward_model is None:
        return None
    check_bandit_reward_model(args.granularity, args.reward_model_path or reward_model, "reward model")
    return args.reward_model_path or getattr(reward_model.config, "_name_or_path", "reward_model")


def segment_settings(args: Any, has_reward_model: bool) -> tuple[float, str, float]:
    """``(entropy_cutoff, aggregation, tau)`` of the run (:func:`resolve_segment_settings`, which warns when the reward
    model records none and the granularity segments at the cutoff); refuses an infinite cutoff for a reward model's
    scores under a granularity that segments them at it (one segment per response is ``bandit``)."""
    segments_at_entropy = Granularity(args.granularity).needs_entropy  # the cutoff matters
    settings = resolve_segment_settings(
        args.reward_model_path, args.entropy_cutoff, args.aggregation, args.tau,
        warn_unrecorded=segments_at_entropy, stacklevel=4,
    )  # fmt: skip
    if has_reward_model and segments_at_entropy and math.isinf(settings[0]):
        raise ValueError(
            f"granularity {args.granularity!r} with an infinite cutoff is the bandit setting: set "
            "entropy_cutoff (e.g. 2.0) or granularity='bandit'"
        )
    return settings
