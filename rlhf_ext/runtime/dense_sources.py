"""Dense reward sources: callables in TRL's ``reward_funcs`` style that return spans ``(char_start, char_end, reward)``
over each completion's text (:mod:`rlhf_ext.runtime.spans`), for any policy tokenizer.

=============================  ======================================================================================
:class:`KeywordCredit`         rules: credit for each keyword or regex match (worked example; learnable from pairs)
:class:`ProcessRewardModel`    a step-wise process reward model, read at each step's end (PRM800K-style)
:class:`SegmentRewardSpans`    a segment reward model with its own tokenizer and SFT model (paper 003)
:class:`~rlhf_ext.runtime.remote_reward.RemoteSegmentReward`  ``rlhf-ext serve rm`` answering with spans
=============================  ======================================================================================

:func:`load_reward_source` builds one from a string (recipes, ``--ext.reward_source``).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf_ext.algos.segment_reward import Segments
from rlhf_ext.runtime.io import PicklableLock
from rlhf_ext.runtime.segment_data import DatasetFormatError, pad_responses, tokenize_pair
from rlhf_ext.runtime.spans import Span, token_char_offsets


# --------------------------------------------------------------------------------------- responses and offsets
@dataclass
class EncodedResponse:
    """One (prompt, response) tokenised as a reward model's training data was (``ids`` = prompt + response tokens,
    the response from ``prompt_len``), and each response token's characters ``[start, end)`` in the response text
    (a chat response: in its last message's ``content``; EOS and other tokens of no text: ``start == end``)."""

    ids: list[int]
    prompt_len: int
    offsets: list[tuple[int, int]] = field(default_factory=list)
    text: str = ""


def _text_token_offsets(tokenizer, text: str, ids: Sequence[int], own: list[int],
                        mapping: list[tuple[int, int]] | None) -> list[tuple[int, int]]:  # fmt: skip
    """Characters of ``text`` held by each of ``ids`` (the tokens of ``text``, possibly cut and with EOS appended):
    ``mapping``, the fast tokenizer's offsets of ``own`` (``text``'s own tokens), or for a slow tokenizer (``mapping``
    None) the offsets found by decoding ``own``; a token that is not ``text``'s own at its index holds none (its start
    and end are the furthest end before it)."""
    if mapping is None:
        decoded, mapping = token_char_offsets(tokenizer, own, skip_special_tokens=False)
        if decoded != text:
            raise ValueError("the reward model's tokenizer does not decode its tokens back to the text; use a fast one")
    n = min(len(ids), len(own))
    if list(ids[:n]) == own[:n]:  # the usual case: own tokens, then only the appended EOS (lists compared in C)
        end = max((e for _, e in mapping[:n]), default=0)
        return mapping[:n] + [(end, end)] * (len(ids) - n)
    match = torch.zeros(len(ids), dtype=torch.bool)
    match[:n] = torch.tensor(list(ids[:n])) == torch.tensor(own[:n])
    table = torch.tensor(mapping + [(0, 0)] * (len(ids) - len(mapping)), dtype=torch.long)[: len(ids)]
    ends = torch.cummax(torch.where(match, table[:, 1], 0), dim=0).values if len(ids) else table[:, 1]
    start = torch.where(match, table[:, 0], ends)
    return list(zip(start.tolist(), torch.where(match, table[:, 1], ends).tolist()))


def encode_response(tokenizer, prompt, response, max_length: int | None = None) -> EncodedResponse:
    """Tokenise ``(prompt, response)`` (text, or chat messages; ``prompt`` may be None) with
    :func:`~rlhf_ext.runtime.segment_data.tokenize_pair`, with the response tokens' character offsets (from the same
    tokenizer call as the response's ids)."""
    example = {"prompt": prompt, "chosen": response, "rejected": response}
    key = "prompt" if prompt is not None else None
    row = tokenize_pair(example, tokenizer, max_length=max_length, prompt_key=key, chosen_offsets=True)
    ids, rendered = row["chosen_ids"], row["chosen_text"]
    offsets = _text_token_offsets(tokenizer, rendered, ids[row["prompt_len"] :], *row["chosen_tokens"])
    text = rendered
    if row["is_chat"]:  # offsets in the last message's content, not in the chat template's rendering
        text = response[-1]["content"] if isinstance(response, list) else response
        shift = rendered.find(text)
        if shift < 0:
            raise DatasetFormatError("the chat template does not render the response's content verbatim; send text")
        offsets = [(min(max(s - shift, 0), len(text)), min(max(e - shift, 0), len(text))) for s, e in offsets]
    return EncodedResponse(ids, row["prompt_len"], offsets, text)


def _offset_tables(encoded: Sequence[EncodedResponse], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, width]`` character starts and ends of each row's tokens at their positions in the padded batch."""
    starts = torch.zeros(len(encoded), width, dtype=torch.long)
    ends = torch.zeros(len(encoded), width, dtype=torch.long)
    for i, e in enumerate(encoded):
        if e.offsets:
            cols = slice(e.prompt_len, e.prompt_len + len(e.offsets))
            starts[i, cols], ends[i, cols] = torch.tensor(e.offsets, dtype=torch.long).T
    return starts, ends


def segment_spans(
    segments: Segments, seg_rewards: torch.Tensor, encoded: Sequence[EncodedResponse]
) -> list[list[Span]]:
    """Each segment of each response as a span over the response's text: from its first token's first character to
    its last token's last character, with its reward (``seg_rewards`` ``[B, S]``). A segment of no text (EOS alone)
    is attached to the character before it, so its reward still reaches the policy."""
    ids = segments.ids.cpu()
    starts, ends = _offset_tables(encoded, ids.shape[1])
    previous = torch.nn.functional.pad(ids, (1, 0), value=-1)[:, :-1]
    first = (ids >= 0) & (ids != previous)
    seg_start, seg_end = starts[first], ends[segments.ends.cpu()]  # row-major: each row's segments in order
    seg_start = torch.where(seg_end > seg_start, seg_start, (seg_end - 1).clamp_min(0))
    rewards = seg_rewards.detach().float().cpu()[segments.mask.cpu()]
    counts = segments.counts.cpu().tolist()
    rows = zip(seg_start.split(counts), seg_end.split(counts), rewards.split(counts))
    return [list(zip(a.tolist(), b.tolist(), r.tolist())) for a, b, r in rows]


# ---------------------------------------------------------------------------------------------------- sources
class KeywordCredit:
    """Rules as a dense reward: each match of a rule's pattern earns the rule's weight on the matched characters.
    ``rules``: ``{pattern: weight}`` (or pairs), literal keywords unless ``regex``; with ``once`` a rule pays for its
    first match only."""

    dense_unit = "char"

    def __init__(self, rules: Mapping[str, float] | Sequence[tuple[str, float]], regex: bool = False,
                 ignore_case: bool = True, once: bool = True, name: str = "keyword_credit"):  # fmt: skip
        items = list(rules.items()) if isinstance(rules, Mapping) else [tuple(r) for r in rules]
        if not items:
            raise ValueError("KeywordCredit needs at least one rule")
        flags = re.IGNORECASE if ignore_case else 0
        self.rules = [(str(p), float(w)) for p, w in items]
        self.patterns = [(re.compile(p if regex else re.escape(p), flags), w) for p, w in self.rules]
        self.regex, self.ignore_case, self.once = regex, ignore_case, once
        self.__name__ = name

    def spans(self, text: str) -> list[Span]:
        out: list[Span] = []
        for pattern, weight in self.patterns:
            for match in pattern.finditer(text):
                if match.end() > match.start():
                    out.append((match.start(), match.end(), weight))
                    if self.once:
                        break
        return sorted(out)

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[list[Span]]:
        return [self.spans(c[-1]["content"] if isinstance(c, list) else c) for c in completions]

    @classmethod
    def learn(cls, chosen: Sequence[str], rejected: Sequence[str], top_k: int = 16, ngram: tuple[int, int] = (2, 4),
              min_count: int = 5, **kwargs: Any) -> KeywordCredit:  # fmt: skip
        """Rules learned from preference pairs: the ``top_k`` word n-grams of each sign with the largest smoothed
        log-odds of appearing in a chosen rather than a rejected response, weighted by it; an n-gram sharing
        ``ngram[0]`` words with a stronger one of its sign is skipped. Deterministic (ties: longest, then by text)."""

        def grams(text: str, sizes=range(ngram[0], ngram[1] + 1)) -> set[str]:
            words = re.findall(r"[\w']+", text.lower())
            return {" ".join(words[i : i + n]) for n in sizes for i in range(len(words) - n + 1)}

        pos, neg = Counter(g for t in chosen for g in grams(t)), Counter(g for t in rejected for g in grams(t))
        scores = {
            g: math.log((pos[g] + 1) / (len(chosen) + 2)) - math.log((neg[g] + 1) / (len(rejected) + 2))
            for g in set(pos) | set(neg)
            if pos[g] + neg[g] >= min_count
        }
        kept: list[tuple[str, float]] = []
        taken: dict[bool, set[str]] = {True: set(), False: set()}  # the shortest n-grams of the kept phrases
        for g, w in sorted(scores.items(), key=lambda kv: (-abs(kv[1]), -kv[0].count(" "), kv[0])):  # longest first
            pieces = grams(g, (ngram[0],))
            if w != 0 and sum((v > 0) == (w > 0) for _, v in kept) < top_k and not pieces & taken[w > 0]:
                kept.append((g, w))
                taken[w > 0] |= pieces
        return cls([(g, round(w, 4)) for g, w in sorted(kept, key=lambda kv: (-kv[1] > 0, -abs(kv[1]), kv[0]))],
                   **kwargs)  # fmt: skip

    def save(self, path: str | Path) -> None:
        import yaml

        from rlhf_ext.runtime.io import atomic_write_text

        rules = [{"pattern": p, "weight": w} for p, w in self.rules]
        data = {"rules": rules, "regex": self.regex, "ignore_case": self.ignore_case, "once": self.once}
        atomic_write_text(path, yaml.safe_dump(data, sort_keys=False, allow_unicode=True))

    @classmethod
    def load(cls, path: str | Path) -> KeywordCredit:
        """Rules from a YAML/JSON file: ``{rules: [{pattern, weight}], regex, ignore_case, once}``."""
        import yaml

        if not Path(path).is_file():
            raise FileNotFoundError(f"rules file '{path}' does not exist")
        data = yaml.safe_load(Path(path).read_text())
        if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
            raise ValueError(f"rules file '{path}' must hold {{rules: [{{pattern: ..., weight: ...}}]}}")
        try:
            rules = [(r["pattern"], r["weight"]) for r in data["rules"]]
        except (KeyError, TypeError) as e:
            raise ValueError(f"rules file '{path}': each rule needs 'pattern' and 'weight' ({e})") from None
        return cls(rules, **{k: data[k] for k in ("regex", "ignore_case", "once") if k in data}, name=Path(path).stem)


class _ModelSource:
    """Shared by the model-based sources: a device, a batch size, a tokenizer lock (fast tokenizers refuse threads)."""

    def __init__(self, batch_size: int, device, name: str):
        self.batch_size = batch_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer_lock = PicklableLock()
        self.__name__ = name

    def _encode(self, tokenizer, prompts, completions, max_length=None) -> list[EncodedResponse]:
        with self.tokenizer_lock:
            return [encode_response(tokenizer, p or None, c, max_length) for p, c in
                    zip(prompts, completions)]  # fmt: skip

    def _batches(self, tokenizer, prompts, completions, max_length=None) -> Iterator[list[EncodedResponse]]:
        for begin in range(0, len(completions), self.batch_size):
            end = begin + self.batch_size
            yield self._encode(tokenizer, prompts[begin:end], completions[begin:end], max_length)


class ProcessRewardModel(_ModelSource):
    """A step-wise process reward model: a sequence classifier (``num_labels=1``; a checkpoint, or a loaded model with
    its ``tokenizer``) read at the last token of each step of a completion, the steps ending after each
    ``step_separator`` (PRM800K-style scoring): step ``k`` is a span rewarded with the score at its last token."""

    dense_unit = "char"

    def __init__(self, model, tokenizer=None, step_separator: str = "\n", batch_size: int = 16, device=None,
                 name: str = "process_reward_model"):  # fmt: skip
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        super().__init__(batch_size, device, name)
        if not step_separator:
            raise ValueError("step_separator must be a non-empty string (e.g. '\\n')")
        if isinstance(model, str | Path):
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model))
            model = AutoModelForSequenceClassification.from_pretrained(str(model), num_labels=1, dtype=torch.float32)
        if tokenizer is None:
            raise ValueError("pass tokenizer= with a loaded process reward model")
        self.model, self.tokenizer, self.step_separator = model.to(self.device).eval(), tokenizer, step_separator

    def steps(self, text: str) -> list[tuple[int, int]]:
        """``[start, end)`` of each step of ``text``."""
        ends = [m.end() for m in re.finditer(re.escape(self.step_separator), text)]
        ends = [e for e in ends if e < len(text)] + ([len(text)] if text else [])
        return [(a, b) for a, b in zip([0, *ends[:-1]], ends)]

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[list[Span]]:
        from rlhf_ext.runtime.token_scores import token_scores

        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        out: list[list[Span]] = []
        for encoded in self._batches(self.tokenizer, prompts, completions):
            ids, mask, _ = pad_responses([e.ids for e in encoded], [e.prompt_len for e in encoded], pad, self.device)
            scores = token_scores(self.model, ids, mask).cpu()
            starts, _ = _offset_tables(encoded, ids.shape[1])
            for row, e in enumerate(encoded):
                steps = self.steps(e.text)
                if not steps:
                    out.append([])
                    continue
                ends = torch.tensor([b for _, b in steps])
                token_starts = torch.tensor([s for s, _ in e.offsets])
                last = (torch.searchsorted(token_starts, ends, right=False) - 1).clamp_min(0) + e.prompt_len
                out.append([(a, b, r) for (a, b), r in zip(steps, scores[row, last].tolist())])
        return out


