"""What ``rlhf-ext`` prints when its output is piped (a CI log, ``| tee run.log``): short lines, no ``\\r``-redrawn
progress bars, no FutureWarnings, and one compact line per logging step instead of transformers' raw dicts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from rlhf_ext.trl.console import format_number

#: 96 training pairs in batches of 16: 6 optimizer steps in the one epoch, a line every 2 steps.
TRAIN_PAIRS, BATCH, LOGGING_STEPS = 96, 16, 2
STEPS = TRAIN_PAIRS // BATCH


def test_piped_segment_rm_run_prints_one_compact_line_per_logging_step(tmp_path, tiny_sft_path):
    """Before: 5 dicts of up to 377 characters ({'loss': '0.7048', 'grad_norm': ...}) and 68 \\r of tqdm bars,
    the longest line 1,088 characters; the evaluation after training was not shown at all. (``tiny_sft_path``:
    builtin:tiny-sft is built beforehand, into the cache the command inherits through RLHF_EXT_CACHE.)"""
    out = tmp_path / "rm"
    env = {k: v for k, v in os.environ.items() if k != "RLHF_EXT_VERBOSITY"}
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf_ext.cli", "train", "segment-rm", "--config", "segment_rm_tiny",
         f"train.output_dir={out}", f"data.max_train_samples={TRAIN_PAIRS}", "data.max_eval_samples=16",
         f"train.batch_size={BATCH}", f"train.micro_batch_size={BATCH}", "train.num_train_epochs=1",
         f"train.logging_steps={LOGGING_STEPS}"],
        capture_output=True, env=env, timeout=1200,
    )  # fmt: skip
    stdout, stderr = proc.stdout.decode(), proc.stderr.decode()  # bytes: text mode would turn "\r" into "\n"
    assert proc.returncode == 0, stderr[-3000:]
    printed = stdout + stderr
    assert "\r" not in printed
    assert "FutureWarning" not in printed
    assert "{'loss'" not in printed
    longest = max(printed.splitlines(), key=len)
    assert len(longest) <= 200, longest

    number = r"[-+]?\d[\d.e+-]*"
    steps = re.findall(
        rf"^rm step (\d+)/{STEPS}  loss {number}  accuracy {number}  margin [-+]{number}  segs/resp {number}$",
        stderr,
        re.MULTILINE,
    )
    assert steps == [str(s) for s in range(LOGGING_STEPS, STEPS + 1, LOGGING_STEPS)]  # 2, 4, 6
    evals = re.findall(r"^rm eval  loss .*$", stderr, re.MULTILINE)
    assert len(evals) == 1  # the end of the epoch; run_segment_rm reuses it instead of evaluating again
    final = json.loads((out / "metrics.json").read_text())["eval"]
    assert f"accuracy {format_number(final['eval_accuracy'])}" in evals[-1]
    assert len(re.findall(rf"^rm finished in {number} s  train loss {number}$", stderr, re.MULTILINE)) == 1
    assert "segment reward model trained" in stdout
