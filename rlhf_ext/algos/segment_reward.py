"""Entropy-based segmentation and segment-reward aggregation (paper 003 Eq. 3-4, section 2.2).

Conventions: tensors are ``[B, T]`` over the full sequence, padded on either or both sides; ``action_mask`` (bool) is
true exactly at response tokens and segments never cross a ``False`` position; ``entropy[b, i]`` is the entropy of
the distribution token ``i`` was sampled from (logits at ``i - 1``; :func:`token_entropy` with ``shift=True``);
segments are 0-based and ``S`` is the most segments of a response in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from rlhf_ext.algos.knobs import check_knob, check_knobs, knob
from rlhf_ext.algos.names import StrEnum, post_init_next


class Aggregation(StrEnum):
    """Aggregation f of the segment rewards into a sequence evaluation (paper 003 Eq. 3-4; Table 4)."""

    SOFTMAX = "softmax"
    SUM = "sum"
    MEAN = "mean"


AGGREGATIONS: tuple[str, ...] = Aggregation.values()

#: Paper defaults (section 4.1, Table 7): entropy cutoff c_ent = 2.0, soft-max temperature tau = 0.5.
DEFAULT_ENTROPY_CUTOFF = 2.0
DEFAULT_TAU = 0.5

#: Logits per chunk: 256k on a CPU (the chunk and its exp buffer stay in cache), 64M on an accelerator (large
#: launches; ``benchmarks/entropy_gpu.py``).
_ENTROPY_CHUNK_ELEMENTS = {"cpu": 1 << 18}
_ENTROPY_CHUNK_ELEMENTS_ACCELERATOR = 1 << 26


def check_aggregation(kind: str) -> str:
    """Validate an aggregation name (a :class:`Aggregation` or its string)."""
    if kind not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}; got {kind!r}")
    return kind


@dataclass
class SegmentRewardKnobs:
    """The knobs of paper 003's segment reward model, declared once: the TRL config
    (:class:`rlhf_ext.trl.SegmentRewardConfig`), the recipes' ``segment:`` section and OpenRLHF's ``--ext.*`` flags of
    ``rlhf_ext.openrlhf.train_rm`` use these names and defaults. ``entropy_cutoff``: c_ent in nats (section 2.1;
    ``inf`` = one segment per response, ``0`` = one per token); ``aggregation`` and ``tau``: paper 003 Eq. 3-4."""

    entropy_cutoff: float = knob(DEFAULT_ENTROPY_CUTOFF, ge=0, inf=True, help="c_ent in nats (paper 003: 2.0).")
    aggregation: Aggregation = field(
        default=Aggregation.SOFTMAX.value, metadata={"help": "softmax (paper 003 Eq. 4) | sum | mean"}
    )
    tau: float = knob(DEFAULT_TAU, gt=0, help="Soft-max temperature of paper 003 Eq. 4 (0.5).")

    def __post_init__(self) -> None:
        post_init_next(self, __class__)  # a config that lists the knobs before TRL's class runs TRL's checks too
        self.check_segment_knobs()

    def check_segment_knobs(self) -> None:
        """Validate the knobs in place (called by every config that embeds them)."""
        check_knobs(self)
        check_aggregation(self.aggregation)


@torch.no_grad()
def logprobs_and_entropy(
    logits: Tensor, labels: Tensor | None = None, chunk_size: int | None = None, entropy: bool = True
) -> tuple[Tensor | None, Tensor | None]:
    """Log-probabilities of ``labels`` and Shannon entropies (nats) of the rows of ``logits``, in one pass per chunk.

    With ``lse = logsumexp(z)`` (as ``torch.logsumexp`` computes it, so the log-probs ``z_label - lse`` equal
    OpenRLHF's and TRL's bit for bit) and ``e = exp(z - max z)``: ``H = lse - (sum_v e_v z_v) / sum_v e_v``, the
    product taken in place in one reused cache-sized buffer. Rows with ``-inf`` logits are recomputed with those
    entries contributing 0.

    Args:
        logits: ``[N, V]`` or ``[B, T, V]``, any float dtype (computed in fp32; a slice is read in place).
        labels: token ids of shape ``logits.shape[:-1]``, or None for entropies only.
        entropy: False skips the entropy (log-probs only).
        chunk_size: rows per chunk (at least 2; default :data:`_ENTROPY_CHUNK_ELEMENTS` logits); results do not
            depend on it.

    Returns:
        ``(log_probs, entropy)``: fp32 of shape ``logits.shape[:-1]`` (None for the one not asked for), entropies
        clamped at 0. Not differentiable.
    """
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must be [N, V] or [B, T, V], got shape {tuple(logits.shape)}")
    lead, v = logits.shape[:-1], logits.shape[-1]
    if labels is not None and labels.shape != lead:
        raise ValueError(f"labels {tuple(labels.shape)} must have the logits' leading shape {tuple(lead)}")
    if labels is None and not entropy:
        raise ValueError("logprobs_and_entropy: nothing to compute (no labels and entropy=False)")
    blocks = _row_blocks(logits)
    n = lead.numel()
    per_chunk = _ENTROPY_CHUNK_ELEMENTS.get(logits.device.type, _ENTROPY_CHUNK_ELEMENTS_ACCELERATOR)
    rows = max(2, chunk_size or per_chunk // max(v, 1))
    ent = torch.empty(n, dtype=torch.float32, device=logits.device) if entropy else None
    log_probs = None if labels is None else torch.empty(n, dtype=torch.float32, device=logits.device)
    flat_labels = None if labels is None else labels.reshape(n, 1)
    buf = torch.empty(min(rows + 1, n), v, dtype=torch.float32, device=logits.device)
    start = 0
    for block in blocks:
        for z in block.split(_chunk_sizes(block.shape[0], rows)):
            z, k = z.float(), z.shape[0]
            m = z.amax(-1, keepdim=True)
            m.masked_fill_(m.abs() == math.inf, 0.0)  # as torch.logsumexp: a row of -inf gives -inf, not nan
            e = torch.sub(z, m, out=buf[:k]).exp_()
            total = e.sum(-1)
            lse = total.log().add_(m.squeeze(-1))
            if log_probs is not None:
                log_probs[start : start + k] = z.gather(-1, flat_labels[start : start + k]).squeeze(-1) - lse
            if ent is not None:
                ent[start : start + k] = lse - e.mul_(z).sum(-1) / total
            start += k
    log_probs = None if log_probs is None else log_probs.view(lead)
    if ent is None:
        return log_probs, None
    bad = ent.isnan().nonzero().squeeze(-1)
    if bad.numel():  # rows with -inf (or nan) logits: the masked formula, on those rows only
        offset = 0
        for block in blocks:
            mine = bad[(bad >= offset) & (bad < offset + block.shape[0])]
            ent[mine] = _masked_entropy(block[mine - offset].float())
            offset += block.shape[0]
    return log_probs, ent.clamp_min_(0.0).view(lead)


def _row_blocks(logits: Tensor) -> list[Tensor]:
    """``[rows, V]`` views covering ``logits`` in order: one, or one per batch row of a non-viewable ``[B, T, V]``."""
    v = logits.shape[-1]
    try:
        return [logits.view(-1, v)]
    except RuntimeError:  # a [B, T, V] slice: each [T, V] row block is still a view
        return [row.reshape(-1, v) for row in logits]


def _chunk_sizes(n: int, rows: int) -> list[int]:
    """Chunks of ``rows`` rows covering ``n``, none of 1 row unless ``n == 1``: torch's CPU sum takes another
    summation order for a single row, and the log-probs must equal the engines' (which reduce many rows at once)."""
    sizes = [rows] * (n // rows) + ([n % rows] if n % rows else [])
    if len(sizes) > 1 and sizes[-1] == 1:
        sizes[-2:] = [rows + 1]
    return sizes


def _masked_entropy(z: Tensor) -> Tensor:
    """``[n]`` entropies of fp32 rows ``z [n, V]`` with ``0 * -inf`` terms counted as 0 (``-inf`` logits)."""
    logz = torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.exp(z - logz)
    return logz.squeeze(-1) - torch.where(p > 0, p * z, torch.zeros_like(z)).sum(-1)


def token_entropy(logits: Tensor, shift: bool = True, chunk_size: int | None = None) -> Tensor:
    """Shannon entropy (nats) of each next-token distribution (:func:`logprobs_and_entropy` without labels).

    Args:
        logits: ``[B, T, V]`` (any float dtype). ``logits[b, t]`` predicts token ``t + 1``.
        shift: True: aligned to the *sampled* token, ``out[b, i] = H(logits[b, i - 1])`` and ``out[b, 0] = 0``;
            False: ``out[b, t] = H(logits[b, t])``.

    Returns:
        ``[B, T]`` float32 entropies. Not differentiable.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    ent = logprobs_and_entropy(logits, chunk_size=chunk_size)[1]
    if shift:
        ent = torch.cat([ent.new_zeros(ent.shape[0], 1), ent[:, :-1]], dim=1)
    return ent


def first_response_tokens(action_mask: Tensor) -> Tensor:
    """``[B, T]`` bool: response tokens whose left neighbour is not a response token (start of each response run)."""
    action_mask = action_mask.bool()
    prev = torch.zeros_like(action_mask)
    prev[:, 1:] = action_mask[:, :-1]
    return action_mask & ~prev


def segment_boundaries(entropy: Tensor, action_mask: Tensor, cutoff: float = DEFAULT_ENTROPY_CUTOFF) -> Tensor:
    """Which tokens start a new segment (paper 003, section 2.2, "Entropy-based Segmentation").

    Token ``i`` starts a segment iff it is the first response token or a response token with ``entropy[b, i] >
    cutoff`` (NaN never does). ``cutoff = inf``: one segment per response; 0: one per token (Appendix C baselines).

    Args:
        entropy: ``[B, T]`` float, aligned to the sampled token.
        action_mask: ``[B, T]`` bool, true at response tokens.
        cutoff: c_ent in nats, ``>= 0``.

    Returns:
        ``[B, T]`` bool, false outside ``action_mask``.
    """
    cutoff = check_knob(SegmentRewardKnobs, "entropy_cutoff", cutoff, "entropy cutoff")
    if entropy.shape != action_mask.shape:
        raise ValueError(f"entropy {tuple(entropy.shape)} and action_mask {tuple(action_mask.shape)} must match")
    action_mask = action_mask.bool()
    return first_response_tokens(action_mask) | (action_mask & (entropy > cutoff))


class Segments(NamedTuple):
    """Segment structure of a batch of responses.

    Attributes:
        ids: ``[B, T]`` long, 0-based segment index of each response token, -1 outside the response.
        lengths: ``[B, S]`` long, number of tokens in each segment (0 for padding segments).
        counts: ``[B]`` long, number of segments per response (0 for an empty response).
        locations: ``[B, S]`` float, location indicator ``p = (s + 1) / counts`` in ``(0, 1]`` (paper section 2.3:
            ``p = t/T`` with 1-based segment index t); 0 for padding segments.
        mask: ``[B, S]`` bool, true for real segments.
        ends: ``[B, T]`` bool, true at the last token of each segment.
    """

    ids: Tensor
    lengths: Tensor
    counts: Tensor
    locations: Tensor
    mask: Tensor
    ends: Tensor


def segment_ids(starts: Tensor, action_mask: Tensor) -> Segments:
    """:class:`Segments` of each response from ``[B, T]`` bool ``starts`` (:func:`segment_boundaries`; the first
    token of a response run always starts one) and ``action_mask``; ``S = max(counts)``, at least 1."""
    if starts.shape != action_mask.shape:
        raise ValueError(f"starts {tuple(starts.shape)} and action_mask {tuple(action_mask.shape)} must match")
    action_mask = action_mask.bool()
    starts = (starts.bool() & action_mask) | first_response_tokens(action_mask)
    ids = torch.cumsum(starts, dim=1)  # long; one [B, T] integer allocation, reused in place
    ids.sub_(1).masked_fill_(~action_mask, -1)
    # a token ends its segment when the next position is outside the response or starts a new segment
    ends = action_mask.clone()
    ends[:, :-1] &= ~action_mask[:, 1:] | starts[:, 1:]
    counts = starts.sum(dim=1)
    num_seg = max(int(counts.max()) if counts.numel() else 0, 1)
    seg_index = torch.arange(num_seg, device=ids.device).unsqueeze(0)
    mask = seg_index < counts.unsqueeze(1)
    # token counts per segment; positions outside the response go to a spare column (index num_seg) that is dropped
    lengths = torch.zeros(ids.shape[0], num_seg + 1, dtype=torch.long, device=ids.device)
    lengths.scatter_add_(1, ids.remainder(num_seg + 1), torch.ones_like(ids))
    lengths = lengths[:, :num_seg]
    locations = torch.where(mask, (seg_index + 1).float() / counts.clamp_min(1).unsqueeze(1).float(), 0.0)
    return Segments(ids=ids, lengths=lengths, counts=counts, locations=locations, mask=mask, ends=ends)


def gather_segment_rewards(token_scores: Tensor, segments: Segments) -> Tensor:
    """Segment reward = the reward model's score at the segment's last token (it has read the whole segment).

    ``token_scores`` ``[B, T]`` (the scalar head at every position) -> ``[B, S]`` (0 at padding segments),
    differentiable.
    """
    if token_scores.shape != segments.ids.shape:
        raise ValueError(
            f"token_scores {tuple(token_scores.shape)} must have the shape of the segment ids "
            f"{tuple(segments.ids.shape)}"
        )
    # segment ends in row-major order fill each row's leading ``counts[b]`` slots (see segment_ids)
    return token_scores.new_zeros(segments.mask.shape).masked_scatter(segments.mask, token_scores[segments.ends])


def aggregate_segments(
    seg_rewards: Tensor, seg_mask: Tensor, kind: Aggregation | str = "softmax", tau: float = DEFAULT_TAU
) -> Tensor:
    """Parameterised sequence evaluation e_phi(x, y) = f({r_phi(s_t, a_t)}) (paper 003 Eq. 3-4).

    ``softmax``: ``tau * log(sum_t exp(r_t / tau))`` (Eq. 4); ``sum``; ``mean`` (Table 4's alternatives).
    ``seg_rewards`` and ``seg_mask`` ``[B, S]`` -> ``[B]``; ``ValueError`` naming rows with no segment.
    """
    check_aggregation(kind)
    seg_mask = seg_mask.bool()
    empty = ~seg_mask.any(dim=1)
    if bool(empty.any()):
        rows = empty.nonzero().flatten().tolist()
        raise ValueError(
            f"response(s) at batch index {rows} are empty (no response token), so they have no segment to score; "
            "drop empty responses from the dataset or make the tokenizer append an EOS token to every response"
        )
    if kind == Aggregation.SOFTMAX:
        tau = check_knob(SegmentRewardKnobs, "tau", tau)
        scaled = (seg_rewards / tau).masked_fill(~seg_mask, float("-inf"))
        return tau * torch.logsumexp(scaled, dim=1)
    total = (seg_rewards * seg_mask).sum(dim=1)
    if kind == Aggregation.SUM:
        return total
    return total / seg_mask.sum(dim=1)


def segment_bt_loss(chosen_eval: Tensor, rejected_eval: Tensor, margin: Tensor | None = None) -> Tensor:
    """Bradley-Terry loss on sequence evaluations (paper 003 Eq. 3; paper 003 Eq. 1 when each response is one segment).

    ``L = -mean_b log sigmoid(e(x, y_w) - e(x, y_l) - margin)``.

    Args:
        chosen_eval, rejected_eval: ``[B]`` evaluations from :func:`aggregate_segments`.
        margin: optional ``[B]`` margin (TRL/OpenRLHF margin loss).
    """
    diff = chosen_eval - rejected_eval
    if margin is not None:
        diff = diff - margin
    return -torch.nn.functional.logsigmoid(diff).mean()


class SequenceEvaluation(NamedTuple):
    """Output of :func:`evaluate_sequences`: ``values`` ``[B]``, ``seg_rewards`` ``[B, S]`` and the segments."""

    values: Tensor
    seg_rewards: Tensor
    segments: Segments


def evaluate_sequences(
    token_scores: Tensor,
    entropy: Tensor,
    action_mask: Tensor,
    cutoff: float = DEFAULT_ENTROPY_CUTOFF,
    aggregation: Aggregation | str = "softmax",
    tau: float = DEFAULT_TAU,
) -> SequenceEvaluation:
    """Token scores -> segments -> segment rewards -> sequence evaluation e_phi (the one path both engines use).

    ``token_scores``, ``entropy`` (SFT model, aligned to the sampled token), ``action_mask``: ``[B, T]``.
    """
    starts = segment_boundaries(entropy, action_mask, cutoff)
    segments = segment_ids(starts, action_mask)
    seg_rewards = gather_segment_rewards(token_scores, segments)
    values = aggregate_segments(seg_rewards, segments.mask, aggregation, tau)
    return SequenceEvaluation(values=values, seg_rewards=seg_rewards, segments=segments)
