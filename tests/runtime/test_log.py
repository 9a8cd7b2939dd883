"""rlhf-ext's library logger: module loggers under ``rlhf_ext``, the host application in charge of what is shown,
and the command line's stream handler (``RLHF_EXT_VERBOSITY``)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from rlhf_ext.runtime.log import (
    LIBRARY_LOGGER,
    ConsoleHandler,
    enable_console_logging,
    parse_verbosity,
)

NO_CUDA_NOTICE = "no GPUs in the cluster: rollouts use the HF generate engine (--ext.rollout_engine hf)"


@pytest.fixture()
def library_logger():
    """The ``rlhf_ext`` logger, its level and handlers restored after the test."""
    log = logging.getLogger(LIBRARY_LOGGER)
    level, handlers = log.level, list(log.handlers)
    yield log
    log.setLevel(level)
    log.handlers[:] = handlers


def _library_call() -> str:
    """A library call that logs one info line (the OpenRLHF driver's rollout-engine notice) and returns a value."""
    from rlhf_ext.openrlhf.train_ppo_ray import resolve_rollout_engine
    from rlhf_ext.runtime.resources import Cluster

    return resolve_rollout_engine("auto", Cluster((0,)))


def test_a_host_application_decides_what_is_shown(library_logger, caplog):
    caplog.set_level(logging.DEBUG)  # the root handler takes everything: only the rlhf_ext level filters
    library_logger.setLevel(logging.WARNING)
    assert _library_call() == "hf"
    assert [r for r in caplog.records if r.name.startswith("rlhf_ext")] == []

    library_logger.setLevel(logging.INFO)
    assert _library_call() == "hf"
    shown = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert shown == [("rlhf_ext.openrlhf.train_ppo_ray", logging.INFO, NO_CUDA_NOTICE)]


def test_module_loggers_sit_under_the_library_logger():
    from rlhf_ext import config, demo
    from rlhf_ext.openrlhf import train_ppo_ray
    from rlhf_ext.sim import compare

    library = logging.getLogger(LIBRARY_LOGGER)
    for module in (demo, config, train_ppo_ray, compare):
        assert module.logger.name == module.__name__
        parent = module.logger.parent
        while parent is not None and parent is not library:
            parent = parent.parent
        assert parent is library


def test_micro_batch_notice_is_a_warning(caplog):
    """Was a print() on stdout, which a host application could neither silence nor redirect."""
    from rlhf_ext.config import per_device_micro_batch

    with caplog.at_level(logging.WARNING, logger=LIBRARY_LOGGER):
        assert per_device_micro_batch(16, 16, 2) == 8
    assert [r.getMessage() for r in caplog.records] == [
        "train.micro_batch_size 16 x 2 processes exceeds train.batch_size 16; using micro batch 8 per process"
    ]


def test_console_handler_writes_to_the_current_stderr(library_logger, capsys):
    handler = enable_console_logging("info")
    assert enable_console_logging("warning") is handler and library_logger.handlers.count(handler) == 1
    assert library_logger.level == logging.WARNING
    library_logger.setLevel(logging.INFO)
    logging.getLogger("rlhf_ext.some.module").info("rm step 1/2  loss 0.69")
    logging.getLogger("rlhf_ext.some.module").warning("the eval set is empty")
    assert capsys.readouterr() == ("", "rm step 1/2  loss 0.69\nwarning: the eval set is empty\n")
    assert isinstance(handler, ConsoleHandler)


@pytest.mark.parametrize(("name", "level"), [("debug", 10), ("INFO", 20), (" warning ", 30), ("error", 40), (25, 25)])
def test_parse_verbosity(name, level):
    assert parse_verbosity(name) == level


def test_parse_verbosity_names_the_choices():
    with pytest.raises(ValueError, match="unknown verbosity 'loud': use one of debug, info, warning, error"):
        parse_verbosity("loud")


CLI_SETUP = (
    "import logging, os, sys\n"
    "from rlhf_ext.runtime.log import configure_cli_output\n"
    "{before}\n"
    "configure_cli_output()\n"
    "from rlhf_ext.openrlhf.train_ppo_ray import resolve_rollout_engine\n"
    "from rlhf_ext.runtime.resources import Cluster\n"
    "resolve_rollout_engine('auto', Cluster((0,)))\n"
    "print(os.environ.get('HF_DATASETS_DISABLE_PROGRESS_BARS'), len(logging.getLogger('rlhf_ext').handlers))\n"
)


def _cli_process(verbosity: str | None = None, before: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RLHF_EXT_VERBOSITY", "HF_DATASETS_DISABLE_PROGRESS_BARS")}
    if verbosity is not None:
        env["RLHF_EXT_VERBOSITY"] = verbosity
    code = CLI_SETUP.format(before=before)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)


def test_the_command_line_shows_info_lines_by_default():
    proc = _cli_process()
    assert proc.stderr == NO_CUDA_NOTICE + "\n"
    assert proc.stdout == "1 1\n"  # stderr piped: the datasets progress bars are off; one handler


@pytest.mark.parametrize(
    ("verbosity", "stderr"),
    [("warning", ""), ("DEBUG", NO_CUDA_NOTICE + "\n"),
     ("loud", "warning: RLHF_EXT_VERBOSITY: unknown verbosity 'loud': use one of debug, info, warning, error; "
              "ignored\n" + NO_CUDA_NOTICE + "\n")],
)  # fmt: skip
def test_rlhf_ext_verbosity(verbosity, stderr):
    assert _cli_process(verbosity).stderr == stderr


def test_the_command_line_leaves_a_configured_host_alone():
    """A host that configured logging (here: the root logger at WARNING) gets no second handler and no info line;
    an explicit RLHF_EXT_VERBOSITY still sets the library's level."""
    proc = _cli_process(before="logging.basicConfig(level=logging.WARNING, format='host: %(message)s')")
    assert proc.stderr == "" and proc.stdout == "1 0\n"
    proc = _cli_process("info", before="logging.basicConfig(level=logging.WARNING, format='host: %(message)s')")
    assert proc.stderr == f"host: {NO_CUDA_NOTICE}\n" and proc.stdout == "1 0\n"


def test_progress_lines_log_the_start_every_interval_and_the_end(monkeypatch, caplog):
    """Issue 23 item 15: long loops under a pipe (no bar) were silent; they log lines with rate and time left."""
    import time

    from rlhf_ext.runtime import log as log_module

    clock = iter([100.0, 110.0, 140.0, 141.0, 200.0])  # start, update, update (30 s later), update, close
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    progress = log_module.ProgressLines
    with caplog.at_level(logging.INFO, logger="rlhf_ext.runtime.log"), progress(100, 0, "segmenting", "pairs") as lines:
        lines.update(10)  # t = 110: 10 s after the start, no line
        lines.update(30)  # t = 140: 40 pairs in 40 s, a line
        lines.set_postfix({"skipped": 2})
        lines.update(20)  # t = 141: no line
    assert [r.getMessage() for r in caplog.records] == [
        "segmenting: 0/100 pairs",
        "segmenting: 40/100 pairs (40.0%), 1.0 pairs/s, about 60 s left",
        "segmenting: 60/100 pairs (60.0%), 0.6 pairs/s, about 67 s left, skipped 2",
    ]


def test_a_piped_generation_logs_progress_lines(tmp_path, caplog, monkeypatch):
    from rlhf_ext.datagen import generate_dataset
    from rlhf_ext.runtime import log as log_module

    monkeypatch.setattr(log_module, "PROGRESS_LINE_SECONDS", 0.0)
    with caplog.at_level(logging.INFO, logger="rlhf_ext.runtime.log"):
        generate_dataset("continual-piecewise-preference", tmp_path / "d", num_samples=10, progress=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "rlhf_ext.runtime.log"]
    total = len(lines) - 1  # the start line, then one per sample (interval 0)
    assert lines[0] == f"continual-piecewise-preference: 0/{total} samples"
    assert lines[-1].startswith(f"continual-piecewise-preference: {total}/{total} samples (100.0%)")


def test_reading_a_data_file_logs_its_size(tmp_path, caplog):
    from rlhf_ext.zoo.builtins import load_preference_dataset

    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n' * 2000)
    with caplog.at_level(logging.INFO, logger="rlhf_ext.zoo.builtins"):
        load_preference_dataset(str(path))
    assert f"reading {path} ({path.stat().st_size / 1e6:.1f} MB)" in [r.getMessage() for r in caplog.records]


@pytest.mark.slow
def test_training_for_1e12_epochs_prints_progress_lines_in_a_pipe(tmp_path, tiny_sft_path):
    """Issue 23 item 15: ``train.num_train_epochs=1e12`` must not run silently. Its step lines (``rm step N/TOTAL``)
    reach a pipe while it trains; the test stops it after the second one."""
    cmd = [sys.executable, "-m", "rlhf_ext.launch.train_segment_rm", "--config", "segment_rm_tiny",
           f"model.sft_model={tiny_sft_path}", "train.num_train_epochs=1e12",
           f"train.output_dir={tmp_path / 'rm'}"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    steps: list[str] = []
    try:
        for line in proc.stdout:
            if line.startswith("rm step"):
                steps.append(line.split()[2])
                if len(steps) == 2:
                    break
    finally:
        proc.kill()
        proc.wait()
    assert steps and all(s.endswith("/32000000000000") for s in steps), steps
