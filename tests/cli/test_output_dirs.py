"""No command writes into a directory that holds one of its inputs, whatever the path's spelling (issue 23 item 1),
and every training command holds its output directory's lock while it writes it (item 14)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlhf_ext.cli import main
from rlhf_ext.runtime.rundir import OutputDirError, check_output_dir, claim_output_dir

#: command -> (its arguments given an input directory IN and an output directory OUT, the input's key)
COMMANDS = {
    "train segment-rm": (["train", "segment-rm", "--config", "segment_rm_tiny", "model.sft_model={IN}",
                          "train.output_dir={OUT}"], "model.sft_model"),
    "train segment-ppo": (["train", "segment-ppo", "--config", "segment_ppo_tiny", "model.reward_model={IN}",
                           "train.output_dir={OUT}"], "model.reward_model"),
    "train online-dpo": (["train", "online-dpo", "--config", "online_dpo_tiny", "policy.sft_model={IN}",
                          "train.output_dir={OUT}"], "policy.sft_model"),
    "train continual": (["train", "continual", "--config", "continual_dpo_tiny", "model.sft_model={IN}",
                         "output_dir={OUT}"], "model.sft_model"),
    "demo": (["demo", "model.base_model={IN}", "out={OUT}"], "model.base_model"),
    "sim compare": (["sim", "compare", "--config", "sim_compare", "model.base={IN}", "output_dir={OUT}"], "model.base"),
    "data sample": (["data", "sample", "{IN}", "-o", "{OUT}", "--keep-train", "1"], "DATASET"),
}  # fmt: skip


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("spelling", ["same", "trailing slash", "relative", "symlink", "parent"])
def test_an_output_directory_holding_an_input_is_refused_and_the_input_is_untouched(
    command, spelling, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "models" / "sft"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "link").symlink_to(model, target_is_directory=True)
    out = {"same": str(model), "trailing slash": f"{model}/", "relative": "./models/sft", "symlink": "link",
           "parent": "models"}[spelling]  # fmt: skip
    before = _snapshot(tmp_path)
    args, key = COMMANDS[command]
    result = CliRunner().invoke(main, [a.format(IN=model, OUT=out) for a in args])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2, result.output
    verb = "holds" if spelling == "parent" else "is"
    assert len(errors) == 1 and f"{out.rstrip('/')}" in errors[0], result.output
    assert f"{verb} the input {key} ({model}): the run would write over it" in errors[0], result.output
    assert _snapshot(tmp_path) == before  # nothing written, the model untouched


def test_inputs_that_are_not_local_paths_and_sibling_directories_are_fine(tmp_path):
    (tmp_path / "sft").mkdir()
    check_output_dir(tmp_path / "rm", {"model": str(tmp_path / "sft"), "hub": "Qwen/Qwen2.5-0.5B", "b": "builtin:tiny"})
    check_output_dir(tmp_path / "sft" / "rm", {"model": str(tmp_path / "sft")})  # inside the input: nothing overwritten
    with pytest.raises(OutputDirError):
        check_output_dir(tmp_path, {"data": str(tmp_path / "sft")})


HOLD = """
import sys
from rlhf_ext.runtime.rundir import claim_output_dir
with claim_output_dir(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "data sample"])
def test_a_second_run_on_a_locked_output_directory_is_refused_at_once(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "runs" / "x"
    other = tmp_path / "other"
    other.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        args, _ = COMMANDS[command]
        result = CliRunner().invoke(main, [a.format(IN=other, OUT=out) for a in args])
    finally:
        holder.communicate("", timeout=60)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: another run is writing {out}"), result.stderr
    assert not out.exists()  # the refused run wrote nothing


def test_the_lock_is_released_when_the_run_ends_and_ranks_lock_separately(tmp_path, monkeypatch):
    out = tmp_path / "run"
    with claim_output_dir(out), pytest.raises(OutputDirError, match="another run is writing"), claim_output_dir(out):
        pass
    with claim_output_dir(out):  # released
        pass
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with claim_output_dir(out):
        monkeypatch.setenv("RANK", "1")
        with claim_output_dir(out):  # another rank of the same launch
            pass
