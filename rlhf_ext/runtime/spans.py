"""The dense-reward contract on the engine side: what a reward source returns, the policy tokens' character offsets,
and the dense per-token rewards both engines train on (:func:`dense_rewards`, which calls
:func:`rlhf_ext.algos.spans.dense_span_rewards`).

A **reward source** is a callable in TRL's ``reward_funcs`` style, ``source(prompts, completions, **columns)``
(``completion_ids`` among the columns), returning per completion (checked by :func:`parse_outputs`):

* a float (or ``None``, unscored): a sequence reward, on the completion's last token, as GRPO uses it;
* a list of spans ``(char_start, char_end, reward)`` over the completion's text: a dense reward;
* a 1-D tensor or list of floats, one per completion token (a source sharing the policy's tokenizer).
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from rlhf_ext.algos.location_norm import LocationNormalizer
from rlhf_ext.algos.segment_dense import DenseRewards, Granularity, Interpolation
from rlhf_ext.algos.segment_reward import DEFAULT_TAU, Aggregation

#: ``(char_start, char_end, reward)``: characters ``[char_start, char_end)`` of the completion earned ``reward``.
Span = tuple[int, int, float]


@runtime_checkable
class DenseRewardFunc(Protocol):
    """A reward function in TRL's ``reward_funcs`` style that returns spans (see the module docstring)::

    def keyword_credit(prompts, completions, **kwargs) -> list[list[tuple[int, int, float]]]:
        return [[(m.start(), m.end(), 1.0) for m in re.finditer("thank you", c)] for c in completions]
    """

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> Sequence[Any]: ...


class RewardOutputError(ValueError):
    """A reward source returned something that is not a reward, spans or per-token rewards."""


@dataclass
class SourceOutput:
    """One source's answer for a batch, parsed: ``scalars[i]`` (float, NaN = unscored) or ``spans[i]`` per completion;
    ``token_unit[i]``: the spans of completion ``i`` are over its token indices, not its characters."""

    name: str
    scalars: list[float] = field(default_factory=list)
    spans: list[list[Span] | None] = field(default_factory=list)
    token_unit: list[bool] = field(default_factory=list)

    @property
    def is_dense(self) -> bool:
        return any(s is not None for s in self.spans)

    @classmethod
    def captured(cls, func, name: str, scalars: Tensor) -> SourceOutput:
        """What reward function ``func`` answered for a rollout: the spans its :class:`CapturedSource` kept, else
        ``scalars`` ``[N]`` (its column of GRPO's rewards, NaN = unscored) as sequence rewards."""
        output = func.pop() if isinstance(func, CapturedSource) else None
        if output is not None and output.is_dense:
            return output
        return cls(name, scalars.tolist(), [None] * len(scalars), [False] * len(scalars))

    def totals(self) -> list[float]:
        """Per completion: its scalar, or the sum of its span rewards (what GRPO logs for the source)."""
        return [sum(r for _, _, r in s) if s is not None else v for v, s in zip(self.scalars, self.spans)]


def _is_number(x: Any) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def parse_outputs(name: str, outputs: Sequence[Any], n: int, num_tokens: Sequence[int] | None = None) -> SourceOutput:
    """Check one source's ``outputs`` for ``n`` completions (``num_tokens[i]``: completion ``i``'s token count, for
    per-token answers) and sort them into sequence rewards and spans (raises :class:`RewardOutputError`)."""
    if isinstance(outputs, Tensor):
        outputs = list(outputs) if outputs.dim() > 1 else outputs.tolist()
    outputs = list(outputs)
    if len(outputs) != n:
        raise RewardOutputError(f"reward source {name!r} returned {len(outputs)} items for {n} completions: one each")
    parsed = SourceOutput(name)
    for i, item in enumerate(outputs):
        scalar, spans, token_unit = math.nan, None, False
        if _is_number(item) or (isinstance(item, Tensor) and item.dim() == 0):
            scalar = float(item)
        elif isinstance(item, Tensor) or (isinstance(item, list | tuple) and item and all(map(_is_number, item))):
            values = torch.as_tensor(item, dtype=torch.float32).flatten().tolist()
            if num_tokens is not None and len(values) != num_tokens[i]:
                raise RewardOutputError(
                    f"reward source {name!r} returned {len(values)} per-token rewards for completion {i}, which has "
                    f"{num_tokens[i]} tokens: return one per completion token (or spans over its characters)"
                )
            spans, token_unit = [(j, j + 1, v) for j, v in enumerate(values)], True
        elif isinstance(item, list | tuple):
            spans = []
            for span in item:
                if not (isinstance(span, list | tuple) and len(span) == 3 and isinstance(span[0], Integral) and
                        isinstance(span[1], Integral) and _is_number(span[2])):  # fmt: skip
                    raise RewardOutputError(
                        f"reward source {name!r} returned {span!r} in the spans of completion {i}; a span is "
                        "(char_start, char_end, reward) with integer character offsets"
                    )
                spans.append((int(span[0]), int(span[1]), float(span[2])))
        elif item is not None:
            raise RewardOutputError(
                f"reward source {name!r} returned {type(item).__name__} for completion {i}; return a float, a list of "
                "(char_start, char_end, reward) spans, or one reward per completion token"
            )
        parsed.scalars.append(scalar)
        parsed.spans.append(spans)
        parsed.token_unit.append(token_unit)
    return parsed


# ------------------------------------------------------------------------------------------- character offsets
def _stream_chunks(tokenizer, ids: Sequence[int], skip_special_tokens: bool) -> list[str | None] | None:
    """Per token, the text it completes (``None`` while a character is incomplete), by the fast tokenizer's streaming
    decoder; ``None`` without one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    return [stream.step(backend, int(i)) for i in ids]


def _prefix_chunks(tokenizer, ids: Sequence[int], text: str, skip_special_tokens: bool) -> list[str | None]:
    """Per token, the characters of ``text`` that decoding the tokens up to it settles (slow: one decode per token)."""
    prefixes = tokenizer.batch_decode([list(ids[: i + 1]) for i in range(len(ids))],
                                      skip_special_tokens=skip_special_tokens)  # fmt: skip
    chunks, done = [], 0
    for i, prefix in enumerate(prefixes):
        common = len(os.path.commonprefix([prefix, text]))
        if prefix.endswith("\ufffd") and i < len(ids) - 1:  # an incomplete character so far
            common = min(common, len(prefix) - 1)
        settled = max(done, common)
        chunks.append(text[done:settled] or None)
        done = settled
    if done < len(text):  # what decoding the whole sequence adds at the end
        chunks[-1] = (chunks[-1] or "") + text[done:]
    return chunks


def token_char_offsets(
    tokenizer, ids: Sequence[int], skip_special_tokens: bool = True
) -> tuple[str, list[tuple[int, int]]]:
    """The decoded text of ``ids`` and each token's characters ``[start, end)`` in it.

    A token's characters are the ones decoding settles at it. Tokens that settle none because they hold part of a
    character (a byte of a multi-byte UTF-8 character in byte-level BPE) share the characters settled by the token
    that completes it; special tokens that decoding drops have none (``start == end``). Offsets never decrease.
    """
    ids = [int(i) for i in ids]
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    chunks = _stream_chunks(tokenizer, ids, skip_special_tokens)
    if chunks is None or "".join(c or "" for c in chunks) != text:
        chunks = _prefix_chunks(tokenizer, ids, text, skip_special_tokens)
    special = set(tokenizer.all_special_ids) if skip_special_tokens else set()
    offsets: list[tuple[int, int]] = []
    pending: list[int] = []  # tokens holding part of the next chunk
    pos = 0
    for token, chunk in zip(ids, chunks):
        if chunk:
            for j in pending:
                offsets[j] = (pos, pos + len(chunk))
            offsets.append((pos, pos + len(chunk)))
            pending, pos = [], pos + len(chunk)
        else:
            if token not in special:
                pending.append(len(offsets))
            offsets.append((pos, pos))
    return text, offsets


@dataclass(frozen=True)
class ByteTable:
    """Per token id of a byte-level BPE tokenizer: the UTF-8 bytes decoding it adds (``data[start[i]:start[i] +
    length[i]]``; none for a special token that ``skip_special_tokens=True`` drops), ``exact[i]``: decoding any
    sequence of tokens concatenates those bytes when token ``i`` is among them, and ``special[i]``: ``i`` is among
    ``all_special_ids``. ``key``: the tokenizer state it was built for (decoder, added and special tokens)."""

    data: np.ndarray  # [total bytes] uint8
    start: np.ndarray  # [V] int64
    length: np.ndarray  # [V] int64
    exact: np.ndarray  # [V] bool
    special: np.ndarray  # [V] bool
    key: tuple


_BYTE_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BYTE_TABLES_LOCK = threading.Lock()
#: Decoders that, before a final ``ByteLevel``, leave a token of ByteLevel's alphabet as it is (as GGUF files' BPE
#: tokenizers are converted: ``<0x..>`` byte tokens and ``▁`` are not of that alphabet and fall back).
_PASS_THROUGH = (
    {"type": "ByteFallback"},
    {"type": "Fuse"},
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
)


def _byte_level_alphabet() -> dict[str, int]:
    """ByteLevel's character for each byte (GPT-2's ``bytes_to_unicode``), inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


