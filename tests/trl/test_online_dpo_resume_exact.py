"""Nothing lost, nothing stuck, nothing silent: per-batch online DPO (paper 001) killed (SIGKILL) after a checkpoint and
resumed. Synchronous runs end exactly where an uninterrupted run ends (the same stored pairs, the same weights); they
used to differ: the resumed run reshuffled the prompts with a seed that depended on the update it resumed at, started
again at the first prompt, and seeded its batches from 0 again. Asynchronous runs differ from the uninterrupted run
by design (the first batch after the resume is generated with the checkpoint's weights), but two resumes from one
checkpoint are identical."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.kill_points import run_cli, was_killed

pytestmark = pytest.mark.usefixtures("cache_dir")

UPDATES = 4
KILLED_AT_BATCH = 2  # killed as the training loop stores batch 2, right after checkpoint-2 was saved
PER_BATCH_DPO = [
    "train", "online-dpo", "--config", "online_dpo_async_tiny", f"train.max_steps={UPDATES}", "train.save_steps=1",
    "train.batch_size=4", "train.micro_batch_size=4", "train.logging_steps=100", "online.max_completion_length=48",
    "online.max_fill_rounds=8", "data.max_train_prompts=32", "data.max_eval_prompts=2",
    "online.eval_samples_per_prompt=1",
]  # fmt: skip


def run(out: Path, sft: str, async_generation: bool, fault_at: str | None = None):
    args = [*PER_BATCH_DPO, f"policy.sft_model={sft}", f"online.async_generation={str(async_generation).lower()}"]
    return run_cli([*args, f"train.output_dir={out}"], fault_at=fault_at)


def kill_after_checkpoint(out: Path, sft: str, async_generation: bool) -> None:
    killed = run(out, sft, async_generation, fault_at=f"committed:iter_{KILLED_AT_BATCH:03d}")
    assert was_killed(killed), killed.stderr[-3000:]
    assert sorted(p.name for p in (out / "online").glob("checkpoint-*"))[-1] == f"checkpoint-{KILLED_AT_BATCH}"


def resume(out: Path, sft: str, async_generation: bool) -> dict:
    rerun = run(out, sft, async_generation)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_update"] == KILLED_AT_BATCH
    return summary


def stored_batches(out: Path) -> list[tuple[str, int, list[int]]]:
    """(pairs.jsonl, policy_version, prompt_cursors) of every stored batch."""
    batches = []
    for i in range(UPDATES):
        stats = json.loads((out / f"pairs/iter_{i:03d}/summary.json").read_text())
        pairs = (out / f"pairs/iter_{i:03d}/pairs.jsonl").read_text()
        batches.append((pairs, stats["policy_version"], stats["prompt_cursors"]))
    return batches


def differing_weights(a: Path, b: Path) -> dict[str, float]:
    """Largest absolute difference of every tensor that differs between the final policies of runs ``a`` and ``b``."""
    wa, wb = (load_file(str(d / "_policies/online_final/model.safetensors")) for d in (a, b))
    assert wa.keys() == wb.keys()
    return {name: float((wa[name] - wb[name]).abs().max()) for name in wa if not torch.equal(wa[name], wb[name])}


@pytest.mark.slow
def test_a_synchronous_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_runs_pairs_and_weights(
    tmp_path, tiny_sft_path
):
    full = run(tmp_path / "full", tiny_sft_path, async_generation=False)
    assert full.returncode == 0, full.stderr[-3000:]
    out = tmp_path / "killed"
    kill_after_checkpoint(out, tiny_sft_path, async_generation=False)
    summary = resume(out, tiny_sft_path, async_generation=False)

    expected = stored_batches(tmp_path / "full")
    assert [version for _, version, _ in expected] == [0, 1, 2, 3]  # on-policy: batch k from theta_k
    assert stored_batches(out) == expected  # the same prompts, responses, pairs and cursors
    assert differing_weights(out, tmp_path / "full") == {}
    assert summary["runner"]["staleness"] == {"0": UPDATES - KILLED_AT_BATCH}  # JSON keys


@pytest.mark.slow
def test_an_asynchronous_resume_from_one_checkpoint_is_deterministic(tmp_path, tiny_sft_path):
    killed = tmp_path / "killed"
    kill_after_checkpoint(killed, tiny_sft_path, async_generation=True)
    first, second = tmp_path / "first", tmp_path / "second"
    shutil.copytree(killed, first)
    shutil.copytree(killed, second)
    summary = resume(first, tiny_sft_path, async_generation=True)
    resume(second, tiny_sft_path, async_generation=True)

    batches = stored_batches(first)
    # the one known difference from an uninterrupted run: batch 2 comes from the checkpoint's theta_2, not theta_1
    assert [version for _, version, _ in batches] == [0, 0, 2, 2]
    assert summary["runner"]["staleness"] == {"0": 1, "1": 1}
    assert stored_batches(second) == batches
    assert differing_weights(first, second) == {}
