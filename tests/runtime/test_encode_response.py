"""``encode_response`` tokenises the response once (its ids and character offsets from one tokenizer call): every
id, prompt length, offset and text is the same as the former three-call encoding (kept here as the reference) over
random pairs: text and chat messages, multibyte characters, a response ending in EOS, truncation at max_length."""

from __future__ import annotations

import random

import pytest
import torch

from rlhf_ext.runtime.dense_sources import EncodedResponse, encode_response
from rlhf_ext.runtime.segment_data import DatasetFormatError, _split_prompt_response, tokenize_pair

WORDS = ["Many", " people", " Café", " ☕", "日本語", " naïve", "\n", "  ", " 👩‍👩‍👧", "e\u0301", " tides", ".",
         "<|endoftext|>", " ü", "—", " 123", "\t", "x"]  # fmt: skip


def _reference_offsets(tokenizer, text, ids):
    """The former ``_text_token_offsets``: ``text`` tokenised again with offsets, compared with ``ids`` in torch."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    own, mapping = encoded["input_ids"], [tuple(o) for o in encoded["offset_mapping"]]
    n = min(len(ids), len(own))
    match = torch.zeros(len(ids), dtype=torch.bool)
    match[:n] = torch.tensor(list(ids[:n])) == torch.tensor(own[:n])
    table = torch.tensor(mapping + [(0, 0)] * (len(ids) - len(mapping)), dtype=torch.long)[: len(ids)]
    ends = torch.cummax(torch.where(match, table[:, 1], 0), dim=0).values if len(ids) else table[:, 1]
    start = torch.where(match, table[:, 0], ends)
    return list(zip(start.tolist(), torch.where(match, table[:, 1], ends).tolist()))


def _reference(tokenizer, prompt, response, max_length):
    """The former ``encode_response``: ``tokenize_pair``, the response rendered again and tokenised again."""
    example = {"prompt": prompt, "chosen": response, "rejected": response}
    key = "prompt" if prompt is not None else None
    row = tokenize_pair(example, tokenizer, max_length=max_length, prompt_key=key)
    _, rendered, is_chat = _split_prompt_response(example, tokenizer, key, "chosen")
    ids = row["chosen_ids"]
    offsets = _reference_offsets(tokenizer, rendered, ids[row["prompt_len"] :])
    text = rendered
    if is_chat:
        text = response[-1]["content"] if isinstance(response, list) else response
        shift = rendered.find(text)
        if shift < 0:
            raise DatasetFormatError("the chat template does not render the response's content verbatim; send text")
        offsets = [(min(max(s - shift, 0), len(text)), min(max(e - shift, 0), len(text))) for s, e in offsets]
    return EncodedResponse(ids, row["prompt_len"], offsets, text)


def _text(rng: random.Random, at_least: int = 0) -> str:
    return "".join(rng.choice(WORDS) for _ in range(rng.randint(at_least, 12)))


def _pair(rng: random.Random):
    """A text pair (the prompt possibly None), or chat messages (with an explicit or an implicit prompt)."""
    form = rng.randrange(4)
    if form == 0:
        return _text(rng), _text(rng)
    if form == 1:
        return None, _text(rng)
    reply = [{"role": "assistant", "content": _text(rng, 1)}]
    user = [{"role": "user", "content": _text(rng, 1)}]
    return (user, reply) if form == 2 else (None, user + reply)


@pytest.mark.parametrize("name", ["toy_tok", "gpt2_tok"])
def test_encode_response_equals_the_three_call_encoding(name, request):
    tokenizer = request.getfixturevalue(name)
    rng = random.Random(0)
    checked = {"chat": 0, "cut": 0, "eos_in_text": 0}
    for _ in range(400):
        prompt, response = _pair(rng)
        max_length = rng.choice([None, None, 3, 6, 10, 24])
        try:
            expected = _reference(tokenizer, prompt, response, max_length)
        except DatasetFormatError as e:
            with pytest.raises(DatasetFormatError, match=str(e)):
                encode_response(tokenizer, prompt, response, max_length)
            continue
        got = encode_response(tokenizer, prompt, response, max_length)
        assert (got.ids, got.prompt_len, got.offsets, got.text) == (expected.ids, expected.prompt_len,
                                                                    expected.offsets, expected.text)  # fmt: skip
        checked["chat"] += isinstance(response, list)
        full = tokenize_pair({"prompt": prompt, "chosen": response, "rejected": response}, tokenizer,
                             prompt_key="prompt" if prompt is not None else None)["chosen_ids"]  # fmt: skip
        checked["cut"] += len(full) > len(got.ids)
        checked["eos_in_text"] += "<|endoftext|>" in got.text
    assert min(checked.values()) >= 20, checked  # every case was met often
