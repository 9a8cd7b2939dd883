"""One compact terminal line per logging step for TRL / transformers trainers, in place of the whole ``logs`` dicts
``PrinterCallback`` / ``ProgressCallback`` print (plus a tqdm bar of the steps when stderr is a terminal)::

    ppo step 12/20  reward +0.41  kl 0.031  len 23.5  segs/resp 3.2  value_loss 0.12
    rm eval  loss 0.486  accuracy 0.984  margin +0.481  segs/resp 7.35
    rm finished in 89.9 s  train loss 0.618

The lines go to this module's logger at ``INFO``; ``trainer.state.log_history`` and the ``report_to`` integrations
still get the full dicts. A trainer built in your own code opts in::

    from rlhf_ext.runtime.log import enable_console_logging
    from rlhf_ext.trl.console import use_console_output

    enable_console_logging()                 # rlhf-ext's info lines on stderr, as under the command line
    trainer = SegmentRewardTrainer(...)
    use_console_output(trainer)              # before trainer.train()
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers import TrainerCallback

from rlhf_ext.runtime.log import stderr_is_terminal

logger = logging.getLogger(__name__)

#: Lines are cut before this many characters (a generic dict of many metrics is not printed whole).
MAX_LINE_WIDTH = 160


@dataclass(frozen=True)
class Metric:
    """One column of a step line: ``label`` and the value of the first of ``keys`` present in the logs.
    ``signed``: always show the sign (rewards, margins)."""

    label: str
    keys: tuple[str, ...]
    signed: bool = False


@dataclass(frozen=True)
class ConsoleProfile:
    """What a trainer kind shows: its line prefix ``name`` and its ``metrics``, in order."""

    name: str
    metrics: tuple[Metric, ...]


LOSS = Metric("loss", ("loss",))
PPO_PROFILE = ConsoleProfile("ppo", (
    Metric("reward", ("reward",), signed=True), Metric("kl", ("segment/kl", "kl")),
    Metric("len", ("segment/response_length", "completions/mean_length")),
    Metric("segs/resp", ("segment/segments_per_response",)), Metric("value_loss", ("critic/value_loss",)),
    Metric("kl_prev", ("continual/kl_to_previous",)),
))  # fmt: skip
REWARD_MODEL_PROFILE = ConsoleProfile("rm", (
    LOSS, Metric("accuracy", ("accuracy",)), Metric("margin", ("margin",), signed=True),
    Metric("segs/resp", ("segments_per_response",)),
))  # fmt: skip
DPO_PROFILE = ConsoleProfile("dpo", (
    LOSS, Metric("margin", ("rewards/margins",), signed=True), Metric("accuracy", ("rewards/accuracies",)),
    Metric("kl_prev", ("continual/kl_to_previous",)),
    # online DPO's round logs (IterativeDPOTrainer: after each iteration / the last update)
    Metric("pairs", ("pairs/num_pairs",)), Metric("tied", ("pairs/dropped",)),
    Metric("pair_reward", ("pairs/mean_reward",), signed=True),
    Metric("eval_reward", ("policy_eval/mean_reward",), signed=True),
    Metric("eval_gold", ("policy_eval/mean_gold",), signed=True),
    Metric("eval_chars", ("policy_eval/mean_length_chars",)),
))  # fmt: skip
SFT_PROFILE = ConsoleProfile(
    "sft", (LOSS, Metric("token_acc", ("mean_token_accuracy",)), Metric("kl_ref", ("kl_to_ref",)))
)
GENERIC_PROFILE = ConsoleProfile("train", (LOSS,))

#: Keys of a step's logs that no line shows (bookkeeping, or constant over a run).
HIDDEN_KEYS = frozenset({"total_flos", "epoch", "step"})
#: Keys that number the rounds of an outer loop (online DPO's iterations and updates): ``dpo iteration 2  ...``.
ROUND_KEYS = ("iteration", "update")


def format_number(value: Any, signed: bool = False) -> str:
    """A metric for a terminal line: three significant digits, integers and values in ``[1000, 1e6)`` without
    decimals, ``signed`` with a ``+`` for positive values; strings cut to 40 characters."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:+d}" if signed else str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        sign = "+" if signed else ""
        if 1000 <= abs(value) < 1e6:
            return f"{value:{sign}.0f}"
        return f"{value:{sign}.3g}"
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _cut(line: str) -> str:
    return line if len(line) <= MAX_LINE_WIDTH else line[: MAX_LINE_WIDTH - 3] + "..."