class SegmentRewardSpans(_ModelSource):
    """A segment reward model (paper 003) as a dense source for a policy with any tokenizer: each completion is
    tokenised with the reward model's own tokenizer, segmented by *its* SFT model's entropy, scored at each segment's
    last token, and every segment returned as a span over the completion's text (:func:`segment_spans`).
    ``reward_model``: a segment reward-model directory, or a loaded :class:`~rlhf_ext.runtime.token_scores.
    SegmentScorer`; ``sft_model``: its SFT model (default: the recorded one).
    """

    dense_unit = "char"

    def __init__(self, reward_model, sft_model: str | None = None, batch_size: int = 16, device=None,
                 max_length: int | None = None, name: str = "segment_rm"):  # fmt: skip
        from rlhf_ext.runtime.token_scores import SegmentScorer

        given = isinstance(reward_model, SegmentScorer)
        self.scorer = reward_model if given else SegmentScorer(str(reward_model), sft_model=sft_model)
        if device is None and given:  # a loaded scorer stays where it is
            device = next(self.scorer.reward_model.parameters()).device
        super().__init__(batch_size, device, name)
        self.scorer.reward_model.to(self.device)
        self.scorer.sft_model.to(self.device)
        self.tokenizer_lock = self.scorer.tokenizer_lock
        self.max_length = max_length

    def encode(self, prompt, response) -> EncodedResponse:
        return self._encode(self.scorer.tokenizer, [prompt], [response], self.max_length)[0]

    @torch.no_grad()
    def score(self, encoded: Sequence[EncodedResponse]) -> tuple[list[float], list[list[Span]]]:
        """e_phi and the segment spans of a batch of encoded pairs (one forward of each model)."""
        tok = self.scorer.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        ids, mask, response = pad_responses([e.ids for e in encoded], [e.prompt_len for e in encoded], pad, self.device)
        evaluation = self.scorer.evaluate(ids, mask, response)
        return evaluation.values.float().tolist(), segment_spans(evaluation.segments, evaluation.seg_rewards, encoded)

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[list[Span]]:
        batches = self._batches(self.scorer.tokenizer, prompts, completions, self.max_length)
        return [spans for encoded in batches for spans in self.score(encoded)[1]]


