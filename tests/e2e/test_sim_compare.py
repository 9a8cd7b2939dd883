"""``rlhf-ext sim compare`` end to end at a tiny size: real trainers, results kept and skipped on rerun."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner


@pytest.fixture()
def recipe_file(tmp_path, tiny_sft_path):
    cfg = {
        "output_dir": str(tmp_path / "run"),
        "seeds": [0],
        "methods": ["sft", "best_of_n", "dpo", "online_dpo_sync"],
        "task": {"source": "toy", "num_samples": 160, "max_eval_prompts": 16, "max_length": 128},
        "model": {"base": tiny_sft_path},  # already fine-tuned on the toy task: SFT only copies it
        "sft": {"max_steps": 0},
        "reward_model": {"train": {"num_train_epochs": 1, "batch_size": 16}},
        "generation": {"max_new_tokens": 64},
        "eval": {"samples_per_prompt": 2},
        "best_of_n": {"n": 4},
        "dpo": {"max_pairs": 48, "train": {"max_steps": 6, "batch_size": 8, "learning_rate": 5e-4}},
        "online_dpo_async": {"max_steps": 2, "batch_size": 4, "num_generations": 2},
    }
    path = tmp_path / "sim.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_sim_compare_end_to_end(recipe_file, tmp_path, monkeypatch):
    from rlhf_ext.cli import main
    from rlhf_ext.sim.report import result_path

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run = tmp_path / "run"
    res = CliRunner().invoke(main, ["sim", "compare", "--config", str(recipe_file)])
    assert res.exit_code == 0, res.output
    summary = json.loads((run / "sim_compare.json").read_text())
    rows = {r["method"]: r for r in summary["methods"]}
    assert list(rows) == ["sft", "best_of_n", "dpo", "online_dpo_sync"]
    assert rows["sft"]["kl"] == 0.0 and rows["sft"]["per_seed"][0]["num_comparisons"] == 32
    for method, row in rows.items():
        # the reported win rate is that of the method's evaluation row: its pool judgements (binary, no ties) counted
        result = json.loads(result_path(run, method, 0).read_text())
        assert result["ties"] == 0 and result["wins"] + result["losses"] == result["num_comparisons"] == 32, method
        assert result["win_rate"] == pytest.approx(result["wins"] / 32, abs=1e-12), method
        assert row["win_rate"] == row["per_seed"][0]["win_rate"] == result["win_rate"], method  # one seed: its value
        # its standard error is clustered by prompt (16 prompts x 2 samples; per-prompt means m_i in {0, 1/2, 1}):
        # 16 * 15 * se^2 = sum_i (m_i - p)^2 = wins / 2 - split / 4 - 16 p^2, `split` = prompts won once of twice
        wins, p = result["wins"], result["win_rate"]
        split = 4 * (wins / 2 - 16 * p**2 - 16 * 15 * result["stderr"] ** 2)
        assert split == pytest.approx(round(split), abs=1e-6), (method, split)
        assert 0 <= round(split) <= min(wins, 32 - wins) and (wins - round(split)) % 2 == 0, (method, split)
    assert rows["best_of_n"]["kl"] == pytest.approx(1.3863 - 0.75, abs=1e-3)  # log 4 - 3/4
    assert rows["dpo"]["kl"] != 0.0  # DPO moved the policy
    sync_run = json.loads((run / "seed-0" / "online_dpo_sync" / "summary.json").read_text())
    assert sync_run["async_generation"] is False and sync_run["runner"]["staleness"] == {"0": 2}  # on-policy
    assert rows["online_dpo_sync"]["kl"] != 0.0
    assert summary["reward_model_heldout_accuracy"]["bandit"]["0"] is not None
    feedback = summary["feedback"]["0"]
    assert feedback["labels"]["pairs"] == 56 and feedback["report"]["flip_prob"] == 0.25
    # the budget stated per method: labels used (dpo.max_pairs of the 56) and responses generated while training
    assert [(rows[m]["labels"], rows[m]["samples"]) for m in rows] == [(0, 0), (56, 0), (48, 0), (56, 2 * 4 * 2)]
    # AlpacaFarm's protocol by default: held-out pairs are two SFT samples per test prompt, gold-ordered, ties dropped
    held_out = feedback["labels"]["heldout_pairs"]
    assert held_out == round(20 * (1 - feedback["labels"]["heldout_gold_tied_fraction"]))
    assert "labels | samples" in (run / "sim_compare.md").read_text()
    assert "held-out pairs" in (run / "sim_compare.md").read_text()
    for name in ("sim_compare.md", "sim_compare_winrate.png", "sim_compare_tradeoff.png"):
        assert (run / name).stat().st_size > 0
    assert "| best_of_n |" in res.output

    # a rerun finds every (method, seed) finished and trains nothing
    before = {p: p.stat().st_mtime_ns for p in (run / "results").rglob("*.json")}
    again = CliRunner().invoke(main, ["sim", "compare", "--config", str(recipe_file), "--methods", "sft,dpo"])
    assert again.exit_code == 0, again.output
    assert again.output.count("done earlier, skipped") == 2
    assert {p: p.stat().st_mtime_ns for p in before} == before
    only = json.loads((run / "sim_compare.json").read_text())
    assert [r["method"] for r in only["methods"]] == ["sft", "dpo"]

    # changing a setting that shapes the results is refused (only --methods / --seeds may change)
    changed = CliRunner().invoke(main, ["sim", "compare", "--config", str(recipe_file), "dpo.beta=0.5"])
    assert changed.exit_code == 2 and "dpo" in changed.output and "different settings" in changed.output
    bad = CliRunner().invoke(main, ["sim", "compare", "--config", str(recipe_file), "--methods", "sft,ppo"])
    assert bad.exit_code == 2 and "unknown method(s) ppo" in bad.output


@pytest.mark.slow
def test_seeds_in_worker_processes_give_the_same_results(recipe_file, tmp_path, monkeypatch):
    # workers: 2 runs the two seeds in two spawned processes; every (method, seed) must equal the sequential run's
    from rlhf_ext.cli import main
    from rlhf_ext.sim.report import result_path

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    methods = "sft,best_of_n,dpo"
    results = {}
    for workers in (1, 2):
        out = tmp_path / f"workers-{workers}"
        res = CliRunner().invoke(
            main,
            ["sim", "compare", "--config", str(recipe_file), "--methods", methods, "--seeds", "0,1", "--out", str(out),
             f"workers={workers}"],
        )  # fmt: skip
        assert res.exit_code == 0, res.output
        results[workers] = {
            (m, s): json.loads(result_path(out, m, s).read_text()) for m in methods.split(",") for s in (0, 1)
        }
    keys = ("win_rate", "stderr", "gold_mean", "kl", "avg_length_chars", "labels", "samples")
    for key, one in results[1].items():
        assert {k: one[k] for k in keys} == {k: results[2][key][k] for k in keys}, key
    assert results[1][("dpo", 0)]["win_rate"] != results[1][("dpo", 1)]["win_rate"]  # the seeds differ


@pytest.mark.slow
def test_killing_the_command_ends_its_worker_processes(recipe_file, tmp_path):
    # `kill PID` of a `sim compare` with workers must not leave its workers training in the background
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    psutil = pytest.importorskip("psutil")
    cmd = [sys.executable, "-m", "rlhf_ext.cli", "sim", "compare", "--config", str(recipe_file), "--seeds", "0,1",
           "--out", str(tmp_path / "killed"), "workers=2"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    workers = []
    try:
        deadline = time.time() + 240
        while time.time() < deadline and len(workers) < 2:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            workers = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
            time.sleep(0.5)
        assert len(workers) == 2
        out = tmp_path / "killed"
        while time.time() < deadline and not ((out / "seed-0").exists() and (out / "seed-1").exists()):
            time.sleep(0.5)  # both workers are past their initializer: they have started on their seed
        assert (out / "seed-0").exists() and (out / "seed-1").exists()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        gone, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, [p.pid for p in alive]
    finally:  # never leave a worker behind, even when the test fails
        proc.kill()
        for c in [*workers, *psutil.Process().children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                c.kill()
