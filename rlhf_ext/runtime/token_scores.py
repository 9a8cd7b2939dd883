"""Per-token scores from any sequence-classification reward model, the segment evaluation e_phi of a loaded segment
reward model, and segment views of single responses.

:class:`TokenScoreCapture` keeps the full ``[B, T]`` output of the ``score`` head (applied at every position, then
read at the last token) from the model's normal forward pass, so segment rewards cost no extra forward and work
through DDP, DeepSpeed and PEFT; :func:`segment_evaluation` turns them into e_phi (paper 003 Eq. 4).
"""

from __future__ import annotations

import html
import inspect
import logging
import os
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_ext.algos.segment_reward import (
    DEFAULT_TAU,
    Aggregation,
    SequenceEvaluation,
    aggregate_segments,
    evaluate_sequences,
    first_response_tokens,
    gather_segment_rewards,
    segment_ids,
)
from rlhf_ext.runtime.io import PicklableLock, weights_problem
from rlhf_ext.runtime.segment_data import (
    SEGMENT_CONFIG_NAME,
    load_segment_settings,
    pad_responses,
    segment_model_dir,
    sft_token_entropy,
)

logger = logging.getLogger(__name__)


def load_value_model(path: str, role: str, dtype: torch.dtype = torch.float32):
    """A reward model, critic or value head: ``AutoModelForSequenceClassification.from_pretrained(path,
    num_labels=1)``, saying in one line what was loaded (``critic: runs/sft with a fresh value head``; a warning for a
    ``reward model`` whose head is fresh, i.e. untrained) instead of transformers' load table (``score.weight |
    MISSING``)."""
    from transformers import AutoModelForSequenceClassification

    def no_load_report(record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()

    transformers_logger = logging.getLogger("transformers.modeling_utils")
    transformers_logger.addFilter(no_load_report)
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=dtype, output_loading_info=True
        )
    finally:
        transformers_logger.removeFilter(no_load_report)
    fresh = sorted(info["missing_keys"])
    if not fresh:
        logger.info("%s: %s", role, path)
    elif role == "reward model":
        logger.warning("reward model: %s has no trained value head (%s freshly initialised)", path, ", ".join(fresh))
    else:
        logger.info("%s: %s with a fresh value head", role, path)
    return model


def _unwrap(model):
    """The model inside a DDP / DeepSpeed engine and a PEFT wrapper."""
    inner = getattr(model, "module", model)  # DDP / DeepSpeed engine
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # PEFT


def find_score_head(model) -> torch.nn.Module:
    """The linear head a sequence-classification model applies to every position (``score`` in HF models)."""
    inner = _unwrap(model)
    head = getattr(inner, getattr(inner, "value_head_prefix", "score"), None)  # OpenRLHF names its head
    if not isinstance(head, torch.nn.Module):
        raise TypeError(
            f"{type(model).__name__} has no `score` head; a segment reward model needs a sequence-classification "
            "model that scores every position (AutoModelForSequenceClassification for Llama, Qwen2, Mistral, Gemma, "
            "Phi-3, GPT-2, ...) with num_labels=1"
        )
    return head


class TokenScoreCapture:
    """Forward hook on the score head: keeps its ``[B, T, 1]`` output from the model's normal forward pass, per thread
    (threads sharing a model each :meth:`pop` their own scores; hence not for ``torch.nn.DataParallel``: use DDP)."""

    def __init__(self, model):
        self._slot = threading.local()
        self.handle = find_score_head(model).register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self._slot.scores = output

    def pop(self) -> torch.Tensor:
        """``[B, T]`` scores of this thread's last forward pass (and forget them)."""
        scores = getattr(self._slot, "scores", None)
        if scores is None:
            raise RuntimeError(
                "the score head did not run during this thread's forward pass (a model wrapped in "
                "torch.nn.DataParallel runs it in other threads: use DDP, e.g. torchrun or accelerate launch)"
            )
        self._slot.scores = None
        return scores.squeeze(-1)

    def remove(self) -> None:
        self.handle.remove()


