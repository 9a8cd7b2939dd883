"""Truncated importance weights (hand-computed) and the per-iteration pair store (atomic, never rewritten)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from rlhf_ext.online import PairStore, truncated_importance_weights

LOG = math.log
# ratios pi_train / pi_rollout per token: row 0 = [0.25, 1, 3, (pad)], row 1 = [1.5, 1.5, (pad), (pad)]
TRAIN = torch.tensor([[LOG(0.25), 0.0, LOG(3.0), 5.0], [LOG(1.5), LOG(1.5), 7.0, 7.0]])
ROLLOUT = torch.zeros(2, 4)
MASK = torch.tensor([[True, True, True, False], [True, True, False, False]])


def test_tis_clips_token_ratios():
    w = truncated_importance_weights(TRAIN, ROLLOUT, MASK, level="token", mode="clip", low=0.0, high=2.0)
    torch.testing.assert_close(w.weights, torch.tensor([[0.25, 1.0, 2.0, 0.0], [1.5, 1.5, 0.0, 0.0]]))
    assert w.filtered.item() == pytest.approx(1 / 5)  # one of five response tokens was clipped


def test_token_mask_zeroes_out_of_band_tokens_and_keeps_the_others_ratio():
    w = truncated_importance_weights(TRAIN, ROLLOUT, MASK, level="token", mode="mask", low=0.5, high=2.0)
    torch.testing.assert_close(w.weights, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.5, 1.5, 0.0, 0.0]]))
    assert w.filtered.item() == pytest.approx(2 / 5)


def test_sequence_mask_gates_on_the_geometric_mean():
    # row 0: geometric mean (0.25 * 1 * 3) ** (1/3) = 0.908 -> kept; row 1: 1.5 -> dropped with high = 1.2
    w = truncated_importance_weights(TRAIN, ROLLOUT, MASK, level="seq", mode="mask", low=0.5, high=1.2)
    torch.testing.assert_close(w.weights, torch.tensor([[0.25, 1.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert w.filtered.item() == pytest.approx(0.5)


def test_weights_carry_no_gradient_and_bad_settings_fail():
    train = TRAIN.clone().requires_grad_(True)
    assert not truncated_importance_weights(train, ROLLOUT, MASK).weights.requires_grad
    with pytest.raises(ValueError, match="level='token'"):
        truncated_importance_weights(TRAIN, ROLLOUT, MASK, level="seq", mode="clip")
    with pytest.raises(ValueError, match="low < high"):
        truncated_importance_weights(TRAIN, ROLLOUT, MASK, low=2.0, high=1.0)
    with pytest.raises(ValueError, match="same"):
        truncated_importance_weights(TRAIN, ROLLOUT[:, :2], MASK)


def _rows(it: int, k: int) -> list[dict]:
    return [{"prompt": f"p{it}-{i}", "chosen": "c", "rejected": "r", "iteration": it} for i in range(k)]


def test_store_accumulates_in_order_and_never_rewrites(tmp_path):
    store = PairStore(tmp_path / "pairs")
    assert store.completed() == []
    store.write(0, _rows(0, 2), {"dropped": 1})
    store.write(1, _rows(1, 3), {"dropped": 0})
    assert store.completed() == [0, 1]
    assert [r["prompt"] for r in store.training_pairs(1)] == ["p0-0", "p0-1", "p1-0", "p1-1", "p1-2"]
    assert [r["prompt"] for r in store.training_pairs(1, "latest")] == ["p1-0", "p1-1", "p1-2"]
    assert store.summary(1) == {"dropped": 0, "iteration": 1, "num_pairs": 3}
    with pytest.raises(FileExistsError, match="never rewritten"):
        store.write(1, _rows(1, 1), {})
    # plain JSON lines: one object per pair
    lines = (store.path(0) / "pairs.jsonl").read_text().splitlines()
    assert [json.loads(x)["prompt"] for x in lines] == ["p0-0", "p0-1"]


def test_store_ignores_a_write_killed_halfway(tmp_path):
    store = PairStore(tmp_path)
    store.write(0, _rows(0, 1), {})
    # what a SIGKILL during atomic_directory leaves behind: a hidden temporary directory with partial content
    partial = tmp_path / ".iter_001.tmp-abc"
    partial.mkdir()
    (partial / "pairs.jsonl").write_text('{"prompt": "half')
    assert store.completed() == [0] and not store.has(1)
    store.write(1, _rows(1, 1), {})  # the iteration is collected again, completely
    assert store.completed() == [0, 1]


def test_importing_rlhf_ext_online_stays_light():
    code = (
        "import sys, rlhf_ext, rlhf_ext.online\n"
        "heavy = {'trl', 'openrlhf', 'deepspeed', 'ray', 'vllm', 'transformers', 'datasets'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
