"""A rerun with changed settings is refused in one line (exit 2), before any stage runs."""

from __future__ import annotations

import json

from click.testing import CliRunner

from rlhf_ext.cli import main


def test_demo_rerun_with_changed_settings_is_refused_in_one_line(tmp_path):
    out = tmp_path / "demo"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"kind": "demo", "fingerprint": "0" * 16, "settings": {"seed": -1}}))
    result = CliRunner().invoke(main, ["demo", "--out", str(out)])
    assert result.exit_code == 2, result.output
    error = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "different settings" in error[0] and "--force" in error[0], result.output
    assert "Traceback" not in result.output
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]  # nothing ran, nothing was overwritten


def test_deepspeed_launchers_local_rank_argument_is_accepted():
    """`deepspeed --module rlhf_ext.cli ...` inserts `--local_rank=N` before the command; it used to fail with
    "No such option '--local_rank'"."""
    for args in (["--local_rank=1", "recipe", "list"], ["--local-rank", "0", "recipe", "list"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0 and "segment_rm_tiny" in result.output, result.output
