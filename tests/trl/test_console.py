"""The console callback: one compact line per logging step instead of transformers' raw ``logs`` dicts."""

from __future__ import annotations

import logging
import re

import pytest
from transformers import TrainerCallback

from rlhf_ext.trl.console import (
    DPO_PROFILE,
    PPO_PROFILE,
    REWARD_MODEL_PROFILE,
    format_logs,
    format_number,
)

#: A real step of the demo's segment PPO (``trainer.state.log_history``), with a critic value loss added.
PPO_LOGS = {
    "loss": 7.062e-08, "grad_norm": 0.4388, "learning_rate": 0.0001624, "num_tokens": 17400.0,
    "completions/mean_length": 62.25, "completions/min_length": 21.0, "completions/clipped_ratio": 0.0,
    "reward": 0.4113, "reward_std": 6.812, "frac_reward_zero_std": 0.0, "segment/score": 3.868,
    "segment/raw_last_score": 0.391, "segment/segments_per_response": 3.2, "segment/response_length": 23.5,
    "segment/kl": 0.03142, "critic/value_loss": 0.1201, "entropy": 0.7342, "clip_ratio/low_mean": 0.0,
    "step_time": 25.17, "epoch": 0.2895,
}  # fmt: skip
#: A real step, evaluation and end of training of ``rlhf-ext train segment-rm --config segment_rm_tiny``.
RM_STEP = {
    "loss": 0.5498, "grad_norm": 2.147, "learning_rate": 1.093e-05, "num_tokens": 35730.0, "min_reward": 0.6389,
    "mean_reward": 1.013, "max_reward": 1.349, "accuracy": 0.9453, "margin": 0.3226, "segments_per_response": 7.238,
    "mean_segment_length": 7.213, "epoch": 0.5,
}  # fmt: skip
RM_EVAL = {
    "eval_loss": 0.4861, "eval_runtime": 13.99, "eval_samples_per_second": 9.151, "eval_steps_per_second": 0.572,
    "eval_num_tokens": 35730.0, "eval_min_reward": 0.5554, "eval_mean_reward": 1.043, "eval_max_reward": 1.433,
    "eval_accuracy": 0.9844, "eval_margin": -0.4809, "eval_segments_per_response": 7.348, "epoch": 0.5,
}  # fmt: skip
RM_END = {"train_runtime": 89.9, "train_samples_per_second": 2.848, "train_steps_per_second": 0.178,
          "train_loss": 0.6182, "epoch": 0.5}  # fmt: skip


def test_ppo_step_line_shows_the_metrics_that_matter():
    line = format_logs(PPO_PROFILE, "ppo", PPO_LOGS, step=12, max_steps=20)
    assert line == "ppo step 12/20  reward +0.411  kl 0.0314  len 23.5  segs/resp 3.2  value_loss 0.12"
    end = {"train_runtime": 68.31, "train_loss": 5.16e-09, "epoch": 0.53}
    assert format_logs(PPO_PROFILE, "ppo", end, step=20, max_steps=20) == "ppo finished in 68.3 s"


def test_reward_model_step_eval_and_end_lines():
    assert format_logs(REWARD_MODEL_PROFILE, "rm", RM_STEP, step=8, max_steps=16) == (
        "rm step  8/16  loss 0.55  accuracy 0.945  margin +0.323  segs/resp 7.24"
    )
    assert format_logs(REWARD_MODEL_PROFILE, "rm", RM_EVAL, step=16, max_steps=16) == (
        "rm eval  loss 0.486  accuracy 0.984  margin -0.481  segs/resp 7.35"
    )
    assert format_logs(REWARD_MODEL_PROFILE, "rm", RM_END, step=16, max_steps=16) == (
        "rm finished in 89.9 s  train loss 0.618"
    )