@dataclass
class PolicyToken:
    """One policy token of a response: its text, its characters ``[start, end)`` in the response and its dense
    reward (tokens sharing a multi-byte character share its offsets; the first of them holds its text)."""

    text: str
    start: int
    end: int
    reward: float

    def __str__(self) -> str:
        return f"  {self.reward:+8.4f}  [{self.start}, {self.end})  {self.text!r}"


def policy_token_rewards(source, policy_tokenizer, prompt, response: str) -> list[PolicyToken]:
    """How a span source's rewards for ``response`` land on the policy's tokens: the response tokenised by
    ``policy_tokenizer`` and its spans mapped as PPO maps them (:func:`~rlhf_ext.runtime.spans.dense_rewards`:
    segment granularity, even split, no normaliser). ``sum(t.reward) == sum`` of the span rewards."""
    from rlhf_ext.runtime.spans import dense_rewards, parse_outputs

    name = getattr(source, "__name__", "source")
    output = parse_outputs(name, source([prompt or ""], [response]), 1)
    ids = policy_tokenizer(response, add_special_tokens=False)["input_ids"]
    completion_ids = torch.tensor([ids], dtype=torch.long).reshape(1, len(ids))
    rewards = dense_rewards([output], [1.0], policy_tokenizer, completion_ids, torch.ones_like(completion_ids)).rewards
    text, offsets = token_char_offsets(policy_tokenizer, ids)
    previous_ends = [0] + [e for _, e in offsets[:-1]]
    return [PolicyToken(text[max(s, p) : e], s, e, r) for (s, e), p, r in zip(offsets, previous_ends,
            rewards[0].tolist())]  # fmt: skip


