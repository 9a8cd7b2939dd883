"""``rlhf-ext data`` end to end: kill -9 in the middle of a real run and resume; the whole CLI on offline data."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from click.testing import CliRunner

from rlhf_ext.cli import main
from rlhf_ext.datagen import OpenAIBackend, generate_dataset, load_continual_dataset
from rlhf_ext.datagen.cache import CACHE_DIR, SAMPLES_FILE
from tests.helpers.chat_server import FakeChatServer

REPO = Path(__file__).resolve().parents[2]


def tree_digest(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file() and CACHE_DIR not in p.relative_to(path).parts
    }


def cached_lines(out: Path) -> list[str]:
    path = out / CACHE_DIR / SAMPLES_FILE
    return path.read_text().splitlines() if path.exists() else []


def test_kill_9_mid_run_then_resume_gives_the_uninterrupted_dataset(tmp_path):
    config = {
        "name": "killed",
        "seed": 1,
        "drift": {"type": "piecewise", "cycles": 2},
        "generation": {"backend": "openai", "response_mode": "pair", "max_concurrency": 3},
        "tasks": [
            {
                "name": name,
                "objective": "Ask a question about the seed words.",
                "preference": pref,
                "domain": {"mix": {"seed_words": ["gravity", "ballot", "enzyme", "orbit", "census", "lens"]}},
                "num_samples": 15,
            }
            for name, pref in (("formal", "Answer in a formal style."), ("rapper", "Answer like a rapper."))
        ],
    }
    cfg = tmp_path / "killed.yaml"
    cfg.write_text(yaml.safe_dump(config))
    out, reference = tmp_path / "out", tmp_path / "reference"
    with FakeChatServer(latency=0.04) as server:
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
        cmd = [sys.executable, "-m", "rlhf_ext.cli", "data", "generate", str(cfg), "-o", str(out)]
        proc = subprocess.Popen([*cmd, "--api-base", server.url, "--no-progress"], env=env, cwd=tmp_path)
        deadline = time.monotonic() + 120
        while len(cached_lines(out)) < 12 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        time.sleep(0.2)  # let the requests the dead client left in flight finish on the server
        lines = cached_lines(out)
        done = len(lines)
        assert 12 <= done < 60 and not (out / "continual_dataset.json").exists()
        assert all(json.loads(line)["status"] == "ok" for line in lines)  # whole lines only
        # at most the in-flight requests were lost: 2 requests per finished sample, <= 3 samples in flight
        lost = server.requests - 2 * done
        assert 0 <= lost <= 2 * 3

        generate_dataset(cfg, out, backend=OpenAIBackend(server.url), progress=False)
        generate_dataset(cfg, reference, backend=OpenAIBackend(server.url), progress=False)
    assert tree_digest(out) == tree_digest(reference)
    before = tree_digest(out)
    generate_dataset(cfg, out, backend=OpenAIBackend("http://127.0.0.1:9/v1"), progress=False)  # nothing to do
    assert tree_digest(out) == before  # re-assembled from the cache alone, without contacting a server
    keys = [json.loads(line)["key"] for line in cached_lines(out)]
    assert len(keys) == len(set(keys)) == 60


def test_cli_end_to_end_on_offline_data(tmp_path, tiny_base_path):
    runner = CliRunner()

    def run(*args):
        result = runner.invoke(main, ["data", *map(str, args)], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    assert "continual-mixed" in run("configs")
    out = tmp_path / "mixed"
    plan = run("generate", "continual-mixed", "-o", out, "--num-samples", 10, "--dry-run")
    assert "4 stages, 40 samples (0 already cached)" in plan and "drift: piecewise / mode combined" in plan
    assert "--- meta_prompt (first sample) ---" in plan and not out.exists()  # a dry run writes nothing
    text = run("generate", "continual-mixed", "-o", out, "--num-samples", 10, "--no-progress")
    assert "samples: 40/40 (this run: 40 new, 0 from cache" in text
    assert "40 already cached" in run("generate", "continual-mixed", "-o", out, "--num-samples", 10, "--dry-run")

    report_path = tmp_path / "report.json"
    run("validate", out, "--judge", "rule", "--embedding-model", tiny_base_path, "--max-embed", 8, "-o", report_path)
    report = json.loads(report_path.read_text())
    assert report["totals"] == {"missing": 0, "planned": 40, "skipped": 0, "test": 8, "train": 32}
    for stage in report["stages"]:
        assert stage["judge"]["agreement"] == 1.0 and stage["identical_pairs"] == 0
        assert 0.0 < stage["embedding_diversity"]["prompt"] < 2.0
        assert stage["entropy"]["chosen"] > 2.0

    shown = run("preview", out, "--stage", "education_qna_expert", "-n", 1)
    assert "style expert" in shown and "CHOSEN:" in shown and "REJECTED:" in shown

    run("transform", "preference_swap", out, "-o", tmp_path / "swapped", "-p", 1.0)
    run(
        "validate",
        tmp_path / "swapped",
        "--judge",
        "rule",
        "--embedding-model",
        "none",
        "-o",
        tmp_path / "swapped.json",
    )
    swapped = json.loads((tmp_path / "swapped.json").read_text())
    assert all(s["judge"]["agreement"] == 0.0 for s in swapped["stages"])
    assert all(s["judge"]["agreement_unswapped"] is None for s in swapped["stages"])

    run("transform", "split", out, "-o", tmp_path / "split", "--test-ratio", 0.5)
    assert [len(d["test"]) for d in load_continual_dataset(tmp_path / "split")] == [5] * 4
    run("sample", out, "-o", tmp_path / "small", "--keep-train", 3, "--keep-test", 1)
    run("merge", tmp_path / "small", out, "-o", tmp_path / "merged")
    merged = load_continual_dataset(tmp_path / "merged")
    assert [len(d["train"]) for d in merged] == [3] * 4 + [8] * 4
    run("export", tmp_path / "merged", "-o", tmp_path / "parquet", "--format", "parquet")
    assert len(list((tmp_path / "parquet").glob("*/train.parquet"))) == 8

    bad = runner.invoke(main, ["data", "preview", str(out), "--stage", "nope"])
    assert bad.exit_code == 2 and "no stage 'nope'" in bad.output
    assert "embedding_diversity" not in swapped["stages"][0]
    missing = runner.invoke(main, ["data", "validate", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "is not a continual dataset" in missing.output


def test_workers_command_of_the_readme_writes_the_one_process_dataset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    command = "rlhf-ext data generate continual-lipschitz -o runs/lip --num-samples 200 --workers 2"
    result = CliRunner().invoke(main, command.split()[1:])
    assert result.exit_code == 0, result.output
    assert "samples: 1800/1800" in result.output
    generate_dataset("continual-lipschitz", tmp_path / "one", num_samples=200, progress=False)
    assert tree_digest(tmp_path / "runs" / "lip") == tree_digest(tmp_path / "one")
    assert (tmp_path / "runs" / "lip" / CACHE_DIR / "samples-1.jsonl").is_file()
