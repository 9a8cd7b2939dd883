"""What :class:`~rlhf_ext.trl.segment_ppo.DensePPOTrainer` logs per rollout batch into TRL's ``self._metrics[mode]``:
the reward with its KL penalty, the dense reward's sums, and the reward-hacking monitor of paper 003's segmentation.
``gather`` is ``accelerator.gather``: every figure is over all processes' rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping

import torch

from rlhf_ext.algos.segment_dense import SegmentationMonitor, SegmentationRates, segmentation_totals
from rlhf_ext.runtime.spans import DenseBatch

Metrics = MutableMapping[str, list]
Gather = Callable[[torch.Tensor], torch.Tensor]


def drop_grpo_reward_metrics(
    metrics: Metrics, gather: Gather, reward_func_names: list[str] | None, sequence_reward: torch.Tensor, group: int
) -> None:
    """Remove GRPO's own reward figures of this rollout (its reward has no KL; ours is logged by
    :func:`log_kl_reward`). With ``reward_func_names`` (GRPO's placeholder function, whose rewards are zeros) drop its
    per-function stats too and recompute ``frac_reward_zero_std`` from ``sequence_reward`` ``[B]`` in prompt groups
    of ``group`` rows."""
    for key in ("reward", "reward_std"):
        if metrics.get(key):
            metrics[key].pop()
    if reward_func_names is None:
        return
    for name in reward_func_names:
        for stat in ("mean", "std"):
            metrics.pop(f"rewards/{name}/{stat}", None)
    if metrics.get("frac_reward_zero_std"):  # the true fraction: prompt groups whose rewards are all equal
        groups = gather(sequence_reward).view(-1, group)
        metrics["frac_reward_zero_std"][-1] = (groups.std(dim=1) == 0).float().mean().item()


def log_kl_reward(
    metrics: Metrics, gather: Gather, sequence_reward: torch.Tensor, kl: torch.Tensor, kl_coef: float
) -> None:
    """``reward`` = summed dense reward ``[B]`` minus ``kl_coef`` times the summed per-token KL ``kl`` ``[B, C]``
    (paper 003 Eq. 5 summed over the response), its std, and ``segment/kl``."""
    total_reward = gather(sequence_reward - kl_coef * kl.sum(dim=1))
    metrics["reward"].append(total_reward.mean().item())
    metrics["reward_std"].append(total_reward.std().item() if total_reward.numel() > 1 else 0.0)
    metrics["segment/kl"].append(gather(kl.sum(dim=1)).mean().item())


def log_dense_rewards(
    metrics: Metrics, gather: Gather, dense: DenseBatch, scores: torch.Tensor, mask: torch.Tensor
) -> None:
    """The batch's mean summed dense reward, the raw score ``[B, C]`` at each response's last token, segments per
    response and response length (``mask`` ``[B, C]``)."""
    last = mask.long().cumsum(1).argmax(1, keepdim=True)
    metrics["segment/score"].append(gather(dense.sequence_reward).mean().item())
    metrics["segment/raw_last_score"].append(gather(scores.gather(1, last)).mean().item())
    metrics["segment/segments_per_response"].append(gather(dense.segments_per_response.float()).mean().item())
    metrics["segment/response_length"].append(gather(mask.sum(dim=1).float()).mean().item())


def monitor_segmentation(
    metrics: Metrics,
    gather: Gather,
    monitor: SegmentationMonitor,
    counts: torch.Tensor,
    mask: torch.Tensor,
    entropy: torch.Tensor | None,
    entropy_cutoff: float,
    step: int | None,
    is_main_process: bool,
) -> None:
    """Log segments per token and the share of tokens above ``entropy_cutoff`` (``counts`` ``[B]`` segments per
    response, ``entropy`` ``[B, C]`` the SFT model's) and their ratios to the SFT policy's; the main process logs the
    monitor's one warning line when either passes 1.5x (``step`` ``None``: evaluation, never warns)."""
    totals = segmentation_totals(counts, mask, entropy, entropy_cutoff)  # [3]: ranks' lengths may differ
    rates = SegmentationRates.of_totals(gather(totals.unsqueeze(0)).sum(0))
    for name, value in monitor.values(rates).items():
        metrics[f"segment/{name}"].append(value)
    message = monitor.check(rates, step) if step is not None else None
    if message is not None and is_main_process:
        logging.getLogger("rlhf_ext").warning(message)