# ----------------------------------------------------------------------------------------------------- loading
SOURCE_FORMS = (
    "module.path:function | file.py:function | rules:FILE.yaml (or rules:builtin:DATASET) | prm:MODEL | "
    "segment-rm:DIR (or a segment reward model directory) | http://HOST:PORT (rlhf-ext serve rm)"
)


def _load_callable(spec: str):
    target, _, name = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            if not Path(target).is_file():
                raise FileNotFoundError(f"no file {target}")
            module_spec = importlib.util.spec_from_file_location(Path(target).stem, target)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        fn = getattr(module, name)
    except (ImportError, AttributeError, FileNotFoundError, SyntaxError) as e:
        raise ValueError(f"reward source {spec!r} could not be loaded ({type(e).__name__}: {e})") from None
    if isinstance(fn, type):
        fn = fn()
    if not callable(fn):
        raise ValueError(f"reward source {spec!r} is not callable")
    return fn


def absolute_source_spec(spec: str | None) -> str | None:
    """``spec`` with a relative ``file.py:function`` or ``rules:FILE`` path made absolute (processes that load the
    source elsewhere, such as OpenRLHF's Ray actors, need not share the caller's working directory)."""
    if not spec or spec.startswith(("http://", "https://")):
        return spec
    kind, _, rest = spec.partition(":")
    if kind == "rules" and not rest.startswith("builtin:"):
        return f"rules:{Path(rest).absolute()}"
    target, _, name = spec.rpartition(":")
    return f"{Path(target).absolute()}:{name}" if target.endswith(".py") else spec