def byte_table(tokenizer) -> ByteTable | None:
    """The :class:`ByteTable` of a fast tokenizer that decodes with ``ByteLevel`` (alone, or after the
    :data:`_PASS_THROUGH` decoders), built once per tokenizer and again if its decoder, added or special tokens
    change; ``None`` for any other tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None:
        return None
    decoder = json.loads(backend.decoder.__getstate__())
    steps = decoder.get("decoders", []) if decoder["type"] == "Sequence" else [decoder]
    if not steps or steps[-1]["type"] != "ByteLevel" or any(d not in _PASS_THROUGH for d in steps[:-1]):
        return None
    added = backend.get_added_tokens_decoder()
    key = (
        decoder,
        tuple(tokenizer.all_special_ids),
        tuple((i, t.content, t.special) for i, t in sorted(added.items())),
    )
    with _BYTE_TABLES_LOCK:
        table = _BYTE_TABLES.get(tokenizer)
        if table is not None and table.key == key:
            return table
        alphabet = _byte_level_alphabet()
        vocab = backend.get_vocab(with_added_tokens=True)
        size = max(vocab.values(), default=-1) + 1
        pieces, exact = [b""] * size, np.ones(size, dtype=bool)
        for token, i in vocab.items():
            if i in added and added[i].special:
                continue  # dropped by skip_special_tokens=True
            if all(c in alphabet for c in token) and not (len(steps) > 1 and re.fullmatch("<0x[0-9A-Fa-f]{2}>", token)):
                pieces[i] = bytes(alphabet[c] for c in token)
            else:  # ByteLevel keeps the token's own UTF-8, alone; after Fuse, the whole text's
                pieces[i], exact[i] = token.encode(), len(steps) == 1
        length = np.array([len(p) for p in pieces], dtype=np.int64)
        special = np.zeros(size, dtype=bool)
        special[[i for i in tokenizer.all_special_ids if 0 <= i < size]] = True
        table = ByteTable(np.frombuffer(b"".join(pieces), dtype=np.uint8), np.cumsum(length) - length, length,
                          exact, special, key)  # fmt: skip
        _BYTE_TABLES[tokenizer] = table
        return table


def _shifted_cummax(x: np.ndarray) -> np.ndarray:
    """``[B, C]``: the largest of ``x[:, :j]`` at ``j`` (0 at ``j = 0``)."""
    return np.concatenate([np.zeros((len(x), 1), dtype=x.dtype), np.maximum.accumulate(x, axis=1)[:, :-1]], axis=1)


def _byte_offsets(table: ByteTable, ids: np.ndarray, mask: np.ndarray, texts: list[str]):
    """:func:`token_char_offsets`'s offsets ``(start, end)`` ``[B, C]`` of a batch of completions ``ids`` ``[B, C]``
    (``mask`` true at their tokens; ``texts``: each row decoded), computed from byte lengths for the whole batch, and
    ``exact`` ``[B]``: the rows where they are exact -- the row's decoded text is the concatenation of its tokens'
    bytes from ``table``, valid UTF-8 but for one incomplete last character (a completion cut at its length limit)
    and otherwise free of U+FFFD (which the streaming decoder reads as an incomplete character).

    A token settles characters when its bytes end on a character boundary (a byte that is not ``0b10xxxxxx``, or the
    end of a row whose last character is complete); those since the previous such token are its own, and the tokens
    between that are not special share them. A row with an incomplete last character goes by prefixes, as
    :func:`token_char_offsets` takes it: each token settles the characters it completes, its last token the rest
    (that character's U+FFFD)."""
    known = (ids >= 0) & (ids < len(table.length))
    ids = np.where(known, ids, 0)
    length = np.where(mask & known, table.length[ids], 0)  # [B, C] bytes each token adds
    end = np.cumsum(length, axis=1)  # [B, C] byte offset of each token's end in its row
    row_bytes = end[:, -1]
    keep = length > 0
    n = length[keep]  # the kept tokens' bytes, rows one after another
    index = np.repeat(table.start[ids[keep]] - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
    data = table.data[index]
    is_start = np.append((data & 0xC0) != 0x80, True)
    row_start = np.cumsum(row_bytes) - row_bytes
    exact = (mask & known & table.exact[ids] | ~mask).all(axis=1)
    cut = np.zeros(len(ids), dtype=bool)  # rows whose last character is incomplete
    for row, (text, begin, size) in enumerate(zip(texts, row_start, row_bytes)):
        own, encoded = data[begin : begin + size], text.encode()
        if "\ufffd" not in text:
            exact[row] &= own.tobytes() == encoded
        elif exact[row] and "\ufffd" not in text[:-1] and is_start[begin : begin + size].any():
            last = int(np.flatnonzero(is_start[begin : begin + size])[-1])  # the last character's lead byte
            lead = int(own[last])
            width = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
            cut[row] = exact[row] = size - last < width and own[:last].tobytes() == encoded[:-3]
        else:
            exact[row] = False
    chars = np.concatenate([[0], np.cumsum(is_start[:-1])])  # characters before each byte, over the batch
    at = row_start[:, None] + end  # [B, C] each token's end in data
    settled = chars[at] - chars[row_start][:, None]  # characters up to each token's end
    boundary = np.where(end == row_bytes[:, None], ~cut[:, None], is_start[np.minimum(at, len(data))])
    last = mask & (np.cumsum(mask, axis=1) == mask.sum(axis=1, keepdims=True))
    # a cut row goes by prefixes: each token settles the characters it completes, the last one the rest
    settled = np.where(cut[:, None] & ~last, settled - ~boundary, settled)
    completes = settled > _shifted_cummax(np.where(mask, settled, 0))
    emits = mask & np.where(cut[:, None], completes | last, (length > 0) & boundary)
    before = _shifted_cummax(np.where(emits, settled, 0))
    big = np.iinfo(np.int64).max
    following = np.minimum.accumulate(np.where(emits, settled, big)[:, ::-1], axis=1)[:, ::-1]
    shares = mask & ~emits & ~(known & table.special[ids]) & (following < big)
    ends = np.where(emits, settled, np.where(shares, following, before))
    return np.where(mask, before, 0), np.where(mask, ends, 0), exact


def offsets_by_row(
    tokenizer, completion_ids: Tensor, mask: Tensor, starts: Tensor, ends: Tensor, rows: Sequence[int]
) -> None:
    """Write :func:`token_char_offsets`'s offsets of ``rows`` of a batch of completions ``[B, C]`` (``mask`` true at
    their tokens) into ``starts``/``ends`` ``[B, C]``, one row at a time (any tokenizer)."""
    for row in rows:
        positions = mask[row].nonzero().flatten()
        _, offsets = token_char_offsets(tokenizer, completion_ids[row, positions].tolist())
        if offsets:
            starts[row, positions], ends[row, positions] = torch.tensor(offsets).T


def completion_offsets(tokenizer, completion_ids: Tensor, mask: Tensor) -> tuple[list[str], Tensor, Tensor]:
    """``(texts, token_start, token_end)`` of a right-padded batch of completions ``[B, C]`` (``mask`` true at its
    tokens): each completion decoded without special tokens, as TRL decodes them, and its tokens' offsets (``[B, C]``
    long, 0 outside ``mask``; :func:`token_char_offsets`'s). Byte-level BPE tokenizers (:func:`byte_table`) take them
    for the whole batch from byte lengths, checked exact per row; other rows go by :func:`offsets_by_row`."""
    ids, mask = completion_ids.cpu(), mask.bool().cpu()
    texts = tokenizer.batch_decode([row[m].tolist() for row, m in zip(ids, mask)], skip_special_tokens=True)
    table = byte_table(tokenizer)
    if table is None or ids.numel() == 0:
        starts, ends, rows = torch.zeros(ids.shape, dtype=torch.long), torch.zeros(ids.shape, dtype=torch.long), None
    else:
        starts, ends, exact = _byte_offsets(table, ids.numpy(), mask.numpy(), texts)
        starts, ends, rows = torch.from_numpy(starts), torch.from_numpy(ends), np.flatnonzero(~exact).tolist()
    offsets_by_row(tokenizer, ids, mask, starts, ends, range(len(ids)) if rows is None else rows)
    return texts, starts, ends


# ---------------------------------------------------------------------------------------------- dense rewards
def span_tensors(spans: Sequence[Sequence[Span] | None]) -> tuple[Tensor, Tensor, Tensor]:
    """``(start, end, reward)`` ``[B, K]`` of per-completion span lists (``None`` = no span), padded with empty
    spans."""
    k = max([len(s) for s in spans if s] + [1])
    start = torch.zeros(len(spans), k, dtype=torch.long)
    end = torch.zeros(len(spans), k, dtype=torch.long)
    reward = torch.zeros(len(spans), k)
    for i, row in enumerate(spans):
        if row:
            start[i, : len(row)], end[i, : len(row)] = torch.tensor([[a, b] for a, b, _ in row], dtype=torch.long).T
            reward[i, : len(row)] = torch.tensor([r for _, _, r in row])
    return start, end, reward


@dataclass
class DenseBatch:
    """What :func:`dense_rewards` returns: ``rewards`` ``[B, C]`` per completion token (before the KL penalty),
    ``sequence_reward`` ``[B]`` (their sum), ``segments_per_response`` ``[B]`` (real spans; 1 for a response
    with sequence rewards only), and the dense sources'
    :class:`~rlhf_ext.algos.segment_dense.DenseRewards` (one per dense source)."""

    rewards: Tensor
    sequence_reward: Tensor
    segments_per_response: Tensor
    dense: list[DenseRewards]


def dense_rewards(
    outputs: Sequence[SourceOutput],
    weights: Sequence[float],
    tokenizer,
    completion_ids: Tensor,
    mask: Tensor,
    normalizer: LocationNormalizer | None = None,
    granularity: str = Granularity.SEGMENT,
    interpolation: str = Interpolation.EVEN_SPLIT,
    aggregation: str = Aggregation.SOFTMAX,
    tau: float = DEFAULT_TAU,
) -> DenseBatch:
    """Per-token rewards ``[B, C]`` of completions ``completion_ids`` (``[B, C]``, ``mask`` true at their tokens) from
    the parsed answers of reward sources weighted by ``weights``: each dense source's spans through
    :func:`~rlhf_ext.algos.spans.dense_span_rewards` (``normalizer``, ``granularity``, ``interpolation``,
    ``aggregation``/``tau``: :class:`~rlhf_ext.algos.segment_dense.DenseRewardKnobs`), plus the sequence rewards
    (weighted sum, NaN as 0, as GRPO sums them) on each completion's last token. The one function both engines call."""
    from rlhf_ext.algos.spans import dense_span_rewards

    mask = mask.bool().cpu()
    completion_ids = completion_ids.cpu()
    dense_outputs = [(o, w) for o, w in zip(outputs, weights) if o.is_dense]
    if normalizer is not None and normalizer.kind != "none" and len(dense_outputs) > 1:
        raise ValueError(
            f"a location normalizer is fitted to one reward source; {len(dense_outputs)} sources returned spans: "
            "combine them into one source or drop the normalizer"
        )
    b, c = completion_ids.shape
    rewards = torch.zeros(b, c)
    scalar = torch.zeros(b)
    for out, weight in zip(outputs, weights):
        values = torch.tensor([v if s is None else math.nan for v, s in zip(out.scalars, out.spans)])
        scalar += weight * torch.nan_to_num(values, nan=0.0)
    last = (mask.long().cumsum(dim=1) == mask.sum(dim=1, keepdim=True)) & mask
    rewards += torch.where(last, scalar[:, None], 0.0)
    # sequence rewards only: one (bandit) segment per response, as dense_segment_rewards counts them
    dense, counts = [], torch.zeros(b, dtype=torch.long) if dense_outputs else mask.any(dim=1).long()
    if dense_outputs:
        _, char_start, char_end = completion_offsets(tokenizer, completion_ids, mask)
        index = torch.cumsum(mask.long(), dim=1) - 1  # token unit: a token's index in its completion
        for out, weight in dense_outputs:
            unit = torch.tensor(out.token_unit)[:, None]
            start, end, reward = span_tensors(out.spans)
            result = dense_span_rewards(
                start, end, reward,
                torch.where(unit, index, char_start), torch.where(unit, index + 1, char_end), mask,
                normalizer=normalizer, granularity=granularity, interpolation=interpolation,
                aggregation=aggregation, tau=tau,
            )  # fmt: skip
            rewards += weight * result.rewards
            counts += result.segments.counts
            dense.append(result)
    return DenseBatch(rewards, rewards.sum(dim=1), counts, dense)


def captured_dense_rewards(
    funcs: Sequence,
    names: Sequence[str],
    rewards_per_func: Tensor,
    weights: Sequence[float],
    tokenizer,
    completion_ids: Tensor,
    mask: Tensor,
    **kwargs,
) -> DenseBatch:
    """:func:`dense_rewards` of reward functions' answers to a rollout (TRL's ``reward_funcs``): for each function the
    spans its :class:`CapturedSource` kept, else its column of ``rewards_per_func`` ``[B, F]`` (GRPO's rewards, one
    row per completion of ``completion_ids`` ``[B, C]``) as sequence rewards; on ``completion_ids``' device."""
    outputs = [SourceOutput.captured(func, name, rewards_per_func[:, i]) for i, (func, name) in
               enumerate(zip(funcs, names))]  # fmt: skip
    batch = dense_rewards(outputs, weights, tokenizer, completion_ids, mask, **kwargs)
    device = completion_ids.device
    batch.rewards, batch.sequence_reward = batch.rewards.to(device), batch.sequence_reward.to(device)
    batch.segments_per_response = batch.segments_per_response.to(device)
    return batch


def _is_async(func) -> bool:
    import asyncio
    import functools

    while isinstance(func, functools.partial):
        func = func.func
    return asyncio.iscoroutinefunction(func) or asyncio.iscoroutinefunction(type(func).__call__)


class CapturedSource:
    """A reward function wrapped so that the caller (GRPO's reward loop) sees one number per completion -- the sum of
    its span rewards, or its scalar -- while the wrapped function's full answer, parsed, waits in :attr:`output` for
    the trainer to map onto tokens (:func:`dense_rewards`)."""

    def __init__(self, func):
        self.func = func
        self.__name__ = getattr(func, "__name__", None) or type(func).__name__
        self.output: SourceOutput | None = None

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
        values = self.func(prompts=prompts, completions=completions, **kwargs)
        ids = kwargs.get("completion_ids")
        self.output = parse_outputs(self.__name__, values, len(completions), [len(i) for i in ids] if ids else None)
        return [None if math.isnan(v) else v for v in self.output.totals()]

    def pop(self) -> SourceOutput | None:
        output, self.output = self.output, None
        return output


def capture_sources(reward_funcs) -> list:
    """``reward_funcs`` (one or a list, as GRPO takes them) with every synchronous callable wrapped in a
    :class:`CapturedSource`; reward-model ids, models and async functions (sequence rewards only) are kept."""
    import torch.nn as nn

    funcs = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    return [CapturedSource(f) if callable(f) and not isinstance(f, nn.Module | CapturedSource) and not _is_async(f)
            else f for f in funcs]  # fmt: skip


def fit_span_normalizer(
    funcs: Sequence[Any],
    tokenizer,
    dataset,
    kind: str = "regression",
    basis: str = "linear",
    granularity: str = Granularity.SEGMENT,
    aggregation: str = Aggregation.SOFTMAX,
    tau: float = DEFAULT_TAU,
    max_pairs: int | None = None,
) -> LocationNormalizer:
    """A :class:`~rlhf_ext.algos.location_norm.LocationNormalizer` (paper 003 Eq. 6) fitted to the one dense source
    among ``funcs`` on ``dataset``'s chosen and rejected responses (``prompt``/``chosen``/``rejected`` text), each
    response tokenised by the policy's ``tokenizer``: its raw span rewards at their locations (``segment``), or its
    sequence rewards at ``p = 1`` (``bandit``, ``segment_as_bandit``)."""
    from rlhf_ext.runtime.segment_data import pad_responses

    if max_pairs is not None:
        dataset = dataset.select(range(min(max_pairs, len(dataset))))
    rows = list(dataset)
    prompts = [r.get("prompt", "") for r in rows] * 2
    completions = [r["chosen"] for r in rows] + [r["rejected"] for r in rows]
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    sources = [f if isinstance(f, CapturedSource) else CapturedSource(f) for f in funcs if callable(f)]
    outputs = []
    for source in sources:
        source(prompts, completions, completion_ids=ids)
        outputs.append(source.pop())
    dense = [o for o in outputs if o.is_dense]
    if len(dense) != 1:
        raise ValueError(
            f"a location normalizer is fitted to the spans of one reward source; {len(dense)} of the reward "
            "functions returned spans on the calibration responses: pass normalizer= or no calibration_dataset"
        )
    completion_ids, mask, _ = pad_responses(ids, [0] * len(ids), 0)
    batch = dense_rewards(dense, [1.0], tokenizer, completion_ids, mask, granularity=granularity,
                          aggregation=aggregation, tau=tau)  # fmt: skip
    result = batch.dense[0]
    if Granularity(granularity).is_bandit:
        positions, rewards = torch.ones(len(completions)), result.raw_seg_rewards[:, 0]
    else:
        mask = result.segments.mask
        positions, rewards = result.segments.locations[mask], result.raw_seg_rewards[mask]
    return LocationNormalizer.fit(positions, rewards, kind=kind, basis=basis, reward_model=dense[0].name)
