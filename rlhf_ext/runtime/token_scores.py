"""Per-token scores from any sequence-classification reward model, and segment views of single responses.

A sequence-classification model applies its ``score`` head at every position and then keeps the last real token.
:class:`TokenScoreCapture` keeps the full ``[B, T]`` output of that head from the model's normal forward pass (a
forward hook), so segment rewards cost no extra forward and work through DDP, DeepSpeed and PEFT wrappers.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import torch

from rlhf_ext.algos.segment_reward import evaluate_sequences
from rlhf_ext.runtime.segment_data import load_segment_settings, sft_token_entropy


def find_score_head(model) -> torch.nn.Module:
    """The linear head a sequence-classification model applies to every position (``score`` in HF models)."""
    inner = getattr(model, "module", model)  # DDP / DeepSpeed engine
    if hasattr(inner, "get_base_model"):  # PEFT
        inner = inner.get_base_model()
    head = getattr(inner, getattr(inner, "value_head_prefix", "score"), None)  # OpenRLHF names its head
    if not isinstance(head, torch.nn.Module):
        raise TypeError(
            f"{type(model).__name__} has no `score` head; a segment reward model needs a sequence-classification "
            "model that scores every position (AutoModelForSequenceClassification for Llama, Qwen2, Mistral, Gemma, "
            "Phi-3, GPT-2, ...) with num_labels=1"
        )
    return head


class TokenScoreCapture:
    """Forward hook on the score head: keeps its ``[B, T, 1]`` output from the model's normal forward pass."""

    def __init__(self, model):
        self.scores: torch.Tensor | None = None
        self.handle = find_score_head(model).register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.scores = output

    def pop(self) -> torch.Tensor:
        """``[B, T]`` scores of the last forward pass (and forget them)."""
        if self.scores is None:
            raise RuntimeError("the score head did not run during the forward pass")
        scores, self.scores = self.scores, None
        return scores.squeeze(-1)

    def remove(self) -> None:
        self.handle.remove()


@torch.no_grad()
def token_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` reward-model scores at every position of a batch (one forward pass)."""
    capture = TokenScoreCapture(model)
    try:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        return capture.pop().float()
    finally:
        capture.remove()


@torch.no_grad()
def preference_accuracy(
    model,
    prepared_rows,
    entropy_cutoff: float,
    aggregation: str = "softmax",
    tau: float = 0.5,
    batch_size: int = 16,
) -> dict[str, float]:
    """Held-out accuracy of a segment reward model: the fraction of pairs with e(x, y_w) > e(x, y_l).

    Args:
        model: a sequence-classification reward model, or the path of one.
        prepared_rows: a dataset prepared by :func:`rlhf_ext.runtime.segment_data.prepare_segment_dataset`.
    """
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
        scores = token_scores(model, batch["input_ids"], batch["attention_mask"])
        ev = evaluate_sequences(scores, batch["entropy"], batch["action_mask"], entropy_cutoff, aggregation, tau)
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

    Args:
        reward_model: path of a reward-model checkpoint written by rlhf-ext (TRL or OpenRLHF engine).
        sft_model: the SFT checkpoint used for segmentation (default: the one recorded with the reward model).
        entropy_cutoff, aggregation, tau: default to the recorded training settings.
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

        settings = load_segment_settings(reward_model)
        self.cutoff = settings["entropy_cutoff"] if entropy_cutoff is None else float(entropy_cutoff)
        self.aggregation = aggregation or settings["aggregation"]
        self.tau = settings["tau"] if tau is None else float(tau)
        sft_path = sft_model or settings.get("sft_model_name_or_path")
        if not sft_path:
            raise ValueError(f"{reward_model} does not record its SFT model; pass sft_model=")
        self.tokenizer = AutoTokenizer.from_pretrained(reward_model)
        self.reward_model = AutoModelForSequenceClassification.from_pretrained(
            reward_model, num_labels=1, dtype=torch.float32
        ).eval()
        self.sft_model = AutoModelForCausalLM.from_pretrained(sft_path, dtype=torch.float32).eval()

    def score(self, prompt, response) -> SegmentView:
        """Segment and score one response. ``prompt``/``response``: text, or chat messages (prompt may be None)."""
        from rlhf_ext.runtime.segment_data import tokenize_pair

        example = {"prompt": prompt, "chosen": response, "rejected": response}
        row = tokenize_pair(example, self.tokenizer, prompt_key="prompt" if prompt is not None else None)
        ids = torch.tensor([row["chosen_ids"]])
        mask = torch.ones_like(ids)
        action = torch.zeros_like(ids, dtype=torch.bool)
        action[:, row["prompt_len"] :] = True
        ent = sft_token_entropy(self.sft_model, ids, mask)
        scores = token_scores(self.reward_model, ids, mask)
        ev = evaluate_sequences(scores, ent, action, self.cutoff, self.aggregation, self.tau)
        seg = ev.segments
        n = int(seg.counts[0])
        texts, starts = [], []
        for s in range(n):
            positions = (seg.ids[0] == s).nonzero().flatten()
            texts.append(self.tokenizer.decode(ids[0, positions]))
            starts.append(float(ent[0, positions[0]]))
        prompt_text = self.tokenizer.decode(ids[0, : row["prompt_len"]])
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