def load_reward_source(spec: str, step_separator: str = "\n", device=None):
    """A dense reward source from a string (:data:`SOURCE_FORMS`); a class named by ``module:Class`` is instantiated
    without arguments. ``step_separator``: for ``prm:``."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"reward source must be one of: {SOURCE_FORMS}")
    if spec.startswith(("http://", "https://")):
        from rlhf_ext.runtime.remote_reward import RemoteSegmentReward

        return RemoteSegmentReward(spec, spans=True)
    kind, _, rest = spec.partition(":")
    if kind == "rules":
        return KeywordCredit.load(rest)
    if kind == "prm":
        return ProcessRewardModel(rest, step_separator=step_separator, device=device)
    if kind == "segment-rm" or (Path(spec) / "segment_config.json").is_file():
        return SegmentRewardSpans(rest if kind == "segment-rm" else spec, device=device)
    if ":" in spec and not Path(spec).exists():
        return _load_callable(spec)
    raise ValueError(f"reward source {spec!r} is none of: {SOURCE_FORMS}")


def check_reward_source(spec: str) -> None:
    """Refuse a reward source that cannot load (``ValueError``/``FileNotFoundError``, one line) without loading a model:
    rules files and callables are loaded (cheap); ``prm:``, ``segment-rm:`` and URLs are checked where they run."""
    if not isinstance(spec, str) or spec.startswith(("http://", "https://", "prm:", "segment-rm:", "builtin:",
                                                     "rules:builtin:")):  # fmt: skip
        return
    load_reward_source(spec)
