"""Issue 23 item 13: inputs that used to end in a traceback are one ``error:`` line naming the problem and the fix,
exit code 2 (the knob ranges of the same item are tested in tests/cli/test_knob_ranges.py)."""

from __future__ import annotations

import json
import shutil

from click.testing import CliRunner

from rlhf_ext.cli import main


def _errors(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def test_segment_show_on_a_truncated_reward_model_is_one_line(tmp_path, tiny_sft_path):
    rm = tmp_path / "rm"
    shutil.copytree(tiny_sft_path, rm)
    settings = {"entropy_cutoff": 2.0, "aggregation": "softmax", "tau": 0.5, "sft_model_name_or_path": tiny_sft_path}
    (rm / "segment_config.json").write_text(json.dumps(settings))
    weights = rm / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])
    result = CliRunner().invoke(main, ["segment", "show", "--model", str(rm), "--response", "It is."])
    assert result.exit_code == 2, result.output
    assert _errors(result) == [
        f"error: the reward model {rm} cannot be loaded (model.safetensors has {size // 2} of {size} bytes): copy or "
        "train it again"
    ]
    assert "Traceback" not in result.output


def test_more_toy_tasks_than_the_toy_sequence_has_is_one_line_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    args = ["train", "continual", "--config", "continual_dpo_tiny", f"model.sft_model={tmp_path}", f"output_dir={out}"]
    result = CliRunner().invoke(main, [*args, "data.num_tasks=1000000"])
    assert result.exit_code == 2, result.output
    assert _errors(result) == [
        "error: num_tasks is 1000000, but the toy preference_shift sequence has 1 to 19 tasks; use fewer tasks "
        "(data.tasks: builtin:toy-continual-preference-shift, data.num_tasks: 1000000)"
    ]
    assert not out.exists()
