"""``builtin:`` names: resolving never trains; ``rlhf-ext zoo build`` does, explicitly."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from rlhf_ext.cli import main
from rlhf_ext.zoo import BuiltinNotBuiltError, resolve_model


@pytest.mark.parametrize("name", ["tiny-sft", "tiny-segment-rm"])
def test_resolving_a_trained_builtin_never_trains(tmp_path, name):
    with pytest.raises(BuiltinNotBuiltError, match=f"run `rlhf-ext zoo build {name}`"):
        resolve_model(f"builtin:{name}", tmp_path)
    assert not (tmp_path / "models" / name).exists()


def test_zoo_build_builds_once_and_names_unknown_models(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_EXT_CACHE", str(tmp_path))
    first = CliRunner().invoke(main, ["zoo", "build", "builtin:tiny"])
    assert first.exit_code == 0, first.output
    path = first.stdout.strip().splitlines()[-1]  # the last line; libraries may log above it
    assert path == str(tmp_path / "models" / "tiny") and (tmp_path / "models" / "tiny" / "config.json").is_file()
    stamp = (tmp_path / "models" / "tiny" / "config.json").stat().st_mtime_ns
    assert CliRunner().invoke(main, ["zoo", "build", "tiny"]).stdout.strip().splitlines()[-1] == path
    assert (tmp_path / "models" / "tiny" / "config.json").stat().st_mtime_ns == stamp  # not rebuilt
    listed = CliRunner().invoke(main, ["zoo", "list"]).output
    assert "builtin:tiny " in listed and "builtin:tiny-sft" in listed and "not built" in listed
    bad = CliRunner().invoke(main, ["zoo", "build", "huge"])
    assert bad.exit_code == 2 and "unknown builtin model 'builtin:huge'" in bad.output