def test_dpo_line_and_logs_no_profile_describes():
    dpo = {"loss": 0.6931, "rewards/margins": 0.0125, "rewards/accuracies": 0.625, "logps/chosen": -80.5}
    assert format_logs(DPO_PROFILE, "dpo", dpo, step=3, max_steps=10) == (
        "dpo step  3/10  loss 0.693  margin +0.0125  accuracy 0.625"
    )
    iteration = {"iteration": 1, "pairs/num_pairs": 31, "pairs/dropped": 1, "pairs/mean_reward": 0.418,
                 "policy_eval/mean_reward": 0.75, "policy_eval/mean_length_chars": 176.25, "epoch": 2.0}  # fmt: skip
    assert format_logs(DPO_PROFILE, "dpo", iteration, step=16, max_steps=16) == (
        "dpo iteration 1  pairs 31  tied 1  pair_reward +0.418  eval_reward +0.75  eval_chars 176"
    )
    assert format_logs(DPO_PROFILE, "dpo", {"update": 12, "custom/x": 0.5}, step=12, max_steps=12) == (
        "dpo update 12  custom/x 0.5"
    )
    many = {f"metric_{k:02d}": 0.5 for k in range(40)}
    line = format_logs(DPO_PROFILE, "dpo", many, step=1, max_steps=1)
    assert len(line) == 160 and line.endswith("...")


@pytest.mark.parametrize(
    ("value", "signed", "text"),
    [(0.031415, False, "0.0314"), (23.46, False, "23.5"), (0.41, True, "+0.41"), (-0.41, True, "-0.41"),
     (12345.6, False, "12346"), (2.5e6, False, "2.5e+06"), (-5.274e-09, False, "-5.27e-09"), (7, True, "+7"),
     (float("nan"), False, "nan"), (True, False, "True"), ("x" * 50, False, "x" * 37 + "...")],
)  # fmt: skip
def test_format_number(value, signed, text):
    assert format_number(value, signed) == text


def test_fine_tune_logs_one_line_per_logging_step_and_prints_no_dicts(tmp_path, toy_tok, toy_data, caplog, capsys):
    """Before: transformers' ProgressCallback wrote every logs dict ({'loss': ..., 'grad_norm': ...}) to stdout and
    nothing reached the rlhf_ext logger."""
    from rlhf_ext.config import TrainSection
    from rlhf_ext.trl.sft import fine_tune
    from rlhf_ext.zoo.models import tiny_causal_lm

    rows = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in toy_data["train"].select(range(32))]
    with caplog.at_level(logging.INFO, logger="rlhf_ext"):
        train = TrainSection(max_steps=4, batch_size=8, micro_batch_size=8, learning_rate=1e-3, logging_steps=2)
        fine_tune(tiny_causal_lm(toy_tok), rows, tmp_path / "sft", train, seed=0, tokenizer=toy_tok)
    lines = [r.getMessage() for r in caplog.records if r.name == "rlhf_ext.trl.console"]
    number = r"[-+]?\d[\d.e+-]*"
    assert len(lines) == 3, lines
    for line, step in zip(lines, (2, 4)):
        assert re.fullmatch(rf"sft step {step}/4  loss {number}  token_acc {number}", line), line
    assert re.fullmatch(rf"sft finished in {number} s  train loss {number}", lines[2]), lines[2]
    out = capsys.readouterr()
    printed = out.out + out.err
    assert "{'loss'" not in printed and "loss" not in printed, printed


def test_use_console_output_replaces_the_printers_once(tmp_path, toy_tok, toy_data):
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import SFTConfig, SFTTrainer

    from rlhf_ext.trl.args import CPU_RUN
    from rlhf_ext.trl.console import SFT_PROFILE, ConsoleCallback, use_console_output
    from rlhf_ext.zoo.models import tiny_causal_lm

    def kinds(trainer) -> list[type]:
        return [type(cb) for cb in trainer.callback_handler.callbacks]

    class RecordLogs(TrainerCallback):  # what a report_to integration (TensorBoard, W&B) receives
        def __init__(self):
            self.logs: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    rows = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in toy_data["train"].select(range(8))]
    for disable_tqdm, printer in ((True, PrinterCallback), (False, ProgressCallback)):
        args = SFTConfig(output_dir=str(tmp_path), max_steps=1, logging_steps=1,
                         **{**CPU_RUN, "disable_tqdm": disable_tqdm})  # fmt: skip
        recorder = RecordLogs()
        trainer = SFTTrainer(tiny_causal_lm(toy_tok), args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=toy_tok, callbacks=[recorder])  # fmt: skip
        assert printer in kinds(trainer)  # TRL's default output, untouched until one opts in
        installed = use_console_output(trainer)
        assert use_console_output(trainer) is installed and installed.profile is SFT_PROFILE
        assert printer not in kinds(trainer) and kinds(trainer).count(ConsoleCallback) == 1
    trainer.train()
    # the loggers and log_history still get the full dicts (the line shows loss and token accuracy only)
    full = {"loss", "grad_norm", "learning_rate", "entropy", "num_tokens", "mean_token_accuracy", "epoch"}
    assert full <= set(recorder.logs[0]) and full <= set(trainer.state.log_history[0])