def metric_columns(profile: ConsoleProfile, logs: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``["label value", ...]`` for the profile's metrics present in ``logs`` (keys looked up with ``prefix``)."""
    columns = []
    for metric in profile.metrics:
        key = next((prefix + k for k in metric.keys if prefix + k in logs), None)
        if key is not None:
            columns.append(f"{metric.label} {format_number(logs[key], metric.signed)}")
    return columns


def generic_columns(logs: Mapping[str, Any]) -> list[str]:
    """``["key value", ...]`` for every shown key of ``logs`` (logs no profile describes)."""
    return [f"{k} {format_number(v)}" for k, v in logs.items() if k not in HIDDEN_KEYS]


def format_logs(profile: ConsoleProfile, name: str, logs: Mapping[str, Any], step: int, max_steps: int) -> str:
    """The terminal line of one ``on_log`` call: a training step, an evaluation (``eval_*`` keys), the end of
    training (``train_runtime``), a round of an outer loop (:data:`ROUND_KEYS`), or other logs."""
    if "train_runtime" in logs:
        head = f"{name} finished in {format_number(float(logs['train_runtime']))} s"
        shows_loss = LOSS in profile.metrics  # (PPO's surrogate loss says nothing; its lines show the reward)
        loss = f"train loss {format_number(logs['train_loss'])}" if shows_loss and "train_loss" in logs else None
        return "  ".join(filter(None, [head, loss]))
    if any(k.startswith("eval_") for k in logs):
        columns = metric_columns(profile, logs, prefix="eval_")
        if not columns:
            columns = generic_columns({k: v for k, v in logs.items() if not k.endswith(("_runtime", "_per_second"))})
        return _cut("  ".join([f"{name} eval", *columns]))
    if "loss" in logs or "learning_rate" in logs:  # ``name step  7/20  col  col`` (right-aligned to max_steps)
        head = f"{name} step {step:>{len(str(max_steps))}}/{max_steps}" if max_steps > 0 else f"{name} step {step}"
        return _cut("  ".join([head, *(metric_columns(profile, logs) or generic_columns(logs))]))
    round_key = next((k for k in ROUND_KEYS if k in logs), None)
    if round_key is not None:
        rest = {k: v for k, v in logs.items() if k != round_key}
        columns = metric_columns(profile, rest) or generic_columns(rest)
        return _cut("  ".join([f"{name} {round_key} {format_number(logs[round_key])}", *columns]))
    return _cut("  ".join([name, *generic_columns(logs)]))


class ConsoleCallback(TrainerCallback):
    """Logs one compact line per ``on_log`` call and draws a tqdm bar of the training steps when stderr is a
    terminal. Install it with :func:`use_console_output`.

    Args:
        profile: the metrics to show (e.g. :data:`PPO_PROFILE`).
        name: the line prefix (default: the profile's name).
        progress_bar: draw the bar; ``None``: when stderr is a terminal and ``args.disable_tqdm`` is false.
    """

    def __init__(self, profile: ConsoleProfile = GENERIC_PROFILE, name: str | None = None,
                 progress_bar: bool | None = None) -> None:  # fmt: skip
        self.profile = profile
        self.name = name or profile.name
        self.progress_bar = progress_bar
        self._bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        show = stderr_is_terminal() and not args.disable_tqdm if self.progress_bar is None else self.progress_bar
        if show and state.is_world_process_zero:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=state.max_steps, initial=state.global_step, desc=self.name, unit="step",
                             file=sys.stderr, dynamic_ncols=True, leave=False)  # fmt: skip

    def on_step_end(self, args, state, control, **kwargs):
        if self._bar is not None:
            self._bar.update(state.global_step - self._bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and state.is_world_process_zero:
            logger.info(format_logs(self.profile, self.name, logs, state.global_step, state.max_steps))

    def on_train_end(self, args, state, control, **kwargs):
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def profile_for(trainer: Any) -> ConsoleProfile:
    """The console profile of a trainer, by the TRL trainer it extends (GRPO-based trainers show PPO's metrics)."""
    from trl import DPOTrainer, GRPOTrainer, RewardTrainer, SFTTrainer

    kinds = ((GRPOTrainer, PPO_PROFILE), (DPOTrainer, DPO_PROFILE), (RewardTrainer, REWARD_MODEL_PROFILE),
             (SFTTrainer, SFT_PROFILE))  # fmt: skip
    return next((profile for cls, profile in kinds if isinstance(trainer, cls)), GENERIC_PROFILE)


def console_callback_of(trainer: Any) -> ConsoleCallback | None:
    """The :class:`ConsoleCallback` installed on ``trainer``, if any."""
    return next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, ConsoleCallback)), None)


def use_console_output(trainer: Any, name: str | None = None, *, progress_bar: bool | None = None,
                       callback: ConsoleCallback | None = None) -> ConsoleCallback:  # fmt: skip
    """Replace ``trainer``'s ``PrinterCallback`` / ``ProgressCallback`` with a :class:`ConsoleCallback` (before
    ``train()``; calling it again changes nothing) and return it: ``callback`` if given, else a new one with ``name``
    and ``progress_bar`` (as for :class:`ConsoleCallback`)."""
    from transformers.trainer import DEFAULT_PROGRESS_CALLBACK
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    printers = (PrinterCallback, ProgressCallback, DEFAULT_PROGRESS_CALLBACK)
    for cb in list(trainer.callback_handler.callbacks):
        if isinstance(cb, printers):
            trainer.remove_callback(cb)
    installed = console_callback_of(trainer)
    if installed is not None:
        return installed
    callback = callback or ConsoleCallback(profile_for(trainer), name, progress_bar)
    trainer.add_callback(callback)
    return callback