@torch.no_grad()
def token_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` reward-model scores at every position of a batch (one forward pass)."""
    capture = TokenScoreCapture(model)
    try:
        # position_ids (correct under left padding) and use_cache=False for a model whose forward takes them (Hugging
        # Face models); OpenRLHF's reward model derives its positions from the mask and takes neither
        params = inspect.signature(_unwrap(model).forward).parameters
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        extras = {k: v for k, v in (("position_ids", position_ids), ("use_cache", False)) if k in params}
        model(input_ids=input_ids, attention_mask=attention_mask, **extras)
        return capture.pop().float()
    finally:
        capture.remove()


@torch.no_grad()
def segment_evaluation(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    sft_model=None,
    entropy: torch.Tensor | None = None,
    segment_ends: torch.Tensor | None = None,
    settings: str | os.PathLike | Mapping[str, Any] | None = None,
    entropy_cutoff: float | None = None,
    aggregation: str | None = None,
    tau: float | None = None,
) -> SequenceEvaluation:
    """The segment evaluation ``e_phi(x, y)`` of a segment reward model that is already loaded (paper 003, Eq. 4):
    ``tau * logsumexp(r_seg / tau)`` (``aggregation="softmax"``; ``"sum"`` / ``"mean"`` for the ablations) over the
    model's scores at each segment's last token, segments starting where the SFT entropy exceeds the cutoff -- not
    the last-token output its ``forward`` returns. The same code the trainers and :class:`SegmentScorer` use; returns
    a :class:`~rlhf_ext.segment.SequenceEvaluation` (``values`` ``[B]``, ``seg_rewards`` ``[B, S]``, ``segments``).

    Args:
        model: the reward model (a per-position score head, possibly wrapped by DDP, DeepSpeed or PEFT), on the
            device of ``input_ids``.
        input_ids, attention_mask, response_mask: ``[B, T]`` prompt + response tokens (right or left padded), and
            bool, true at response tokens.
        sft_model, entropy, segment_ends: the segments, in this order of precedence: ``segment_ends`` (``[B, T]``
            bool, true at each segment's last token), ``entropy`` (``[B, T]`` SFT entropies in nats, as
            :func:`~rlhf_ext.runtime.segment_data.sft_token_entropy` returns them), or ``sft_model`` (run here).
        settings: a reward-model directory or its ``segment_config.json`` mapping (default: the directory ``model``
            was loaded from); ``entropy_cutoff``, ``aggregation`` and ``tau`` override it.
    """
    if settings is None:  # the directory ``model`` was loaded from (``config._name_or_path``), if it records any
        settings = segment_model_dir(getattr(model, "module", model)) or {}
    recorded = dict(settings) if isinstance(settings, Mapping) else load_segment_settings(settings)
    aggregation = aggregation or recorded.get("aggregation")
    tau = recorded.get("tau") if tau is None else tau
    cutoff = recorded.get("entropy_cutoff") if entropy_cutoff is None else entropy_cutoff
    if aggregation is None or tau is None or (cutoff is None and segment_ends is None):
        raise ValueError(
            "segment_evaluation needs the reward model's segment settings: pass settings=<reward model directory> "
            "(its segment_config.json), or entropy_cutoff=, aggregation= and tau="
        )
    scores = token_scores(model, input_ids, attention_mask)
    response_mask = response_mask.bool()
    if segment_ends is not None:
        after_end = torch.zeros_like(response_mask)
        after_end[:, 1:] = segment_ends.bool()[:, :-1]
        segments = segment_ids(response_mask & (first_response_tokens(response_mask) | after_end), response_mask)
        seg_rewards = gather_segment_rewards(scores, segments)
        values = aggregate_segments(seg_rewards, segments.mask, aggregation, float(tau))
        return SequenceEvaluation(values=values, seg_rewards=seg_rewards, segments=segments)
    if entropy is None:
        if sft_model is None:
            raise ValueError("segment_evaluation needs sft_model=, entropy= or segment_ends= to find the segments")
        entropy = sft_token_entropy(sft_model, input_ids, attention_mask)
    return evaluate_sequences(scores, entropy.float(), response_mask, float(cutoff), aggregation, float(tau))


@torch.no_grad()
def preference_accuracy(
    model,
    prepared_rows,
    entropy_cutoff: float,
    aggregation: str = Aggregation.SOFTMAX,
    tau: float = DEFAULT_TAU,
    batch_size: int = 16,
) -> dict[str, float]:
    """Held-out accuracy of a segment reward ``model`` (or its path): the fraction of pairs with e(x, y_w) > e(x, y_l)
    on ``prepared_rows`` (:func:`rlhf_ext.runtime.segment_data.prepare_segment_dataset`'s)."""
    from transformers import AutoModelForSequenceClassification

    from rlhf_ext.runtime.segment_data import collate_segment_pairs

    if isinstance(model, str):
        model = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1, dtype=torch.float32)
    model.eval()
    pad = model.config.pad_token_id or 0
    correct, segments, total = 0, 0.0, 0
    for start in range(0, len(prepared_rows), batch_size):
        rows = prepared_rows.select(range(start, min(start + batch_size, len(prepared_rows))))
        batch = collate_segment_pairs(list(rows), pad)
        ev = segment_evaluation(
            model, batch["input_ids"], batch["attention_mask"], batch["action_mask"], entropy=batch["entropy"],
            entropy_cutoff=entropy_cutoff, aggregation=aggregation, tau=tau,
        )  # fmt: skip
        chosen, rejected = ev.values.chunk(2)
        correct += int((chosen > rejected).sum())
        segments += float(ev.segments.counts.float().sum())
        total += chosen.numel()
    return {"eval_accuracy": correct / total, "eval_segments_per_response": segments / (2 * total)}


@dataclass
class SegmentView:
    """One response split into segments: texts, rewards (at each segment's last token), entropies at the starts."""

    prompt: str
    segments: list[str]
    rewards: list[float]
    start_entropy: list[float]
    evaluation: float

    def as_text(self) -> str:
        rows = [f"  {r:+8.3f}  H={h:5.2f}  {s!r}" for s, r, h in zip(self.segments, self.rewards, self.start_entropy)]
        return f"e(x, y) = {self.evaluation:+.3f}  ({len(self.segments)} segments)\n" + "\n".join(rows)


class SegmentScorer:
    """Loads a segment reward model and the SFT model it was trained with, and splits responses into scored segments.
    Thread-safe (forward passes run concurrently; the tokenizer is used under :attr:`tokenizer_lock`).

    ``reward_model``: a reward-model checkpoint written by rlhf-ext; ``sft_model``, ``entropy_cutoff``,
    ``aggregation``, ``tau`` default to its recorded settings (all four needed without ``segment_config.json``).
    """

    def __init__(
        self,
        reward_model: str,
        sft_model: str | None = None,
        entropy_cutoff: float | None = None,
        aggregation: str | None = None,
        tau: float | None = None,
    ):
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        recorded = segment_model_dir(reward_model)
        if recorded is None and any(v is None for v in (entropy_cutoff, aggregation, tau, sft_model)):
            raise FileNotFoundError(
                f"'{reward_model}' is not a segment reward model: it has no {SEGMENT_CONFIG_NAME} (written by "
                "`rlhf-ext train segment-rm`); give the output directory of a segment reward-model run, or pass "
                "entropy_cutoff, aggregation, tau and sft_model for another sequence-classification model"
            )
        settings = load_segment_settings(recorded) if recorded is not None else {}
        self.entropy_cutoff = settings["entropy_cutoff"] if entropy_cutoff is None else float(entropy_cutoff)
        self.aggregation = aggregation or settings["aggregation"]
        self.tau = settings["tau"] if tau is None else float(tau)
        sft_path = sft_model or settings.get("sft_model_name_or_path")
        if not sft_path:
            raise ValueError(f"{reward_model} does not record its SFT model; pass sft_model=")
        for what, path in (("reward model", reward_model), ("SFT model", sft_path)):
            problem = weights_problem(path) if Path(path).is_dir() else None
            if problem:
                raise ValueError(f"the {what} {path} cannot be loaded ({problem}): copy or train it again")
        self.tokenizer = AutoTokenizer.from_pretrained(reward_model)
        #: held around every use of :attr:`tokenizer` (hold it too when you use the tokenizer from several threads)
        self.tokenizer_lock = PicklableLock()
        self.reward_model = AutoModelForSequenceClassification.from_pretrained(
            reward_model, num_labels=1, dtype=torch.float32
        ).eval()
        self.sft_model = AutoModelForCausalLM.from_pretrained(sft_path, dtype=torch.float32).eval()

    @property
    def cutoff(self) -> float:
        """Deprecated name of :attr:`entropy_cutoff`."""
        warnings.warn("SegmentScorer.cutoff is deprecated; use SegmentScorer.entropy_cutoff", DeprecationWarning,
                      stacklevel=2)  # fmt: skip
        return self.entropy_cutoff

    def evaluate(self, input_ids, attention_mask, response_mask, entropy=None) -> SequenceEvaluation:
        """:func:`segment_evaluation` of a batch with this scorer's models and settings."""
        return segment_evaluation(
            self.reward_model, input_ids, attention_mask, response_mask, sft_model=self.sft_model, entropy=entropy,
            entropy_cutoff=self.entropy_cutoff, aggregation=self.aggregation, tau=self.tau,
        )  # fmt: skip

    def encode(self, prompt, response, max_length: int | None = None) -> dict[str, Any]:
        """One response tokenised as the reward model's training data was (:func:`~rlhf_ext.runtime.segment_data.
        tokenize_pair`: ``chosen_ids`` = prompt + response tokens, ``prompt_len``). ``prompt``/``response``: text,
        or chat messages (prompt may be None)."""
        from rlhf_ext.runtime.segment_data import tokenize_pair

        example = {"prompt": prompt, "chosen": response, "rejected": response}
        with self.tokenizer_lock:
            return tokenize_pair(example, self.tokenizer, max_length=max_length,
                                 prompt_key="prompt" if prompt is not None else None)  # fmt: skip

    def score(self, prompt, response) -> SegmentView:
        """Segment and score one response. ``prompt``/``response``: text, or chat messages (prompt may be None)."""
        row = self.encode(prompt, response)
        ids, mask, action = pad_responses([row["chosen_ids"]], [row["prompt_len"]], 0)
        ent = sft_token_entropy(self.sft_model, ids, mask)
        ev = self.evaluate(ids, mask, action, entropy=ent)
        seg = ev.segments
        n = int(seg.counts[0])
        positions = [(seg.ids[0] == s).nonzero().flatten() for s in range(n)]
        with self.tokenizer_lock:
            texts = [self.tokenizer.decode(ids[0, p]) for p in positions]
            prompt_text = self.tokenizer.decode(ids[0, : row["prompt_len"]])
        starts = [float(ent[0, p[0]]) for p in positions]
        return SegmentView(prompt_text, texts, ev.seg_rewards[0, :n].tolist(), starts, float(ev.values[0]))


SEGMENT_CSS = (
    "body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;line-height:1.7}"
    ".ex{border:1px solid #ddd;border-radius:6px;padding:.8rem;margin:1rem 0}"
    ".prompt{color:#555;white-space:pre-wrap}"
    ".seg{border-right:2px solid #fff;padding:1px 0;white-space:pre-wrap}.meta{color:#777;font-size:.85rem}"
)


def render_segments(views: list[SegmentView]) -> str:
    """HTML fragment: each response's segments coloured by reward (green high, red low; paper Figure 3)."""
    all_r = [r for v in views for r in v.rewards] or [0.0]
    scale = max(abs(min(all_r)), abs(max(all_r)), 1e-6)

    def colour(r: float) -> str:
        a = min(abs(r) / scale, 1.0) * 0.75
        return f"rgba(22,163,74,{a:.2f})" if r >= 0 else f"rgba(220,38,38,{a:.2f})"

    blocks = []
    for v in views:
        spans = "".join(
            f'<span class="seg" style="background:{colour(r)}" title="reward {r:+.3f}, start entropy {h:.2f}">'
            f"{html.escape(s)}</span>"
            for s, r, h in zip(v.segments, v.rewards, v.start_entropy)
        )
        blocks.append(
            f'<div class="ex"><div class="prompt">{html.escape(v.prompt)}</div><div class="resp">{spans}</div>'
            f'<div class="meta">e(x, y) = {v.evaluation:+.3f} &middot; {len(v.segments)} segments</div></div>'
        )
    return f"<style>{SEGMENT_CSS}</style>" + "".join(blocks)


def render_html(views: list[SegmentView], title: str = "Segment rewards") -> str:
    """A self-contained HTML page around :func:`render_segments`."""
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head><body>"
        f"<h1>{html.escape(title)}</h1><p>Each coloured block is one segment; colour = the reward model's score at "
        "the segment's last token (green high, red low). Hover for values.</p>"
        + render_segments(views)
        + "</body></html>"
    )


def position_scores(capture: TokenScoreCapture, model, input_ids, attention_mask) -> torch.Tensor:
    """``[B, L]`` output of a scalar head at every position (one forward; gradients flow if enabled)."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return capture.pop().float()
