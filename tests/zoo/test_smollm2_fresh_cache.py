"""``builtin:smollm2`` on an EMPTY cache, the way the README runs it (``rlhf-ext demo --config demo_smollm2``): the
real GGUF conversion (~30 s, 1.7 GB), run once per test run (marked slow, not behind ``RLHF_EXT_REAL_MODEL``).

Before the one-owner fix the demo died here with ``RuntimeError: Deadlock`` (filelock 4; 3.x waited forever):
``resolve_model`` held ``models/smollm2.lock`` and the conversion took it again. Machines that had converted the
model once never met it, and every other SmolLM2 test starts from a converted cache.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.helpers.kill_points import read_stderr_until, run_cli, start_cli, was_killed

pytestmark = pytest.mark.slow


def test_demo_smollm2_on_an_empty_cache_converts_survives_a_kill_and_shares_the_conversion(tmp_path, monkeypatch):
    cache, out = tmp_path / "cache", tmp_path / "runs" / "demo_smollm2"
    monkeypatch.setenv("RLHF_EXT_CACHE", str(cache))
    models = cache / "models"
    demo = ["demo", "--config", "demo_smollm2", "--out", str(out)]

    # 1. The README's command on an empty cache, killed (kill -9) when the converted model is complete in its
    #    temporary directory but not yet in place: the data stage is done, the cache has no model.
    first = run_cli(demo, fault_at="written:smollm2", cwd=tmp_path)
    assert was_killed(first), first.stderr[-3000:]
    assert (out / "stages" / "data.json").is_file()
    assert not (models / "smollm2").exists()
    assert len([p for p in models.iterdir() if p.name.startswith(".smollm2.tmp-")]) == 1

    # 2. The same command again converts from scratch (the killed copy is deleted first); while it converts (paused
    #    here so that the other one surely arrives), `rlhf-ext zoo build smollm2` waits for it and then reuses it.
    #    The demo is killed once the model is in place (its SFT stage would take minutes).
    second = start_cli(demo, fault_at="committed:smollm2", cwd=tmp_path)
    second_log = read_stderr_until(second, "building ")
    os.kill(second.pid, signal.SIGSTOP)
    try:
        waiting = start_cli(["zoo", "build", "smollm2"], cwd=tmp_path)
        waiting_log = read_stderr_until(waiting, "waiting for")
    finally:
        os.kill(second.pid, signal.SIGCONT)
    printed, rest = second.communicate(timeout=900)
    assert second.returncode == -signal.SIGKILL, "".join(second_log) + rest[-3000:]
    assert "[1/8] data: reusing" in printed and "[2/8] sft ..." in printed
    stdout, stderr = waiting.communicate(timeout=900)
    assert waiting.returncode == 0, stderr[-3000:]
    assert stdout.strip().splitlines()[-1] == str(models / "smollm2")
    assert not any(line.startswith("building ") for line in waiting_log + stderr.splitlines())  # it reused it
    assert sorted(p.name for p in models.iterdir()) == ["smollm2", "smollm2.lock"]  # no leftover copy

    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models / "smollm2")
    config = AutoConfig.from_pretrained(models / "smollm2")
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert (config.eos_token_id, config.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert config.num_hidden_layers == 30 and not hasattr(config, "quantization_config")