def test_progress_bar_only_when_stderr_is_a_terminal(monkeypatch, capsys):
    from types import SimpleNamespace

    from transformers import TrainerState

    from rlhf_ext.trl import console
    from rlhf_ext.trl.console import SFT_PROFILE, ConsoleCallback

    for terminal in (False, True):
        monkeypatch.setattr(console, "stderr_is_terminal", lambda terminal=terminal: terminal)
        callback, args = ConsoleCallback(SFT_PROFILE), SimpleNamespace(disable_tqdm=False)
        state = TrainerState(max_steps=3, is_world_process_zero=True)
        callback.on_train_begin(args, state, None)
        for step in (1, 2, 3):
            state.global_step = step
            callback.on_step_end(args, state, None)
        callback.on_train_end(args, state, None)
        err = capsys.readouterr().err
        assert ("\r" in err) is terminal and ("sft:" in err) is terminal, err


@pytest.mark.slow  # 19-32 s on 2 cores, 107 s on a loaded machine
def test_console_output_lasts_over_every_dpo_run_of_an_iterative_trainer(tmp_path, tiny_sft_path, caplog, capsys):
    """IterativeDPOTrainer builds a new DPOTrainer (and transformers' printers) for each iteration's DPO run."""
    from rlhf_ext.trl import IterativeDPOConfig, IterativeDPOTrainer
    from rlhf_ext.trl.args import CPU_RUN
    from rlhf_ext.trl.console import use_console_output
    from rlhf_ext.zoo.toy import keyphrase_gold_reward, toy_preference_dataset

    prompts = toy_preference_dataset(n_train=32, n_test=8, seed=0)
    args = IterativeDPOConfig(
        output_dir=str(tmp_path), num_iterations=2, prompts_per_iteration=8, num_generations=4,
        max_completion_length=64, learning_rate=1e-4, num_train_epochs=1, per_device_train_batch_size=4, beta=0.1,
        **CPU_RUN, logging_steps=1, eval_num_prompts=2, eval_samples_per_prompt=1, max_length=128, seed=0,
    )  # fmt: skip
    trainer = IterativeDPOTrainer(tiny_sft_path, keyphrase_gold_reward, args, prompts["train"], prompts["test"])
    use_console_output(trainer)
    with caplog.at_level(logging.INFO, logger="rlhf_ext"):
        out = trainer.train()
    lines = [r.getMessage() for r in caplog.records if r.name == "rlhf_ext.trl.console"]
    assert len([line for line in lines if line.startswith("dpo step ")]) == out.global_step > 0  # every step logged
    assert [line.split("  ")[0] for line in lines if " iteration " in line] == ["dpo iteration 0", "dpo iteration 1"]
    pairs = [it["pairs"] for it in trainer.summary["iterations"]]
    assert all(p["num_pairs"] > 0 for p in pairs)  # two DPO runs, each with its own DPOTrainer initialisation
    assert len([line for line in lines if line.startswith("dpo finished in ")]) == 3  # 2 runs, then the whole
    online = [r.getMessage() for r in caplog.records if r.name == "rlhf_ext.runtime.iterations"]  # step 5 logs
    assert online == [f"iteration {t}: {p['num_pairs']} pairs ({p['dropped']} prompts dropped)" for t, p in
                      enumerate(pairs)]  # fmt: skip
    assert "{'loss'" not in capsys.readouterr().out
